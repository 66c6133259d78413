"""Straight from object storage (issue #30 item 3): one rank's shard read by parallel ranged reads
into memory (host or GPU), every chunk checked as it arrives, no local disk.

``shardc.load_shard("s3://bucket/prefix/manifest.json", tp, pp, device=...)`` lands here
(``load_remote``): the facade (shardc/__init__.py) hands in the store's side, ``RangedObjects``
(store/ranged.py: S3, boto3), opened only after the arguments were checked. ``shardc verify
--manifest s3://... --device D`` without ``--dir`` checks ranks the same way (store/ranged.py
``verify_streamed``).

The checks are the local loader's (loader/rank_checks.py ``rank_of``, ``header_check``) and so is
the read (loader/sinks.py): the shard's chunks are fetched by several ranged reads at once, each
straight into the buffer the tensors will live in (or a pinned staging buffer on CUDA) and hashed
there while the others download. A chunk whose digest differs is fetched once more (a body
garbled on the way), then it is a VerifyMismatch naming it and its tensors. Every read is pinned to
the object's version at the start (S3: its ETag, ``IfMatch``). Only manifests with chunk digests
and objects pushed uncompressed can be streamed: a ranged read of a zstd stream has nothing to
check per chunk, and a format_version 2 shard's upgrade (loader/upgrade.py) would read it twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import StoreError, VerifyMismatch
from ..formats.manifest import Manifest
from .rank_checks import check_arguments, header_check, rank_of
from .sinks import load_chunks
from .sources import ChunkReads
from .tensors import RawShard

PULL = "shardc pull it to a local disk, then load_shard the directory"


class RangedObjects(Protocol):
    """What the loader needs of a store to stream a shard: its URI and an object's, an object's
    current size and version (None: missing), and the chunk source of ranged reads pinned to that
    version."""

    uri: str

    def object_uri(self, name: str) -> str: ...

    def version(self, name: str) -> tuple[int, str] | None: ...

    def chunk_reads(self, name: str, size: int, version: str, chunk_size: int, digests: Sequence[str],
                    digest: str) -> ChunkReads: ...


def load_remote(manifest_uri: str, tp_rank: int, pp_stage: int, *, device: str, dp_rank: int,
                open_objects: Callable[[], tuple[RangedObjects, Manifest]]) -> RawShard:
    """One rank's shard from the store onto ``device``, every chunk and the header checked.
    ``open_objects``: the store and its manifest, called once the arguments passed their checks."""
    check_arguments(tp_rank, pp_stage, device, None, dp_rank)
    objects, remote = open_objects()
    remote, layout, rank_layout, dev = rank_of(remote, tp_rank, pp_stage, device, dp_rank)
    entry = remote.shard(rank_layout.file)
    assert entry is not None  # rank_of names a missing entry
    if entry.chunk_size is None:
        raise StoreError(f"{manifest_uri} has no chunk digests (format_version 2): its shards cannot be "
                         "checked chunk by chunk as they stream", hint=f"{PULL}, or rebuild and push it")
    if entry.compressed is not None:
        raise StoreError(f"{objects.object_uri(rank_layout.file)} is stored zstd-compressed; ranged reads need the "
                         "object as built", hint=f"push it uncompressed (`compress` none), or {PULL}")
    found = objects.version(rank_layout.file)
    if found is None:
        raise VerifyMismatch(f"{rank_layout.file}: named by the manifest but missing from {objects.uri}",
                             hint="the store was changed after the push; push the build again")
    size, version = found
    if size != entry.size:
        raise VerifyMismatch(f"{rank_layout.file}: size {size} bytes in {objects.uri}, expected {entry.size}",
                             hint="push the build again")
    source = objects.chunk_reads(rank_layout.file, size, version, entry.chunk_size, entry.chunks, entry.chunk_digest)
    return load_chunks(source, dev, on_header=header_check(rank_layout, layout))
