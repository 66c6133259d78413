"""What every command shares: the one printer (text for people, ``--json`` for machines), progress
bars only for people, the choice of ranks from flags, and the one table that turns a library
error's field into the flag a user typed.

The library returns frozen result types (``shardc.results``) and raises domain errors whose ``key``
names a field (``rank``, ``tp_rank``, the planner's ``block_size``); it never names a flag.
``emit`` prints a result, ``error_line`` an error, in the command line's words.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import click

from ..errors import ShardcError
from ..results import to_json

if TYPE_CHECKING:
    from ..store.transfers import PushResult

# library field -> the flag that sets it (like huggingface_hub's CLI error mapping), for every
# command: a field is shown as the flag only where the running command has that flag (flag_for).
GLOBAL_FLAGS = {"--debug"}  # shardc's own options (cli.py), before the command
FLAGS: dict[str, str | tuple[str, ...]] = {
    "rank": "--rank", "tp_rank": "--tp-rank", "pp_stage": "--pp-stage", "source": "--source",
    "reference": "--reference", "deep": "--deep", "out": "--out", "max_shard_size": "--max-shard-size",
    "replace": "--replace", "force": "--force", "dequantize": "--dequantize", "allow_pickle": "--allow-pickle",
    "device": "--device", "timeout_s": "--timeout", "tokenizer": "--tokenizer", "build_dir": "--build-dir",
    "dest_uri": "--to", "compress": "--compress", "endpoint_url": "--endpoint-url", "debug": "--debug",
    "manifests_dir": "--manifests-dir", "golden": "--golden", "window": "--window", "max_tokens": "--max-tokens",
    # a build's directory: run and verify's --dir; gate reads two builds, each from its own
    "directory": ("--dir", "--baseline-dir / --candidate-dir"),
    # shardc plan's inputs (the planner's errors, and `field` mentions in its hints and warnings)
    "model": "--model", "gpu": "--gpu", "gpus_per_node": "--gpus-per-node", "nodes": "--nodes",
    "dtype": "--dtype", "kv_dtype": "--kv-dtype", "max_model_len": "--max-model-len",
    "avg_context": "--avg-context", "kv_cache_cap": "--kv-cache-cap", "kv_memory": "--kv-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization", "block_size": "--block-size",
    "price_per_gpu_hour": "--price-per-gpu-hour", "target_tpot_ms": "--target-tpot-ms",
    "demand_tokens_per_s": "--demand-tokens-per-s", "objective": "--objective",
    "lora_adapters": "--lora-adapters", "lora_rank": "--lora-rank", "draft_model": "--draft-model",
    "gpu_memory": "--gpu-memory", "hbm_bandwidth": "--hbm-bandwidth", "interconnect": "--interconnect",
    "fabric": "--fabric", "microbatches": "--param microbatches", "tp": "--tp", "pp": "--pp",
    "concurrency": "--concurrency", "allow_long_context": "--param allow_long_context=1",
    "isl": "--isl", "osl": "--osl", "ttft_ms": "--ttft-ms",
}


def flag_for(field: str | None, command: click.Command | None) -> str | None:
    """The flag that sets ``field`` in ``command``, or None where that command has no such flag
    (a ``rank`` error of ``shardc run`` is not about a --rank it does not take); ``command`` None:
    the table's (first) flag. Global flags (``--debug``) belong to every command."""
    flags = FLAGS.get(field or "")
    if flags is None:
        return None
    options = (flags,) if isinstance(flags, str) else flags
    if command is None:
        return options[0]
    have = {o for p in command.params for o in p.opts} | GLOBAL_FLAGS
    return next((f for f in options if f.split()[0] in have), None)


class UsageError(ShardcError):
    """Flags that do not go together (a command-line mistake, not a domain one): exit 2."""


class Stderr(str):
    """A line of a command's text output that goes to stderr (a verify problem, run's timing)."""


def emit(result: Any, as_json: bool, text: Callable[[], Iterable[str]] | None = None, *,
         quiet: bool = False) -> None:
    """The one printer: with ``--json`` the result's JSON form (``shardc.results.to_json``) as one
    document on stdout; otherwise, unless ``quiet``, the lines ``text()`` makes (a ``Stderr``
    line to stderr). ``text`` is called only when the text is shown."""
    if as_json:
        echo_json(result)
    elif not quiet and text is not None:
        for line in text():
            click.echo(line, err=isinstance(line, Stderr))


_FIELD = re.compile(r"`([a-z_]+)`")


def in_flags(text: str, command: click.Command | None = None) -> str:
    """The library's words in the command line's: a `field` (the library quotes the fields of its
    calls in backticks) becomes the flag that sets it where ``command`` has one; other text stays."""
    return _FIELD.sub(lambda m: flag_for(m.group(1), command) or m.group(0), text)


def error_line(exc: ShardcError, command: click.Command | None = None) -> str:
    """The one line the CLI prints for an expected error, in the command line's words (a message
    quoting another library's multi-line text is folded onto the line)."""
    key = (flag_for(exc.key, command) or exc.key) if exc.key is not None else None
    text = in_flags(exc.message if key is None else f"{key}: {exc.message}", command)
    text = f"{text} (hint: {in_flags(exc.hint, command)})" if exc.hint else text
    return " ".join(text.splitlines())


def error_object(exc: ShardcError, command: click.Command | None = None) -> dict[str, Any]:
    """An expected error as data, for ``--json``: what the one line says, field by field."""
    key = (flag_for(exc.key, command) or exc.key) if exc.key is not None else None
    return {"error": in_flags(exc.message, command), "key": key,
            "hint": in_flags(exc.hint, command) if exc.hint else exc.hint, "exit": exc.exit_code}


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
    """Machine-readable output for CI: one JSON document on stdout (``obj`` through
    ``results.to_json``). Once it is out, an error that follows is the stderr line only (the
    handler would print a second document)."""
    click.echo(json.dumps(to_json(obj), indent=1, sort_keys=True))
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["shardc.json"] = False


def show_progress(quiet: bool) -> bool:
    """Progress unless --quiet: a bar on a terminal, a line every few seconds in a log
    (shardc/progress.py)."""
    return not quiet


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


def push_lines(res: PushResult) -> list[str]:
    """What ``push`` (and ``build --upload``) did, as text."""
    from ..formats.files import human_size

    lines = [f"pushed {res.uploaded} file(s), {human_size(res.bytes_uploaded)} "
             f"({res.present} already present) in {res.seconds:.1f}s",
             f"manifest: {res.manifest_uri} ({res.manifest})"]
    if res.removed:
        lines.append(f"removed {len(res.removed)} object(s) of the replaced build")
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
