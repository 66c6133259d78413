"""The chunked one-pass read for the Checkpoint Loader (docs/architecture.md §2): a shard whose
manifest entry has chunk digests (format_version 3), read at the device's speed and checked on
every core. How each chunk is read and hashed is formats/chunkread.py's (a local file, or ranged
GETs: store/ranged.py); what is done with the chunks is here: onto the host, onto a GPU, into a
file (pull), the header check and the failure lines.

Order: every chunk is queued in file order, the ones holding the header first; the header is
parsed from those very bytes (which are hashed with the rest: what is checked is what is
interpreted) and checked by the caller's ``on_header`` as soon as they are in, while the workers
read on; a wrong file cancels what is still queued (it costs what was in flight). Then the file's
size is checked again. Nothing is returned until every chunk's digest matched; a mismatch names the chunks,
their byte ranges and the tensors in them. The reads may have been started before this module was
imported (``to_host``'s ``started``: the loader's early start, formats/prefetch.py).

CUDA: each worker reads its chunk into a pinned staging buffer of a small pool, hashes it and
copies it to the GPU buffer asynchronously on its own stream; a staging buffer is reused only once
its copy is done (its event). Every copy stream is synchronized before the call returns or raises.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ShardFormatError, VerifyMismatch
from ..formats import chunks as ch
from ..formats.chunkread import ALIGN, ChunkReads, HostReads
from ..formats.safetensors import MAX_HEADER, METADATA, parse_header
from .reader import HeaderCheck, RawShard

HINT = "re-pull the shard, or rebuild it; shardc verify gives the full report"


def load_chunks(source: ChunkReads, device: str, on_header: HeaderCheck | None = None,
                started: HostReads | None = None) -> RawShard:
    """Every chunk of ``source`` onto ``device``, checked (a file, or ranged GETs: store/stream.py);
    ``started``: the host reads of ``source`` already under way."""
    import torch

    try:
        if torch.device(device).type == "cuda":
            assert started is None  # the early start is for the host only
            return to_cuda(source, torch.device(device), on_header)
        return to_host(source, on_header, started)
    finally:
        source.restore()


def header_of(source: ChunkReads, head: memoryview,
              on_header: HeaderCheck | None) -> tuple[dict[str, Any] | None, str | None, int]:
    """Parse the header from the bytes read (``head``: the file's first bytes, at least 8 + the
    header length when the file has that many) and run the caller's check."""
    header, error, n = None, None, 0
    if len(head) < 8 or (n := struct.unpack("<Q", head[:8])[0]) > min(MAX_HEADER, source.size - 8):
        error, n = "file shorter than its header length says", 0
        start = min(8, len(head))
    else:
        start = 8 + n
        try:
            tensors, meta = parse_header(bytes(head[8:start]), source.name)
            header = {**tensors, METADATA: meta}
        except ShardFormatError as exc:
            error = exc.message
    if on_header is not None:
        on_header(header, error, source.size - start)
    return header, error, start


def head_chunks(source: ChunkReads, first: memoryview) -> int:
    """How many leading chunks hold the header, from chunk 0's bytes (its length prefix)."""
    if len(first) < 8:
        return 1
    (n,) = struct.unpack("<Q", first[:8])
    end = 8 + min(n, MAX_HEADER, max(0, source.size - 8))
    return max(1, min(source.count, ch.chunk_count(end, source.chunk_size)))


def fail(source: ChunkReads, bad: list[int], header: dict[str, Any] | None, start: int) -> None:
    """Raise for what the read found: a file that changed size, or the damaged chunks (kept in
    ``source.bad`` instead when ``source.report_bad``: verify reports them with the rest)."""
    if source.short or source.changed():
        raise VerifyMismatch(f"{source.where}: file changed size while it was read", hint="is something rewriting it?")
    if bad and source.report_bad:
        source.bad = tuple(bad)
    elif bad:
        line = ch.chunk_problem(bad, source.size, source.chunk_size,
                                lambda lo, hi: ch.tensors_in(header or {}, start, lo, hi), digest=source.digest)
        raise VerifyMismatch(f"{source.name}: {line}", hint=HINT)


# -- CPU ------------------------------------------------------------------------------------------
def to_host(source: ChunkReads, on_header: HeaderCheck | None, started: HostReads | None = None) -> RawShard:
    """Every chunk read straight into one page-aligned buffer (formats/chunkread.py ``HostReads``,
    or ``started``); the header checked as soon as its chunks are in; the tensors are views of it."""
    reads = started or HostReads(source)
    queued = reads.queued
    assert len(queued) == source.count  # an early start's window is followed by the rest (prefetch ``take``)
    try:
        heads = [queued[0].result()] if source.count else []
        nhead = head_chunks(source, heads[0][0]) if heads else 0
        heads += [queued[i].result() for i in range(1, nhead)]
        header, error, start = header_of(source, reads.mv[: sum(len(g) for g, _ in heads)], on_header)
        rest = [f.result()[1] for f in queued[nhead:]]
    except BaseException:
        reads.close()  # what is in flight finishes, nothing more is read
        raise
    reads.close(cancel=False)
    bad = [i for i, (_, good) in enumerate(heads) if not good] + [nhead + i for i, good in enumerate(rest) if not good]
    fail(source, bad, header, start)
    return RawShard("", header, reads.whole[start : source.size], error)


# -- a file (pull) --------------------------------------------------------------------------------
def to_file(source: ChunkReads, fd: int, on_bytes: Callable[[int], None] | None = None) -> list[int]:
    """Every chunk written at its offset of ``fd`` (the caller's temp file), each hashed in
    memory before it is written, none written unless it matched. The indices of the damaged
    chunks (after the refetch); a source that changed size raises."""
    local = threading.local()

    def one(i: int) -> bool:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(-(-source.chunk_size // ALIGN) * ALIGN))
        got, good = source.checked(i, local.buf)
        if good:
            view, at = got, source.span(i)[0]
            while view:
                k = os.pwrite(fd, view, at)
                view, at = view[k:], at + k
        if on_bytes is not None:
            on_bytes(len(got))
        return good

    with ThreadPoolExecutor(source.parallel(), thread_name_prefix="shardc-pull") as pool:
        bad = [i for i, good in enumerate(pool.map(one, range(source.count))) if not good]
    if source.short or source.changed():
        raise VerifyMismatch(f"{source.where}: changed size while it was read", hint="push the build again")
    return bad


# -- CUDA -----------------------------------------------------------------------------------------
def to_cuda(source: ChunkReads, dev: Any, on_header: HeaderCheck | None) -> RawShard:
    """Chunks through a pool of pinned staging buffers, hashed there and copied to the GPU
    buffer asynchronously, one copy stream per worker."""
    import torch

    data = torch.empty(source.size, dtype=torch.uint8, device=dev)
    nbuf = min(source.count, source.parallel() + 2) or 1
    room = -(-min(source.chunk_size, max(source.size, 1)) // ALIGN) * ALIGN
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
            with source.lock:
                streams.append(local.stream)
        return local.stream

    def land(i: int, keep_host: bool = False) -> tuple[bool, bytes | None]:
        """Read, hash and copy chunk ``i``; with ``keep_host`` also a copy of its bytes (the
        header's chunks: the header is parsed from the very bytes that were hashed)."""
        buf, done = free.get()
        if done is not None:
            done.synchronize()  # its last copy has left it
        got, good = source.checked(i, memoryview(buf.numpy()))
        lo = i * source.chunk_size
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
        if source.count:
            heads.append(land(0, keep_host=True))
            nhead = head_chunks(source, memoryview(heads[0][1] or b""))
            heads += [land(i, keep_host=True) for i in range(1, nhead)]
        head = b"".join(h or b"" for _, h in heads)
        header, error, start = header_of(source, memoryview(head), on_header)
        with ThreadPoolExecutor(source.parallel(), thread_name_prefix="shardc-load") as pool:
            rest = list(pool.map(lambda i: land(i)[0], range(nhead, source.count)))
        bad = [i for i, (good, _) in enumerate(heads) if not good]
        bad += [nhead + i for i, good in enumerate(rest) if not good]
    finally:
        for s in streams:  # nothing in flight once this returns or raises
            s.synchronize()
    fail(source, bad, header, start)
    return RawShard("", header, data[start:], error)
