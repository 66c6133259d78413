"""The chunked read of a local shard file (verify/chunked.py's ``ChunkSource`` for a file): the
entry points ``read_chunked`` (load_shard) and ``load_for_verify`` (verify --device), and the
positioned, ``O_DIRECT`` reads of a file's chunks in pieces, each hashed right after its read."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import VerifyMismatch
from ..formats import chunks as ch
from ..formats.manifest import ShardEntry
from ..formats.safetensors import disable_direct, enable_direct
from ..layout.plan import DEFAULT_CHUNK_DIGEST
from .chunked import ALIGN, ChunkSource, load_chunks
from .reader import HeaderCheck, RawShard

PIECE = 1 << 20  # a local file's chunk is read and hashed in pieces of this many bytes (cache-hot)


def read_chunked(fd: int, name: str, size: int, chunk_size: int, digests: Sequence[str], device: str,
                 on_header: HeaderCheck | None = None, *, where: str | None = None,
                 digest: str = DEFAULT_CHUNK_DIGEST) -> RawShard:
    """Read a shard of ``size`` bytes from ``fd`` (the caller's one descriptor, size already
    checked against the manifest) onto ``device`` ("cpu" or a resolved "cuda:N"), checking every
    chunk against ``digests``. Raises VerifyMismatch for a damaged chunk (naming the file as
    ``name``) or a file that changed size while it was read (naming it as ``where``, its path);
    ``on_header`` may raise to stop before the data is read. ``digest``: what ``digests`` are
    (the manifest entry's ``chunk_digest``)."""
    source = FileChunks(fd, name, size, chunk_size, digests, digest)
    source.where = where or name
    return load_chunks(source, device, on_header)


def load_for_verify(path: Path, entry: ShardEntry, device: str) -> RawShard | tuple[int, ...]:
    """``verify --device``'s one read of a shard with chunk digests: this loader's parallel read,
    then the non-finite tensors found (``RawShard.nonfinite``); damaged chunks are returned as
    their indices (verify reports them its own way, with the rest of its report)."""
    from .reader import nonfinite, tensors_of

    assert entry.chunk_size is not None
    with open(path, "rb", buffering=0) as f:
        source = _Reporting(f.fileno(), path.name, entry.size, entry.chunk_size, entry.chunks, entry.chunk_digest)
        source.where = str(path)
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


class FileChunks(ChunkSource):
    """Chunks of a local file, through the caller's descriptor: positioned reads, ``O_DIRECT``
    where the filesystem takes it (aligned: the buffers are page-aligned, chunk sizes and offsets
    page multiples; the last chunk's read is rounded up and ends at the file's end)."""

    def __init__(self, fd: int, name: str, size: int, chunk_size: int, digests: Sequence[str],
                 digest: str = DEFAULT_CHUNK_DIGEST) -> None:
        super().__init__(name, size, chunk_size, digests, digest)
        self.fd = fd
        # a file already in the page cache is copied from it (O_DIRECT would go to the disk again)
        self.direct = not _cached(fd, size) and enable_direct(fd)

    def restore(self) -> None:
        """Leave the caller's descriptor as it was given (cached I/O)."""
        if self.direct:
            self.direct = disable_direct(self.fd)

    def changed(self) -> bool:
        return os.fstat(self.fd).st_size != self.size

    def fetch(self, i: int, mv: memoryview) -> tuple[memoryview, str]:
        """Chunk ``i`` in pieces of PIECE bytes, each hashed right after its read, while it is
        still in the CPU's cache (hashing a whole 16 MiB chunk after reading it would fetch it
        from memory again)."""
        lo, hi = self.span(i)
        h, got = ch.new_hash(self.digest), 0
        while got < hi - lo:
            n = min(PIECE, hi - lo - got)
            part = self.read_at(lo + got, n, mv[got : got + -(-n // ALIGN) * ALIGN])
            h.update(part)
            got += len(part)
            if len(part) < n:
                break
        return mv[:got], h.hexdigest()

    def read(self, i: int, mv: memoryview) -> memoryview:
        lo, hi = self.span(i)
        return self.read_at(lo, hi - lo, mv)

    def read_at(self, lo: int, want: int, mv: memoryview) -> memoryview:
        """``want`` bytes at offset ``lo`` into ``mv`` (room rounded up to a page); those read."""
        span = -(-want // ALIGN) * ALIGN if self.direct else want
        got = 0
        while got < want:
            try:
                k = os.preadv(self.fd, [mv[got:span]], lo + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise VerifyMismatch(f"{self.name}: cannot be read ({exc.strerror})", hint="re-pull the shard") from None
                with self._lock:  # taken at open, refused at the read (some network filesystems)
                    if self.direct:
                        self.direct = disable_direct(self.fd)
                span = want
                continue
            if not k:
                self.short = True
                break
            got += k
        return mv[: min(got, want)]


class _Reporting(FileChunks):
    """verify's read: the damaged chunks are kept in ``bad`` rather than raised (a file that
    changed size while it was read still raises)."""

    bad: tuple[int, ...] = ()

    def fail(self, bad: list[int], header: dict[str, Any] | None, start: int) -> None:
        self.bad = tuple(bad)
        super().fail([], header, start)


def _cached(fd: int, size: int, probes: int = 16) -> bool:
    """Whether the file looks resident in the page cache: one page at each of ``probes`` spread
    offsets read with ``RWF_NOWAIT`` (which fails rather than wait for the disk). False where the
    flag is missing."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or size <= 0:
        return False
    page = bytearray(ALIGN)
    for k in range(probes):
        offset = (size - 1) * k // max(1, probes - 1) // ALIGN * ALIGN
        try:
            if os.preadv(fd, [page], offset, flag) <= 0:
                return False
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the filesystem cannot say
            return False
    return True
