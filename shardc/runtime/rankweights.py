"""The weights one rank's decoder runs on: its layers' local slices, its embedding / final norm /
lm_head, and its local sizes. Filled from the shard by runtime/weights.py, read by
runtime/decoder.py: the one type that crosses between loading a shard and computing with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# One routed expert's weights: (gate, up, down), or stacked (gpt-oss) (gate_up, gate_up bias, down,
# down bias or None)
ExpertWeights = (tuple[torch.Tensor, ...]
                 | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None])


@dataclass
class MoeWeights:
    """One sparse layer's router (replicated), the routed experts this rank holds (all of them, each
    split over TP like a dense MLP; or, with expert parallelism, its own whole experts) as
    (gate, up, down) or, stacked (gpt-oss), (gate_up, gate_up bias, down, down bias or None: the
    bias of an expert split over TP is added by TP rank 0 only), and a shared expert with its
    sigmoid gate (Qwen2-MoE)."""

    router: torch.Tensor
    experts: dict[int, ExpertWeights]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    shared_gate: torch.Tensor | None = None
    score_bias: torch.Tensor | None = None  # e_score_correction_bias (DeepSeek-V3), the choice only
    router_bias: torch.Tensor | None = None  # gpt-oss: added to the router logits


@dataclass
class LayerWeights:
    """One decoder layer's local slices. q/k/v and gate/up stay separate (as in the shard files)."""

    index: int
    ln1: torch.Tensor
    ln2: torch.Tensor
    q: torch.Tensor | None  # MLA: q_b_proj (or q_proj), this rank's heads; None on a linear-attention layer
    k: torch.Tensor | None  # None with MLA: ``mla`` holds the latent projections
    v: torch.Tensor | None
    o: torch.Tensor  # a linear-attention layer's out_proj too (row-parallel like o_proj)
    gate: torch.Tensor | None  # None on a sparse layer: ``moe`` holds its MLP
    up: torch.Tensor | None
    down: torch.Tensor | None
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # q, k, v, o, gate, up, down
    # q_norm, k_norm (per head); post_attn, post_ffw (sandwich norms; ln2 is then the pre-MLP norm)
    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    moe: MoeWeights | None = None
    # MLA (Forward.mla): q_a, q_a_norm (when q_lora_rank), kv_a, kv_a_norm (replicated), kv_b (this
    # rank's heads)
    mla: dict[str, torch.Tensor] = field(default_factory=dict)
    sinks: torch.Tensor | None = None  # this rank's heads' attention sinks (Forward.sinks)
    # a linear-attention layer (Forward.hybrid): its tensors by role (hybrid.py LINEAR) but out_proj (``o``)
    linear: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StageWeights:
    """Everything one rank holds: its layers, and the embedding / final norm / lm_head if it owns them."""

    layers: list[LayerWeights]
    embed: torch.Tensor | None  # [padded_vocab / tp, hidden] on the first stage
    vocab_start: int  # first vocabulary row of this rank's slice
    norm: torch.Tensor | None  # final norm on the last stage
    lm_head: torch.Tensor | None  # [padded_vocab / tp, hidden] on the last stage (tied: the embed slice)


@dataclass(frozen=True)
class Dims:
    """Local sizes for one rank."""

    hidden: int
    heads: int  # local query heads
    kv_heads: int  # local KV heads (1 when tp > num_key_value_heads: a replicated head)
    head_dim: int
    vocab: int  # true vocabulary (logits beyond it are padding and dropped)
    eps: float
    latent: tuple[int, int] | None = None  # MLA: the cache holds (kv_lora_rank, qk_rope_head_dim) per token
    index_dim: int | None = None  # DSA: the cache holds the indexer's key of index_head_dim per token
    linear: tuple[bool, ...] = ()  # per layer: linear attention (a DeltaNet state, no KV) (Forward.hybrid)
