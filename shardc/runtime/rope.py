"""Rotary position tables as Hugging Face computes them: default, linear, llama3 and YaRN inverse
frequencies (runtime/support.py lists the rope types a rank may start with), the attention scaling
they imply, and cos/sin tables in fp32 cast to the model dtype."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ModelError
from .support import ROPE_TYPES


def rope_inv_freq(model: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for default, linear and llama3 rope (HF's formulas)."""
    dim = model["head_dim"]
    base = float(model["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = model.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l), 1.0
    if kind == "yarn":  # transformers' _compute_yarn_parameters, step for step
        return _yarn(model, scaling, dim, base)
    raise ModelError(
        f"rope_scaling type {kind!r} is not supported by the shardc runtime",
        key="rope_scaling",
        hint=f"supported: {', '.join(ROPE_TYPES)}",  # support.py refuses it before a rank starts
    )


def _yarn(model: dict[str, Any], p: dict[str, Any], dim: int, base: float) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or model["max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = model["max_position_embeddings"] / orig

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention is None:
        attention = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                     if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


def rope_tables(model: dict[str, Any], length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, head_dim] for positions 0..length-1, in fp32 then cast (as HF does)."""
    inv, scale = rope_inv_freq(model)
    pos = torch.arange(length, dtype=torch.int64).float()
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
