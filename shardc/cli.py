"""The shardc command line: thin click commands that parse, call the library and format.

Each command lives in ``shardc/commands/<topic>.py`` and exports ``COMMANDS``. Expected problems
(``ShardcError``) end as one line on stderr with the error's exit code, and with ``--json`` also
as a JSON object on stdout; ``--debug`` shows the traceback. Nothing here imports torch: commands import heavy modules inside their bodies.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# numpy's OpenBLAS starts a worker thread per core at import, and each spins for a while waiting
# for work that never comes (shardc does no BLAS): ~0.1-0.15 s of CPU per command on 2 cores,
# taken from the hashing and copying threads. Set before any command imports numpy; a user's own
# setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from .commands.output import echo_json, error_line, error_object
from .errors import ShardcError
from .version import __version__

COMMAND_MODULES = ("build", "reshard", "verify", "store", "plan", "runtime")

EPILOG = """\b
Examples:
  shardc plan --model llama-3.3-70b --gpu a100-80gb
  shardc build plans/tp4pp2-fp16.yaml
  shardc reshard --manifest build/demo-tp3pp2-bf16/manifest.json --plan plans/demo-tp1pp1-bf16.yaml
  shardc verify --manifest build/llama3-70b-fp16-primary/manifest.json --rank 0
  shardc push --manifest manifests/llama3-70b-fp16-primary.json --to s3://models/llama3-70b/fp16
  shardc gate --baseline build/demo-tp1pp1-bf16 --candidate build/demo-tp3pp2-bf16
"""


class ShardcGroup(click.Group):
    """Maps ShardcError to one clear line and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardcError as exc:
            if ctx.meta.get("shardc.debug"):
                raise
            command = ctx.meta.get("shardc.command")  # the running command (commands/options.py)
            if ctx.meta.get("shardc.json"):  # a CI step parsing stdout gets the error as data too
                echo_json(error_object(exc, command))
            click.echo(f"error: {error_line(exc, command)}", err=True)
            _exit_past_stuck_calls(exc.exit_code)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


def _exit_past_stuck_calls(code: int) -> None:
    """A torch store call left blocked in C++ (verify/distributed.py ``_within``: a rendezvous host
    that takes connections and never answers) would end the interpreter's finalization in
    std::terminate, a second line on stderr after the one error line. Such a process leaves at
    once, its output flushed. Only a real process's (its stderr is the interpreter's own; an
    in-process runner's is not)."""
    import sys
    import threading

    if sys.stderr is sys.__stderr__ and any(t.name == "shardc-store-call" and t.is_alive()
                                            for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None under pythonw-like hosts: nothing to flush
                stream.flush()
        os._exit(code)


@click.group(cls=ShardcGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardc")
@click.option("--debug", is_flag=True, help="Show tracebacks for expected errors too.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """shardc: compile a Hugging Face checkpoint into per-GPU TP x PP shards, verify and ship them."""
    ctx.meta["shardc.debug"] = debug


for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"shardc.commands.{_name}")
    except ModuleNotFoundError as _exc:  # pragma: no cover - only while a command is being written
        if _exc.name != f"shardc.commands.{_name}":
            raise
        continue
    for _cmd in _mod.COMMANDS:
        main.add_command(_cmd)


if __name__ == "__main__":
    main()
