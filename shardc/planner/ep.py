"""Expert parallelism (EP) for mixture-of-experts models: the EP ladder and one EP unit worked out.

An EP unit of N GPUs is the plan ``dp_degree: N, tp_degree: 1, expert_parallel: true``: every GPU
holds all non-expert weights whole (attention, norms, router, shared experts, dense MLP layers,
embeddings) and its block of the routed experts, vLLM's linear placement (rank r holds experts
[r·E/N, (r+1)·E/N), the remainder to the first ranks), so the largest rank, rank 0, holds
ceil(E/N) of them and sets the memory verdict. The bytes come from the family's tensor table
through the Layout of a tp=1 probe (one layer of each kind, sparse or dense): the rows with an
``expert`` id are counted per expert, everything else whole (DeepSeek-V3's MLA projections too).

The KV cache is split by request (attention data parallelism): each rank keeps the KV of
ceil(streams / N) streams, whole (every KV head, every layer; an MLA latent is whole anyway); one
stream's KV never splits, so one request of the max model length must fit on one GPU.

The ladder: N = 2, 4, 8, ... up to min(routed experts, the fabric's EP domain). The EP domain is
the NVLink domain the TP limit names (a node of 8 on the presets, 4 on PCIe): an EP group's
all-to-all stays on the fabric inside a node, so EP beyond 8 GPUs is only tried on a rack-scale
NVLink domain (``--gpus-per-node`` above 8, an NVL72 say). policy.py takes the smallest N that
fits (and leaves no GPU above 95 %); if none does, the dense TP/PP path.

Speed (approximate; ``ep_slot`` is one engine step, serving.py schedules the workload on it as
for a dense unit): per step a GPU streams its
non-expert weights and, of its own experts, the share a batch of B tokens routes to, 1 - (1 -
k/E)^B (uniform routing: at B = 1, k of E experts per token spread over N GPUs, k/N experts each),
plus the KV of its ceil(B / N) streams; compute is its streams' dense and attention FLOPs plus B·k/N
tokens through one expert; each MoE layer costs two all-to-alls (dispatch and combine) of the
rank's tokens x k x hidden x 2 B over the node's link. Load imbalance between experts, the
dispatch kernels' own cost and DP ranks waiting for each other are not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import LayoutError, PlanError, QuantizationError
from ..layout.model import ModelSpec
from ..layout.plan import plan_from_dict
from ..layout.ranks import build_layout, check_degrees
from ..layout.tensors import STACKED, layer_of, tensor_table
from .candidate import (
    Candidate,
    attn_flops,
    kv_bpt,
    lora_bytes,
    memory_reasons,
    routing,
    sequences_with_state,
    state_bytes,
    unit_cost,
)
from .formulas import (
    ACT_BYTES,
    Workload,
    all_to_all_s,
    experts_touched,
    kv_blocks,
    rate_dtype,
    request_kv_bytes,
    request_tokens,
    round_to_blocks,
)
from .gpus import GIB, fp8_fixed_us, rates
from .records import GpuMemory, KvFigures, Search, Speed
from .serving import Step, choose, serving_at, sweep
from .weights import RankWeights, layer_kinds, plan_dict, plan_name


def linear_block(experts: int, ranks: int, r: int) -> range:
    """The experts rank ``r`` of ``ranks`` holds: vLLM's linear placement (spec Moe.owner's rule)."""
    base, extra = divmod(experts, ranks)
    start = r * base + min(r, extra)
    return range(start, start + base + (1 if r < extra else 0))


@dataclass(frozen=True)
class EpWeights:
    """One model at one dtype, split into what every EP rank holds whole and the routed experts."""

    dtype: str
    experts: int  # routed experts per MoE layer
    top_k: int
    moe_layers: int
    layers: int
    base_bytes: int  # stored bytes of everything but the routed experts: whole on every EP rank
    base_read: int  # of those, streamed per decode step (all but the embedding lookup)
    base_linear: int  # matmul elements of those: 2 FLOPs each per token
    expert_bytes: tuple[int, ...]  # per expert id: its stored bytes over every MoE layer
    expert_linear: int  # matmul elements of one expert over every MoE layer

    def rank_weights(self, n: int) -> list[RankWeights]:
        out = []
        for r in range(n):
            held = linear_block(self.experts, n, r)
            eb = sum(self.expert_bytes[e] for e in held)
            out.append(RankWeights(r, 0, (0, self.layers), self.base_bytes + eb, self.base_read + eb,
                                   self.base_linear + len(held) * self.expert_linear, 0, eb))
        return out


def ep_weights(model: ModelSpec, dtype: str) -> EpWeights:
    """The split, from the Layout of a tp=1 probe with one layer of each kind (sparse or dense)."""
    k, experts = routing(model)
    moe = model.forward.moe
    assert moe is not None  # asked for MoE models only (search.py: when routing() finds experts)
    kinds = layer_kinds(model)
    first = {kind: kinds.index(kind) for kind in set(kinds)}  # one probe layer of each kind
    probe = dataclasses.replace(model, num_layers=max(first.values()) + 1)
    plan = plan_from_dict(plan_dict("probe", "src", 1, 1, dtype))
    check_degrees(model, plan)
    table = tensor_table(probe)
    base = read = linear = 0
    per = [0] * experts
    elems = [0] * experts
    for t in build_layout(probe, plan).ranks[0].tensors:
        layer = layer_of(t.name)
        if layer is not None and layer != first[kinds[layer]]:
            continue
        mult = 1 if layer is None else kinds.count(kinds[layer])
        streamed = t.name != model.forward.names.embed or model.tie_word_embeddings
        matrix = len(t.shape) == 2 or t.split == STACKED and len(t.shape) == 3
        mm = math.prod(t.shape) * (t.pack or 1) if streamed and matrix and t.scale_of is None else 0
        row = table.get(t.source)
        if row is not None and row.expert is not None:
            per[row.expert] += mult * t.nbytes
            elems[row.expert] += mult * mm
            continue
        if t.split == STACKED:  # every expert's tensor in one (gpt-oss): an equal share each
            for e in range(experts):
                per[e] += mult * t.nbytes // experts
                elems[e] += mult * mm // experts
            continue
        base += mult * t.nbytes
        read += mult * t.nbytes if streamed else 0
        linear += mult * mm
    return EpWeights(dtype, experts, k, sum(moe.sparse), model.num_layers, base, read, linear, tuple(per), max(elems))


def ep_degrees(s: Search) -> list[int]:
    """The EP ladder: powers of two from 2 up to min(routed experts, the fabric's EP domain, the GPUs)."""
    experts = routing(s.model)[1]
    top = min(experts, s.cluster.tp_limit, s.cluster.total_gpus)
    out, n = [], 2
    while n <= top:
        out.append(n)
        n *= 2
    return out


def ep_demand_tokens(w: Workload, max_position: int, n: int) -> int:
    """KV tokens one EP rank must hold: one request of the max model length (a stream's KV never
    splits), or the ceil(concurrency / n) requests that rank serves, each paged in whole blocks."""
    length = w.max_model_len or max_position
    each = request_tokens(w, length)
    streams = -(-w.requests // n)
    return max(round_to_blocks(length, w.block_size), streams * round_to_blocks(each, w.block_size))


def ep_demand_words(w: Workload, max_position: int, n: int) -> str:
    length = w.max_model_len or max_position
    each = request_tokens(w, length)
    streams = -(-w.requests // n)
    if streams * round_to_blocks(each, w.block_size) > round_to_blocks(length, w.block_size):
        return f"ceil({w.requests} / {n}) = {streams} requests of {each:,} tokens on each GPU"
    one = f"one {length:,}-token request on one GPU"
    return one if streams == 1 else f"{one}, which covers ceil({w.requests} / {n}) = {streams} x {each:,} tokens"


def evaluate_ep(s: Search, n: int, dtype: str, ew: EpWeights | str) -> Candidate:
    """One EP unit of ``n`` GPUs at ``dtype`` (``ew``: its weights, or why the model has none)."""
    c = Candidate(1, 1, dtype, ep=n, dp=n)
    if isinstance(ew, str):
        c.reasons.append(ew)
        return c
    c.ep_detail = ew
    try:
        c.plan = plan_from_dict(plan_dict(plan_name(s.model_name, 1, 1, dtype, n), s.source, 1, 1, dtype, dp=n))
        check_degrees(s.model, c.plan)
    except (LayoutError, PlanError) as exc:
        c.reasons.append(exc.message)
        return c
    c.weights = ew.rank_weights(n)
    _memory(s, c)
    if not c.reasons:
        _speed(s, c)
    return c


def weights_for(s: Search, dtype: str) -> EpWeights | str:
    try:
        return ep_weights(s.model, dtype)
    except (LayoutError, QuantizationError) as exc:
        return exc.message


def _memory(s: Search, c: Candidate) -> None:
    model, w, gpu, n = s.model, s.workload, s.cluster.gpu, c.ep
    over, inside = s.overheads.per_gpu(n), s.overheads.in_budget(n)
    rw = max(c.weights, key=lambda r: r.nbytes)  # rank 0: the remainder experts go to the first ranks
    layers = model.num_layers
    bpt = kv_bpt(model, layers, 1, w.kv_bytes)  # every KV head of every layer: the KV splits by request
    extra = lora_bytes(model, w, layers) + 2 * s.draft_params  # whole on every DP rank
    avail = gpu.memory * w.gpu_memory_utilization - rw.nbytes - extra - inside
    budget = w.kv_memory if w.kv_memory is not None else min(w.cap, avail)
    need = ep_demand_tokens(w, model.max_position_embeddings, n)
    mem = GpuMemory(0, gpu.memory, w.gpu_memory_utilization, rw.nbytes, over, bpt, avail, budget, extra, inside,
                    bpt * need)
    blocks = kv_blocks(budget, bpt, w.block_size)
    tokens = blocks * w.block_size
    req = w.max_model_len or model.max_position_embeddings
    c.memory = mem
    state = state_bytes(model, layers, 1)
    c.kv = KvFigures(bpt, budget, blocks, tokens, min(tokens, max(req, model.max_position_embeddings)),
                     n * sequences_with_state(blocks, budget, bpt, state, w.context, w.block_size), req,
                     request_kv_bytes(bpt, req, w.block_size) + state, need, bpt * need, state)
    before = len(c.reasons)
    memory_reasons(s, c, [mem], mem, mem, tokens, need, n,
                   words=ep_demand_words(w, model.max_position_embeddings, n), limit_always=True)
    where = fullest_words(c.ep_detail.experts, n, c.weights) if c.ep_detail else None
    if where:  # a verdict on the fullest rank's figures says so: the other ranks hold less
        c.reasons[before:] = [r if r.startswith("vLLM would not start") else f"{r} {where}"
                              for r in c.reasons[before:]]


def fullest_words(experts: int, n: int, weights: list[RankWeights]) -> str | None:
    """Which ranks a memory verdict is about when ``experts`` do not split evenly over ``n`` ranks
    (60 over 8: ranks 0-3 hold 8, ranks 4-7 hold 7): the verdict is the fullest ranks', and the line
    says so with the others' weights, so no one reads it as every rank's or the mean's. None when
    every rank holds the same."""
    base, extra = divmod(experts, n)
    if extra == 0:
        return None
    full = "rank 0" if extra == 1 else f"ranks 0-{extra - 1}"
    rest = f"rank {extra} holds" if extra == n - 1 else f"ranks {extra}-{n - 1} hold"
    return (f"on {full}, the fullest ({base + 1} of the {experts} experts{' each' if extra > 1 else ''}; "
            f"{rest} {base}: weights {weights[-1].nbytes / GIB:.2f} GiB)")


def ep_slot(s: Search, c: Candidate, d: float, p: float = 0.0, plen: int = 0) -> Step:
    """One engine step of the unit with ``d`` decoding sequences and ``p`` prompt tokens (spread over
    the DP ranks): the fullest rank's HBM reads, FLOPs, all-to-alls and fixed overheads."""
    model, gpu, sp, w = s.model, s.cluster.gpu, s.speed, s.workload
    ew, n = c.ep_detail, c.ep
    rw = max(c.weights, key=lambda r: r.nbytes)
    held = len(linear_block(ew.experts, n, 0))
    hbm_w, hbm_kv, flops = rates(gpu, rate_dtype(s.model, c.dtype or ""), sp)
    local, local_p = math.ceil(d / n), p / n  # streams and prompt tokens on the fullest rank
    bpt = kv_bpt(model, model.num_layers, 1, w.kv_bytes)
    share = experts_touched(d + p, ew.top_k, ew.experts)
    read = rw.read_bytes - rw.expert_bytes * (1 - share)
    mem = read / hbm_w + local * w.context * bpt / hbm_kv
    routed = (d + p) * ew.top_k * held / ew.experts  # token-expert pairs this rank computes
    attn = model.num_layers * model.num_heads * attn_flops(model) * (local * w.context + local_p * plen / 2)
    comp = ((local + local_p) * 2 * ew.base_linear + attn + routed * 2 * ew.expert_linear) / flops
    link = gpu.link
    a2a = 2 * ew.moe_layers * all_to_all_s(n, (local + local_p) * ew.top_k * model.hidden_size * ACT_BYTES,
                                           link.bandwidth * sp.link_efficiency, link.latency)
    fp8_us = fp8_fixed_us(gpu, rate_dtype(s.model, c.dtype or ""), sp, local + local_p)
    fixed = model.num_layers * (sp.layer_overhead_us + fp8_us) * 1e-6
    return Step(max(mem, comp) + a2a + fixed + sp.step_overhead_ms * 1e-3, mem, comp, a2a, fixed)


def _speed(s: Search, c: Candidate) -> None:
    sp, w, n = s.speed, s.workload, c.ep

    def step(d: float, p: float, plen: int) -> Step:
        return ep_slot(s, c, d, p, plen)

    kv = c.kv
    assert kv is not None
    most = n * sp.max_num_seqs  # every DP rank schedules its own max_num_seqs
    v, limited, ok = choose(step, min(kv.sequences, most), w, sp, n)
    c.curve = sweep(step, min(kv.sequences, most), w, sp, n)
    if limited == "cap":
        limited = "kv" if kv.sequences <= most else "max_num_seqs"
    t = ep_slot(s, c, v.concurrency, 0.0, v.isl)
    c.serving = v
    c.speed = Speed(v.concurrency, 0, 1, 0.0, t.memory, t.compute, t.comm, t.fixed, t.total, v.tpot_s,
                    v.tokens_per_s, limited, serving_at(step, 1, w, sp, n).tpot_s, v.ttft_s, v.requests_per_s,
                    v.tokens_per_s_per_gpu)
    c.meets_target = ok
    c.cost = unit_cost(s, n, v.tokens_per_s)
