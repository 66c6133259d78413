"""One candidate (tp, pp, dtype) worked out: per-GPU memory, KV figures, decode speed and cost.

The arithmetic of formulas.py applied to one replica shape, stage by stage: the fullest GPU sets
the memory verdict, the stage with the fewest KV blocks the KV capacity, the slowest stage the
decode step. A unit fits when every stage's KV pool (what vLLM would allocate, at most the cap)
holds the demand and the CUDA context and graphs fit in the headroom vLLM leaves outside its
budget (with a measured `kv_memory` pool: no GPU above the memory limit); the cap alone never rules
a unit out.
Weights come from the Layout of every family (weights.py), MLA ones included; LoRA adapters and a
draft model are sharded like the weights.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import LayoutError, QuantizationError
from ..layout.model import ModelSpec
from ..layout.plan import plan_from_dict
from .formulas import (
    ACT_BYTES,
    Workload,
    demand_tokens,
    demand_words,
    dollars_per_mtok,
    experts_touched,
    gpipe_bubble,
    indexer_key_bytes,
    kv_blocks,
    kv_bytes_per_token,
    lora_bytes_per_layer,
    mla_kv_bytes_per_token,
    rate_dtype,
    request_kv_bytes,
    ring_allreduce_s,
    round_to_blocks,
    sequences_at,
    vllm_allreduce_s,
)
from .gpus import GIB, fp8_fixed_us, rates
from .records import Candidate, Cost, GpuMemory, KvFigures, Search, Speed
from .serving import Step, choose, serving_at, sweep
from .weights import plan_dict, plan_name, rank_weights


def lora_bytes(model: Any, w: Workload, layers: int) -> int:
    """LoRA adapters of ``layers`` layers, whole (before the TP split)."""
    if not w.lora_adapters:
        return 0
    per = lora_bytes_per_layer(model.hidden_size, model.num_heads * model.head_dim,
                               model.num_kv_heads * model.head_dim, model.intermediate_size,
                               w.lora_adapters, w.lora_rank)
    return layers * per


def kv_bpt(model: ModelSpec, layers: int, tp: int, kv_bytes: int, first: int = 0) -> int:
    """KV bytes per token on one GPU holding ``layers`` layers from ``first``: K and V of its KV heads,
    or an MLA latent (kv_lora_rank + qk_rope_head_dim per layer), whole on every GPU whatever the TP,
    plus DSA's indexer key on each of those layers that runs its own indexer."""
    mla, hybrid = model.forward.mla, model.forward.hybrid
    if hybrid is not None:  # KV on the full-attention layers only; the linear ones hold a state (state_bytes)
        layers -= sum(hybrid.linear[first:first + layers])
    if mla is not None:
        bpt = mla_kv_bytes_per_token(layers, mla.kv_lora_rank, mla.rope, kv_bytes)
        if mla.indexer is not None:
            bpt += sum(mla.indexer.own[first:first + layers]) * indexer_key_bytes(mla.indexer.head_dim)
        return bpt
    return kv_bytes_per_token(layers, model.num_kv_heads, tp, model.head_dim, kv_bytes)


def state_bytes(model: ModelSpec, layers: int, tp: int, first: int = 0) -> int:
    """A hybrid model's fixed state per sequence on one GPU holding ``layers`` layers from ``first``
    (layout/families/hybrid.py ``Hybrid.state_bytes``); 0 for every other model."""
    x = model.forward.hybrid
    if x is None:
        return 0
    return x.state_bytes(sum(x.linear[first:first + layers]), tp, 4 if model.torch_dtype == "float32" else 2)


def sequences_with_state(blocks: int, budget: float, bpt: int, state: int, context: int, block: int) -> int:
    """Concurrent sequences of ``context`` tokens: what the KV blocks hold, and with a per-sequence
    state (hybrid models) what the budget holds of (the sequence's whole blocks + its state)."""
    kv_only = sequences_at(blocks, context, block)
    if not state:
        return kv_only
    return min(kv_only, math.floor(budget / (round_to_blocks(context, block) * bpt + state)))


def routing(model: ModelSpec) -> tuple[int, int]:
    """(experts a token is routed to, routed experts per MoE layer); (0, 0) for a dense model."""
    moe = model.forward.moe
    return (moe.top_k, moe.experts) if moe is not None else (0, 0)


def attn_flops(model: ModelSpec) -> int:
    """Attention FLOPs per layer, head and context token: q.k and p.v. MLA decodes in vLLM's
    absorbed form, against the latent: q.k over kv_lora_rank + rope, p.v over kv_lora_rank."""
    mla = model.forward.mla
    if mla is not None:
        return 2 * (mla.kv_lora_rank + mla.rope) + 2 * mla.kv_lora_rank
    return 4 * model.head_dim


def evaluate(s: Search, tp: int, pp: int, dtype: str) -> Candidate:
    c = Candidate(tp, pp, dtype)
    if tp * pp > s.cluster.total_gpus:
        c.reasons.append(f"tp x pp = {tp * pp} GPUs > the {s.cluster.total_gpus} available")
        return c
    try:
        c.plan = plan_from_dict(plan_dict(plan_name(s.model_name, tp, pp, dtype), s.source, tp, pp, dtype))
        c.weights = rank_weights(s.model, c.plan)
    except (LayoutError, QuantizationError) as exc:  # a split or a dtype this model cannot take
        c.reasons.append(exc.message)
        return c
    _memory(s, c)
    if not c.reasons:
        _speed(s, c)
    return c


def _memory(s: Search, c: Candidate) -> None:
    """Per-GPU memory of every stage, the KV figures of the replica, and the memory rules."""
    model, w, gpu = s.model, s.workload, s.cluster.gpu
    assert c.pp is not None  # evaluate's candidate, made with its pp
    world = c.tp * c.pp
    over, inside = s.overheads.per_gpu(world), s.overheads.in_budget(world)
    draft = -(-2 * s.draft_params // world)
    need = demand_tokens(w, model.max_position_embeddings)
    stages = []
    for st in range(c.pp):
        rw = max((r for r in c.weights if r.pp_stage == st), key=lambda r: r.nbytes)
        layers = rw.layers[1] - rw.layers[0]
        bpt = kv_bpt(model, layers, c.tp, w.kv_bytes, rw.layers[0])
        extra = -(-lora_bytes(model, w, layers) // c.tp) + draft
        avail = gpu.memory * w.gpu_memory_utilization - rw.nbytes - extra - inside
        budget = w.kv_memory if w.kv_memory is not None else min(w.cap, avail)
        stages.append(GpuMemory(st, gpu.memory, w.gpu_memory_utilization, rw.nbytes, over, bpt, avail, budget,
                                extra, inside, bpt * need))
    fullest = min(stages, key=lambda m: (m.kv_available, -m.kv_bytes_per_token))
    limiting = min(stages, key=lambda m: (kv_blocks(m.kv_budget, m.kv_bytes_per_token, w.block_size),
                                          -m.kv_bytes_per_token))
    blocks = kv_blocks(limiting.kv_budget, limiting.kv_bytes_per_token, w.block_size)
    bpt = max(m.kv_bytes_per_token for m in stages)
    req = w.max_model_len or model.max_position_embeddings
    tokens = blocks * w.block_size
    c.memory = fullest
    rl = max((r for r in c.weights if r.pp_stage == limiting.stage), key=lambda r: r.nbytes).layers
    state = state_bytes(model, rl[1] - rl[0], c.tp, rl[0])
    c.kv = KvFigures(bpt, limiting.kv_budget, blocks, tokens, min(tokens, max(req, model.max_position_embeddings)),
                     sequences_with_state(blocks, limiting.kv_budget, limiting.kv_bytes_per_token, state, w.context,
                                          w.block_size), req,
                     request_kv_bytes(bpt, req, w.block_size) + state, need, bpt * need, state)
    memory_reasons(s, c, stages, fullest, limiting, tokens, need, world)


def memory_reasons(s: Search, c: Candidate, stages: list[GpuMemory], fullest: GpuMemory, limiting: GpuMemory,
                   tokens: int, need: int, world: int, words: str | None = None,
                   limit_always: bool = False) -> None:
    """The memory rules, as reasons on ``c``: vLLM starts, the weights fit its budget, the pool holds
    the demand (``need`` tokens per GPU), and with a measured pool no GPU above the memory limit."""
    model, w, gpu = s.model, s.workload, s.cluster.gpu
    inside = s.overheads.in_budget(world)
    g = GIB
    outside, headroom = s.overheads.outside(world), gpu.memory * (1 - w.gpu_memory_utilization)
    if w.kv_memory is None and outside > headroom:  # vLLM's start check, and room for the graph capture
        c.reasons.append(
            f"vLLM would not start: CUDA context and graphs {outside / g:.2f} GiB > the {headroom / g:.2f} GiB "
            f"it leaves outside its budget ({gpu.memory / g:.2f} GiB x (1 - {w.gpu_memory_utilization:g}))")
    elif w.kv_memory is None and fullest.kv_available <= 0:
        c.reasons.append(
            f"does not fit: weights {fullest.weights / g:.2f} GiB + "
            + (f"LoRA/draft {fullest.extra / g:.2f} GiB + " if fullest.extra else "")
            + f"activations and NCCL {inside / g:.2f} GiB "
            f"> {fullest.usable / g:.2f} GiB usable ({gpu.memory / g:.2f} GiB x {w.gpu_memory_utilization:g})")
    elif tokens < need:
        m = limiting
        source = ("`kv_memory`" if w.kv_memory is not None else
                  f"the {w.cap / g:.2f} GiB cap" if w.cap <= m.kv_available else "what memory leaves")
        c.reasons.append(
            f"KV demand {m.kv_demand / g:.2f} GiB per GPU ({words or demand_words(w, model.max_position_embeddings)}: "
            f"{need:,} tokens) > the {m.kv_budget / g:.2f} GiB KV pool ({source}; it holds {tokens:,})")
    # The budget (total x utilization) bounds the pool, and the headroom check above the rest; a
    # measured pool (`kv_memory`) bypasses the budget, so the planner's own limit bounds the card.
    worst = max(stages, key=lambda m: m.used_fraction)
    if (w.kv_memory is not None or limit_always) and worst.used_fraction > s.speed.max_memory_fraction \
            and not c.reasons:
        c.reasons.append(f"GPU at {worst.used_fraction:.1%} of its memory "
                         f"(> {s.speed.max_memory_fraction:.0%}): no headroom")


def _speed(s: Search, c: Candidate) -> None:
    """The engine-step model of a TP x PP unit (GPipe over the stages), then the workload (serving.py)."""
    model, gpu, sp, w, cl = s.model, s.cluster.gpu, s.speed, s.workload, s.cluster
    tp, pp = c.tp, c.pp or 1
    link = gpu.link
    rate = rate_dtype(model, c.dtype or "")
    hbm_w, hbm_kv, flops = rates(gpu, rate, sp)
    heads, attn = model.num_heads // tp, attn_flops(model)
    stages = [max((r for r in c.weights if r.pp_stage == st), key=lambda r: r.read_bytes) for st in range(pp)]
    def allreduce(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
        measured = gpu.allreduce_s(n, nbytes)
        if measured is not None:  # the system's own measurement (GPU.allreduce), no link efficiency
            return measured
        if link.name.startswith("nvlink"):
            return vllm_allreduce_s(n, nbytes, bandwidth, latency, sp.two_stage_us)
        return ring_allreduce_s(n, nbytes, bandwidth, latency)

    def slot(d: float, p: float, plen: int) -> tuple[Step, int]:
        """One micro-batch of ``d`` decoding sequences and ``p`` prompt tokens through the slowest stage."""
        worst, where = Step(0.0, 0.0, 0.0, 0.0, 0.0), 0
        for st, rw in enumerate(stages):
            layers = rw.layers[1] - rw.layers[0]
            bpt = kv_bpt(model, layers, tp, w.kv_bytes, rw.layers[0])
            read: float = rw.read_bytes
            if rw.expert_bytes:  # MoE: a step reads the routed experts its tokens picked
                read -= rw.expert_bytes * (1 - experts_touched(d + p, *routing(model)))
            mem = read / hbm_w + d * w.context * bpt / hbm_kv
            comp = ((d + p) * 2 * rw.linear_params + layers * heads * attn * (d * w.context + p * plen / 2)) / flops
            comm = 2 * layers * allreduce(tp, (d + p) * model.hidden_size * ACT_BYTES,
                                          link.bandwidth * sp.link_efficiency, link.latency)
            if tp > 1 and not gpu.measures_allreduce(tp):  # each all-reduce's launch and barrier,
                comm += 2 * layers * sp.allreduce_overhead_us * 1e-6  # in a measured one's latency already
            if st < pp - 1:
                hop = link if cl.node_of(st * tp) == cl.node_of((st + 1) * tp) else cl.inter_node
                comm += (d + p) * model.hidden_size * ACT_BYTES / (hop.bandwidth * sp.link_efficiency) + hop.latency
            fixed = layers * (sp.layer_overhead_us + fp8_fixed_us(gpu, rate, sp, d + p)) * 1e-6
            one = Step(max(mem, comp) + comm + fixed, mem, comp, comm, fixed)
            if one.total > worst.total:
                worst, where = one, st
        return worst, where

    def micro(n: float) -> int:
        return max(1, min(sp.microbatches or pp, math.ceil(n)))

    def step(d: float, p: float, plen: int) -> Step:
        m = micro(d + (1 if p else 0))
        t, _ = slot(d / m, p / m, plen)
        return Step((m + pp - 1) * t.total + sp.step_overhead_ms * 1e-3, t.memory, t.compute, t.comm, t.fixed)

    kv = c.kv
    assert kv is not None
    cap = min(kv.sequences, sp.max_num_seqs)
    v, limited, ok = choose(step, cap, w, sp, c.gpus)
    c.curve = sweep(step, cap, w, sp, c.gpus)
    if limited == "cap":
        limited = "kv" if kv.sequences <= sp.max_num_seqs else "max_num_seqs"
    m = micro(v.concurrency)
    t, st = slot(v.concurrency / m, 0.0, v.isl)
    c.serving = v
    c.speed = Speed(v.concurrency, st, m, gpipe_bubble(pp, m), t.memory, t.compute, t.comm, t.fixed, t.total,
                    v.tpot_s, v.tokens_per_s, limited, serving_at(step, 1, w, sp, c.gpus).tpot_s, v.ttft_s,
                    v.requests_per_s, v.tokens_per_s_per_gpu)
    c.meets_target = ok
    c.cost = unit_cost(s, c.gpus, v.tokens_per_s)


def unit_cost(s: Search, world: int, tokens_per_s: float) -> Cost:
    """$/Mtok at the unit's serving throughput, and how many units a node, the cluster and the demand take."""
    w, cl = s.workload, s.cluster
    gpn, nodes = cl.gpus_per_node, cl.nodes
    per_node = gpn // world if world <= gpn else 0
    in_cluster = per_node * nodes if per_node else nodes // -(-world // gpn)
    need = math.ceil(w.demand_tokens_per_s / tokens_per_s) if w.demand_tokens_per_s else None
    return Cost(world, dollars_per_mtok(world, w.price_per_gpu_hour, tokens_per_s),
                world * 1e6 / (tokens_per_s * 3600), per_node, in_cluster, need,
                need * world if need is not None else None)
