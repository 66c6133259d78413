"""q and k between their projections and attention, where a family's forward (``Forward``) differs
from Llama's: rope over part of each head (``Forward.rotary_dim``: the first rotary_dim dimensions
turn NeoX-style, the rest pass, as transformers' ``apply_rotary_pos_emb`` with a partial rotary
factor), and MiniMax-M2's RMSNorm of q and of k over the width of every head together
(``Forward.qk_norm_whole``; transformers' MiniMaxM2Attention ``q_norm`` / ``k_norm``).

Under tensor parallelism a rank holds some heads and the norm weight's slice for them (the Layout
cuts it with its heads: ``column`` for q, ``kv_column`` for k). The mean over the whole width is
then the fp32 sum of squares over each rank's slice, all-reduced over the TP group (``Comm``'s
ordered fp32 sum), divided by the whole width: vLLM's ``MiniMaxText01RMSNormTP``. Where the KV heads
are fewer than the ranks, each KV head is held by tp / kv_heads ranks: only the first of them adds
its sum, so every head counts once. At tp = 1 it is transformers' RMSNorm, operation for operation
(the mean, not sum / width), so the logits are the same bits.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SumComm(Protocol):
    """What the whole-width norm needs of the tensor-parallel group (runtime/comm.py ``Comm``)."""

    tp: int
    tp_rank: int

    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor: ...


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over the first ``cos.shape[-1]`` dimensions of each head, the rest passed through and
    concatenated after them (every dimension when the tables are the head's width)."""
    n = cos.shape[-1]
    if n == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, rest = x[..., :n], x[..., n:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, rest], dim=-1)


def whole_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int, comm: SumComm, counted: bool,
               what: str) -> torch.Tensor:
    """RMSNorm of ``x`` [..., this rank's part of the width] as over the whole ``width``: the rank's
    fp32 sum of squares (zero when ``counted`` is false: another rank adds these heads) all-reduced
    over TP and divided by ``width``; at tp = 1 transformers' own mean."""
    dtype = x.dtype
    h = x.float()
    if comm.tp == 1:
        variance = h.pow(2).mean(-1, keepdim=True)
    else:
        squares = h.pow(2).sum(-1, keepdim=True)
        if not counted:
            squares = torch.zeros_like(squares)
        variance = comm.all_reduce_sum(squares, what) / width
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def whole_qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  heads: int, kv_heads: int, head_dim: int, comm: SumComm, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., local heads x head_dim] and k [..., local KV heads x head_dim] normed over all
    ``heads`` / ``kv_heads`` of the model (not this rank's: every rank's share is summed)."""
    copies = comm.tp // kv_heads if kv_heads < comm.tp else 1  # ranks holding each KV head
    q = whole_norm(q, q_weight, eps, heads * head_dim, comm, True, f"{what} (q norm)")
    k = whole_norm(k, k_weight, eps, kv_heads * head_dim, comm, comm.tp_rank % copies == 0, f"{what} (k norm)")
    return q, k
