"""Straight from object storage (issue #30 item 3): one rank's shard streamed with parallel ranged
GETs into memory (host or GPU), every chunk checked as it arrives, no local disk.

``shardc.load_shard("s3://bucket/prefix/manifest.json", tp, pp, device=...)`` lands here
(``stream_rank``; the facade hands any other manifest to verify/loader.py's ``load_shard``), ``shardc verify --manifest s3://...
--device D`` without ``--dir`` checks ranks this way (``verify_streamed``); ``shardc pull``
downloads shards with chunk digests by the same ranged reads, to disk (store/ranged.py).

The checks are the local loader's (verify/loader.py ``rank_of``, ``header_check``) and so is the
read (verify/chunk_sinks.py): the shard's chunks are fetched by several ranged GETs at once, each
straight into the buffer the tensors will live in (or a pinned staging buffer on CUDA) and hashed
there while the others download. A chunk whose sha256 differs is fetched once more (a body garbled
on the way), then it is a VerifyMismatch naming it and its tensors. Every GET is pinned to the
object's ETag at the start (``IfMatch``): an object pushed again while it is read is one StoreError
line, never a mix of two objects. Only manifests with chunk digests (format_version 3) and objects
pushed uncompressed can be streamed: a ranged GET of a zstd stream has nothing to check per chunk.
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreError, VerifyMismatch
from ..formats.manifest import Manifest
from ..verify.chunk_sinks import load_chunks
from ..verify.loader import header_check, rank_of
from ..verify.reader import RawShard, nonfinite, tensors_of
from ..verify.report import VerifyReport
from .object_store import S3Settings, Store
from .ranged import RangedChunks
from .s3 import S3Store

_PULL = "shardc pull it to a local disk, then load_shard the directory"


def stream_rank(manifest_uri: str, tp_rank: int, pp_stage: int, *, device: str, dp_rank: int = 0,
                endpoint_url: str | None = None, settings: S3Settings | None = None,
                opened: tuple[Store, Manifest] | None = None) -> RawShard:
    """One rank's shard from the store onto ``device``, every chunk and the header checked."""
    from ..verify.loader import _check_arguments
    from .pull import check_names, open_manifest

    _check_arguments(tp_rank, pp_stage, device, None, dp_rank)
    store, remote = opened or open_manifest(manifest_uri, endpoint_url=endpoint_url, settings=settings)
    if not isinstance(store, S3Store):
        raise StoreError(f"{manifest_uri} is not in object storage", hint="load_shard a local path directly")
    check_names(remote, manifest_uri)
    remote, layout, rl, dev = rank_of(remote, tp_rank, pp_stage, device, dp_rank)
    entry = remote.shard(rl.file)
    assert entry is not None  # rank_of names a missing entry
    if entry.chunk_size is None:
        raise StoreError(f"{manifest_uri} has no chunk digests (format_version 2): its shards cannot be "
                         "checked chunk by chunk as they stream", hint=f"{_PULL}, or rebuild and push it")
    if entry.compressed is not None:
        raise StoreError(f"{store.object_uri(rl.file)} is stored zstd-compressed; ranged reads need the "
                         "object as built", hint=f"push it uncompressed (`compress` none), or {_PULL}")
    found = store.version(rl.file)
    if found is None:
        raise VerifyMismatch(f"{rl.file}: named by the manifest but missing from {store.uri}",
                             hint="the store was changed after the push; push the build again")
    size, etag = found
    if size != entry.size:
        raise VerifyMismatch(f"{rl.file}: size {size} bytes in {store.uri}, expected {entry.size}",
                             hint="push the build again")
    source = RangedChunks(store, rl.file, size, etag, entry.chunk_size, entry.chunks, entry.chunk_digest)
    return load_chunks(source, dev, on_header=header_check(rl, layout))


def verify_streamed(manifest_uri: str, manifest: Manifest, ranks: list[Any], device: str,
                    endpoint_url: str | None = None) -> VerifyReport:
    """``shardc verify --manifest s3://... --device D`` without ``--dir``: each rank streamed onto
    ``device`` (one after another, nothing written), checked, finite-checked; the report has
    ``verify_build``'s form. A mismatch is a failed rank; a store error (an object replaced while
    read, the store unreachable) raises."""
    from ..verify.checks import RankResult, check_manifest_against_layout
    from .pull import open_manifest

    opened = open_manifest(manifest_uri, endpoint_url=endpoint_url)
    layout = manifest.to_layout()
    problems = check_manifest_against_layout(manifest, layout)
    results = []
    for rl in ranks:
        res = RankResult(rl.file, rl.tp_rank, rl.pp_stage, rl.rank)
        try:
            raw = stream_rank(manifest_uri, rl.tp_rank, rl.pp_stage, device=device, dp_rank=rl.dp_rank,
                              opened=opened)
            tensors = tensors_of(raw)
            res.checks += ["present", "size", "sha256", "header", f"load:{device}"]
            dtypes = {k: v.get("dtype") for k, v in (raw.header or {}).items() if isinstance(v, dict)}
            for name in nonfinite(tensors, dtypes):
                res.fail(f"tensor {name} holds NaN or Inf on {device}")
            del tensors, raw
        except VerifyMismatch as exc:
            res.ok = False
            res.problems.append(exc.message if exc.message.startswith(rl.file) else f"{rl.file}: {exc.message}")
        results.append(res)
    return VerifyReport.of(layout.plan.name, layout.plan.sha256, problems, [r.verdict() for r in results],
                           streamed_from=manifest_uri)
