"""Mixture-of-experts routing and gpt-oss's stacked expert, as transformers computes them: which
experts each token goes to and with what weight (the router is replicated, so every rank computes
the same choice), and one gpt-oss expert's clamped SwiGLU. runtime/decoder.py adds the experts a
rank holds and all-reduces (docs/architecture.md §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout.families.family import Moe
from .rankweights import MoeWeights


def route(moe: Moe, mw: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights, chosen expert ids) per token [tokens, top_k], by the family's scoring:
    DeepSeek-V3's grouped sigmoid, MiniMax-M2's sigmoid with a correction bias, gpt-oss's softmax
    over the top k logits (model dtype), or
    softmax then top k (renormalized when ``norm_topk``); in the logits' dtype unless ``weights_fp32``."""
    if moe.scoring == "sigmoid":
        logits, weights, chosen = grouped_route(moe, mw, x)
    elif moe.scoring == "sigmoid_bias":
        logits, weights, chosen = biased_route(moe, mw, x)
    elif moe.scoring == "topk_softmax":  # gpt-oss: softmax over the top k logits, model dtype
        logits = F.linear(x, mw.router, mw.router_bias)
        top, chosen = torch.topk(logits, moe.top_k, dim=-1)
        weights = F.softmax(top, dim=1, dtype=top.dtype)
    else:
        logits = F.linear(x, mw.router)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.weights_fp32:
        weights = weights.to(logits.dtype)
    return weights, chosen


def stacked_expert(moe: Moe, y: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                   down: torch.Tensor, down_bias: torch.Tensor | None) -> torch.Tensor:
    """One gpt-oss expert (transformers' GptOssExperts, operation for operation): x @ W + b,
    gate and up interleaved, the clamped SwiGLU, then down (its bias added when this rank
    adds it: the whole expert, or TP rank 0 of a split one)."""
    assert moe.swiglu is not None
    alpha, limit = moe.swiglu
    gu = y @ gate_up + gate_up_bias
    gate, up = gu[..., ::2].clamp(min=None, max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
    out = ((up + 1) * (gate * torch.sigmoid(gate * alpha))) @ down
    return out if down_bias is None else out + down_bias


def grouped_route(moe: Moe, mw: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, step for step, all in fp32):
    sigmoid scores; the correction bias added for the choice only; the best ``topk_groups``
    groups by the sum of their two best biased scores; top-k among their experts; the weights
    are the chosen experts' unbiased scores, renormalized when ``norm_topk``, times
    ``scaling``. Returns (logits, weights, chosen expert ids)."""
    assert mw.score_bias is not None
    e, g = moe.experts, moe.groups
    logits = F.linear(x.float(), mw.router.float())
    scores = logits.sigmoid()
    choice = scores + mw.score_bias.float()
    group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
    choice = choice.masked_fill(~keep.bool(), float("-inf"))
    chosen = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if moe.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * moe.scaling, chosen


def biased_route(moe: Moe, mw: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MiniMax-M2's router (transformers' MiniMaxM2TopKRouter, step for step): logits in the
    router's dtype (the model's: transformers keeps no fp32 copy), sigmoid scores in fp32, the
    correction bias (model dtype, promoted) added for the choice only, top-k, the chosen unbiased
    scores renormalized (always; no epsilon). Returns (logits, weights, chosen expert ids)."""
    assert mw.score_bias is not None
    logits = F.linear(x.to(mw.router.dtype), mw.router)
    scores = torch.sigmoid(logits.float())
    chosen = torch.topk(scores + mw.score_bias, moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    return logits, weights / weights.sum(dim=-1, keepdim=True), chosen
