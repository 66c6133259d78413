"""The store's side of a rank streamed out of S3 (issue #30 item 3; the read itself is the loader's,
loader/remote.py): ``open_ranged`` opens an ``s3://`` manifest and hands the loader the store as
its ``RangedObjects`` (``S3Objects``: ranged GETs pinned to the ETag, store/ranged.py), and
``verify_streamed`` is ``shardc verify --manifest s3://... --device D`` without ``--dir``: each rank
streamed and checked, nothing written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import StoreError, VerifyMismatch
from ..formats.manifest import Manifest
from ..loader.sources import ChunkReads
from ..verify.report import VerifyReport
from .object_store import S3Settings
from .ranged import RangedChunks
from .s3 import S3Store


class S3Objects:
    """An S3 store as the loader's ``RangedObjects`` (loader/remote.py): versions are ETags."""

    def __init__(self, store: S3Store) -> None:
        self.store, self.uri = store, store.uri

    def object_uri(self, name: str) -> str:
        return self.store.object_uri(name)

    def version(self, name: str) -> tuple[int, str] | None:
        return self.store.version(name)

    def chunk_reads(self, name: str, size: int, version: str, chunk_size: int, digests: Sequence[str],
                    digest: str) -> ChunkReads:
        return RangedChunks(self.store, name, size, version, chunk_size, digests, digest)


def open_ranged(manifest_uri: str, *, endpoint_url: str | None = None,
                settings: S3Settings | None = None) -> tuple[S3Objects, Manifest]:
    """The S3 store an ``s3://`` manifest URI names and the manifest as stored, its file names
    checked (``pull``'s ``check_names``), for the loader's streaming read."""
    from .pull import check_names, open_manifest

    store, remote = open_manifest(manifest_uri, endpoint_url=endpoint_url, settings=settings)
    if not isinstance(store, S3Store):
        raise StoreError(f"{manifest_uri} is not in object storage", hint="load_shard a local path directly")
    check_names(remote, manifest_uri)
    return S3Objects(store), remote


def verify_streamed(manifest_uri: str, manifest: Manifest, ranks: list[Any], device: str,
                    endpoint_url: str | None = None) -> VerifyReport:
    """``shardc verify --manifest s3://... --device D`` without ``--dir``: each rank streamed onto
    ``device`` (one after another, nothing written), checked, finite-checked; the report has
    ``verify_build``'s form. A mismatch is a failed rank; a store error (an object replaced while
    read, the store unreachable) raises."""
    from ..loader.rank_checks import check_manifest_against_layout
    from ..loader.remote import load_remote
    from ..loader.tensors import nonfinite, tensors_of
    from ..verify.checks import RankResult

    opened = open_ranged(manifest_uri, endpoint_url=endpoint_url)
    layout = manifest.to_layout()
    problems = check_manifest_against_layout(manifest, layout)
    results = []
    for rank_layout in ranks:
        res = RankResult(rank_layout.file, rank_layout.tp_rank, rank_layout.pp_stage, rank_layout.rank)
        try:
            raw = load_remote(manifest_uri, rank_layout.tp_rank, rank_layout.pp_stage, device=device,
                              dp_rank=rank_layout.dp_rank, open_objects=lambda: opened)
            tensors = tensors_of(raw)
            res.checks += ["present", "size", "sha256", "header", f"load:{device}"]
            dtypes = {k: v.get("dtype") for k, v in (raw.header or {}).items() if isinstance(v, dict)}
            for name in nonfinite(tensors, dtypes):
                res.fail(f"tensor {name} holds NaN or Inf on {device}")
            del tensors, raw
        except VerifyMismatch as exc:
            res.ok = False
            file = rank_layout.file
            res.problems.append(exc.message if exc.message.startswith(file) else f"{file}: {exc.message}")
        results.append(res)
    return VerifyReport.of(layout.plan.name, layout.plan.sha256, problems, [r.verdict() for r in results],
                           streamed_from=manifest_uri)
