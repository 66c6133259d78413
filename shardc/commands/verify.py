"""`shardc verify`: the node cold-start check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .options import endpoint_option, json_option

if TYPE_CHECKING:
    from ..verify.report import VerifyReport


@click.command("verify", epilog="""\b
Exit codes: 0 all good, 1 mismatch (names shard, tensor, expected vs found), 2 bad input.
Examples:
  shardc verify --manifest build/demo-tp3pp2-bf16/manifest.json
  shardc verify --manifest /models/manifest.json --rank 5 --device cuda
  shardc verify --manifest s3://models/llama-tp4/manifest.json --rank 5 --device cuda   # streamed, no disk
  shardc verify --manifest build/x/manifest.json --deep /data/Llama-3.3-70B-Instruct --json
  shardc verify --manifest /nvme/build/manifest.json --plan plans/tp2pp1-int8.yaml --source /data/Llama-3.3-70B-Instruct
  torchrun --nproc-per-node 8 -m shardc.cli verify --manifest m.json --distributed --device cuda
""")
@click.option("--manifest", "manifest_path", required=True,
              help="manifest.json path (or a URI understood by shardc pull).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Directory holding the shards [default: the manifest's directory].")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path),
              help="The plan this node expects; the manifest must be of exactly this plan "
                   "(and of its model.source, unless --source).")
@click.option("--source", "source", help="With --plan: the --source the build was made with (as "
              "typed to shardc build); the manifest must record exactly that override.")
@click.option("--rank", type=int, help="Global rank to verify (only its file is read).")
@click.option("--tp-rank", type=int, help="TP rank (with --pp-stage).")
@click.option("--pp-stage", type=int, help="PP stage (with --tp-rank).")
@click.option("--all", "all_ranks", is_flag=True, help="Verify every rank (the default).")
@click.option("--device", help="Load every tensor onto this device and check values: cpu, cuda "
                               "(this process's GPU, cuda:LOCAL_RANK) or cuda:N.")
@click.option("--deep", "deep_source", help="Reassemble against this source checkpoint, byte for byte.")
@click.option("--jobs", type=int, help="Parallel hashing threads [default: cores, at most 8].")
@click.option("--distributed", is_flag=True, help="One process per rank (torchrun env); the group agrees.")
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True,
              help="Seconds any distributed wait may take before it is an error.")
@endpoint_option
@json_option
@click.pass_context
def verify_cmd(ctx, manifest_path, directory, plan_file, source, rank, tp_rank, pp_stage, all_ranks, device,
               deep_source, jobs, distributed, timeout_s, endpoint_url, as_json) -> None:
    """Check shard files against the manifest and the plan: bytes, header, tensors, shapes."""
    from ..errors import ManifestError
    from ..verify.checks import verify_build
    from .output import UsageError, chosen_ranks, emit

    manifest, default_dir = _load_manifest(manifest_path, endpoint_url)
    directory = directory or default_dir
    stream = directory is None and device is not None and not distributed and manifest_path.startswith("s3://")
    if directory is None and not stream:
        raise ManifestError("a manifest from a store needs --dir (where this node's shards are) or "
                            "--device (stream the ranks from the store onto it, nothing written)",
                            hint="shardc verify --manifest s3://bucket/prefix/manifest.json --rank 0 --device cuda")
    if source is not None and plan_file is None:
        raise UsageError("--source goes with --plan (it names the source of the plan this node expects)",
                         hint="shardc verify --manifest M --plan PLAN.yaml --source SRC")
    plan_record = None
    if plan_file is not None:
        from ..layout.plan import load_plan
        from ..verify.checks import plan_check

        expected = load_plan(plan_file)
        plan_record = plan_check(manifest, expected.with_source(source) if source else expected, str(plan_file))
    if distributed or "TORCHELASTIC_RUN_ID" in os.environ:  # --distributed, or launched by torchrun
        from ..verify.distributed import distributed_verify

        report = distributed_verify(manifest, directory, device=device, deep=deep_source, timeout_s=timeout_s)
    else:
        ranks = manifest.to_layout().select(*chosen_ranks(rank, tp_rank, pp_stage, all_ranks, required=False))
        if device:  # one process checks its ranks one after another, on one GPU
            from ..loader.devices import check_gpus

            check_gpus(manifest.name, device, 1)
        if stream:  # straight from object storage: ranged GETs into memory, every chunk checked
            from ..store.stream import verify_streamed

            if deep_source:
                raise UsageError("--deep reads the shards from --dir", hint="pass --dir, or drop --deep")
            report = verify_streamed(manifest_path, manifest, ranks, device, endpoint_url=endpoint_url)
        else:
            report = verify_build(manifest, directory, ranks, device=device, deep=deep_source, jobs=jobs)
    if plan_record is not None:  # a new report: the shards may be sound, yet not what this node expects
        report = report.with_plan_check(plan_record)
    emit(report, as_json, lambda: _text(report))
    ctx.exit(0 if report.ok else 1)


def _text(report: VerifyReport) -> list[str]:
    """The verdict for people: a line per rank (the check that failed and why, on the line: the
    passed ones would mislead), the problems on stderr, then the verdict."""
    from .output import Stderr

    lines: list[str] = []
    for r in report.ranks:
        where = f"{r.file} (rank {r.rank}: tp {r.tp_rank}, pp {r.pp_stage})"
        if r.ok:
            lines.append(f"ok   {where}  {' '.join(r.checks)}")
        else:
            reasons = [p.removeprefix(f"{r.file}: ") for p in r.problems] or ["failed"]
            lines.append(f"FAIL {where}  {reasons[0]}")
            lines += [f"     also: {more}" for more in reasons[1:]]
        lines += [f"     warning: {w}" for w in r.warnings]
    lines += [Stderr(f"error: {p}") for p in report.problems]
    verdict = "all good" if report.ok else f"{len(report.problems)} problem(s)"
    return [*lines, f"{report.plan}: {verdict}"]



def _load_manifest(ref: str, endpoint_url: str | None):
    """A local manifest path (its directory is the default --dir), or a URI fetched from a store."""
    from ..formats.manifest import load

    if "://" in ref and not ref.startswith("file://"):
        from ..store import fetch_manifest

        return fetch_manifest(ref, endpoint_url=endpoint_url), None
    path = Path(ref.removeprefix("file://"))
    if path.is_dir():
        path = path / "manifest.json"
    return load(path), path.parent


COMMANDS = [verify_cmd]
