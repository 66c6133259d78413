"""`shardc build` and `shardc inspect`."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import click

from ..errors import ShardcError
from ..formats.files import human_size
from .options import endpoint_option, json_option, quiet_option


@click.command("build", epilog="""\b
Examples:
  shardc build plans/tp4pp2-fp16.yaml
  shardc build plans/demo-tp3pp2-bf16.yaml --json
  shardc build plans/tp2pp1-int8.yaml --source /data/Llama-3.3-70B-Instruct --out /nvme/build
  shardc build plans/tp4pp2-fp16.yaml --upload --to s3://models/llama3-70b/fp16
  shardc build plans/tp4pp2-fp16.yaml --dry-run      # validate against the 70B preset, offline
""")
@click.argument("plan_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--source", help="Read weights from here instead of the plan's model.source "
              "(local dir or hf://org/repo[@rev]). The plan and its sha256 in the shards are "
              "unchanged; the manifest records the override and the effective plan's sha256 "
              "(check with verify --plan PLAN --source SOURCE).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Output directory [default: build/<plan name>].")
@click.option("--manifests-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("manifests"), show_default=True, envvar="SHARDC_MANIFESTS_DIR", show_envvar=True,
              help="Where the copy of the manifest (the rollout record, <plan>.json) goes.")
@click.option("--force", is_flag=True, help="Rebuild even if the output is complete and up to date.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickled .bin checkpoints of a local directory (loaded weights_only; never from hf://).")
@click.option("--upload", is_flag=True, help="Push the build to object storage afterwards.")
@click.option("--to", "to_uri", help="With --upload: destination [default: the plan's manifest_uri directory].")
@endpoint_option
@click.option("--replace", is_flag=True, help="Replace another plan's build in the output directory "
              "(switched in once the new one is complete) and its record in --manifests-dir; with --upload, "
              "at the destination too (as push --replace). Files that are not a build are never replaced.")
@click.option("--dry-run", is_flag=True, help="Validate the plan against the model and print the "
              "per-rank layout; reads no weights (hub sources use the built-in presets).")
@click.option("--model", "model_ref", help="With --dry-run: model preset or config.json to check against.")
@quiet_option
@json_option
def build_cmd(plan_file, source, out_dir, manifests_dir, force, allow_pickle, upload, to_uri,
              endpoint_url, replace, dry_run, model_ref, quiet, as_json) -> None:
    """Compile PLAN_FILE into per-rank safetensors shards, config.json and manifest.json."""
    from ..layout.plan import load_plan
    from .output import emit, push_lines, show_progress, summary_lines

    plan = load_plan(plan_file)
    if source:
        _check_same_words(plan, source)
        plan = plan.with_source(source)
    if dry_run:
        _dry_run(plan, model_ref, as_json)
        return
    from ..compiler.compile import build

    # The cyclic garbage collector finds next to nothing in a build, yet runs hundreds of times
    # (mostly while numba loads; docs/performance.md §2): this process, the command's own, holds it
    # until the build is done. The library leaves the interpreter's state to its caller.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = build(plan, out_dir, force=force, progress=show_progress(quiet) and not as_json,
                       allow_pickle=allow_pickle, manifests_dir=manifests_dir, replace=replace)
    except ShardcError as exc:
        if source and exc.key == "model.source":  # the plan's field, which --source set
            exc.key = "source"
        raise
    finally:
        if gc_was_enabled:
            gc.enable()
    summary = result.summary()
    pushed = None
    if upload:
        from ..store import push_build

        pushed = push_build(result.manifest_path, to_uri, endpoint_url=endpoint_url,
                            progress=show_progress(quiet) and not as_json, replace=replace)

    def text() -> list[str]:
        state = "up to date" if result.up_to_date else f"built in {summary['seconds']:.1f}s"
        lines = summary_lines(summary, state, result.out_dir)
        if result.skipped and not result.up_to_date:
            lines.append(f"  resumed: {len(result.skipped)} shard(s) already complete were kept")
        lines.append(f"manifest: {result.manifest_path}")
        if manifests_dir is not None:
            lines.append(f"record:   {Path(manifests_dir) / (summary['plan'] + '.json')}")
        return lines + (push_lines(pushed) if pushed is not None else [])

    emit(summary if pushed is None else {**summary, "upload": pushed}, as_json, text, quiet=quiet)


def _check_same_words(plan, source: str) -> None:
    """``--source`` in the plan's own words is no override, and is recorded as none; a relative
    path means another directory here (the plan's is relative to the plan file), so that is
    refused rather than recorded as the plan's own source."""
    from .output import UsageError

    if source == plan.data["model"]["source"] and plan.source_label is not None \
            and Path(source).resolve() != Path(plan.source).resolve():
        raise UsageError(f"--source {source!r} is the plan's own model.source, which the plan resolves to "
                         f"{plan.source}, not {Path(source).resolve()}",
                         hint="pass the directory as it should be recorded, e.g. an absolute path")


def _dry_run(plan, model_ref: str | None, as_json: bool) -> None:
    from ..formats.safetensors import shard_file_size
    from ..layout.model import model_for_source
    from ..layout.ranks import build_layout
    from .output import emit

    layout = build_layout(model_for_source(plan.source, model_ref), plan)
    ranks: list[dict[str, Any]] = [{"file": r.file, "rank": r.rank, "tp_rank": r.tp_rank, "pp_stage": r.pp_stage,
              "layers": list(r.layers), "tensors": len(r.tensors), "bytes": r.nbytes,
              "file_bytes": shard_file_size(layout, r)} for r in layout.ranks]
    emit({"plan": plan.name, "plan_sha256": plan.sha256, "effective_plan_sha256": plan.effective_sha256,
          "overrides": plan.overrides, "valid": True, "ranks": ranks}, as_json, lambda: [
        f"{plan.name}: valid (tp={plan.tp} pp={plan.pp} dtype={plan.dtype}, "
        f"{layout.model.architecture} {layout.model.num_layers} layers)",
        *(f"  {r['file']}  rank {r['rank']:>3}  layers {r['layers'][0]}:{r['layers'][1]}  "
          f"{r['tensors']:4d} tensors  {human_size(r['file_bytes']):>12} file" for r in ranks)])


@click.command("inspect", epilog="""\b
Examples:
  shardc inspect build/demo-tp3pp2-bf16/manifest.json
  shardc inspect build/demo-tp3pp2-bf16/model-tp01-pp00.safetensors --tensors
""")
@click.argument("path", type=click.Path(exists=True, dir_okay=True, path_type=Path))
@click.option("--tensors", is_flag=True, help="List every tensor.")
@json_option
def inspect_cmd(path: Path, tensors: bool, as_json: bool) -> None:
    """Summarize a manifest, a build directory or one shard file."""
    from ..verify.inspect import describe
    from .output import emit

    info = describe(path)
    emit(info, as_json, lambda: [*info.lines, *(
        f"    {t['name']:<60} {t['dtype']:<8} {t['shape']}  {t.get('split', '')}"
        for t in (info.tensors if tensors else []))])


COMMANDS = [build_cmd, inspect_cmd]
