"""The chunked read of a local shard file: the entry points ``read_chunked`` (load_shard) and
``load_for_verify`` (verify --device). The reads themselves (positioned, ``O_DIRECT``, in pieces
each hashed right after its read) are formats/chunk_reads.py's ``FileChunkReads``; what is done with
the chunks is verify/chunk_sinks.py's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import VerifyMismatch
from ..formats.chunk_reads import FileChunkReads, HostReads
from ..formats.manifest import ShardEntry
from .chunk_sinks import load_chunks
from .reader import HeaderCheck, RawShard


def read_chunked(fd: int, name: str, size: int, chunk_size: int, digests: Sequence[str], device: str,
                 on_header: HeaderCheck | None = None, *, where: str | None = None,
                 digest: str = DEFAULT_CHUNK_DIGEST, started: HostReads | None = None) -> RawShard:
    """Read a shard of ``size`` bytes from ``fd`` (the caller's one descriptor, size already
    checked against the manifest) onto ``device`` ("cpu" or a resolved "cuda:N"), checking every
    chunk against ``digests``. Raises VerifyMismatch for a damaged chunk (naming the file as
    ``name``) or a file that changed size while it was read (naming it as ``where``, its path);
    ``on_header`` may raise to stop before the data is read. ``digest``: what ``digests`` are
    (the manifest entry's ``chunk_digest``). ``started``: these very reads, already under way on
    ``fd`` (the loader's early start, formats/prefetch.py; its source is reused)."""
    source = started.source if started is not None else FileChunkReads(fd, name, size, chunk_size, digests, digest)
    source.where = where or name
    return load_chunks(source, device, on_header, started)


def load_for_verify(path: Path, entry: ShardEntry, device: str) -> RawShard | tuple[int, ...]:
    """``verify --device``'s one read of a shard with chunk digests: this loader's parallel read,
    then the non-finite tensors found (``RawShard.nonfinite``); damaged chunks are returned as
    their indices (verify reports them its own way, with the rest of its report)."""
    from .reader import nonfinite, tensors_of

    assert entry.chunk_size is not None
    with open(path, "rb", buffering=0) as f:
        source = FileChunkReads(f.fileno(), path.name, entry.size, entry.chunk_size, entry.chunks, entry.chunk_digest)
        source.where, source.report_bad = str(path), True
        raw = load_chunks(source, device)
    if source.bad:
        return source.bad
    if raw.header is not None:
        try:
            tensors = tensors_of(raw)
        except VerifyMismatch:  # the caller's own tensors_of reports it
            return raw
        dtypes = {k: v.get("dtype") for k, v in raw.header.items() if isinstance(v, dict)}
        raw.nonfinite = nonfinite(tensors, dtypes)
    return raw
