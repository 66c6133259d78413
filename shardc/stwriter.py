"""Incremental safetensors writer (DESIGN.md §3.2).

``safetensors.torch.save_file`` needs a whole file's tensors in memory; one rank of a 70B model is
9-35 GB. The format is simple enough to stream: 8-byte little-endian header length, the JSON header
(dtype, shape, data_offsets, ``__metadata__``) padded with spaces to 8 bytes, then each tensor's
bytes in header order. Tensors are laid out sorted by name, so the bytes are deterministic.

The writer hashes what it writes (sha256 of the whole file) and commits atomically: temp file,
fsync, rename. Tests read every written file back with the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from .layout import DTYPE_BYTES

ALIGN = 8
WRITEBACK_CHUNK = 64 << 20


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
    number of times (bytes must arrive in header order); ``size, sha = w.commit()``. ``abort()``
    removes the temp file. Until commit, the final name is untouched.
    """

    def __init__(
        self,
        path: str | Path,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        head = header_bytes(tensors, metadata)
        self.expected = len(head) + sum(math.prod(s) * DTYPE_BYTES[d] for _, d, s in tensors)
        self._sha = hashlib.sha256()
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self.written = 0
        self._flushed = 0
        self.write(head)

    def write(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        if self.written + mv.nbytes > self.expected:
            raise ValueError(f"{self.path.name}: more bytes than the header declares")
        self._f.write(mv)
        self._sha.update(mv)
        self.written += mv.nbytes
        if self.written - self._flushed >= WRITEBACK_CHUNK:
            self._start_writeback()

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing what we have so far (without waiting): the fsync at
        commit then only waits for the tail instead of stalling on the whole file."""
        if hasattr(os, "sync_file_range"):
            self._f.flush()
            try:
                os.sync_file_range(self._f.fileno(), self._flushed, self.written - self._flushed,
                                   os.SYNC_FILE_RANGE_WRITE)
            except OSError:
                pass  # not supported by this filesystem: fsync at commit does all the work
        self._flushed = self.written

    def commit(self) -> tuple[int, str]:
        if self.written != self.expected:
            self.abort()
            raise ValueError(f"{self.path.name}: wrote {self.written} of {self.expected} bytes")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.written, self._sha.hexdigest()

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
