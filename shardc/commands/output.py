"""Output helpers every command shares: JSON for machines, progress bars only for people."""

from __future__ import annotations

import json
import sys
from typing import Any

import click


def echo_json(obj: Any) -> None:
    """Machine-readable output for CI: one JSON document on stdout."""
    click.echo(json.dumps(obj, indent=1, sort_keys=True))


def show_progress(quiet: bool) -> bool:
    """Progress bars only on a TTY, and never with --quiet."""
    return not quiet and sys.stderr.isatty()
