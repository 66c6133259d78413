"""Chunk digests (docs/architecture.md §3.3): a shard's bytes cut at fixed offsets, each piece with
its own digest (sha256 by default, blake3 where the plan asks), recorded in the manifest beside the
whole file's sha256.

Why: one sha256 over a whole file is a chain, so checking it runs on one core (about 1.6 GB/s
here) whatever the machine has, and a mismatch says only "somewhere in these 9 GB". Digests of
fixed-size chunks are independent: every core (and every ranged GET) checks its own chunks, a file
is checked as fast as it is read, and a mismatch names the chunk, its byte range and the tensors in
it. The whole-file sha256 keeps its meaning (``manifest["shards"][file]["sha256"]``), so older
readers and external tools are unaffected.

Why blake3 as well (``replica_group.checkpoint.chunk_digest: blake3``, manifest format_version 4):
sha256 costs about 0.65 s of CPU per GB even with the CPU's SHA instructions, blake3 about 0.17 s,
both cryptographic. On a node with few cores per disk (2 cores and a 2.7 GB/s disk here) the sha256
check alone takes longer than an unchecked loader's whole read; with blake3 the check hides behind
the read (docs/performance.md). sha256 stays the default: it is what FIPS-bound sites and external
tools know, and on a GPU node's dozens of cores it keeps up with the disk too.

The writer (formats/safetensors.py ``ShardWriter``) cuts chunks while it hashes what it writes: no
extra pass over the bytes. Readers check chunks with ``check_chunks`` (a thread pool: hashlib and
blake3 release the GIL on large buffers).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST, new_hash

CHUNK_SIZE = 16 << 20  # what builds write: two of the writer's staging buffers; ~1 digest per 16 MiB
# Bounds on a manifest's chunk size: page multiples (so chunk reads can be O_DIRECT-aligned), at
# least a page, at most 1 GiB (a chunk is one read into memory; more would be one huge buffer).
CHUNK_ALIGN = 4096
MIN_CHUNK = CHUNK_ALIGN
MAX_CHUNK = 1 << 30


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks a file of ``size`` bytes has (the last one may be short)."""
    return -(-size // chunk_size)


def chunk_size_problem(chunk_size: Any) -> str | None:
    """Why ``chunk_size`` cannot be a manifest's chunk size (None when it can)."""
    if type(chunk_size) is not int or not MIN_CHUNK <= chunk_size <= MAX_CHUNK or chunk_size % CHUNK_ALIGN:
        return (f"is {chunk_size!r}; a chunk size is a multiple of {CHUNK_ALIGN} bytes from {MIN_CHUNK} to "
                f"{MAX_CHUNK} (builds write {CHUNK_SIZE})")
    return None


def workers() -> int:
    """Threads that hash at once: every core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class ChunkHasher:
    """Chunk digests of a byte stream fed in order, in pieces of any size (the writer's staging
    buffers): each piece is hashed once per chunk it touches, no copy."""

    def __init__(self, chunk_size: int = CHUNK_SIZE, digest: str = DEFAULT_CHUNK_DIGEST) -> None:
        self.chunk_size, self.digest = chunk_size, digest
        self.digests: list[str] = []
        self._h = new_hash(digest)
        self._fill = 0

    def update(self, buf: Any) -> None:
        mv = memoryview(buf).cast("B")
        while mv:
            k = min(len(mv), self.chunk_size - self._fill)
            self._h.update(mv[:k])
            self._fill += k
            mv = mv[k:]
            if self._fill == self.chunk_size:
                self._cut()

    def _cut(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h, self._fill = new_hash(self.digest), 0

    def finish(self) -> list[str]:
        """The digests of every chunk, the short last one included (call once, at the end)."""
        if self._fill:
            self._cut()
        return self.digests


def digest_file(fd: int, size: int, chunk_size: int = CHUNK_SIZE,
                digest: str = DEFAULT_CHUNK_DIGEST) -> tuple[str, list[str]]:
    """(whole-file sha256, chunk digests) of an open file in one read (a resumed build's shard)."""
    whole, chunks = hashlib.sha256(), ChunkHasher(chunk_size, digest)
    buf = bytearray(min(chunk_size, max(size, 1)))
    pos = 0
    while pos < size:
        n = os.preadv(fd, [memoryview(buf)[: min(len(buf), size - pos)]], pos)
        if not n:
            break
        piece = memoryview(buf)[:n]
        whole.update(piece)
        chunks.update(piece)
        pos += n
    return whole.hexdigest(), chunks.finish()


def check_chunks(fd: int, size: int, chunk_size: int, expected: Sequence[str], *,
                 pool: ThreadPoolExecutor | None = None, digest: str = DEFAULT_CHUNK_DIGEST) -> list[int]:
    """Read and hash every chunk of an open file on all cores; the indices of the chunks whose
    ``digest`` differs from ``expected`` (a chunk cut short by a truncation differs too)."""
    local = threading.local()  # one buffer per thread, reused: no fresh pages per chunk

    def one(i: int) -> bool:
        start = i * chunk_size
        n = min(chunk_size, size - start)
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(chunk_size))
        got = pread_full(fd, local.buf[:n], start)
        if got != n:
            return True
        h = new_hash(digest)
        h.update(local.buf[:got])
        return bool(h.hexdigest() != expected[i])

    own = pool is None
    pool = pool or ThreadPoolExecutor(workers(), thread_name_prefix="shardc-chunk")
    try:
        return [i for i, bad in zip(range(len(expected)), pool.map(one, range(len(expected))), strict=True) if bad]
    finally:
        if own:
            pool.shutdown()


def pread_full(fd: int, mv: memoryview, offset: int) -> int:
    """Bytes read into ``mv`` at ``offset`` (fewer only at the end of the file)."""
    got = 0
    while got < len(mv):
        k = os.preadv(fd, [mv[got:]], offset + got)
        if not k:
            break
        got += k
    return got


def tensors_in(header: dict[str, Any], data_start: int, lo: int, hi: int) -> list[str]:
    """Names of the tensors with bytes in file range [lo, hi) (``header``: the parsed safetensors
    header, data_offsets relative to ``data_start``); the header itself is named ``<header>``."""
    names = []
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        try:
            s, e = (int(x) + data_start for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            continue
        if s < hi and lo < e:
            names.append(name)
    return (["<header>"] if lo < data_start else []) + sorted(names)


def chunk_problem(bad: Iterable[int], size: int, chunk_size: int,
                  names_of: Callable[[int, int], list[str]] | None = None, *, limit: int = 4,
                  digest: str = DEFAULT_CHUNK_DIGEST) -> str:
    """One line naming the damaged chunks, their byte ranges and the tensors in them (the caller
    prefixes the file's name)."""
    bad = list(bad)
    parts = []
    for i in bad[:limit]:
        lo, hi = i * chunk_size, min(size, (i + 1) * chunk_size)
        names = names_of(lo, hi) if names_of is not None else []
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"chunk {i} (bytes {lo}..{hi}" + (f": {shown})" if shown else ")"))
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return (f"{digest} of {len(bad)} of {chunk_count(size, chunk_size)} chunk(s) differs from the manifest: "
            f"{'; '.join(parts)}{more} (corrupted bytes)")
