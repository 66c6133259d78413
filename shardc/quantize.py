"""Weight-only int8 / fp8 (e4m3fn) quantization: pure functions plus a naming convention.

Per output channel, symmetric (DESIGN.md §3.4). The FULL tensor is quantized, then sliced, so an
int8/fp8 plan at any TP degree holds the same quantized model. ``X.weight`` gets the quantized
values and ``X.weight_scale`` the float32 ``[out, 1]`` scales; ``w ~= q * scale``.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import QuantizationError

QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_TINY = torch.finfo(torch.float32).tiny  # scales at least this large make the clamp a no-op
_E4M3_EXP_SHIFT = 2.0**120  # e4m3 bits (sans sign) << 20, read as fp32, are the value / 2**120
# A chunk of rows goes through two per-thread fp32 buffers (2 MiB with the rows): the dozen passes
# over it mostly hit the core's cache, and there are few enough chunks that the per-op overhead
# (~5 us of dispatch each) stays small. Measured here: 256K elements beat 128K and 1M.
_CHUNK_ELEMS = 1 << 18


def _nonfinite(name: str, w: torch.Tensor) -> QuantizationError:
    bad = (~torch.isfinite(w)).nonzero()[0].tolist()
    return QuantizationError(
        f"tensor {name!r} holds NaN or Inf (first at index {bad})",
        hint="the source checkpoint is damaged; re-download or re-export it",
    )


class _Buffers(threading.local):
    """Two fp32 chunk buffers per quantizer thread: small enough to stay in the core's L2 cache
    with the source rows, so the dozen passes below read cache, not memory."""

    def get(self, elems: int) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "elems", 0) < elems:
            self.elems = elems
            self.bufs = (torch.empty(elems), torch.empty(elems))
        return self.bufs


_buffers = _Buffers()


def _quantize_rows(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scheme: str) -> list[float]:
    """Quantize the rows ``w`` into ``q``, their scales into ``s`` (views of the outputs).

    Returns [max error, -min error, sum error^2, sum w^2] over these rows, the error being the
    source weight minus the dequantized one. Every line is a pass over the chunk, or a small
    op on its scales; they are ordered for the fewest passes (9 for int8, 12 for fp8)."""
    n, in_f = w.shape
    wbuf, x = (b[: n * in_f].view(n, in_f) for b in _buffers.get(n * in_f))
    wf = w if w.dtype == torch.float32 else wbuf.copy_(w)
    # absmax per row as max(amax, -amin): two cheap reductions, no |w| temporary
    torch.maximum(wf.amax(dim=1, keepdim=True), wf.amin(dim=1, keepdim=True).neg_(), out=s)
    s.div_(QMAX[scheme])
    s.masked_fill_(s == 0, 1.0)  # an all-zero row: any scale reproduces it; 1 by convention
    torch.div(wf, s, out=x)
    # |w / s| <= qmax * (1 + 2^-23) once s is a normal float (s = absmax / qmax, each division
    # rounded once), and that rounds to qmax in both formats: the clamp would change nothing.
    # (A NaN/Inf row has a non-finite scale: the caller rejects the tensor.)
    clamp = not float(s.min()) >= _TINY
    if scheme == "int8":  # torch.round is round-half-to-even
        x.round_()
        if clamp:
            x.clamp_(-127, 127)
        q.copy_(x)
        err = torch.addcmul(wf, x, s, value=-1, out=x)  # w - q * scale
        src = wf
    else:
        if clamp:
            x.clamp_(-448.0, 448.0)  # the e4m3fn cast does not saturate
        q.copy_(x)
        # The dequantized magnitude without torch's slow e4m3 -> fp32 cast: the e4m3 bits less
        # the sign, shifted into an fp32's exponent and mantissa, read as fp32, are the value
        # / 2^120 (subnormals too); scaling by a power of two is exact. q has the sign of w, so
        # |w - q*scale| = | |w| - |q|*scale |.
        deq = x.view(torch.int32).copy_(q.view(torch.uint8)).bitwise_and_(0x7F).bitwise_left_shift_(20)
        deq = deq.view(torch.float32).mul_(_E4M3_EXP_SHIFT)
        src = wf.abs_() if wf is wbuf else torch.abs(wf, out=wbuf)
        err = torch.addcmul(src, deq, s, value=-1, out=deq)
    flat, src = err.view(-1), src.view(-1)
    out = torch.stack([flat.amax(), flat.amin().neg_(), torch.dot(flat, flat), torch.dot(src, src)]).tolist()
    if math.isinf(out[2]) or math.isinf(out[3]):  # fp32 sums of squares overflow past ~1e19
        out[2:] = float(torch.dot(flat.double(), flat.double())), float(torch.dot(src.double(), src.double()))
    return out


def quantize(
    name: str, w: torch.Tensor, scheme: str, workers: int | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Quantize a 2-D weight per output row. Returns (q, scale[out, 1] fp32, error stats).

    int8: scale = absmax/127, q = clamp(round_half_even(w/scale), ±127).
    fp8:  scale = absmax/448, q = e4m3fn(clamp(w/scale, ±448)) (the cast does not saturate).
    All-zero rows get scale 1. NaN/Inf anywhere in a row makes its absmax non-finite: an error.
    Row chunks run on ``workers`` threads (torch releases the GIL), each with its own buffers;
    chunks are whole rows of the full tensor, so the statistics do not depend on the TP degree.
    """
    if scheme not in QMAX:
        raise QuantizationError(f"unknown scheme {scheme!r}", hint="int8 or fp8")
    out_f, in_f = w.shape
    q = torch.empty((out_f, in_f), dtype=QDTYPE[scheme]) if out is None else out.view(QDTYPE[scheme]).view(out_f, in_f)
    scale = torch.empty((out_f, 1), dtype=torch.float32)
    step = max(1, min(out_f, _CHUNK_ELEMS // max(in_f, 1)))
    starts = list(range(0, out_f, step))
    workers = max(1, min(workers or os.cpu_count() or 1, len(starts)))

    def run(r0: int) -> list[float]:
        r1 = min(r0 + step, out_f)
        return _quantize_rows(w[r0:r1], q[r0:r1], scale[r0:r1], scheme)

    if workers == 1:
        parts = [run(r0) for r0 in starts]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="shardc-quant") as pool:
            parts = list(pool.map(run, starts))
    if not bool(torch.isfinite(scale).all()):
        raise _nonfinite(name, w)
    max_err = max(max(p[0], p[1]) for p in parts)
    sse, ssq = sum(p[2] for p in parts), sum(p[3] for p in parts)
    stats = {
        "max_abs_err": _round(max_err),
        "rel_rms_err": _round(math.sqrt(sse / ssq) if ssq else 0.0),
    }
    return q, scale, stats


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w ~= q * scale (row-wise), in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


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
