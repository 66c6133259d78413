"""How a shard's chunks are read and hashed (docs/architecture.md §3.3): the geometry, the checked
read of one chunk, a local file's positioned ``O_DIRECT`` reads, and a shard's chunks queued (all at
once, or a bounded window first) into the one host buffer its tensors will live in (``HostReads``).

What is done with the chunks (the header check, the failure lines, the GPU and the pull to disk)
is loader/sinks.py's. The split is by import cost: this module imports the standard library, the
digest kinds, formats' chunk geometry and O_DIRECT switch (formats/direct_io.py) and (inside a call) torch, nothing of shardc's layout or manifest, so the loader can
start the disk before those are imported (loader/early_start.py: they are 70 ms of a cold start).

Why chunks and not one pass: one whole-file sha256 is a chain, one core's worth, and 1 MiB reads on
one thread leave a fast disk idle. With chunk digests every chunk is independent: sixteen reads in
flight, each straight into the buffer the tensors will live in (``O_DIRECT`` where the filesystem
takes it: no copy through the page cache, none left behind), each 1 MiB piece hashed right after its
read while it is in the CPU's cache, every core hashing.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..digests import DEFAULT_CHUNK_DIGEST, new_hash
from ..errors import VerifyMismatch
from ..formats.chunk_digests import CHUNK_ALIGN, chunk_count, workers
from ..formats.direct_io import disable_direct, enable_direct, page_cached

ALIGN = CHUNK_ALIGN  # O_DIRECT: buffer address, file offset and length in whole pages
PIECE = 1 << 20  # a local file's chunk is read and hashed in pieces of this many bytes (cache-hot)
IN_FLIGHT = 16  # a local disk's reads waiting at once (4 to 24 measured: docs/performance.md, session 12)


class ChunkReads:
    """Where a shard's chunks come from: the geometry and the checked read of one chunk.
    Subclasses say how chunk ``i`` is read (``read``), whether the object changed meanwhile
    (``changed``), whether a damaged chunk is read once more (``refetch``: a network read may have
    been garbled on the way; a local file would give the same bytes again) and what to undo at the
    end (``restore``)."""

    refetch = False

    def __init__(self, name: str, size: int, chunk_size: int, digests: Sequence[str],
                 digest: str = DEFAULT_CHUNK_DIGEST) -> None:
        self.name, self.size, self.chunk_size, self.digests = name, size, chunk_size, digests
        self.digest, self.where = digest, name  # digest: what ``digests`` are (sha256, blake3)
        self.count = chunk_count(size, chunk_size)
        assert len(digests) == self.count  # the manifest reader checked it
        self.lock = threading.Lock()  # for what the reading threads share (a descriptor's O_DIRECT flag)
        self.short = False  # a read ended before the recorded size: the object shrank meanwhile
        self.report_bad = False  # verify's read: damaged chunks are kept in ``bad``, not raised
        self.derived = False  # ``digests`` are the upgrade's first pass's (loader/upgrade.py), not recorded ones
        self.bad: tuple[int, ...] = ()

    def read(self, i: int, mv: memoryview) -> memoryview:
        """Chunk ``i`` into ``mv`` (room for the chunk rounded up to a page); the bytes read."""
        raise NotImplementedError

    def changed(self) -> bool:
        """Whether the object is no longer the one being read (its size, here)."""
        return False

    def restore(self) -> None:
        """Undo what reading needed (nothing by default)."""

    def parallel(self) -> int:
        """Chunks read at once (a local disk: sixteen waiting on the disk, one more per core
        hashing), never more than there are chunks."""
        return max(1, min(self.count, workers() + IN_FLIGHT))

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_size, min(self.size, (i + 1) * self.chunk_size)

    def room(self, i: int) -> int:
        """Bytes chunk ``i`` needs in a buffer: its length rounded up to a page (O_DIRECT)."""
        lo, hi = self.span(i)
        return -(-(hi - lo) // ALIGN) * ALIGN

    def checked(self, i: int, mv: memoryview) -> tuple[memoryview, bool]:
        """Chunk ``i`` read into ``mv`` and whether its digest matched (read once more first when
        it did not and the source allows it)."""
        got, digest = self.fetch(i, mv)
        if not self.ok(i, got, digest) and self.refetch:
            got, digest = self.fetch(i, mv)
        return got, self.ok(i, got, digest)

    def fetch(self, i: int, mv: memoryview) -> tuple[memoryview, str]:
        """Chunk ``i`` read into ``mv`` and the digest of what was read."""
        got = self.read(i, mv)
        h = new_hash(self.digest)
        h.update(got)
        return got, h.hexdigest()

    def ok(self, i: int, data: memoryview, digest: str) -> bool:
        return len(data) == self.span(i)[1] - self.span(i)[0] and digest == self.digests[i]


class FileChunkReads(ChunkReads):
    """Chunks of a local file, through the caller's descriptor: positioned reads, ``O_DIRECT``
    where the filesystem takes it (aligned: the buffers are page-aligned, chunk sizes and offsets
    page multiples; the last chunk's read is rounded up and ends at the file's end)."""

    def __init__(self, fd: int, name: str, size: int, chunk_size: int, digests: Sequence[str],
                 digest: str = DEFAULT_CHUNK_DIGEST, *, direct: bool = True) -> None:
        super().__init__(name, size, chunk_size, digests, digest)
        self.fd = fd
        # a file already in the page cache is copied from it (O_DIRECT would go to the disk again);
        # ``direct=False``: the reads land in the caller's memory (``scatter``), which O_DIRECT's
        # page alignment cannot be asked of, so they go through the page cache and its readahead
        self.direct = direct and not page_cached(fd, size) and enable_direct(fd)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window

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
        h, got = new_hash(self.digest), 0
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

    def scatter(self, i: int, views: Sequence[memoryview]) -> bool:
        """Chunk ``i`` read straight into ``views`` (writable byte views whose lengths add up to the
        chunk's, in file order: the tensors' own memory), in pieces of PIECE bytes, each hashed
        right after its read; whether the chunk's digest matched. Cached I/O (``direct=False``)."""
        assert not self.direct and sum(len(v) for v in views) == self.span(i)[1] - self.span(i)[0]
        h, at = new_hash(self.digest), self.span(i)[0]
        for view in views:
            done = 0
            while done < len(view):
                part = self.read_at(at, min(PIECE, len(view) - done), view[done:])
                h.update(part)
                done, at = done + len(part), at + len(part)
                if not part:
                    return False  # short: the file shrank (``short`` is set; the caller says so)
        return bool(h.hexdigest() == self.digests[i])

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
                with self.lock:  # taken at open, refused at the read (some network filesystems)
                    if self.direct:
                        self.direct = disable_direct(self.fd)
                span = want
                continue
            if not k:
                self.short = True
                break
            got += k
        return mv[: min(got, want)]


class HostReads:
    """The chunks of ``source`` queued in file order (the header's chunks first), each read
    straight into its place in one page-aligned host buffer and checked there (``checked``).
    ``queued[i]`` is chunk ``i``'s future: (the bytes read, whether its digest matched). Nothing
    waits here; loader/sinks.py's ``to_host`` takes the results (and the header) from them.

    ``first``: queue only that many chunks now and the rest on ``more()`` (the loader's early
    start, loader/early_start.py, reads a bounded window until the manifest is checked). The buffer
    is allocated at the whole size at once (the tensors are views of one buffer; filling a smaller
    one first would cost a copy of the window later): an allocation is address space, and only
    the pages read into are memory, so until ``more()`` the reads hold at most the window."""

    def __init__(self, source: ChunkReads, first: int | None = None) -> None:
        import torch

        self.source = source
        padded = -(-source.size // ALIGN) * ALIGN
        self.raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
        off = -self.raw.data_ptr() % ALIGN
        self.whole = self.raw[off : off + padded]
        self.mv = self.whole.numpy().data if padded else memoryview(b"")  # the array's own memoryview
        self.pool = ThreadPoolExecutor(source.parallel(), thread_name_prefix="shardc-load")
        self.queued: list[Future[tuple[memoryview, bool]]] = []
        try:
            self.more(first)
        except BaseException:
            self.close()
            raise

    def more(self, upto: int | None = None) -> None:
        """Queue the chunks after those already queued, up to chunk ``upto`` (None: every one)."""
        source = self.source
        stop = source.count if upto is None else min(upto, source.count)
        self.queued += [self.pool.submit(source.checked, i, self.mv[lo : lo + source.room(i)])
                        for i, lo in ((i, source.span(i)[0]) for i in range(len(self.queued), stop))]

    def close(self, cancel: bool = True) -> None:
        """Stop: what is queued is dropped (with ``cancel``), what is in flight finishes; no reader
        thread outlives this call. Cancelled reads also let go of the buffer (the pages read so
        far are freed now, not when the caller's frame ends: a discarded early start must not hold
        them while the shard is read again)."""
        for f in getattr(self, "queued", ()) if cancel else ():
            f.cancel()
        self.pool.shutdown(wait=True)
        if cancel:
            self.queued = []  # their results are views of the buffer
            self.mv = memoryview(b"")
            self.whole = self.raw = self.raw.new_empty(0)  # not a slice: that would keep the storage
