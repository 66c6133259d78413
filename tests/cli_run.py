"""A real ``shardc`` process and the one-line error contract, written once for the tests that run
the CLI as a user does (``docs/architecture.md §7``: one line on stderr, no traceback, the exit
code of the error's class). Import by name: ``from cli_run import one_line, shardc``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shardc(*args: object, env: dict[str, str] | None = None, fault: str | None = None,
           timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m shardc.cli ARGS`` with this checkout's package first on PYTHONPATH, run from
    the repository root. ``fault`` sets ``SHARDC_FAULT`` (the kill hooks of switch and export);
    an inherited one is dropped, so that no test is killed by another's hook."""
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    full.pop("SHARDC_FAULT", None)
    if fault:
        full["SHARDC_FAULT"] = fault
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "shardc.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=full, cwd=cwd)


def one_line(r: subprocess.CompletedProcess, needle: str = "", code: int = 2) -> str:
    """The process exited with ``code`` and said one line on stderr (no traceback) containing
    ``needle``; returns that line."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0], lines[0]
    return lines[0]
