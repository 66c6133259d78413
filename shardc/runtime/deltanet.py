"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5) as pure torch functions,
bit-equal to transformers' torch fallbacks (models/qwen3_next/modeling_qwen3_next.py; qwen3_5's
copy is identical): ``Qwen3NextRMSNormGated``, the causal depthwise conv1d with the cache
semantics of ``causal_conv1d_forward`` / ``LinearAttentionLayer.update_conv_state``, both
``torch_*_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True``, and
``Qwen3NextGatedDeltaNet.forward`` between the input projections and ``out_proj``. No
transformers import: the runtime must not depend on it.

Why each choice: every function repeats transformers' ops in the same order and dtypes (casts,
chunk size 64 with right zero-padding, ``solve_triangular`` for the UT transform, the same
``F.conv1d`` calls, padding and slicing): float results depend on all of them, and the runtime
is tested with ``torch.equal``, not a tolerance.

State layout, as transformers' cache keeps it: the conv state is ``[batch, channels, kernel]``
(the last ``kernel`` inputs of the conv, not ``kernel - 1``; left zero-padded when a prompt is
shorter than the kernel) in the dtype of the conv input; the recurrent state is
``[batch, num_v_heads, head_k_dim, head_v_dim]`` in float32.

Tensor parallelism: every op is per head (recurrence, l2norm, gated norm, A_log/dt_bias) or per
channel (the depthwise conv); key head ``i`` serves value heads ``i*r .. i*r+r-1`` (``r =
num_v_heads // num_k_heads``). A rank holding a contiguous range of key heads, their value heads,
exactly their conv channels (:func:`local_conv_channels`) and their A_log / dt_bias computes the
slice of the full result, bit for bit (tested); ``out_proj`` is row-parallel. All functions take
any number of heads. A CPU quirk: torch's CPU kernels compute sigmoid/softplus/silu in SIMD
blocks (2 x 16 floats on AVX512) and the tail of each (per-thread) run with a scalar formula that
may differ by an ulp, so an element's bits depend on its position. For the tiny [batch, t, heads]
beta and g, :func:`beta_and_decay` computes at full width with the rank's heads at their offset
(``v_head_offset``, ``num_v_heads``), as the full layer does; the conv's and the norm's silu run
over b*t*channels and b*t*heads*dv elements, multiples of 32 with real head dims (128), so no
element changes path there. CUDA's elementwise kernels do not depend on position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..layout.families.hybrid import Hybrid

CHUNK_SIZE = 64


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """ACT2FN for the conv: "silu" (SiLUActivation) and "swish" (nn.SiLU) are both F.silu."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    return x if activation is None else F.silu(x)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated.forward: RMS-normalize ``x`` over its last dim in fp32, back to x's
    dtype, times ``weight``, times silu(z) in fp32, back to x's dtype."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = (weight * h.to(input_dtype)) * F.silu(z.to(torch.float32))
    return h.to(input_dtype)


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, activation: str | None = "silu",
                 prev_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over ``x`` [batch, channels, t] (weight [channels, 1, kernel], no
    bias) as transformers' cache-filling path computes it; returns (y [batch, channels, t] in x's
    dtype, new conv state [batch, channels, kernel] in x's dtype, a fresh contiguous tensor).

    A prompt (no ``prev_state``) is left zero-padded to ``kernel`` when t < kernel, as the cache
    does; several tokens after earlier ones run over ``cat(prev_state, x)``. Then
    ``F.conv1d(padding=kernel-1)[..., :len]``, the last t outputs kept; the state is the last
    ``kernel`` columns of that padded/concatenated input."""
    t, kernel = x.shape[-1], weight.shape[-1]
    if prev_state is not None:
        full = torch.cat([prev_state, x], dim=-1)
    else:
        full = F.pad(x, (kernel - t, 0), value=0) if t < kernel else x
    state = full[..., -kernel:].clone(memory_format=torch.contiguous_format)
    y = F.conv1d(full.to(weight.dtype), weight=weight, bias=None, padding=kernel - 1,  # causal_conv1d_fn
                 groups=full.shape[1])[:, :, :full.shape[-1]]
    y = _act(y, activation).to(full.dtype)
    return y[:, :, -t:], state


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              activation: str | None = "silu") -> torch.Tensor:
    """transformers' causal_conv1d_update: ``x`` [batch, channels, t] (t == 1 when decoding)
    after ``state`` [batch, channels, kernel]; ``state`` is updated IN PLACE to the last
    ``kernel`` columns of cat(state, x) (cast to the weight's dtype first); returns y
    [batch, channels, t] in x's dtype."""
    t, state_len = x.shape[-1], state.shape[-1]
    full = torch.cat([state, x], dim=-1).to(weight.dtype)
    state.copy_(full[:, :, -state_len:])
    y = F.conv1d(full, weight, None, padding=0, groups=x.shape[1])[:, :, -t:]
    return _act(y, activation).to(x.dtype)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' l2norm (FLA's): x * rsqrt(sum(x*x) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> list[torch.Tensor]:
    """Both rules' start: q/k repeated per value head, heads before time, fp32, q/k l2-normed."""
    if k.shape[2] != v.shape[2]:
        q, k = (x.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for x in (q, k))
    out = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
           for x in (q, k, v, beta, g)]
    return [l2norm(out[0]), l2norm(out[1]), *out[2:]]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_chunk_gated_delta_rule(chunk_size=64, use_qk_l2norm_in_kernel=True,
    output_final_state=True). q, k [b, t, hk, dk]; v [b, t, hv, dv]; g (log decay, fp32) and
    beta [b, t, hv]; initial_state [b, hv, dk, dv] or None (zeros). Returns (out [b, t, hv, dv]
    in q's dtype, final state [b, hv, dk, dv] fp32, a new tensor: the input is not modified)."""
    initial_dtype = q.dtype
    b, t, _, dk = k.shape
    hv, dv = v.shape[-2:]
    query, key, value, beta, decay = _prepare(q, k, v, g, beta)
    query = query * (query.shape[-1] ** -0.5)
    cs = CHUNK_SIZE
    pad = (cs - t % cs) % cs
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    num_chunks = (t + pad) // cs
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, cs, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, cs)
    upper = torch.ones(cs, cs, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf"))
    pairwise = pairwise.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False,
                                               unitriangular=True)
    state = (torch.zeros((b, hv, dk, dv), dtype=new_values.dtype, device=new_values.device)
             if initial_state is None else initial_state.to(new_values))
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        inter = query[:, :, i] @ state
        out[:, :, i] = inter + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, hv, -1, dv)[:, :, :t]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True, output_final_state=True),
    token by token; same shapes as :func:`chunk_gated_delta_rule`. ``state`` is not modified (a
    new final state is returned)."""
    initial_dtype = q.dtype
    b, t, _, dk = k.shape
    hv, dv = v.shape[-2:]
    query, key, value, beta, decay = _prepare(q, k, v, g, beta)
    query = query / (query.shape[-1] ** 0.5)
    s = (torch.zeros((b, hv, dk, dv), dtype=value.dtype, device=value.device)
         if state is None else state.to(value))
    out = torch.zeros_like(value)
    for i in range(t):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        s = s * decay[:, :, i].exp()[..., None, None]
        kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(initial_dtype), s


@dataclass
class DeltaNetState:
    """One layer's cache for one rank: ``conv`` [batch, channels, kernel] (x's dtype) and
    ``recurrent`` [batch, hv, dk, dv] fp32; both None before the first forward."""

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None


def local_conv_channels(k_heads: range, num_k_heads: int, head_k_dim: int, num_v_heads: int,
                        head_v_dim: int) -> torch.Tensor:
    """Indices into the full conv's channels (ordered [all q | all k | all v]) of the key heads
    ``k_heads`` and their value heads, in the order :func:`gated_deltanet` concatenates them."""
    r, key_dim = num_v_heads // num_k_heads, num_k_heads * head_k_dim
    qk = torch.arange(k_heads.start * head_k_dim, k_heads.stop * head_k_dim)
    vv = torch.arange(k_heads.start * r * head_v_dim, k_heads.stop * r * head_v_dim)
    return torch.cat([qk, qk + key_dim, vv + 2 * key_dim])


def beta_and_decay(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   v_head_offset: int = 0, num_v_heads: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) = (b.sigmoid(), -A_log.float().exp() * softplus(a.float() + dt_bias)) as the layer
    computes them; b, a [batch, t, hv]. With ``num_v_heads`` (the layer's total) > hv, the inputs
    are zero-padded to full width with this rank's heads at ``v_head_offset`` and the result
    sliced back, so each element takes the same SIMD-or-tail path as in the full layer (module
    docstring). Pass b and a contiguous, as the projections produce them."""
    hv = b.shape[-1]
    total, heads = hv if num_v_heads is None else num_v_heads, slice(v_head_offset, v_head_offset + hv)
    if total != hv:
        pad = (v_head_offset, total - v_head_offset - hv)
        b, a, A_log, dt_bias = (F.pad(x, pad) for x in (b, a, A_log, dt_bias))
    beta, g = b.sigmoid(), -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return (beta, g) if total == hv else (beta[..., heads], g[..., heads])


def gated_deltanet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                   b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   conv_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   state: DeltaNetState, activation: str | None = "silu", v_head_offset: int = 0,
                   num_v_heads: int | None = None) -> torch.Tensor:
    """Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet.forward between the input projections and
    out_proj, for whatever heads these are. Inputs are the projections before the conv: q, k
    [batch, t, hk, dk]; v, z [batch, t, hv, dv]; b, a [batch, t, hv]; A_log, dt_bias [hv];
    conv_weight [hk*dk*2 + hv*dv, 1, kernel] (channels [q | k | v]); norm_weight [dv].
    ``state`` is read and updated (fields reassigned; the conv state is updated in place on a
    single-token step). Returns [batch, t, hv, dv] (flatten the last two dims for out_proj).
    Branches as transformers: conv step iff a conv state exists and t == 1, recurrent rule iff a
    recurrent state exists and t == 1, else the chunked rule from the state (or zeros). On a TP
    rank pass ``v_head_offset``/``num_v_heads`` (see :func:`beta_and_decay`)."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    mixed = torch.cat([x.reshape(bsz, t, -1) for x in (q, k, v)], dim=-1).transpose(1, 2)
    if state.conv is not None and t == 1:
        mixed = conv_step(mixed, state.conv, conv_weight, activation)
    else:
        mixed, state.conv = conv_prefill(mixed, conv_weight, activation, state.conv)
    mixed = mixed.transpose(1, 2)
    query, key, value = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    query, key = query.reshape(bsz, t, -1, dk), key.reshape(bsz, t, -1, dk)
    value = value.reshape(bsz, t, -1, dv)
    beta, g = beta_and_decay(b, a, A_log, dt_bias, v_head_offset, num_v_heads)
    rule = (recurrent_gated_delta_rule if state.recurrent is not None and t == 1
            else chunk_gated_delta_rule)
    out, state.recurrent = rule(query, key, value, g, beta, state.recurrent)
    out = gated_rms_norm(out.reshape(-1, dv), z.reshape(-1, dv), norm_weight, eps)
    return out.reshape(bsz, t, hv, dv)


def linear_attention(x: Hybrid, w: dict[str, torch.Tensor], h: torch.Tensor, eps: float, state: DeltaNetState,
                     tp_rank: int) -> torch.Tensor:
    """A Gated DeltaNet layer for one rank's key heads and their value heads, before out_proj:
    Qwen3-Next's fused in-projections read per key head as transformers'
    fix_query_key_value_ordering, or Qwen3.5's apart (``x.fused_qkvz`` False: the rank's
    ``in_proj_qkv`` rows are its [q | k | v], z, b and a its value heads'), then
    :func:`gated_deltanet`. ``w``: the layer's tensors by role (hybrid.py LINEAR or LINEAR_SPLIT),
    this rank's rows; ``state``: filled by a prefill, continued by a decode."""
    bsz, t, _ = h.shape
    r = x.value_heads // x.key_heads
    if not x.fused_qkvz:
        qkv = F.linear(h, w["qkv"])
        hk = qkv.shape[-1] // (2 * x.key_dim + r * x.value_dim)
        q, k, v = torch.split(qkv, [hk * x.key_dim, hk * x.key_dim, hk * r * x.value_dim], dim=-1)
        q, k = q.reshape(bsz, t, hk, x.key_dim), k.reshape(bsz, t, hk, x.key_dim)
        z, b, a = F.linear(h, w["z"]), F.linear(h, w["b"]), F.linear(h, w["a"])
    else:
        qkvz = F.linear(h, w["qkvz"])
        hk = qkvz.shape[-1] // (2 * x.key_dim + 2 * r * x.value_dim)
        q, k, v, z = torch.split(qkvz.view(bsz, t, hk, -1), [x.key_dim, x.key_dim, r * x.value_dim, r * x.value_dim],
                                 dim=3)
        b, a = torch.split(F.linear(h, w["ba"]).view(bsz, t, hk, 2 * r), [r, r], dim=3)
        b, a = b.reshape(bsz, t, -1), a.reshape(bsz, t, -1)
    v, z = v.reshape(bsz, t, -1, x.value_dim), z.reshape(bsz, t, -1, x.value_dim)
    out = gated_deltanet(q, k, v, z, b, a, w["A_log"], w["dt_bias"], w["conv"], w["norm"], eps, state,
                         v_head_offset=tp_rank * hk * r, num_v_heads=x.value_heads)
    return out.reshape(bsz, t, -1)
