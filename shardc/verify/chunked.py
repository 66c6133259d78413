"""The chunked one-pass read for the Checkpoint Loader (docs/architecture.md §2): a shard whose
manifest entry has chunk digests (format_version 3), read at the device's speed and checked on
every core.

Why not reader.py's pass: one whole-file sha256 is a chain, one core's worth (about 1.6 GB/s
here), and its 1 MiB reads on one thread leave a fast disk idle. With chunk digests every chunk
is independent, so several workers each read a chunk with one large aligned read (``O_DIRECT``
where the filesystem takes it: no copy through the page cache, no cache left to evict) straight
into the buffer the tensors will live in, and hash it while the others read: reading and hashing
overlap across chunks and every core hashes. Nothing maps the file.

Order: every chunk is queued in file order, the ones holding the header first; the header is
parsed from those very bytes (which are hashed with the rest: what is checked is what is
interpreted) and checked by the caller's ``on_header`` as soon as they are in, while the workers
read on; a wrong file cancels what is still queued (it costs what was in flight). Then the file's
size is checked again. Nothing is returned until every chunk's digest matched; a mismatch names the chunks,
their byte ranges and the tensors in them.

CUDA: each worker reads its chunk into a pinned staging buffer of a small pool, hashes it and
copies it to the GPU buffer asynchronously on its own stream; a staging buffer is reused only once
its copy is done (its event). Every copy stream is synchronized before the call returns or raises.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ShardFormatError, VerifyMismatch
from ..formats import chunks as ch
from ..formats.safetensors import MAX_HEADER, METADATA, parse_header
from ..layout.plan import DEFAULT_CHUNK_DIGEST
from .reader import HeaderCheck, RawShard

ALIGN = ch.CHUNK_ALIGN  # O_DIRECT: buffer address, file offset and length in whole pages
HINT = "re-pull the shard, or rebuild it; shardc verify gives the full report"


def load_chunks(source: ChunkSource, device: str, on_header: HeaderCheck | None = None) -> RawShard:
    """Every chunk of ``source`` onto ``device``, checked (a file, or ranged GETs: store/stream.py)."""
    import torch

    try:
        if torch.device(device).type == "cuda":
            return source.to_cuda(torch.device(device), on_header)
        return source.to_host(on_header)
    finally:
        source.restore()


class ChunkSource:
    """Where a shard's chunks come from, and everything done with them: the geometry, the checks,
    the reads onto the host or a GPU. Subclasses say how chunk ``i`` is read (``read``), whether
    the object changed meanwhile (``changed``), whether a damaged chunk is read once more
    (``refetch``: a network read may have been garbled on the way; a local file would give the
    same bytes again) and what to undo at the end (``restore``)."""

    refetch = False

    def __init__(self, name: str, size: int, chunk_size: int, digests: Sequence[str],
                 digest: str = DEFAULT_CHUNK_DIGEST) -> None:
        self.name, self.size, self.chunk_size, self.digests = name, size, chunk_size, digests
        self.digest, self.where = digest, name  # digest: what ``digests`` are (sha256, blake3)
        self.count = ch.chunk_count(size, chunk_size)
        assert len(digests) == self.count  # the manifest reader checked it
        self._lock = threading.Lock()
        self.short = False  # a read ended before the recorded size: the object shrank meanwhile

    def read(self, i: int, mv: memoryview) -> memoryview:
        """Chunk ``i`` into ``mv`` (room for the chunk rounded up to a page); the bytes read."""
        raise NotImplementedError

    def changed(self) -> bool:
        """Whether the object is no longer the one being read (its size, here)."""
        return False

    def restore(self) -> None:
        """Undo what reading needed (nothing by default)."""

    def parallel(self) -> int:
        """Chunks read at once (a local disk: sixteen waiting on the disk, one more per core hashing)."""
        return _workers(self.count)

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_size, min(self.size, (i + 1) * self.chunk_size)

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
        h = ch.new_hash(self.digest)
        h.update(got)
        return got, h.hexdigest()

    def ok(self, i: int, data: memoryview, digest: str) -> bool:
        return len(data) == self.span(i)[1] - self.span(i)[0] and digest == self.digests[i]

    def header(self, head: memoryview, on_header: HeaderCheck | None) -> tuple[dict[str, Any] | None, str | None, int]:
        """Parse the header from the bytes read (``head``: the file's first bytes, at least 8 +
        the header length when the file has that many) and run the caller's check."""
        header, error, n = None, None, 0
        if len(head) < 8 or (n := struct.unpack("<Q", head[:8])[0]) > min(MAX_HEADER, self.size - 8):
            error, n = "file shorter than its header length says", 0
            start = min(8, len(head))
        else:
            start = 8 + n
            try:
                tensors, meta = parse_header(bytes(head[8:start]), self.name)
                header = {**tensors, METADATA: meta}
            except ShardFormatError as exc:
                error = exc.message
        if on_header is not None:
            on_header(header, error, self.size - start)
        return header, error, start

    def head_chunks(self, first: memoryview) -> int:
        """How many leading chunks hold the header, from chunk 0's bytes (its length prefix)."""
        if len(first) < 8:
            return 1
        (n,) = struct.unpack("<Q", first[:8])
        end = 8 + min(n, MAX_HEADER, max(0, self.size - 8))
        return max(1, min(self.count, ch.chunk_count(end, self.chunk_size)))

    def fail(self, bad: list[int], header: dict[str, Any] | None, start: int) -> None:
        """Raise for what the read found: a file that changed size, or the damaged chunks."""
        if self.short or self.changed():
            raise VerifyMismatch(f"{self.where}: file changed size while it was read", hint="is something rewriting it?")
        if bad:
            line = ch.chunk_problem(bad, self.size, self.chunk_size,
                                    lambda lo, hi: ch.tensors_in(header or {}, start, lo, hi), digest=self.digest)
            raise VerifyMismatch(f"{self.name}: {line}", hint=HINT)

    # -- CPU --------------------------------------------------------------------------------------
    def to_host(self, on_header: HeaderCheck | None) -> RawShard:
        """Every chunk read straight into one page-aligned buffer; the tensors are views of it."""
        import torch

        padded = -(-self.size // ALIGN) * ALIGN
        raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
        off = -raw.data_ptr() % ALIGN
        whole = raw[off : off + padded]
        mv = memoryview(whole.numpy()) if padded else memoryview(b"")

        def room(i: int) -> memoryview:
            lo, hi = self.span(i)
            return mv[lo : lo + -(-(hi - lo) // ALIGN) * ALIGN]

        with ThreadPoolExecutor(self.parallel(), thread_name_prefix="shardc-load") as pool:
            # every chunk queued in order, the header's first; the header is parsed from its
            # chunks' checked bytes and checked as soon as they are in, while the others are read:
            # a wrong file cancels what is still queued
            queued = [pool.submit(self.checked, i, room(i)) for i in range(self.count)]
            try:
                heads = [queued[0].result()] if self.count else []
                nhead = self.head_chunks(heads[0][0]) if heads else 0
                heads += [queued[i].result() for i in range(1, nhead)]
                header, error, start = self.header(mv[: sum(len(g) for g, _ in heads)], on_header)
            except BaseException:
                for f in queued:  # what is in flight finishes, nothing more is read
                    f.cancel()
                raise
            rest = [f.result()[1] for f in queued[nhead:]]
        bad = [i for i, (_, good) in enumerate(heads) if not good] + [nhead + i for i, good in enumerate(rest) if not good]
        self.fail(bad, header, start)
        return RawShard("", header, whole[start : self.size], error)

    # -- a file (pull) ----------------------------------------------------------------------------
    def to_file(self, fd: int, on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Every chunk written at its offset of ``fd`` (the caller's temp file), each hashed in
        memory before it is written, none written unless it matched. The indices of the damaged
        chunks (after the refetch); a source that changed size raises."""
        local = threading.local()

        def one(i: int) -> bool:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(-(-self.chunk_size // ALIGN) * ALIGN))
            got, good = self.checked(i, local.buf)
            if good:
                view, at = got, self.span(i)[0]
                while view:
                    k = os.pwrite(fd, view, at)
                    view, at = view[k:], at + k
            if on_bytes is not None:
                on_bytes(len(got))
            return good

        with ThreadPoolExecutor(self.parallel(), thread_name_prefix="shardc-pull") as pool:
            bad = [i for i, good in enumerate(pool.map(one, range(self.count))) if not good]
        if self.short or self.changed():
            raise VerifyMismatch(f"{self.where}: changed size while it was read", hint="push the build again")
        return bad

    # -- CUDA -------------------------------------------------------------------------------------
    def to_cuda(self, dev: Any, on_header: HeaderCheck | None) -> RawShard:
        """Chunks through a pool of pinned staging buffers, hashed there and copied to the GPU
        buffer asynchronously, one copy stream per worker."""
        import torch

        data = torch.empty(self.size, dtype=torch.uint8, device=dev)
        nbuf = min(self.count, self.parallel() + 2) or 1
        room = -(-min(self.chunk_size, max(self.size, 1)) // ALIGN) * ALIGN
        free: queue.Queue[tuple[Any, Any]] = queue.Queue()
        for _ in range(nbuf):
            free.put((torch.empty(room, dtype=torch.uint8, pin_memory=True), None))  # page-aligned
        local = threading.local()
        streams: list[Any] = []
        ready = torch.cuda.current_stream(dev)

        def stream() -> Any:
            if not hasattr(local, "stream"):
                local.stream = torch.cuda.Stream(dev)
                local.stream.wait_stream(ready)  # ``data``'s allocation is ordered first
                with self._lock:
                    streams.append(local.stream)
            return local.stream

        def land(i: int, keep_host: bool = False) -> tuple[bool, bytes | None]:
            """Read, hash and copy chunk ``i``; with ``keep_host`` also a copy of its bytes (the
            header's chunks: the header is parsed from the very bytes that were hashed)."""
            buf, done = free.get()
            if done is not None:
                done.synchronize()  # its last copy has left it
            got, good = self.checked(i, memoryview(buf.numpy()))
            lo = i * self.chunk_size
            s = stream()
            with torch.cuda.stream(s):
                data[lo : lo + len(got)].copy_(buf[: len(got)], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
            kept = bytes(got) if keep_host else None
            free.put((buf, ev))
            return good, kept

        try:
            nhead = 1
            heads: list[tuple[bool, bytes | None]] = []
            if self.count:
                heads.append(land(0, keep_host=True))
                nhead = self.head_chunks(memoryview(heads[0][1] or b""))
                heads += [land(i, keep_host=True) for i in range(1, nhead)]
            head = b"".join(h or b"" for _, h in heads)
            header, error, start = self.header(memoryview(head), on_header)
            with ThreadPoolExecutor(self.parallel(), thread_name_prefix="shardc-load") as pool:
                rest = list(pool.map(lambda i: land(i)[0], range(nhead, self.count)))
            bad = [i for i, (good, _) in enumerate(heads) if not good]
            bad += [nhead + i for i, good in enumerate(rest) if not good]
        finally:
            for s in streams:  # nothing in flight once this returns or raises
                s.synchronize()
        self.fail(bad, header, start)
        return RawShard("", header, data[start:], error)


def _workers(count: int) -> int:
    """Sixteen reads in flight (a fast disk wants a queue) plus one worker per core hashing, never
    more than there are chunks (4 to 24 workers measured: docs/performance.md, session 12)."""
    return max(1, min(count, ch.workers() + 16))
