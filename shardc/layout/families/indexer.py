"""DeepSeek Sparse Attention's lightning indexer as data (``Mla.indexer``): what
runtime/indexer.py computes, and the tensors it reads (``INDEXER``, by role).

Per layer the indexer scores every visible past token for every query with its own small
projections: ``wq_b`` from MLA's normed q latent (``index_n_heads`` heads of ``index_head_dim``),
one key per token from ``wk`` and a LayerNorm (``k_norm``, weight and bias, eps 1e-6), rope on the
first ``qk_rope_head_dim`` dimensions of both, ReLU(q·k / sqrt(d)) summed over heads with weights
from ``weights_proj``; attention then reads only the ``index_topk`` best tokens. Below
``index_topk`` visible tokens that is every token, so DSA equals dense MLA there. Its key (one
vector per token) is cached beside MLA's latent. Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The indexer's tensors under model.layers.N., by the decoder's role (runtime/indexer.py)
INDEXER = (("ix_q", "self_attn.indexer.wq_b.weight"), ("ix_k", "self_attn.indexer.wk.weight"),
           ("ix_k_norm", "self_attn.indexer.k_norm.weight"), ("ix_k_bias", "self_attn.indexer.k_norm.bias"),
           ("ix_weights", "self_attn.indexer.weights_proj.weight"))


@dataclass(frozen=True)
class Indexer:
    """One model's indexer: sizes, the top-k, its rope layout and which layers run their own."""

    heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk: tokens each query attends to once more are visible
    rope: int  # qk_rope_head_dim: the rotated dimensions at the start of each head
    interleave: bool  # rope on (even, odd) pairs (GLM-5) or on halves (DeepSeek-V3.2)
    # per layer: True runs the layer's own indexer; False ("shared", GLM-5.x) reuses the top-k the
    # nearest earlier layer chose and holds no indexer tensors
    own: tuple[bool, ...]
    k_norm_eps: float = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)
