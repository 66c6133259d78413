"""DeepSeek Sparse Attention's token selection (``Mla.indexer``; layout/families/indexer.py), as
transformers' DeepseekV32Indexer / GlmMoeDsaIndexer compute it, operation for operation, and the
mask that makes eager MLA attend to the selected tokens only (as transformers' eager path masks).

The indexer's weights are whole on every TP rank (families/deepseek_v32.py says why): each rank
computes the same fp32 scores and the same top-k, so no communication and no rank disagreement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout.families.indexer import Indexer
from .qk import rotate_half


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [batch, t, heads, rope] turned by cos/sin [t, rope] (cat(freqs, freqs), model dtype)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if not interleave:  # DeepSeek-V3.2: halves (apply_rotary_pos_emb)
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2  # GLM-5: (even, odd) pairs (apply_rotary_pos_emb_interleave)
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def select(ix: Indexer, w: dict[str, torch.Tensor], h: torch.Tensor, q_latent: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor | None, start: int) -> torch.Tensor:
    """The top-k visible tokens of each query, [batch, t, min(topk, n)] (int64), n = start + t.

    ``h``: the layer's normed input [batch, t, hidden]; ``q_latent``: MLA's normed q latent;
    ``keys``: this layer's indexer key cache [batch, max_len, head_dim] (None: no cache), written
    at positions start..start+t and read up to them."""
    bsz, t, _ = h.shape
    r = ix.rope
    q = F.linear(q_latent, w["ix_q"]).view(bsz, t, ix.heads, ix.head_dim)
    k = F.layer_norm(F.linear(h, w["ix_k"]), (ix.head_dim,), w["ix_k_norm"], w["ix_k_bias"], ix.k_norm_eps)
    k = k.unsqueeze(2)
    q = torch.cat([_rope(q[..., :r], cos, sin, ix.interleave), q[..., r:]], dim=-1)
    k = torch.cat([_rope(k[..., :r], cos, sin, ix.interleave), k[..., r:]], dim=-1).squeeze(2)
    if keys is not None:
        keys[:, start : start + t] = k
        k = keys[:, : start + t]
    n = k.shape[1]
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.head_dim**-0.5)
    # transformers keeps weights_proj in fp32 for an fp16 model only (_keep_in_fp32_modules): computed
    # in the dtype transformers holds it in
    wp = w["ix_weights"]
    dtype = torch.float32 if h.dtype == torch.float16 else h.dtype
    weights = F.linear(h.to(dtype), wp.to(dtype)).float() * ix.heads**-0.5
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [batch, t, n]
    if t > 1:  # the eager causal mask added, as transformers adds it: 0 or the dtype's minimum
        visible = torch.ones(t, n, dtype=torch.bool, device=h.device).tril(n - t)
        index = index + torch.zeros(t, n, dtype=h.dtype, device=h.device).masked_fill(
            ~visible, torch.finfo(h.dtype).min)
    return index.topk(min(ix.topk, n), dim=-1).indices


def keep(chosen: torch.Tensor, n: int) -> torch.Tensor:
    """[batch, 1, t, n]: True at the chosen tokens (what attention may read, before causality)."""
    bsz, t, _ = chosen.shape
    return torch.zeros(bsz, t, n, dtype=torch.bool, device=chosen.device).scatter(-1, chosen, True).unsqueeze(1)
