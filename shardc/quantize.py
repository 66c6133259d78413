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
_E4M3_TO_F32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
# Rows are processed in chunks through preallocated fp32 buffers: bounded memory, no page faults
# from fresh multi-MB allocations, and few passes over each element.
_CHUNK_ELEMS = 1 << 20


def _nonfinite(name: str, w: torch.Tensor) -> QuantizationError:
    bad = (~torch.isfinite(w)).nonzero()[0].tolist()
    return QuantizationError(
        f"tensor {name!r} holds NaN or Inf (first at index {bad})",
        hint="the source checkpoint is damaged; re-download or re-export it",
    )


def quantize(
    name: str, w: torch.Tensor, scheme: str, workers: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Quantize a 2-D weight per output row. Returns (q, scale[out, 1] fp32, error stats).

    int8: scale = absmax/127, q = clamp(round_half_even(w/scale), ±127).
    fp8:  scale = absmax/448, q = e4m3fn(clamp(w/scale, ±448)) (the cast does not saturate).
    All-zero rows get scale 1. NaN/Inf anywhere in a row makes its absmax non-finite: an error.
    Row chunks run on ``workers`` threads (torch releases the GIL), each with its own buffers.
    """
    if scheme not in QMAX:
        raise QuantizationError(f"unknown scheme {scheme!r}", hint="int8 or fp8")
    out_f, in_f = w.shape
    q = torch.empty((out_f, in_f), dtype=QDTYPE[scheme])
    scale = torch.empty((out_f, 1), dtype=torch.float32)
    step = max(1, min(out_f, _CHUNK_ELEMS // max(in_f, 1)))
    starts = list(range(0, out_f, step))
    workers = max(1, min(workers or os.cpu_count() or 1, len(starts)))
    local = threading.local()

    def run(r0: int) -> tuple[float, float, float]:
        # fewest passes over the chunk: amax/amin instead of abs + amax, copy_ into q instead
        # of a converted temporary, the error in one addcmul (each ~0.4 ms per 2M elements here)
        if not hasattr(local, "bufs"):
            local.bufs = (torch.empty((step, in_f)), torch.empty((step, in_f)),
                          torch.empty(step * in_f, dtype=torch.int32))
        n = min(step, out_f - r0)
        wf, x, idx = local.bufs[0][:n], local.bufs[1][:n], local.bufs[2][: n * in_f]
        wf.copy_(w[r0 : r0 + n])
        s = torch.maximum(wf.amax(dim=1, keepdim=True), wf.amin(dim=1, keepdim=True).neg_())
        if not bool(torch.isfinite(s).all()):
            raise _nonfinite(name, w)
        s.div_(QMAX[scheme])
        s[s == 0] = 1.0  # an all-zero row: any scale reproduces it; 1 by convention
        torch.div(wf, s, out=x)
        qc = q[r0 : r0 + n]
        if scheme == "int8":  # torch.round is round-half-to-even
            x.round_().clamp_(-127, 127)
            qc.copy_(x)
        else:
            x.clamp_(-448.0, 448.0)
            qc.copy_(x)
            # back to fp32 through a 256-entry table: 5x faster than torch's e4m3 -> fp32 cast here
            idx.copy_(qc.view(torch.uint8).view(-1))
            torch.index_select(_E4M3_TO_F32, 0, idx, out=x.view(-1))
        scale[r0 : r0 + n] = s
        torch.addcmul(wf, x, s, value=-1, out=x)  # w - q * scale: the dequantization error
        flat, wflat = x.view(-1), wf.view(-1)
        max_err = max(float(flat.amax()), -float(flat.amin()))
        return max_err, float(torch.dot(flat, flat)), float(torch.dot(wflat, wflat))

    if workers == 1:
        parts = [run(r0) for r0 in starts]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="shardc-quant") as pool:
            parts = list(pool.map(run, starts))
    max_err = max(p[0] for p in parts)
    sse, ssq = sum(p[1] for p in parts), sum(p[2] for p in parts)
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
