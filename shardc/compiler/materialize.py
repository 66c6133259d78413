"""Materializing a rank's tensors: the source read once, quantized when the plan says so, and
each rank's slice cut and cast a chunk of rows at a time straight into its writer's buffer."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

from ..formats.safetensors import ShardWriter
from ..layout.dtypes import DTYPE_BYTES
from ..layout.ranks import Layout, TensorSpec
from .arrays import np_dtype
from .quantize import quantize_array, stored
from .quantqueue import QuantQueue
from .source import Source
from .tiles import Tiles

# Threads quantizing a tensor's row chunks: half the cores, at most 4. One thread of the numba
# kernels keeps pace with reading a layer from disk; the other cores hash and write. On 2 cores
# one thread gives the same wall time as two for less CPU (docs/performance.md §2).
QUANT_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))


def region(full: np.ndarray | Tiles, spec: TensorSpec) -> np.ndarray:
    """The rank's slice of a full tensor (source or quantized) as a view: nothing is copied
    (except from Tiles, which are put together first: ``stream_region`` avoids that). A fused
    tensor's pieces are concatenated (a copy: ``stream_region`` writes them one after another)."""
    if isinstance(full, Tiles):
        full = np.asarray(full)
    if spec.pieces:
        return np.concatenate([region(full, p) for p in spec.split_pieces()])
    if spec.dim is None:
        return full
    assert spec.start is not None and spec.stop is not None  # a cut along ``dim`` has its bounds
    p = (spec.pack or 1) if spec.dim == 1 else 1  # packed: ``pack`` source columns per element
    return full[(slice(None),) * spec.dim + (slice(spec.start // p, spec.stop // p),)]


def cut(full: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The rank's slice in the spec's dtype, as a contiguous array of its own. Pads are not
    included (they are written separately)."""
    part = region(full, spec)
    out = np.empty(part.shape, np_dtype(spec.dtype))
    _cast(out, part)
    return out


# Each writer thread streams its slices a chunk of rows at a time: the cast lands in cache, and
# the hash and the copy to disk read it from there.
CHUNK_BYTES = 1 << 20
_thread = threading.local()


def _chunk_buffer(nbytes: int) -> np.ndarray:
    """The writer thread's spare buffer (reused: fresh multi-MB allocations cost a zeroed page
    fault per 4 KiB)."""
    buf = getattr(_thread, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _thread.buf = np.empty(max(nbytes, CHUNK_BYTES), dtype=np.uint8)
    return buf[:nbytes]


def stream_region(writer: ShardWriter, full: np.ndarray, spec: TensorSpec) -> None:
    """Write the rank's slice of ``full`` in the spec's dtype, a few rows at a time.

    Each chunk of rows is sliced and cast straight into the writer's staging buffer (no
    intermediate copy, and the GIL is free meanwhile); only a chunk that straddles the end of a
    staging buffer goes through the thread's own buffer and a plain ``write``. From Tiles (a
    reshard's input ranks) each chunk is filled from the pieces it spans. A fused tensor's pieces
    (spec.pieces: source-row ranges) are written one after another, each cut from the one source
    view, so the source is read once whatever the number of ranks and parts."""
    for piece in spec.split_pieces():
        _stream_rows(writer, full, piece)


def _stream_rows(writer: ShardWriter, full: np.ndarray | Tiles, spec: TensorSpec) -> None:
    if isinstance(full, Tiles):
        start, stop = spec.start or 0, spec.stop or 0  # read only along ``dim``, where both are set
        lo = [start if spec.dim == i else 0 for i in range(len(full.shape))]
        shape = tuple(stop - start if spec.dim == i else n for i, n in enumerate(full.shape))
    else:
        part = region(full, spec)
        shape = part.shape
    dtype = np_dtype(spec.dtype)
    if not shape:  # a scalar (ModelOpt's per-tensor scales): one element, written as it is
        out = np.empty((), dtype)
        if isinstance(full, Tiles):
            full.fill(out, (), _cast)
        else:
            _cast(out, part)
        writer.write(out.reshape(-1).view(np.uint8))
        return
    row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
    step = max(1, CHUNK_BYTES // row_bytes)
    r0 = 0
    while r0 < shape[0]:
        rows = min(step, shape[0] - r0, writer.room() // row_bytes) or 1
        chunk = (rows, *shape[1:])
        n = math.prod(chunk) * dtype.itemsize
        staged = writer.reserve(n)
        out = (np.frombuffer(staged, dtype=dtype) if staged is not None else _chunk_buffer(n).view(dtype))
        out = out.reshape(chunk)
        if isinstance(full, Tiles):
            full.fill(out, (lo[0] + r0, *lo[1:]), _cast)
        else:
            _cast(out, part[r0 : r0 + rows])
        if staged is not None:
            writer.advance(n)
        else:
            writer.write(out.reshape(-1).view(np.uint8))
        r0 += rows


def _cast(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, rounding to nearest even. NaN, inf and overflow pass through as torch's
    casts do (a 16-bit plan copies the checkpoint as it is), so numpy's warnings are off."""
    with np.errstate(all="ignore"):
        np.copyto(dst, src, casting="unsafe")


class Materializer:
    """Reads a source tensor once and produces what the specs ask: the source view (sliced and
    cast later, per rank), or quantized values + scales (from the QuantQueue when one runs)."""

    def __init__(self, source: Source, layout: Layout) -> None:
        self.source, self.layout = source, layout
        self._key: tuple | None = None
        self._value: Any = None
        self.stats: dict[str, dict] = {}
        self.queue: QuantQueue | None = None

    def start_queue(self, keys: list[tuple[str, str]]) -> None:
        """Quantize ``keys`` ahead of the writers, on a thread, within a memory budget: half the
        largest source tensor (the 16-bit streaming that the quantizing overlaps holds at most
        about that much too), and at least the largest quantized tensor. Keys the source holds
        quantized already (a reshard's input build) are not quantized again."""
        keys = [k for k in keys if not self.source.holds_quantized(*k)]
        if not keys:
            return
        infos = self.source.tensors
        largest = max(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in infos.values())
        shapes = {n: infos[n].shape if n in infos else self.source.quantized_shapes[n] for n, _ in keys}
        budget = max(largest // 2, max(math.prod(s) for s in shapes.values()))
        self.queue = QuantQueue(keys, self.whole, self.stats, budget, QUANT_WORKERS)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None

    def full(self, spec: TensorSpec) -> np.ndarray:
        if spec.value is not None:  # X.weight_shape: its contents are in the Layout
            return np.asarray(spec.value, np.int64)
        key = (spec.source, spec.quant)
        if spec.quant and self.queue is not None and not self.source.holds_quantized(spec.source, spec.quant):
            q, scale = self.queue.get((spec.source, spec.quant))
            return scale if spec.scale_of else q
        if key != self._key:
            self._value = None  # release the previous tensor before reading the next
            if spec.quant:
                self._value = self.quantize(spec.source, spec.quant)
            elif spec.source in self.source.quantized_shapes and (
                    spec.source not in self.source.tensors or spec.dtype != self.source.tensors[spec.source].dtype):
                self._value = self.source.dense(spec.source)  # a quantized source to 16 bits
            else:
                self._value = self.source.view(spec.source)
            self._key = key
        if spec.quant:
            return self._value[1] if spec.scale_of else self._value[0]
        return self._value

    def whole(self, name: str) -> np.ndarray:
        """A source tensor as one array (the quantizer needs it whole; a reshard's Tiles are put
        together here)."""
        return np.asarray(self.source.dense(name))  # a quantized source's weight dequantized

    def release(self, spec: TensorSpec) -> None:
        """The writers are done with this spec's quantized tensor."""
        if spec.quant and self.queue is not None:
            self.queue.release((spec.source, spec.quant))

    def quantize(self, name: str, scheme: str, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Quantized values and scales of a source tensor, here and now; records its error stats.
        A source that holds the tensor quantized already (a reshard's input build) hands its values
        over unchanged (int8 unpacked: the stored form is made here, as for a fresh quantization)."""
        if self.source.holds_quantized(name, scheme):
            q, scale, self.stats[name] = self.source.quantized(name, scheme)
            return stored(q, scheme), scale
        w = self.whole(name) if w is None else w
        q, scale, self.stats[name] = quantize_array(name, w, scheme, QUANT_WORKERS)
        return stored(q, scheme), scale
