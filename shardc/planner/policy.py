"""Which candidate to recommend: the objectives (fit, cost, latency) and the fastest alternative.

``fit`` (the default) follows the calculator rules users were promised, per weight dtype in
precision order (the checkpoint's 16-bit dtype first; int8/fp8 only when it fits nowhere):

1. Memory splits into what shards across GPUs (weights, LoRA adapters, a draft model and, for GQA
   and MHA models, the KV demand, by attention head) and what every GPU repeats (activations,
   framework overhead, the NCCL workspace; an MLA latent cache, whole on every GPU). The KV demand
   is what was asked: one request of the max model length, or ``concurrency`` requests. The KV cap
   (20 GiB per GPU shard) is a ceiling on the pool a unit allocates, never a reservation. One card
   first.
2. Minimum cards = ceil(sharded / room per card); the room is memory x gpu_memory_utilization less
   the overheads vLLM counts in it (activations, NCCL). The CUDA context and graphs must fit in the
   headroom, memory x (1 - utilization), or vLLM does not start (no unit fits). With a measured
   pool (``kv_memory``, which bypasses the budget as vLLM's kv_cache_memory_bytes does) the room is
   95% of the memory less every overhead.
3. TP = the smallest valid TP (divides the heads) >= that minimum, up to the fabric's limit; each
   step is judged with the full per-GPU arithmetic, and the next valid TP is tried if a card lands
   above the limits.
4. Only when no TP inside the fabric is enough: the largest valid TP, PP = ceil(minimum / TP), then
   deeper pipelines until one fits. The speed model charges the GPipe bubble.

With a user-given TPOT target the step must also meet it; without one, the default target only
sizes the batch, and a pick that misses it comes with a warning instead of an error (#17). ``cost``
is the cheapest $/Mtok meeting the target; ``latency`` the lowest TPOT at batch 1. Beside any pick:
the fastest alternative, the lowest-TPOT single-node TP unit of the same dtype with more cards, named
only when it is faster at batch 1 than the pick (more GPUs can be slower: all-reduce latency on a
small model).
"""

from __future__ import annotations

import math
from typing import Any

from ..layout.plan import plan_from_dict
from .candidate import kv_bpt, lora_bytes
from .formulas import DEFAULT_TPOT_MS, DTYPE_ORDER, demand_tokens, demand_words, min_cards
from .gpus import GIB
from .records import Candidate, FitTrail, Search
from .weights import plan_dict, rank_weights

OBJECTIVES = ("fit", "cost", "latency")
OBJECTIVE_WORDS = {
    "fit": "the smallest unit that fits (TP first, then stages)",
    "cost": "the cheapest $/Mtok meeting the TPOT target",
    "latency": "the lowest TPOT at batch 1",
}


def _dtype_rank(c: Candidate) -> int:
    return DTYPE_ORDER.index(c.dtype or "bf16")


def _verdict(c: Candidate, need_target: bool, target_ms: float) -> str:
    if c.reasons:
        return c.reasons[0]
    if c.skipped:
        return c.skipped
    used = f"fits: fullest GPU at {c.memory.used_fraction:.1%}" if c.memory else "fits"
    if need_target and not c.meets_target:
        tpot1 = c.require_speed().tpot1_s
        return f"{used}, but misses the {target_ms:g} ms target ({tpot1 * 1e3:.1f} ms at batch 1)"
    return used


def _fit(s: Search) -> Candidate | None:
    """Rules 1-4 per dtype in precision order; the trail of every dtype walked goes to s.trails."""
    w = s.workload
    need = w.target_set
    for d in sorted(s.dtypes, key=DTYPE_ORDER.index):
        mine = {(c.tp, c.pp): c for c in s.candidates if c.dtype == d and c.pp is not None and c.ep == 1}
        ladder = sorted((c for c in s.candidates if c.dtype == d and c.ep > 1), key=lambda c: c.ep)
        trail = fit_trail(s, d)
        s.trails.append(trail)
        _rejected(trail, mine.values())
        if w.kv_memory is None and trail.outside > trail.headroom:
            trail.steps.append(("*", f"the CUDA context and graphs ({trail.outside / GIB:.2f} GiB) do not fit the "
                                f"{trail.headroom / GIB:.2f} GiB headroom: vLLM would not start"))
            continue
        if trail.minimum is None:
            trail.steps.append(("*", "the replicated part alone fills a card: no unit fits"))
            continue
        one = mine.get((1, 1))
        if ladder and not (trail.minimum == 1 and one is not None and one.fits):  # one card beats EP
            for c in ladder:
                verdict = _verdict(c, need, w.target_ms)
                mem = c.memory
                trail.ep_ladder.append((c.label, mem.weights if mem else 0, mem.used if mem else 0.0, verdict))
                if c.fits and not c.skipped and (c.meets_target or not need):
                    trail.chosen = c.label
                    _rejected(trail, mine.values(), c.gpus)
                    return c
        tps = sorted(tp for tp, pp in mine if pp == 1)
        for tp in (t for t in tps if t >= trail.minimum):
            c = mine[tp, 1]
            trail.steps.append((c.label, _verdict(c, need, w.target_ms)))
            if c.fits and not c.skipped and (c.meets_target or not need):
                trail.chosen = c.label
                _rejected(trail, mine.values(), tp)
                return c
        # stages go with the largest TP first; a TP whose staged units all exceed the GPUs there are
        # (never worked out: kimi-k2 on 8 GPUs, whose tp=8 would need 16 for two stages) is passed over
        staged = sorted({tp for (tp, pp), c in mine.items() if pp > 1 and c.memory is not None}, reverse=True)
        for tp in staged:
            # the card minimum counts an MLA latent whole on every GPU, as TP holds it; stages split it
            # by layers, so with MLA it bounds nothing here (kimi-k2 on 8 x H200: 9 cards by the
            # minimum, yet tp=4 pp=2 fits) and every stage count is tried
            start = 2 if s.model.forward.mla is not None else max(2, math.ceil(trail.minimum / tp))
            for pp in sorted(p for t, p in mine if t == tp and p >= start):
                c = mine[tp, pp]
                trail.steps.append((c.label, _verdict(c, need, w.target_ms)))
                if c.fits and not c.skipped and (c.meets_target or not need):
                    trail.chosen = c.label
                    _rejected(trail, mine.values(), tp * pp)
                    return c
    if not need:  # a unit fits that the card minimum ruled out: never "no recommendation" for it
        fitting = [c for c in s.fitting() if not c.skipped]
        rec = min(fitting, key=lambda c: (DTYPE_ORDER.index(c.dtype), c.gpus, -c.tp), default=None)
        if rec is not None:
            for trail in (t for t in s.trails if t.dtype == rec.dtype):
                trail.steps.append((rec.label, "fits, below the card minimum: the fewest GPUs that fit"))
                trail.chosen = rec.label
        return rec
    return None


def _rejected(trail: FitTrail, cands: Any, cards: int | None = None) -> None:
    """Every worked-out unit with fewer cards than ``cards`` (None: all), and why it is not the pick:
    its first reason, or, for one that fits, the rule that passed over it (rules 2 and 4)."""
    out = [c for c in cands if c.memory is not None and (cards is None or c.tp * c.pp < cards)]
    trail.rejected = [(c.label, _why_not(trail, c)) for c in sorted(out, key=lambda c: (c.tp * c.pp, c.pp))]


def _why_not(trail: FitTrail, c: Candidate) -> str:
    if c.reasons:
        return c.reasons[0]
    if c.pp == 1:
        return f"fits, but below the minimum of {trail.minimum} cards the fit rules start from"
    return "fits, but stages go with the largest valid TP first (TP first, then PP)"


def _fastest(cands: list[Candidate]) -> Candidate | None:
    return min(cands, key=lambda c: (c.require_speed().tpot1_s, c.gpus, _dtype_rank(c)), default=None)


def _dollars_per_mtok(c: Candidate) -> float:
    assert c.cost is not None  # worked out with the speed, which every unit that fits has
    return c.cost.dollars_per_mtok


def recommend(s: Search) -> None:
    """Set s.recommended, s.alternative and s.warnings for s.objective."""
    w = s.workload
    fitting = [c for c in s.fitting() if not c.skipped]
    meeting = [c for c in fitting if c.meets_target]
    if s.objective == "fit":
        rec = _fit(s)
    elif s.objective == "cost":
        rec = min(meeting, key=lambda c: (round(_dollars_per_mtok(c), 9), c.tp, c.pp, _dtype_rank(c)),
                  default=None)
        if rec is None and not w.target_set and fitting:
            rec = _fastest(fitting)
            assert rec is not None  # of a non-empty list
            s.warnings.append(
                f"no candidate meets the default {DEFAULT_TPOT_MS:g} ms TPOT target; recommending the fastest "
                f"that fits, {rec.label} ({rec.require_speed().tpot1_s * 1e3:.1f} ms at batch 1); give "
                "`target_tpot_ms` to require a target")
    else:
        rec = _fastest(meeting if w.target_set else fitting)
    s.recommended = rec
    if rec is None:
        return
    speed = rec.require_speed()
    if not rec.meets_target and not s.warnings:
        s.warnings.append(
            f"{rec.label} misses the default {DEFAULT_TPOT_MS:g} ms TPOT target ({speed.tpot_s * 1e3:.1f} ms "
            f"at concurrency {speed.batch}, the figures' concurrency"
            + (f"; {speed.tpot1_s * 1e3:.1f} ms at batch 1" if speed.batch > 1 else "")
            + f"); recommended anyway as {OBJECTIVE_WORDS[s.objective]}, since no `target_tpot_ms` was given")
    cards, tpot1 = rec.gpus, speed.tpot1_s
    # more GPUs are only worth naming when faster
    s.alternative = _fastest([c for c in fitting if c.pp == 1 and c.dtype == rec.dtype and c.tp > cards
                              and c.require_speed().tpot1_s < tpot1])


def fit_trail(s: Search, dtype: str) -> FitTrail:
    """Rules 1 and 2 for one dtype: sharded and replicated memory, and the minimum card count.

    Sharded: weights, LoRA, the draft model and (GQA/MHA) the KV demand, whole, which TP splits
    by KV head; an MLA latent is whole on every GPU, so its demand is replicated. Replicated: the
    overheads. A card's room is what vLLM's budget (memory x utilization) leaves after the
    in-budget overheads; the CUDA context and graphs must fit in the headroom outside it. With a
    measured pool (`kv_memory`) the room is what the 95% limit leaves after every overhead.
    """
    w, sp, gpu, ov = s.workload, s.speed, s.cluster.gpu, s.overheads
    weights = rank_weights(s.model, plan_from_dict(plan_dict("probe", "src", 1, 1, dtype)))[0].nbytes
    lora = lora_bytes(s.model, w, s.model.num_layers)
    need = demand_tokens(w, s.model.max_position_embeddings)
    kv = need * kv_bpt(s.model, s.model.num_layers, 1, w.kv_bytes)
    kv_sharded, kv_rep = (0, kv) if s.model.forward.mla is not None else (kv, 0)
    if w.kv_memory is not None:  # the measured pool is a fixed block on every GPU; the demand is in it
        kv_sharded, kv_rep = 0, int(w.kv_memory)
    usable, limit = gpu.memory * w.gpu_memory_utilization, gpu.memory * sp.max_memory_fraction

    def room(world: int) -> float:
        if w.kv_memory is not None:  # the engine measured it: only the memory limit applies
            return limit - sum(ov.per_gpu(world).values()) - kv_rep
        return usable - ov.in_budget(world) - kv_rep  # the context and graphs sit in the headroom

    sharded = weights + lora + 2 * s.draft_params + kv_sharded
    one, many = room(1), room(2)
    minimum = 1 if sharded <= one else min_cards(sharded, many, 0)
    valid = sorted({c.tp for c in s.candidates if c.dtype == dtype and c.pp == 1})
    return FitTrail(dtype, weights, lora, 2 * s.draft_params, kv_sharded, kv_rep, need,
                    demand_words(w, s.model.max_position_embeddings), usable, limit,
                    ov.in_budget(2), sum(ov.per_gpu(2).values()), many, one, minimum,
                    s.cluster.tp_limit, valid, ov.outside(2), gpu.memory - usable)
