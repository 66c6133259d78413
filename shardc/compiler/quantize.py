"""Weight-only int8 / fp8 (e4m3fn) quantization: pure functions plus a naming convention.

Per output channel, symmetric (docs/architecture.md §5). The FULL tensor is quantized, then sliced, so an
int8/fp8 plan at any TP degree holds the same quantized model. ``X.weight`` gets the quantized
values and ``X.weight_scale`` the float32 ``[out, 1]`` scales; ``w ~= q * scale``.

The arithmetic is numba loops (``kernels``); this module splits a tensor into row chunks for
threads and combines their statistics. No torch: a build never imports it (its import alone
would cost seconds of a build's budget; docs/performance.md §2).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import QuantizationError
from .arrays import from_torch, to_torch

QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
# A chunk of rows is staged as fp32 (for 16-bit sources) and its errors land in a second fp32
# buffer: 2 MiB per thread with the rows, mostly in the core's L2 cache.
_CHUNK_ELEMS = 1 << 18


def _nonfinite(name: str, w: np.ndarray) -> QuantizationError:
    with np.errstate(all="ignore"):
        bad = [int(i) for i in np.argwhere(~np.isfinite(w.astype(np.float32)))[0]]
    return QuantizationError(
        f"tensor {name!r} holds NaN or Inf (first at index {bad})",
        hint="the source checkpoint is damaged; re-download or re-export it",
    )


class _Buffers(threading.local):
    """Two fp32 chunk buffers per quantizer thread, allocated once."""

    def get(self, elems: int) -> tuple[np.ndarray, np.ndarray]:
        if getattr(self, "elems", 0) < elems:
            self.elems = elems
            self.bufs = (np.empty(elems, np.float32), np.empty(elems, np.float32))
        return self.bufs


_buffers = _Buffers()


def _rows(scheme: str, w: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Quantize the rows ``w`` into ``q`` with scales into ``s`` (views of the outputs).
    Returns [max |error|, sum error^2, sum w^2] of these rows, where error = source - q * scale,
    the product rounded to fp32 as the runtime dequantizes. A NaN/Inf row gets a non-finite
    scale; the caller rejects the tensor."""
    from . import kernels as k  # numba: imported only where something is quantized

    n, in_f = w.shape
    wf, err = (b[: n * in_f].reshape(n, in_f) for b in _buffers.get(n * in_f))
    qmax = QMAX[scheme]
    if w.dtype == ml_dtypes.bfloat16:
        k.bf16_scales(w.view(np.uint16), wf, s, qmax)  # fp32 copy and absmax in one pass
    else:
        if w.dtype == np.float32:
            wf = w
        else:
            np.copyto(wf, w, casting="unsafe")
        k.scales(wf, s, qmax)
    if scheme == "int8":
        k.int8_rows(wf, s, q, err)
    else:
        k.fp8_rows(wf, s, q.view(np.uint8), err)  # numba has no fp8 type
    stats = np.empty(3)
    k.error_stats(err, wf, stats)
    return stats


def quantize_array(
    name: str, w: np.ndarray, scheme: str, workers: int | None = None, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Quantize a 2-D weight per output row. Returns (q, scale[out, 1] fp32, error stats).

    int8: scale = absmax/127, q = clamp(round_half_even(w/scale), ±127).
    fp8:  scale = absmax/448, q = e4m3fn(clamp(w/scale, ±448)) (the cast does not saturate).
    All-zero rows get scale 1. NaN/Inf anywhere in a row makes its absmax non-finite: an error.
    ``out``, a byte buffer of ``w.size``, is filled instead of a new array (reused buffers skip a
    zeroed page fault per 4 KiB). Row chunks run on ``workers`` threads (the kernels and numpy
    release the GIL); chunks are whole rows of the full tensor, so the statistics do not depend
    on the TP degree or the thread count.
    """
    if scheme not in QMAX:
        raise QuantizationError(f"unknown scheme {scheme!r}", hint="int8 or fp8")
    out_f, in_f = w.shape
    if out is None:
        q = np.empty((out_f, in_f), QDTYPE[scheme])
    else:
        q = out[: w.size].view(QDTYPE[scheme]).reshape(out_f, in_f)
    scale = np.empty((out_f, 1), np.float32)
    step = max(1, min(out_f, _CHUNK_ELEMS // max(in_f, 1)))
    starts = list(range(0, out_f, step))
    workers = max(1, min(workers or os.cpu_count() or 1, len(starts)))

    def run(r0: int) -> np.ndarray:
        r1 = min(r0 + step, out_f)
        return _rows(scheme, w[r0:r1], q[r0:r1], scale[r0:r1])

    if workers == 1:
        parts = [run(r0) for r0 in starts]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="shardc-quant") as pool:
            parts = list(pool.map(run, starts))
    if not np.isfinite(scale).all():
        raise _nonfinite(name, w)
    max_err = max(float(p[0]) for p in parts)
    sse, ssq = math.fsum(p[1] for p in parts), math.fsum(p[2] for p in parts)
    stats = {
        "max_abs_err": _round(max_err),
        "rel_rms_err": _round(math.sqrt(sse / ssq) if ssq else 0.0),
    }
    return q, scale, stats


def quantize(name: str, w: Any, scheme: str, workers: int | None = None) -> tuple[Any, Any, dict]:
    """``quantize_array`` for a torch tensor: returns torch tensors (q, scale, stats)."""
    q, scale, stats = quantize_array(name, from_torch(w.contiguous()), scheme, workers)
    return to_torch(q), to_torch(scale), stats


def dequantize(q: Any, scale: Any, dtype: Any = None) -> Any:
    """w ~= q * scale (row-wise) for torch tensors, in ``dtype`` (default float32). With a 16-bit
    ``dtype`` the scale is rounded to it first, as the serving clients (compressed-tensors, vLLM's
    W8A16 schemes) and shardc's runtime hold it."""
    if dtype is None:
        return q.float() * scale.float()
    return (q.float() * scale.to(dtype).float()).to(dtype)


def _round(x: float) -> float:
    """4 significant digits: a statistic for reviewers, stable across summation orders (thread
    counts, BLAS builds), so the manifest stays byte-deterministic."""
    return float(f"{x:.4g}")


def pack_int8(q: np.ndarray) -> np.ndarray:
    """int8 [out, in] -> compressed-tensors' pack-quantized int32 [out, in/4], IN PLACE.

    ``pack_to_int32(q, 8)`` adds 128 to each value and puts element i of a group of four at bits
    8i..8i+7 of one int32: exactly the bytes of ``q + 128`` read as little-endian int32. Adding
    128 to a two's-complement byte flips its top bit, so packing is one XOR over the buffer and a
    reinterpreting view (tests compare it with compressed-tensors' own function, bit for bit).
    """
    if q.dtype != np.int8 or q.ndim != 2 or q.shape[1] % 4 or not q.flags.c_contiguous:
        raise ValueError(f"pack_int8 needs a C-contiguous int8 [out, in] with in % 4 == 0, got "
                         f"{q.dtype}{list(q.shape)}")
    u = q.view(np.uint8)
    np.bitwise_xor(u, np.uint8(0x80), out=u)
    return u.view("<i4")


def unpack_int8(packed: np.ndarray) -> np.ndarray:
    """pack-quantized int32 [out, in/4] -> int8 [out, in] (a new array)."""
    u = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8) ^ np.uint8(0x80)
    return u.view(np.int8)


def stored(q: np.ndarray, scheme: str) -> np.ndarray:
    """Quantized values in the form the shard files hold them: packed for int8 (in place)."""
    return pack_int8(q) if scheme == "int8" else q


# config.json's quantization_config, as compressed-tensors (0.20) models it: QuantizationConfig
# with one QuantizationScheme of weight-only QuantizationArgs. Written as plain JSON here (importing
# compressed-tensors imports torch, which a build never does); the tests validate every block with
# compressed-tensors' own models and check it against vLLM's scheme-selection rules.
CT_FORMAT = {"int8": "pack-quantized", "fp8": "float-quantized"}


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """The compressed-tensors block for weight-only, per-channel, symmetric int8 / fp8.

    ``quantization_status: compressed`` says the weights in the files ARE the compressed form (a
    reader that misses it treats them as unquantized and returns garbage). The format is given
    both at the top and in the group: transformers reads the group's, vLLM the group's and then the
    top-level one. Only compressed-tensors keys: shardc's own facts live in the manifest."""
    weights = {
        "num_bits": 8,
        "type": "int" if scheme == "int8" else "float",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
        "group_size": None,
    }
    fmt = CT_FORMAT[scheme]
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
