"""What every command shares: JSON for machines, progress bars only for people, the choice of
ranks from flags, and the one table that turns a library error's field into the flag a user typed.

The library raises domain errors whose ``key`` names a field (``rank``, ``tp_rank``); it never
names a flag. ``error_line`` maps the field to the command line's words.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..errors import ShardcError

# library field -> the flag that sets it (like huggingface_hub's CLI error mapping)
FLAGS = {
    "rank": "--rank",
    "tp_rank": "--tp-rank",
    "pp_stage": "--pp-stage",
    "block_size": "--block-size",
    "source": "--source",
    "reference": "--reference",
}


class UsageError(ShardcError):
    """Flags that do not go together (a command-line mistake, not a domain one): exit 2."""


def error_line(exc: ShardcError) -> str:
    """The one line the CLI prints for an expected error, in the command line's words (a message
    quoting another library's multi-line text is folded onto the line)."""
    if exc.key in FLAGS:
        text = f"{FLAGS[exc.key]}: {exc.message}"
        text = f"{text} (hint: {exc.hint})" if exc.hint else text
    else:
        text = exc.one_line()
    return " ".join(text.splitlines())


def error_object(exc: ShardcError) -> dict[str, Any]:
    """An expected error as data, for ``--json``: what the one line says, field by field."""
    key = FLAGS.get(exc.key, exc.key) if exc.key is not None else None
    return {"error": exc.message, "key": key, "hint": exc.hint, "exit": exc.exit_code}


def remember_json(cmd: click.Command) -> None:
    """Make a command's ``--json`` flag known to the error handler (``cli.py``), which runs in the
    group's context: the flag's value is kept in the contexts' shared ``meta``."""
    for param in cmd.params:
        if param.name == "as_json":
            def keep(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
                ctx.meta["shardc.json"] = bool(value)
                return value

            param.callback = keep


def chosen_ranks(rank: list[int] | tuple[int, ...] | int | None, tp_rank: int | None,
                 pp_stage: int | None, all_ranks: bool, *, required: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """(global ranks, (tp_rank, pp_stage) pairs) from --rank / --tp-rank --pp-stage / --all; both
    empty means every rank. ``required``: the command needs one of the three spelled out."""
    ranks = [] if rank is None else [rank] if isinstance(rank, int) else list(rank)
    if (tp_rank is None) != (pp_stage is None):
        raise UsageError("--tp-rank and --pp-stage go together", hint="or use --rank R")
    pairs = [] if tp_rank is None else [(tp_rank, pp_stage)]
    named = bool(ranks) + bool(pairs) + bool(all_ranks)
    if all_ranks and named > 1:
        raise UsageError("--all cannot be combined with --rank/--tp-rank/--pp-stage")
    if required and named != 1:
        raise UsageError("choose which shards to fetch",
                         hint="pass one of --rank R, --tp-rank T --pp-stage P, or --all")
    return ranks, pairs  # type: ignore[return-value]


def echo_json(obj: Any) -> None:
    """Machine-readable output for CI: one JSON document on stdout. Once it is out, an error that
    follows is the stderr line only (the handler would print a second document)."""
    click.echo(json.dumps(obj, indent=1, sort_keys=True))
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["shardc.json"] = False


def show_progress(quiet: bool) -> bool:
    """Progress bars only on a TTY, and never with --quiet."""
    return not quiet and sys.stderr.isatty()


def summary_lines(summary: dict[str, Any], state: str, out_dir: Any) -> list[str]:
    """A build's or reshard's summary as text: what happened, then a line per shard (file, ranks,
    layers, size, sha256)."""
    from ..formats.files import human_size

    head = (f"{summary['plan']}: {state}; {len(summary['shards'])} shards, "
            f"{human_size(summary['total_bytes'])} in {out_dir}")
    lines = [head] + [f"  {s['file']}  rank {s['rank']:>3} (tp {s['tp_rank']}, pp {s['pp_stage']})  "
             f"layers {s['layers'][0]}:{s['layers'][1]}  {human_size(s['size']):>12}  {s['sha256'][:12]}"
             for s in summary["shards"]]
    if summary.get("finished_switch"):
        lines.append("  first finished switching in the files of an interrupted rebuild (compiler/switch.py)")
    return lines


def push_lines(res: dict[str, Any]) -> list[str]:
    """What ``push`` (and ``build --upload``) did, as text."""
    from ..formats.files import human_size

    lines = [f"pushed {res['uploaded']} file(s), {human_size(res['bytes_uploaded'])} "
             f"({res['present']} already present) in {res['seconds']:.1f}s",
             f"manifest: {res['manifest_uri']} ({res['manifest']})"]
    if res.get("removed"):
        lines.append(f"removed {len(res['removed'])} object(s) of the replaced build")
    return lines


def ensure_parent(path: Any, flag: str) -> None:
    """Create the directory a file flag's path lives in (``--report reports/gate.json`` on a fresh
    clone), before any work: a missing directory must not surface after minutes of it."""
    from pathlib import Path

    from ..errors import OutputError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot create its directory ({exc.strerror or exc})",
                          hint=f"pass {flag} a path in a writable directory") from None
