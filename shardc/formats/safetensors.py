"""The shard-file format (docs/architecture.md §3.2): safetensors header write and read, the
streaming writer, shard metadata.

``safetensors.torch.save_file`` needs a whole file's tensors in memory; one rank of a 70B model is
9-35 GB. The format is simple enough to stream: 8-byte little-endian header length, the JSON header
(dtype, shape, data_offsets, ``__metadata__``) padded with spaces to 8 bytes, then each tensor's
bytes in header order. Tensors are laid out sorted by name, so the bytes are deterministic.

The writer hashes what it writes (sha256 of the whole file) and commits atomically: temp file,
fsync, rename. Tests read every written file back with the safetensors library.

``read_header`` is the one parser of the header (verify, inspect and the source index use it); it
bounds what it reads and checks every entry, so a damaged file is an error naming the file and
the key, never a crash or a huge allocation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import ShardFormatError
from ..layout.dtypes import DTYPE_BYTES
from ..layout.ranks import Layout, RankLayout
from ..version import __version__
from . import chunk_digests as _chunks
from .direct_io import disable_direct, enable_direct
from .files import create_temp

ALIGN = 8
STAGE_BYTES = 8 << 20  # per write; a multiple of any block size O_DIRECT asks for
DIRECT_ALIGN = 4096
MAX_HEADER = 100 << 20  # the safetensors library's own limit
METADATA = "__metadata__"


def shard_metadata(layout: Layout, rank_layout: RankLayout) -> dict[str, str]:
    """A shard's ``__metadata__``: catches a file that strays into the wrong directory."""
    p = layout.plan
    return {
        "format": "pt",
        "shardc.version": __version__,
        "shardc.plan": p.name,
        "shardc.plan_sha256": p.sha256,
        "shardc.tp_degree": str(p.tp),
        "shardc.pp_degree": str(p.pp),
        "shardc.tp_rank": str(rank_layout.tp_rank),
        "shardc.pp_stage": str(rank_layout.pp_stage),
        "shardc.rank": str(rank_layout.rank),
        "shardc.layers": f"{rank_layout.layers[0]}:{rank_layout.layers[1]}",
    } | ({"shardc.experts": ",".join(map(str, rank_layout.experts))} if rank_layout.experts else {}) | (
        {"shardc.dp_degree": str(p.dp), "shardc.dp_rank": str(rank_layout.dp_rank)} if p.dp > 1 else {})


def read_header(path: str | Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """Parse a safetensors file's header: (tensors, metadata, data start).

    ``tensors`` maps each name to its entry (``dtype`` str, ``shape`` list of ints,
    ``data_offsets`` [begin, end] relative to the data start). Raises ShardFormatError naming the
    file and the entry when the header is short, oversized, not a JSON object, or malformed.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _bad(path.name, "file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise _bad(path.name, f"header length {n} is implausible")
        data = f.read(n)
    if len(data) != n:
        raise _bad(path.name, "header truncated")
    tensors, meta = parse_header(data, path.name)
    return tensors, meta, 8 + n


def _bad(file: str, msg: str, key: str | None = None) -> ShardFormatError:
    return ShardFormatError(msg, key=f"{file}:{key}" if key else file,
                            hint="the file is damaged or not a safetensors file")


def parse_header(data: bytes, file: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The header's JSON bytes -> (tensors, metadata), every entry checked (ShardFormatError names
    ``file`` and the entry). For readers that already hold the bytes (the loader hashes as it reads)."""
    try:
        header = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(file, f"header is not JSON ({exc})") from None
    except RecursionError:
        raise _bad(file, "header is nested too deeply") from None
    if not isinstance(header, dict):
        raise _bad(file, "header is not a JSON object")
    meta = header.pop(METADATA, None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(file, "metadata is not a map of strings", METADATA)
    for name, e in header.items():
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str):
            raise _bad(file, "entry has no dtype", name)
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(file, f"shape {shape!r} is not a list of sizes", name)
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise _bad(file, f"data_offsets {offs!r} are not [begin, end]", name)
    return header, meta


def extent_problem(tensors: dict[str, Any], data_len: int) -> str | None:
    """What is wrong with where the header puts the tensors' bytes, else None: the rule the
    safetensors library applies when it opens a file (each tensor holds exactly its elements'
    bytes, the tensors tile the data section from 0 without gaps or overlaps, and the last one ends
    at the end of the file). A header can be well-formed and still point past the end of a file
    cut short, or two tensors at the same bytes; only this check, not the header's syntax, sees it.
    Tensors of a dtype outside shardc's table are checked for tiling only."""
    end = 0
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0])):
        begin, stop = e["data_offsets"]
        item = DTYPE_BYTES.get(e["dtype"])
        if item is not None and stop - begin != math.prod(e["shape"]) * item:
            return (f"tensor {name}: data_offsets {[begin, stop]} hold {stop - begin} bytes, its "
                    f"{e['dtype']}{e['shape']} needs {math.prod(e['shape']) * item}")
        if begin != end:
            return (f"tensor {name}: data starts at {begin}, expected {end} "
                    f"({'a gap' if begin > end else 'overlapping the previous tensor'})")
        end = stop
    if end != data_len:
        return (f"the tensors' data ends at {end}, the file's data section holds {data_len} bytes"
                f"{' (the file is cut short)' if end > data_len else ''}")
    return None


def shard_file_size(layout: Layout, rank_layout: RankLayout) -> int:
    """The exact size of a rank's shard file as build writes it: header and tensor bytes (what
    ``build --dry-run`` reports, so it matches ``ls -l`` afterwards)."""
    head = header_bytes([(t.name, t.dtype, t.shape) for t in rank_layout.tensors], shard_metadata(layout, rank_layout))
    return len(head) + rank_layout.nbytes


def header_bytes(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str] | None
) -> bytes:
    """The 8-byte length prefix plus padded JSON header for tensors laid out in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    offset = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in order, hashing as it goes.

    Usage: ``w = ShardWriter(path, [(name, dtype, shape), ...], metadata)``; ``w.write(buf)`` any
    number of times (bytes must arrive in header order); ``size, sha = w.commit()``, and then
    ``w.chunks`` holds the chunk digests (formats/chunk_digests.py). ``abort()`` removes the temp file.
    Until commit, the final name is untouched.

    The whole-file sha256 is taken on the filling thread while each piece is in cache; the chunk
    digests on the I/O thread, from each staging buffer just before it is written: both hashes
    of a byte run at once on two cores, and nothing is read twice.

    Bytes are staged in page-aligned buffers and written with ``O_DIRECT`` where the filesystem
    allows it, by a background thread while the next buffer fills. A shard must be durable
    before it is renamed (fsync), so its bytes go to the disk either way; going around the page
    cache saves the kernel's copy into it (about as much CPU as hashing the bytes; see
    docs/performance.md §2) and leaves nothing for the final fsync to wait for. Where ``O_DIRECT`` is
    refused (tmpfs, some network filesystems) the same buffers are written through the cache.
    ``SHARDC_DIRECT_IO=0`` turns it off.
    """

    def __init__(
        self,
        path: str | Path,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        chunk_size: int | None = None,
        chunk_digest: str = DEFAULT_CHUNK_DIGEST,
    ) -> None:
        self.path = Path(path)
        self.chunk_size = chunk_size or _chunks.CHUNK_SIZE  # read at call time: tests make it small
        self.chunk_digest = chunk_digest
        self._chunker = _chunks.ChunkHasher(self.chunk_size, chunk_digest)
        self.chunks: list[str] = []  # the chunk digests, once committed
        head = header_bytes(tensors, metadata)
        self.expected = len(head) + sum(math.prod(s) * DTYPE_BYTES[d] for _, d, s in tensors)
        self._sha = hashlib.sha256()
        self._fd, self.tmp = create_temp(self.path)
        self.direct = enable_direct(self._fd)
        self._bufs = [mmap.mmap(-1, STAGE_BYTES) for _ in range(2)]  # page-aligned
        self._fill = 0  # bytes in the current buffer
        self._offset = 0  # file offset of the current buffer
        self._io = ThreadPoolExecutor(1, thread_name_prefix="shardc-io")
        self._pending: Future[None] | None = None
        self.closed = False
        self.written = 0
        self.write(head)

    def write(self, buf: Any) -> None:
        """Append bytes (copied into the staging buffer): anything with the buffer protocol
        (bytes, a numpy array's memory), hence Any (typing.Buffer is Python 3.12)."""
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        pos = 0
        while pos < n:
            k = min(n - pos, STAGE_BYTES - self._fill)
            view = self.reserve(k)
            assert view is not None  # k fits: it is at most the room left
            view[:] = mv[pos : pos + k]
            self.advance(k)
            pos += k

    def reserve(self, n: int) -> memoryview | None:
        """The next ``n`` bytes of the staging buffer, to be filled in place and then passed to
        ``advance(n)``; None when fewer than ``n`` bytes are left in it (use ``write``). Filling
        in place (a cast straight into it) saves a copy, and the filler can release the GIL."""
        if self._fill + n > STAGE_BYTES:
            return None
        if self.written + n > self.expected:
            raise ValueError(f"{self.path.name}: more bytes than the header declares")
        return memoryview(self._bufs[0])[self._fill : self._fill + n]

    def room(self) -> int:
        """Bytes left in the staging buffer: the most ``reserve`` can hand out now."""
        return STAGE_BYTES - self._fill

    def advance(self, n: int) -> None:
        """Account for ``n`` bytes filled in place after ``reserve(n)``: hash them (while they
        are still in cache) and hand the buffer to the I/O thread once it is full."""
        with memoryview(self._bufs[0])[self._fill : self._fill + n] as mv:
            self._sha.update(mv)
        self._fill += n
        self.written += n
        if self._fill == STAGE_BYTES:
            self._flush(STAGE_BYTES)

    def _flush(self, nbytes: int, data: int | None = None) -> None:
        """Hand the current buffer to the I/O thread and switch to the other one (waiting until
        its previous write is done: at most one buffer is in flight). ``data``: how many of the
        ``nbytes`` are the file's (the rest is O_DIRECT padding, not hashed)."""
        if self._pending is not None:
            self._pending.result()
        self._pending = self._io.submit(self._hash_and_write, memoryview(self._bufs[0])[:nbytes], self._offset,
                                        nbytes if data is None else data)
        self._bufs.reverse()
        self._offset += nbytes
        self._fill = 0

    def _hash_and_write(self, mv: memoryview, offset: int, data: int) -> None:
        """On the I/O thread: the buffer's chunk digests, then its write (buffers arrive in order)."""
        with mv[:data] as part:
            self._chunker.update(part)
        self._pwrite(mv, offset)

    def _pwrite(self, mv: memoryview, offset: int) -> None:
        while mv:
            try:
                done = os.pwrite(self._fd, mv, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self.direct = disable_direct(self._fd)  # accepted at open, refused at write
                continue
            mv, offset = mv[done:], offset + done
        mv.release()

    def commit(self, rename: bool = True) -> tuple[int, str]:
        """Finish the file: (size, sha256). Durable (fsync) either way; ``rename=False`` leaves it
        at its temp name (``self.tmp``) for a caller that switches many files at once."""
        if self.written != self.expected:
            self.abort()
            raise ValueError(f"{self.path.name}: wrote {self.written} of {self.expected} bytes")
        try:
            # O_DIRECT writes whole blocks: pad the tail with zeros, then cut the file to size
            tail = self._fill
            padded = -(-tail // DIRECT_ALIGN) * DIRECT_ALIGN
            self._bufs[0][tail:padded] = bytes(padded - tail)
            self._flush(padded, tail)
            assert self._pending is not None  # _flush just handed the tail to the I/O thread
            self._pending.result()
            self.chunks = self._chunker.finish()
            os.ftruncate(self._fd, self.written)
            os.fsync(self._fd)
            self._close()
            if rename:
                os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.written, self._sha.hexdigest()

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._io.shutdown(wait=True)
        os.close(self._fd)
        for b in self._bufs:
            try:
                b.close()
            except BufferError:
                pass  # a view still held by a failed write's traceback: freed with it


