"""The options several commands share, each defined once (as huggingface_hub's CLI shares its
option types): ``--json``, ``--endpoint-url``, ``--quiet``. A command stacks the decorator; the help
text and the parameter name are the same everywhere, so a script written against one command works
against the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def _remember(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    """``--json`` is kept in the contexts' shared ``meta`` for the group's error handler (cli.py),
    which runs in the group's context, together with the running command (whose flags name the
    fields of an error: output.py ``error_line``). Every command takes ``--json``, so this runs for
    every command, given or not."""
    ctx.meta["shardc.json"] = bool(value)
    ctx.meta["shardc.command"] = ctx.command
    return value


def json_option(f: F) -> F:
    """``--json``: the command's result as one JSON document on stdout (output.py ``emit``); an
    expected error as a JSON object too, and its line on stderr."""
    return click.option("--json", "as_json", is_flag=True, callback=_remember, expose_value=True,
                        help="Print the result as one JSON document on stdout.")(f)


def endpoint_option(f: F) -> F:
    """``--endpoint-url``: where an ``s3://`` URI's store is (MinIO, a proxy); boto3's own default
    otherwise."""
    return click.option("--endpoint-url", help="S3 endpoint for s3:// URIs [default: AWS_ENDPOINT_URL, "
                                               "else AWS].")(f)


def quiet_option(f: F) -> F:
    """``--quiet``: no progress bars and no text summary (``--json`` still prints its document)."""
    return click.option("--quiet", "-q", is_flag=True, help="No progress bars or summary text.")(f)
