"""Ranged reads of an S3 object checked chunk by chunk (issue #30 item 3): the chunk source the
loader's streaming read (loader/remote.py, through store/stream.py) reads into memory, and
``download_chunked``, the same reads to disk for ``shardc pull``. Every GET is pinned to the
object's ETag at the start (``IfMatch``): an object pushed again while it is read is one StoreError
line, never a mix of two objects."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import ShardcError, VerifyMismatch
from ..loader.sinks import to_file
from ..loader.sources import ChunkReads
from .s3 import S3Store


class RangedChunks(ChunkReads):
    """Chunks of an S3 object, each one ranged GET pinned to the object's ETag."""

    refetch = True  # a garbled body is fetched once more before it is a mismatch

    def __init__(self, store: S3Store, name: str, size: int, etag: str, chunk_size: int,
                 digests: Sequence[str], digest: str = DEFAULT_CHUNK_DIGEST) -> None:
        super().__init__(name, size, chunk_size, digests, digest)
        self.store, self.etag = store, etag
        self.where = store.object_uri(name)
        self.in_flight = max(4, store.settings.max_concurrency)

    def parallel(self) -> int:
        return max(1, min(self.count, self.in_flight))

    def read(self, i: int, mv: memoryview) -> memoryview:
        lo, hi = self.span(i)
        got = self.store.get_range(self.name, lo, hi, mv, self.etag)
        if got < hi - lo:
            self.short = True
        return mv[:got]



def download_chunked(store: S3Store, final: Path, size: int, chunk_size: int, chunks: tuple[str, ...],
                     fsync: bool, on_bytes: Callable[[int], None] | None = None, *,
                     digest: str = DEFAULT_CHUNK_DIGEST) -> None:
    """``shardc pull``'s download of a shard with chunk digests: parallel ranged GETs (pinned to
    the ETag) written at their offsets of an exclusive partial file next to ``final``, each chunk
    checked in memory before it is written (a damaged one fetched once more), renamed into place
    only when every chunk matched: no second read of the file to hash it."""
    from ..formats.chunk_digests import chunk_problem, tensors_in
    from ..formats.safetensors import read_header
    from .codec import new_partial

    name = final.name
    found = store.version(name)
    if found is None:
        raise VerifyMismatch(f"{name}: named by the manifest but missing from {store.uri}",
                             hint="the store was changed after the push; push the build again")
    if found[0] != size:
        raise VerifyMismatch(f"{name}: the stored object is {found[0]} bytes, the manifest's {size}",
                             hint="push the build again")
    path, f = new_partial(final)
    try:
        with f:
            bad = to_file(RangedChunks(store, name, size, found[1], chunk_size, chunks, digest), f.fileno(), on_bytes)
            if bad:
                try:
                    tensors, _, start = read_header(path)
                except (ShardcError, OSError):
                    tensors, start = {}, 0
                line = chunk_problem(bad, size, chunk_size, lambda lo, hi: tensors_in(tensors, start, lo, hi),
                                     digest=digest)
                raise VerifyMismatch(f"{name}: downloaded data does not match the manifest: {line}",
                                     hint="the object was corrupted or replaced in the store; push the build again")
            os.ftruncate(f.fileno(), size)
            if fsync:
                os.fsync(f.fileno())
        os.replace(path, final)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
