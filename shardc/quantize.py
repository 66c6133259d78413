"""Weight-only int8 / fp8 (e4m3fn) quantization: pure functions plus a naming convention.

Per output channel, symmetric (DESIGN.md §3.4). The FULL tensor is quantized, then sliced, so an
int8/fp8 plan at any TP degree holds the same quantized model. ``X.weight`` gets the quantized
values and ``X.weight_scale`` the float32 ``[out, 1]`` scales; ``w ~= q * scale``.
"""

from __future__ import annotations

import math

import torch

from .errors import QuantizationError

QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_CHUNK_ELEMS = 1 << 22  # rows are processed in chunks: bounded fp32 temporaries


def _check_finite(name: str, w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise QuantizationError(
            f"tensor {name!r} holds NaN or Inf (first at index {bad})",
            hint="the source checkpoint is damaged; re-download or re-export it",
        )


def _encode(x: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "int8":  # torch.round is round-half-to-even
        return torch.clamp(torch.round(x), -127, 127).to(torch.int8)
    return torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn)  # the cast does not saturate


def quantize(name: str, w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Quantize a 2-D weight per output row. Returns (q, scale[out, 1] fp32, error stats)."""
    if scheme not in QMAX:
        raise QuantizationError(f"unknown scheme {scheme!r}", hint="int8 or fp8")
    _check_finite(name, w)
    out_f, in_f = w.shape
    q = torch.empty((out_f, in_f), dtype=QDTYPE[scheme])
    scale = torch.empty((out_f, 1), dtype=torch.float32)
    step = max(1, _CHUNK_ELEMS // max(in_f, 1))
    max_err, sse, ssq = 0.0, 0.0, 0.0
    for r0 in range(0, out_f, step):
        wf = w[r0 : r0 + step].float()
        s = wf.abs().amax(dim=1, keepdim=True) / QMAX[scheme]
        s[s == 0] = 1.0  # an all-zero row: any scale reproduces it; 1 by convention
        qc = _encode(wf / s, scheme)
        q[r0 : r0 + step] = qc
        scale[r0 : r0 + step] = s
        err = qc.float() * s - wf
        max_err = max(max_err, float(err.abs().max()))
        sse += float(err.double().square().sum())
        ssq += float(wf.double().square().sum())
    stats = {
        "max_abs_err": _round(max_err),
        "rel_rms_err": _round(math.sqrt(sse / ssq) if ssq else 0.0),
    }
    return q, scale, stats


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w ~= q * scale (row-wise), in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def _round(x: float) -> float:
    """6 significant digits: stable across summation orders, so the manifest stays deterministic."""
    return float(f"{x:.6g}")


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
