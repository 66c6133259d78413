"""`shardc reshard` and `shardc export`: a build to another plan, or back to one HF checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from .options import endpoint_option, json_option, quiet_option


@click.command("reshard", epilog="""\b
Reads only the input build (never its source) and only the files its manifest lists: every one
is checked against the input manifest's sha256, and every shard's header as verify checks it,
before use; links are never followed. An s3:// input is downloaded to .shardc-input-* beside the
output directory; a rerun removes those of a killed run. Exit codes: 0 done, 1 a corrupted input (names
the file), a shard verify rejects, replicas that differ (names the tensor) or an s3:// manifest
replaced while it was read, 2 bad input (another model's plan, a lossy dtype change without
--dequantize, a malformed manifest), another build writing to the output, another plan's build
in it (--replace replaces it) or files that are not a build (never replaced); nothing is left in
the output on failure.
Examples:
  shardc reshard --manifest build/demo-tp3pp2-bf16/manifest.json --plan plans/demo-tp1pp1-bf16.yaml
  shardc reshard --manifest s3://models/llama3-70b/fp16/manifest.json --plan plans/tp4pp2-fp16.yaml --json
  shardc reshard --manifest build/x-int8/manifest.json --plan plans/x-bf16.yaml --dequantize
""")
@click.option("--manifest", "manifest_ref", required=True,
              help="Input build: manifest.json path, build directory, file:// or s3:// manifest URI.")
@click.option("--plan", "plan_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The plan to reshard to (same model as the input build).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Output directory [default: build/<plan name>].")
@click.option("--dequantize", is_flag=True, help="Allow int8/fp8 -> 16-bit or another scheme "
              "(lossy: q * scale, then cast or quantized; recorded in the manifest).")
@click.option("--manifests-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("manifests"), show_default=True, envvar="SHARDC_MANIFESTS_DIR", show_envvar=True,
              help="Where the copy of the manifest (the rollout record, <plan>.json) goes.")
@click.option("--force", is_flag=True, help="Rebuild even if the output is complete and up to date.")
@click.option("--replace", is_flag=True, help="Replace another plan's build in the output directory "
              "(switched in once the new one is complete) and its record in --manifests-dir. Files that "
              "are not a build are never replaced.")
@endpoint_option
@quiet_option
@json_option
def reshard_cmd(manifest_ref, plan_file, out_dir, dequantize, manifests_dir, force, replace, endpoint_url,
                quiet, as_json) -> None:
    """Build PLAN from an existing build instead of the Hugging Face source."""
    from ..compiler.reshard import reshard
    from ..layout.plan import load_plan
    from ..store.reshard_input import open_input
    from .output import emit, show_progress, summary_lines

    plan = load_plan(plan_file)
    out = out_dir or Path("build") / plan.name
    inp = open_input(manifest_ref, endpoint_url=endpoint_url, spool_parent=out.parent)
    result = reshard(inp, plan, out, dequantize=dequantize, force=force, manifests_dir=manifests_dir,
                     progress=show_progress(quiet) and not as_json, replace=replace)
    fetched = {"input_bytes_fetched": inp.bytes_fetched} if hasattr(inp, "bytes_fetched") else {}
    summary = {**result.summary(), "input": result.manifest.source.to_dict(), **fetched}

    def text() -> list[str]:
        state = "up to date" if result.up_to_date else f"resharded in {summary['seconds']:.1f}s"
        lines = summary_lines(summary, f"{state} from {manifest_ref}", result.out_dir)
        if summary["input"]["reshard_of"]["dequantized"]:
            lines.append(f"  dequantized (lossy): {len(summary['input']['reshard_of']['dequantized'])} tensors")
        return [*lines, f"manifest: {result.manifest_path}"]

    emit(summary, as_json, text, quiet=quiet)


@click.command("export", epilog="""\b
Every file is written at a temp name and the index is renamed in last: a failed or killed
export leaves the one already in DIR whole (killed while switching: no index), and a rerun
removes its leftovers. One export per DIR at a time; DIR may not be the input build's, hold files
an export does not write, or (without --replace) an export of another model or dtype.
Exit codes: 0 done, 1 a corrupted input file (named) or a disk failure, 2 bad input, another
export writing to DIR, or what DIR holds.
Examples:
  shardc export --manifest build/demo-tp3pp2-bf16/manifest.json --out /tmp/smollm2-hf
  shardc export --manifest s3://models/llama3-70b/fp16/manifest.json --out ./hf --max-shard-size 10GB
""")
@click.option("--manifest", "manifest_ref", required=True,
              help="Input build: manifest.json path, build directory, file:// or s3:// manifest URI.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the Hugging Face checkpoint.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest file (5GB = 5e9 bytes, 5GiB = 5*2^30); a larger tensor gets its own file.")
@click.option("--replace", is_flag=True, help="Replace an export of another model or dtype in DIR. Files "
              "that are not an export (a checkpoint shardc did not write) are never replaced.")
@endpoint_option
@quiet_option
@json_option
def export_cmd(manifest_ref, out_dir, max_shard_size, replace, endpoint_url, quiet, as_json) -> None:
    """Write a build as one Hugging Face checkpoint: model-0000i-of-0000n.safetensors + index."""
    from ..compiler.export import export
    from ..store.reshard_input import open_input
    from ..units import parse_size
    from .output import UsageError, emit

    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise UsageError(f"{exc}, found {max_shard_size!r}", key="--max-shard-size") from None
    inp = open_input(manifest_ref, endpoint_url=endpoint_url, spool_parent=out_dir.parent)
    res = export(inp, out_dir, max_shard_size=limit, replace=replace)
    emit(res, as_json, lambda: [
        f"exported {len(res.files)} file(s), {res.total_bytes / 2**30:.2f} GiB ({res.dtype}) to {res.out_dir} "
        f"in {res.seconds:.1f}s",
        *(f"  {f.name}  {f.tensors:5d} tensors  {f.size / 2**20:10.1f} MiB  {f.sha256[:12]}" for f in res.files)],
        quiet=quiet)


COMMANDS = [reshard_cmd, export_cmd]
