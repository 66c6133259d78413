"""Weight-only int8 / fp8 (e4m3fn) quantization: pure functions plus a naming convention.

Per output channel, symmetric (DESIGN.md §3.4). The FULL tensor is quantized, then sliced, so an
int8/fp8 plan at any TP degree holds the same quantized model. ``X.weight`` gets the quantized
values and ``X.weight_scale`` the float32 ``[out, 1]`` scales; ``w ~= q * scale``.

int8 runs in numpy, so an int8 build never needs torch. fp8 runs in torch for its e4m3 cast
(ml_dtypes' is scalar: ~11 ns per value here, against ~1 ns).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from .arrays import from_torch, to_torch
from .errors import QuantizationError

QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_TINY = float(np.finfo(np.float32).tiny)  # scales at least this large make the clamp a no-op
_E4M3_EXP_SHIFT = 2.0**120  # e4m3 bits (sans sign) << 20, read as fp32, are the value / 2**120
# A chunk of rows goes through two per-thread fp32 buffers (2 MiB with the rows): the dozen passes
# over it mostly hit the core's cache, and there are few enough chunks that the per-op overhead
# (~5 us of torch dispatch each) stays small. Measured here: 256K elements beat 128K and 1M.
_CHUNK_ELEMS = 1 << 18


def _nonfinite(name: str, w: np.ndarray) -> QuantizationError:
    with np.errstate(all="ignore"):
        bad = [int(i) for i in np.argwhere(~np.isfinite(w.astype(np.float32)))[0]]
    return QuantizationError(
        f"tensor {name!r} holds NaN or Inf (first at index {bad})",
        hint="the source checkpoint is damaged; re-download or re-export it",
    )


class _Buffers(threading.local):
    """Two fp32 chunk buffers per quantizer thread: small enough to stay in the core's L2 cache
    with the source rows, so the passes below read cache, not memory."""

    def get(self, elems: int) -> tuple[np.ndarray, np.ndarray]:
        if getattr(self, "elems", 0) < elems:
            self.elems = elems
            self.bufs = (np.empty(elems, np.float32), np.empty(elems, np.float32))
        return self.bufs


_buffers = _Buffers()


def _chunk(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows as fp32 (``w`` itself if it is fp32, else a copy in the first buffer), the first
    buffer and a scratch buffer, all of ``w``'s shape."""
    n, in_f = w.shape
    wbuf, x = (b[: n * in_f].reshape(n, in_f) for b in _buffers.get(n * in_f))
    if w.dtype == np.float32:
        return w, wbuf, x
    np.copyto(wbuf, w, casting="unsafe")
    return wbuf, wbuf, x


def _scales(wf: np.ndarray, s: np.ndarray, qmax: float) -> bool:
    """Row absmax / qmax into ``s`` (an all-zero row gets 1); True if the clamp is needed.

    |w / s| <= qmax * (1 + 2^-23) once s is a normal float (s = absmax / qmax, each division
    rounded once), and that rounds to qmax in both formats: the clamp would change nothing.
    A NaN/Inf row gets a non-finite scale; the caller rejects the tensor."""
    # absmax as max(amax, -amin): two cheap reductions, no |w| temporary
    np.maximum(wf.max(axis=1, keepdims=True), -wf.min(axis=1, keepdims=True), out=s)
    s /= np.float32(qmax)
    s[s == 0] = 1.0  # an all-zero row: any scale reproduces it; 1 by convention
    return not float(s.min()) >= _TINY


def _stats(err: np.ndarray, src: np.ndarray) -> list[float]:
    """[max error, -min error, sum error^2, sum src^2], float64 where fp32 sums overflow."""
    out = [float(err.max()), -float(err.min()), float(np.dot(err, err)), float(np.dot(src, src))]
    if math.isinf(out[2]) or math.isinf(out[3]):  # fp32 sums of squares overflow past ~1e19
        out[2:] = float(np.dot(err.astype(np.float64), err)), float(np.dot(src.astype(np.float64), src))
    return out


def _int8_rows(w: np.ndarray, q: np.ndarray, s: np.ndarray) -> list[float]:
    """int8 for the rows ``w`` into ``q`` with scales into ``s`` (views of the outputs), in
    numpy. Returns the error statistics of these rows: error = source - q * scale, the product
    rounded to fp32 as the runtime dequantizes."""
    wf, _, x = _chunk(w)
    clamp = _scales(wf, s, QMAX["int8"])
    np.divide(wf, s, out=x)
    np.rint(x, out=x)  # round half to even
    if clamp:
        np.clip(x, -127, 127, out=x)
    np.copyto(q, x, casting="unsafe")
    np.multiply(x, s, out=x)
    np.subtract(wf, x, out=x)  # w - q * scale
    return _stats(x.reshape(-1), wf.reshape(-1))


def _fp8_rows(w: np.ndarray, q: np.ndarray, s: np.ndarray) -> list[float]:
    """fp8 e4m3fn for the rows ``w``, as ``_int8_rows``. Scales and statistics are the same
    numpy code; torch does the passes between, for its e4m3 cast (numpy has no fast one)."""
    import torch

    wf, wbuf, x = _chunk(w)
    clamp = _scales(wf, s, QMAX["fp8"])
    xt, st, qt = torch.from_numpy(x), torch.from_numpy(s), to_torch(q)
    torch.div(to_torch(wf), st, out=xt)
    if clamp:
        xt.clamp_(-448.0, 448.0)  # the e4m3fn cast does not saturate
    qt.copy_(xt)
    # The dequantized magnitude without torch's slow e4m3 -> fp32 cast: the e4m3 bits less the
    # sign, shifted into an fp32's exponent and mantissa, read as fp32, are the value / 2^120
    # (subnormals too). Times scale * 2^120 (exact while that does not overflow) it is q * scale
    # rounded once, as the runtime dequantizes. q has the sign of w, so
    # |w - q*scale| = | |w| - |q|*scale |.
    bits = xt.view(torch.int32).copy_(qt.view(torch.uint8))
    deq = bits.bitwise_and_(0x7F).bitwise_left_shift_(20).view(torch.float32)
    if float(s.max()) < 2.0**7:
        deq.mul_(st * _E4M3_EXP_SHIFT)
    else:
        deq.mul_(_E4M3_EXP_SHIFT).mul_(st)
    src = np.abs(wf, out=wbuf)
    torch.sub(torch.from_numpy(src), deq, out=deq)
    return _stats(x.reshape(-1), src.reshape(-1))  # x holds the error now


_KERNELS = {"int8": _int8_rows, "fp8": _fp8_rows}


def quantize_array(
    name: str, w: np.ndarray, scheme: str, workers: int | None = None, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Quantize a 2-D weight per output row. Returns (q, scale[out, 1] fp32, error stats).

    int8: scale = absmax/127, q = clamp(round_half_even(w/scale), ±127).
    fp8:  scale = absmax/448, q = e4m3fn(clamp(w/scale, ±448)) (the cast does not saturate).
    All-zero rows get scale 1. NaN/Inf anywhere in a row makes its absmax non-finite: an error.
    ``out``, a byte buffer of ``w.size``, is filled instead of a new array (reused buffers skip a
    zeroed page fault per 4 KiB). Row chunks run on ``workers`` threads (numpy and torch release
    the GIL); chunks are whole rows of the full tensor, so the statistics do not depend on the
    TP degree or the thread count.
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
    kernel = _KERNELS[scheme]

    def run(r0: int) -> list[float]:
        r1 = min(r0 + step, out_f)
        with np.errstate(all="ignore"):  # NaN rows are reported below, by name
            return kernel(w[r0:r1], q[r0:r1], scale[r0:r1])

    if workers == 1:
        parts = [run(r0) for r0 in starts]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="shardc-quant") as pool:
            parts = list(pool.map(run, starts))
    if not np.isfinite(scale).all():
        raise _nonfinite(name, w)
    max_err = max(max(p[0], p[1]) for p in parts)
    sse, ssq = sum(p[2] for p in parts), sum(p[3] for p in parts)
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
    """w ~= q * scale (row-wise) for torch tensors, in ``dtype`` (default float32)."""
    w = q.float() * scale.float()
    return w if dtype is None else w.to(dtype)


def _round(x: float) -> float:
    """4 significant digits: a statistic for reviewers, stable across summation orders (thread
    counts, BLAS builds), so the manifest stays byte-deterministic."""
    return float(f"{x:.4g}")


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """compressed-tensors style description for config.json (weights only, per channel)."""
    weights = {
        "num_bits": 8,
        "type": "int" if scheme == "int8" else "float",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if scheme == "int8" else "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
        "shardc_scheme": scheme,
        "shardc_scale_suffix": "_scale",
    }
