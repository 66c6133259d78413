"""`shardc push` and `shardc pull`: parse, call shardc.store, format. No boto3 import here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..formats.files import human_size
from .options import endpoint_option, json_option, quiet_option

if TYPE_CHECKING:
    from ..store.transfers import PullResult


@click.command("push", epilog="""\b
Examples:
  shardc push --manifest build/llama3-70b-fp16-primary/manifest.json
  shardc push --manifest manifests/llama3-70b-fp16-primary.json --to s3://models/llama3-70b/fp16
  shardc push --manifest build/demo/manifest.json --to /mnt/models/demo --json
  AWS_ENDPOINT_URL=http://127.0.0.1:9000 shardc push --manifest build/demo/manifest.json --to s3://models/demo --compress zstd

\b
Objects already in the store with the right sha256 are skipped, so a rerun resumes an interrupted
push. The manifest is uploaded last: a reader that finds it can fetch every file it names.
A destination that holds another plan's build (or one built from another source) is refused
unless --replace is given.
""")
@click.option("--manifest", "manifest_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The build's manifest.json (or its copy in manifests/).")
@click.option("--to", "to_uri", help="Destination: local dir, file:///dir or s3://bucket/prefix "
              "[default: the directory of the plan's checkpoint.manifest_uri].")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the shards are, if not next to --manifest (nor in build/<plan name>).")
@endpoint_option
@click.option("--compress", type=click.Choice(["none", "zstd"]), default="none", show_default=True,
              help="Store shards as .zst objects: ~20% smaller, but zstd runs at ~0.3-0.7 GB/s "
              "per core, so it pays only on links slower than that.")
@click.option("--replace", is_flag=True,
              help="Replace another plan's build at the destination: once the new manifest is in "
              "place, the objects the old manifest named and the new one does not are removed.")
@quiet_option
@json_option
def push_cmd(manifest_path: Path, to_uri: str | None, build_dir: Path | None, endpoint_url: str | None,
             compress: str, replace: bool, quiet: bool, as_json: bool) -> None:
    """Upload a build to object storage, manifest last."""
    from ..store import push_build
    from .output import emit, push_lines, show_progress

    res = push_build(manifest_path, to_uri, endpoint_url=endpoint_url,
                     compress=None if compress == "none" else compress,
                     progress=show_progress(quiet) and not as_json, build_dir=build_dir,
                     replace=replace)
    emit(res, as_json, lambda: push_lines(res), quiet=quiet)


@click.command("pull", epilog="""\b
Examples:
  shardc pull --manifest s3://models/llama3-70b/fp16/manifest.json --rank 5 --dest /nvme/shards
  shardc pull --manifest s3://models/llama3-70b/fp16/manifest.json --tp-rank 1 --pp-stage 1 --dest /nvme/shards
  shardc pull --manifest /mnt/models/demo/manifest.json --all --dest ./demo --json

\b
Every file is verified (sha256) before it gets its final name; files already present and matching
are kept. Exit codes: 0 ok, 1 the store's data does not match its manifest, 2 bad input/store error.
""")
@click.option("--manifest", "manifest_uri", required=True,
              help="URI of the manifest: local path, file://..., s3://bucket/prefix/manifest.json.")
@click.option("--rank", type=int, multiple=True, help="Global rank to fetch (repeatable).")
@click.option("--tp-rank", type=int, help="With --pp-stage: the rank to fetch.")
@click.option("--pp-stage", type=int, help="With --tp-rank: the rank to fetch.")
@click.option("--all", "all_ranks", is_flag=True, help="Fetch every rank's shard.")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Local directory to put the files in.")
@endpoint_option
@quiet_option
@json_option
def pull_cmd(manifest_uri: str, rank: tuple[int, ...], tp_rank: int | None, pp_stage: int | None,
             all_ranks: bool, dest: Path, endpoint_url: str | None, quiet: bool, as_json: bool) -> None:
    """Download a build's shards for some ranks (or all), verified, then check them like verify."""
    from ..store import pull_build
    from .output import chosen_ranks, emit, show_progress

    ranks, pairs = chosen_ranks(rank, tp_rank, pp_stage, all_ranks, required=True)
    kwargs: dict[str, Any] = {}
    if ranks:
        kwargs["global_ranks"] = ranks
    elif pairs:
        kwargs["ranks"] = pairs
    res = pull_build(manifest_uri, dest, endpoint_url=endpoint_url,
                     progress=show_progress(quiet) and not as_json, **kwargs)
    emit(res, as_json, lambda: _pull_lines(res), quiet=quiet)


def _pull_lines(res: PullResult) -> list[str]:
    """What ``pull`` did, as text."""
    ranks = ", ".join(str(r.rank) for r in res.ranks)
    return [f"pulled rank(s) {ranks}: {res.downloaded} file(s) downloaded, {res.present} already present, "
            f"{human_size(res.bytes_downloaded)} in {res.seconds:.1f}s; verified OK",
            f"manifest: {res.manifest}"]


COMMANDS = [push_cmd, pull_cmd]
