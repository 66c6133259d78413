"""The loader's one chunk engine (docs/architecture.md §1.3): a shard's chunks read at the device's
speed and checked on every core against its chunk digests (the manifest's, or for a format_version 2
shard those of loader/upgrade.py's pass). How each chunk is read and hashed is loader/sources.py's
(a local file, or ranged GETs: store/ranged.py); what is done with the chunks is here: onto the
host, onto a GPU, into the caller's tensors (``into=``), into a file (pull), the header check and
the failure lines.

Order: every chunk is queued in file order, the ones holding the header first; the header is
parsed from those very bytes (which are hashed with the rest: what is checked is what is
interpreted) and checked by the caller's ``on_header`` as soon as they are in, while the workers
read on; a wrong file cancels what is still queued (it costs what was in flight). Then the file's
size is checked again. Nothing is returned until every chunk's digest matched; a mismatch names the chunks,
their byte ranges and the tensors in them. The reads may have been started before this module was
imported (``to_host``'s ``started``: the loader's early start, loader/early_start.py).

CUDA: each worker reads its chunk into a pinned staging buffer of a small pool, hashes it and
copies it to the GPU buffer asynchronously on its own stream; a staging buffer is reused only once
its copy is done (its event). Every copy stream is synchronized before the call returns or raises.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, ShardFormatError, VerifyMismatch
from ..formats import chunk_digests as ch
from ..formats.safetensors import MAX_HEADER, METADATA, parse_header
from ..layout.dtypes import DTYPES
from .sources import ALIGN, ChunkReads, FileChunkReads, HostReads
from .tensors import HeaderCheck, RawShard

HINT = "re-pull the shard, or rebuild it; shardc verify gives the full report"


def load_chunks(source: ChunkReads, device: str, on_header: HeaderCheck | None = None,
                started: HostReads | None = None) -> RawShard:
    """Every chunk of ``source`` onto ``device``, checked (a file, or ranged GETs: loader/remote.py);
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
    if bad and source.derived:  # the digests of this very file's first pass: it changed since
        raise VerifyMismatch(f"{source.where}: file changed while it was read", hint="is something rewriting it?")
    if bad and source.report_bad:
        source.bad = tuple(bad)
    elif bad:
        line = ch.chunk_problem(bad, source.size, source.chunk_size,
                                lambda lo, hi: ch.tensors_in(header or {}, start, lo, hi), digest=source.digest)
        raise VerifyMismatch(f"{source.name}: {line}", hint=HINT)


# -- CPU ------------------------------------------------------------------------------------------
def to_host(source: ChunkReads, on_header: HeaderCheck | None, started: HostReads | None = None) -> RawShard:
    """Every chunk read straight into one page-aligned buffer (loader/sources.py ``HostReads``,
    or ``started``); the header checked as soon as its chunks are in; the tensors are views of it."""
    reads = started or HostReads(source)
    queued = reads.queued
    assert len(queued) == source.count  # an early start's window is followed by the rest (early_start ``take``)
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


# -- CPU, into the caller's tensors ---------------------------------------------------------------
def into_host(source: FileChunkReads, on_header: HeaderCheck, into: Mapping[str, Any]) -> dict[str, Any]:
    """Every chunk read straight into the caller's tensors (``into``: name -> a contiguous CPU
    tensor of the header's dtype and shape; an engine's parameters) and the other tensors into one
    buffer of their own, each chunk hashed as it arrives (``FileChunkReads.scatter``). The header's
    chunks are read first into a buffer of their own and checked (``on_header``), and ``into``
    against the header, before any other chunk is read. Nothing is returned until every digest
    matched; a tensor in ``into`` holds unchecked bytes when this raises, so the caller must not
    use it then. Returns every tensor: ``into``'s own objects, the rest views of the buffer.

    Why: an engine that loads a shard and then copies it into its parameters holds the rank's
    weights twice and touches every byte twice; read here, the bytes go from the page cache into
    the parameters once (cached I/O: a parameter's memory is not page-aligned, as O_DIRECT needs)."""
    import torch

    if not source.count:  # an empty file: its header check fails
        header_of(source, memoryview(b""), on_header)
    first = bytearray(source.room(0))
    heads = [source.checked(0, memoryview(first))]
    nhead = head_chunks(source, heads[0][0])
    head = bytearray(first[: len(heads[0][0])])
    for i in range(1, nhead):
        buf = bytearray(source.room(i))
        heads.append(source.checked(i, memoryview(buf)))
        head += buf[: len(heads[-1][0])]
    header, _, start = header_of(source, memoryview(head), on_header)
    assert header is not None  # on_header raised otherwise
    places = _places(header, into, start)
    rest = torch.empty(max(1, sum(p.hi - p.lo for p in places if p.staged is not None)), dtype=torch.uint8)
    views = _views(places, into, rest.numpy().data.cast("B"), start, source.size)  # .data: the array's memoryview
    done = len(head)  # the header's chunks: their tensor bytes are copied from the checked buffer
    for lo, hi, mv in views:
        if lo < done:
            mv[: min(hi, done) - lo] = head[lo : min(hi, done)]
    bad = [i for i, (_, good) in enumerate(heads) if not good]

    def chunk(i: int) -> bool:
        lo, hi = source.span(i)
        return source.scatter(i, [mv[max(a, lo) - a : min(b, hi) - a] for a, b, mv in views if a < hi and b > lo])

    # cached reads: one thread per core hashing and one more waiting on the disk keep the file's
    # readahead ahead of the hashing (more threads would scatter its readahead window)
    threads = min(max(1, source.count - nhead), ch.workers() + 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="shardc-load") as pool:
        bad += [nhead + i for i, good in enumerate(pool.map(chunk, range(nhead, source.count))) if not good]
    fail(source, bad, header, start)
    return {p.name: into[p.name] if p.staged is None else
            rest[p.staged : p.staged + p.hi - p.lo].view(p.dtype).reshape(p.shape) for p in places}


@dataclass(frozen=True)
class _Place:
    """One header tensor: its bytes in the file (``lo``, ``hi``), its dtype and shape, and where
    in the shared buffer it lands (``staged``; None: in the caller's tensor)."""

    name: str
    lo: int
    hi: int
    dtype: Any
    shape: list[int]
    staged: int | None


def _places(header: dict[str, Any], into: Mapping[str, Any], start: int) -> list[_Place]:
    """The header's tensors in file order, ``into`` checked against them (a caller's mistake is a
    LayoutError, raised before any data is read)."""
    import torch

    unknown = sorted(set(into) - set(header) - {METADATA})
    if unknown:
        raise LayoutError(f"{unknown[0]} is not a tensor of this shard", key="into",
                          hint="into= names tensors of the rank's shard (shardc inspect lists them)")
    out, staged = [], 0
    for name, info in sorted(((k, v) for k, v in header.items() if k != METADATA),
                             key=lambda kv: int(kv[1]["data_offsets"][0])):
        dtype, shape = getattr(torch, DTYPES[info["dtype"]].torch), [int(x) for x in info["shape"]]
        lo, hi = (start + int(x) for x in info["data_offsets"])
        t = into.get(name)
        if t is None:
            out.append(_Place(name, lo, hi, dtype, shape, staged))
            staged += hi - lo
            continue
        check_into(name, t, dtype, shape)
        out.append(_Place(name, lo, hi, dtype, shape, None))
    return out


def check_into(name: str, t: Any, dtype: Any, shape: list[int]) -> None:
    """``into``'s tensor for ``name`` must be where the shard's bytes can land as they are: a
    contiguous CPU tensor of the shard's dtype and shape (never a cast, a broadcast or a view
    with gaps)."""
    import torch

    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == dtype and list(t.shape) == shape \
            and t.is_contiguous():
        return
    got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
    if isinstance(t, torch.Tensor) and not t.is_contiguous():
        got += " (not contiguous)"
    raise LayoutError(f"{name}: the shard holds {dtype} {shape}, into= gives {got}", key="into",
                      hint="give a contiguous CPU tensor of the shard's dtype and shape, or leave the tensor "
                           "out of into=")


def _views(places: list[_Place], into: Mapping[str, Any], rest: memoryview, start: int,
           size: int) -> list[tuple[int, int, memoryview]]:
    """The data section as (file offset, end, writable view) in file order: each tensor's own
    memory (``into``) or its place in ``rest``; bytes that no tensor covers (none in a shard
    shardc wrote) land in scratch memory, still hashed."""
    import torch

    out: list[tuple[int, int, memoryview]] = []
    at = start
    for p in places:
        if p.lo > at:
            out.append((at, p.lo, memoryview(bytearray(p.lo - at))))
        t = into[p.name] if p.staged is None else None
        if t is not None:
            mv = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")
        else:
            assert p.staged is not None  # not in a caller's tensor: staged in ``rest`` (_places)
            mv = rest[p.staged : p.staged + p.hi - p.lo]
        out.append((p.lo, p.hi, mv))
        at = max(at, p.hi)
    if size > at:
        out.append((at, size, memoryview(bytearray(size - at))))
    return out


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
