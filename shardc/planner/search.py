"""Candidate search: every (tp, pp, dtype) the cluster allows, judged with formulas.py's arithmetic.

Rules, in order: tp stays inside one node and within the fabric's TP limit (the NVLink domain; 4 on
PCIe) and satisfies the head rules of the Layout; pp stays within the layer count; tp x pp fits the
GPUs available. A candidate fits when every GPU holds its weights (plus LoRA adapters and a draft
model), the overheads and the KV cap, with no GPU above 95% of its memory. Tensor parallelism comes
first: a dtype's pipeline candidates are only worked out when none of its pp = 1 candidates fits.
policy.py picks among the candidates for the objective. Infeasible candidates keep their reasons,
so the table can say why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import LayoutError, PlanError
from ..spec.layout import check_degrees
from ..spec.model import ModelSpec
from ..spec.plan import DTYPES, Plan, plan_from_dict
from .formulas import (
    ACT_BYTES,
    Cost,
    GpuMemory,
    KvFigures,
    Overheads,
    RankWeights,
    Speed,
    SpeedParams,
    Workload,
    check_inputs,
    dollars_per_mtok,
    gpipe_bubble,
    kv_blocks,
    kv_bytes_per_token,
    lora_bytes_per_layer,
    min_cards,
    mla_kv_bytes_per_token,
    param_count,
    plan_dict,
    plan_name,
    rank_weights,
    request_kv_bytes,
    ring_allreduce_s,
    round_to_blocks,
    sequences_at,
)
from .gpus import GIB, Cluster
from .mla import MlaModel, experts_touched, mla_rank_weights, mla_tp_problems
from .policy import OBJECTIVES, FitTrail, recommend


@dataclass
class Candidate:
    """One (tp, pp, dtype): its figures when it was worked out, else the reasons it is out."""

    tp: int
    pp: int | None  # None: the reason holds for every pp and dtype at this tp
    dtype: str | None
    reasons: list[str] = field(default_factory=list)
    skipped: str | None = None
    plan: Plan | None = None
    weights: list[RankWeights] = field(default_factory=list)
    memory: GpuMemory | None = None
    kv: KvFigures | None = None
    speed: Speed | None = None
    cost: Cost | None = None
    meets_target: bool = False

    @property
    def fits(self) -> bool:
        return not self.reasons and self.kv is not None

    @property
    def status(self) -> str:
        if self.reasons:
            return "infeasible"
        if self.skipped:
            return "skipped"
        return "ok" if self.meets_target else "slow"

    @property
    def label(self) -> str:
        return f"tp={self.tp} pp={self.pp if self.pp else '*'} {self.dtype or '*'}"

    def to_json(self) -> dict[str, Any]:
        """Every figure of the candidate, plain JSON types."""
        out: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "dtype": self.dtype, "status": self.status,
            "reasons": self.reasons, "skipped": self.skipped,
            "gpus": self.tp * self.pp if self.pp else None,
        }
        for name in ("memory", "kv", "speed", "cost"):
            part = getattr(self, name)
            out[name] = dataclasses.asdict(part) if part is not None else None
        if self.memory is not None:
            m = self.memory
            out["memory"].update(usable=m.usable, overhead=m.overhead, used=m.used, used_fraction=m.used_fraction)
        out["ranks"] = [dataclasses.asdict(w) for w in self.weights]
        return out


@dataclass
class Search:
    """The inputs, every candidate with its figures or reasons, and the recommendation."""

    model: Any  # a ModelSpec (Llama family, buildable) or an MlaModel (advisory)
    model_name: str
    source: str
    cluster: Cluster
    workload: Workload
    overheads: Overheads
    speed: SpeedParams
    dtypes: tuple[str, ...]
    params: int
    candidates: list[Candidate]
    recommended: Candidate | None = None
    objective: str = "fit"
    draft_params: int = 0  # the draft model's parameters (16-bit, sharded like the weights)
    alternative: Candidate | None = None  # the fastest single-node TP unit with more cards
    warnings: list[str] = field(default_factory=list)
    trails: list[FitTrail] = field(default_factory=list)

    @property
    def advisory(self) -> str | None:
        """Why no plan file can be written for this model (None: `shardc build` compiles it)."""
        if isinstance(self.model, ModelSpec):
            return None
        return (f"{self.model_name} ({self.model.architecture}) is not Llama-family: `shardc build` cannot "
                "compile it, so these figures are an advisory estimate")

    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    def require_recommendation(self) -> Candidate:
        """The pick, or one PlanError line that names the nearest miss and what would help."""
        if self.recommended is not None:
            return self.recommended
        where = f"{self.cluster.total_gpus} x {self.cluster.gpu.name}"
        fitting = [c for c in self.fitting() if not c.skipped]
        if fitting:
            fastest = min(fitting, key=lambda c: c.speed.tpot1_s if c.speed else math.inf)
            tpot = fastest.speed.tpot1_s * 1e3 if fastest.speed else math.inf
            raise PlanError(
                f"no candidate on {where} meets the TPOT target of {self.workload.target_ms:g} ms: "
                f"the fastest, {fastest.label}, needs {tpot:.1f} ms per token even at batch 1",
                key="target_tpot_ms",
                hint="raise `target_tpot_ms`, add GPUs (`nodes`) or pick a faster `gpu`",
            )
        tried = [c for c in self.candidates if c.memory is not None]
        if tried:
            near = max(tried, key=lambda c: (c.memory.kv_available, -c.tp * (c.pp or 1)))
            detail = f"closest is {near.label}: {near.reasons[0]}"
        else:
            near = self.candidates[0] if self.candidates else None
            detail = near.reasons[0] if near else "no tp/pp combination fits the GPU count"
        raise PlanError(
            f"{self.model_name} fits no candidate on {where}; {detail}",
            key="model",
            hint="add GPUs (`nodes`), lower `kv_cache_cap` or `max_model_len`, "
            + ("" if {"int8", "fp8"} & set(self.dtypes) else "try `dtype` int8 or fp8, ")
            + "or pick a larger `gpu`",
        )

    def plan_for(self, cand: Candidate, source: str | None = None) -> dict[str, Any]:
        """The plan file for a fitting candidate; plan_from_dict validates it before it is returned."""
        assert cand.pp is not None and cand.dtype is not None and cand.speed is not None
        if self.advisory:
            raise PlanError(f"no plan file: {self.advisory}", key="model",
                            hint="shardc build compiles Llama-family checkpoints only")
        data = plan_dict(
            plan_name(self.model_name, cand.tp, cand.pp, cand.dtype), source or self.source, cand.tp,
            cand.pp, cand.dtype, kv_cache_cap_gib=round(self.workload.cap / GIB, 2),
            max_concurrent_sequences=cand.speed.batch,
        )
        plan_from_dict(data)
        return data

    def fit_trail(self, dtype: str) -> FitTrail:
        """Rules 1 and 2 for one dtype: sharded and replicated memory, and the minimum card count."""
        w, sp, gpu = self.workload, self.speed, self.cluster.gpu
        if isinstance(self.model, MlaModel):
            weights = mla_rank_weights(self.model, 1, 1, dtype, [(0, self.model.num_layers)])[0].nbytes
        else:
            weights = rank_weights(self.model, plan_from_dict(plan_dict("probe", "src", 1, 1, dtype)))[0].nbytes
        lora = _lora_bytes(self.model, w, self.model.num_layers)
        if w.kv_memory is not None:
            per_card, kv = gpu.memory * sp.max_memory_fraction, w.kv_memory
        else:
            per_card, kv = gpu.memory * min(w.gpu_memory_utilization, sp.max_memory_fraction), w.cap
        one = int(sum(self.overheads.per_gpu(1).values()) + kv)
        many = int(sum(self.overheads.per_gpu(2).values()) + kv)
        sharded = weights + lora + 2 * self.draft_params
        minimum = 1 if sharded <= per_card - one else min_cards(sharded, per_card, many)
        valid = sorted({c.tp for c in self.candidates if c.dtype == dtype and c.pp == 1})
        return FitTrail(dtype, weights, lora, 2 * self.draft_params, per_card, many, one, minimum,
                        self.cluster.tp_limit, valid)

    def to_json(self) -> dict[str, Any]:
        rec, alt = self.recommended, self.alternative
        gpu, cl = self.cluster.gpu, self.cluster
        return {
            "model": {"name": self.model_name, "source": self.source, "params": self.params,
                      **self.model.summary()},
            "hardware": {
                "gpu": dataclasses.asdict(gpu), "gpus_per_node": cl.gpus_per_node,
                "nodes": cl.nodes, "inter_node": dataclasses.asdict(cl.inter_node),
                "fabric": {"link": gpu.link.name, "tp_limit": cl.tp_limit, "calibrated": cl.calibrated,
                           "description": cl.fabric()},
            },
            "workload": {**dataclasses.asdict(self.workload), "cap": self.workload.cap,
                         "target_ms": self.workload.target_ms, "draft_params": self.draft_params},
            "parameters": {"overheads": dataclasses.asdict(self.overheads),
                           "speed": dataclasses.asdict(self.speed)},
            "dtypes": list(self.dtypes),
            "objective": self.objective,
            "candidates": [c.to_json() for c in self.candidates],
            "recommended": self.candidates.index(rec) if rec is not None else None,
            "alternative": self.candidates.index(alt) if alt is not None else None,
            "fit": [t.to_json() for t in self.trails],
            "warnings": list(self.warnings),
            "advisory": self.advisory,
            "plan": self.plan_for(rec) if rec is not None and not self.advisory else None,
        }


def default_dtypes(model: Any) -> tuple[str, ...]:
    """--dtype auto: the checkpoint's 16-bit dtype and both 8-bit weight formats."""
    return ("fp16" if model.torch_dtype == "float16" else "bf16", "int8", "fp8")


def search(
    model: Any,
    cluster: Cluster,
    workload: Workload | None = None,
    *,
    dtypes: Sequence[str] | None = None,
    tps: Sequence[int] | None = None,
    pps: Sequence[int] | None = None,
    overheads: Overheads | None = None,
    speed: SpeedParams | None = None,
    model_name: str = "model",
    source: str = "",
    objective: str = "fit",
    draft: Any = None,
) -> Search:
    """Judge every candidate and pick one for ``objective`` (fit, cost or latency). ``tps``/``pps``
    restrict the search (e.g. to reproduce); ``draft`` is a speculative-decoding draft model."""
    w, ov, sp = workload or Workload(), overheads or Overheads(), speed or SpeedParams()
    check_inputs(model, cluster, w, sp)
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}", key="objective", hint=f"use {', '.join(OBJECTIVES)}")
    dts = tuple(dtypes) if dtypes else default_dtypes(model)
    for d in dts:
        if d not in DTYPES:
            raise PlanError(f"unknown dtype {d!r}", key="dtype", hint=f"use auto or one of {', '.join(DTYPES)}")
    if w.lora_adapters and isinstance(model, MlaModel):
        raise PlanError("LoRA memory is modelled for Llama-family projections only", key="lora_adapters")
    s = Search(model, model_name, source or model_name, cluster, w, ov, sp, dts, param_count(model), [],
               objective=objective, draft_params=param_count(draft) if draft is not None else 0)
    total, gpn, limit = cluster.total_gpus, cluster.gpus_per_node, cluster.tp_limit
    domain = "NVLink domain" if cluster.gpu.nvlink else "node"
    pairs: list[tuple[int, int]] = []
    for tp in sorted(tps) if tps else range(1, total + 1):
        if tp > total:
            s.candidates.append(Candidate(tp, None, None, [f"tp={tp} needs more than the {total} GPUs available"]))
            continue
        problems = _tp_problems(s, tp, dts[0])
        if problems:
            if tp <= gpn or tps:
                s.candidates.append(Candidate(tp, None, None, problems[:1]))
            continue
        if tp > gpn:
            s.candidates.append(Candidate(tp, None, None, [
                f"crosses the {domain}: tp={tp} > {gpn} GPUs per node"]))
            continue
        if tp > limit:
            s.candidates.append(Candidate(tp, None, None, [
                f"over the {cluster.gpu.link.name} TP limit: tp={tp} > {limit} (stages instead: "
                f"tp={limit} x pp={-(-tp // limit)})"]))
            continue
        pairs += [(tp, pp) for pp in (sorted(pps) if pps else range(1, min(model.num_layers, total // tp) + 1))]
    # TP first, per dtype: a dtype's pipeline candidates are only worked out when none of its pp = 1 fits.
    first = {(tp, d): _evaluate(s, tp, 1, d) for tp, pp in pairs if pp == 1 for d in dts}
    fit = {d: min((c for c in first.values() if c.fits and c.dtype == d), key=lambda c: c.tp, default=None)
           for d in dts}
    for tp, pp in pairs:
        for d in dts:
            if pp == 1:
                s.candidates.append(first[tp, d])
            elif fit[d] is not None:
                s.candidates.append(Candidate(tp, pp, d, skipped=f"TP first: {fit[d].label} fits inside the "
                                              f"{domain}"))
            else:
                s.candidates.append(_evaluate(s, tp, pp, d))
    recommend(s)
    return s


def _tp_problems(s: Search, tp: int, dtype: str) -> list[str]:
    if isinstance(s.model, MlaModel):
        return mla_tp_problems(s.model, tp)
    try:
        check_degrees(s.model, plan_from_dict(plan_dict("probe", s.source, tp, 1, dtype)))
    except LayoutError as exc:
        return [exc.message]
    return []


def _lora_bytes(model: Any, w: Workload, layers: int) -> int:
    """LoRA adapters of ``layers`` layers, whole (before the TP split)."""
    if not w.lora_adapters:
        return 0
    per = lora_bytes_per_layer(model.hidden_size, model.num_heads * model.head_dim,
                               model.num_kv_heads * model.head_dim, model.intermediate_size,
                               w.lora_adapters, w.lora_rank)
    return layers * per


def kv_bpt(model: Any, layers: int, tp: int, kv_bytes: int) -> int:
    if isinstance(model, MlaModel):
        return mla_kv_bytes_per_token(layers, model.kv_lora_rank, model.qk_rope_head_dim, kv_bytes)
    return kv_bytes_per_token(layers, model.num_kv_heads, tp, model.head_dim, kv_bytes)


def attn_flops(model: Any) -> int:
    """Attention FLOPs per layer, head and context token: q.k and p.v (MLA: against the latent)."""
    if isinstance(model, MlaModel):
        return 2 * model.latent_dim + 2 * model.kv_lora_rank
    return 4 * model.head_dim


def _evaluate(s: Search, tp: int, pp: int, dtype: str) -> Candidate:
    c = Candidate(tp, pp, dtype)
    if tp * pp > s.cluster.total_gpus:
        c.reasons.append(f"tp x pp = {tp * pp} GPUs > the {s.cluster.total_gpus} available")
        return c
    try:
        c.plan = plan_from_dict(plan_dict(plan_name(s.model_name, tp, pp, dtype), s.source, tp, pp, dtype))
        if isinstance(s.model, MlaModel):
            if pp > s.model.num_layers:
                raise LayoutError(f"pp_degree={pp} exceeds num_hidden_layers={s.model.num_layers}")
            c.weights = mla_rank_weights(s.model, tp, pp, dtype, _even_stages(s.model.num_layers, pp))
        else:
            c.weights = rank_weights(s.model, c.plan)
    except LayoutError as exc:
        c.reasons.append(exc.message)
        return c
    _memory(s, c)
    if not c.reasons:
        _speed(s, c)
    return c


def _even_stages(n: int, pp: int) -> list[tuple[int, int]]:
    """The Layout's default stage split (stage_ranges): even, the remainder to the first stages."""
    base, extra = divmod(n, pp)
    out, start = [], 0
    for st in range(pp):
        out.append((start, start + base + (1 if st < extra else 0)))
        start = out[-1][1]
    return out


def _memory(s: Search, c: Candidate) -> None:
    """Per-GPU memory of every stage, the KV figures of the replica, and the memory rules."""
    model, w, gpu = s.model, s.workload, s.cluster.gpu
    over = s.overheads.per_gpu(c.tp * c.pp)
    draft = -(-2 * s.draft_params // (c.tp * c.pp))
    stages = []
    for st in range(c.pp):
        rw = max((r for r in c.weights if r.pp_stage == st), key=lambda r: r.nbytes)
        layers = rw.layers[1] - rw.layers[0]
        bpt = kv_bpt(model, layers, c.tp, w.kv_bytes)
        extra = -(-_lora_bytes(model, w, layers) // c.tp) + draft
        avail = gpu.memory * w.gpu_memory_utilization - rw.nbytes - extra - sum(over.values())
        budget = w.kv_memory if w.kv_memory is not None else min(w.cap, avail)
        stages.append(GpuMemory(st, gpu.memory, w.gpu_memory_utilization, rw.nbytes, over, bpt, avail, budget,
                                extra))
    fullest = min(stages, key=lambda m: (m.kv_available, -m.kv_bytes_per_token))
    blocks = min(kv_blocks(m.kv_budget, m.kv_bytes_per_token, w.block_size) for m in stages)
    limiting = min(stages, key=lambda m: kv_blocks(m.kv_budget, m.kv_bytes_per_token, w.block_size))
    bpt = max(m.kv_bytes_per_token for m in stages)
    req = w.max_model_len or model.max_position_embeddings
    tokens = blocks * w.block_size
    c.memory = fullest
    c.kv = KvFigures(bpt, limiting.kv_budget, blocks, tokens, min(tokens, model.max_position_embeddings),
                     sequences_at(blocks, w.avg_context, w.block_size), req,
                     request_kv_bytes(bpt, req, w.block_size))
    g = GIB
    if w.kv_memory is None and fullest.kv_available <= 0:
        c.reasons.append(
            f"does not fit: weights {fullest.weights / g:.2f} GiB + "
            + (f"LoRA/draft {fullest.extra / g:.2f} GiB + " if fullest.extra else "")
            + f"overheads {fullest.overhead / g:.2f} GiB "
            f"> {fullest.usable / g:.2f} GiB usable ({gpu.memory / g:.2f} GiB x {w.gpu_memory_utilization:g})")
    elif w.kv_memory is None and fullest.kv_available < w.cap:
        c.reasons.append(f"KV budget {fullest.kv_available / g:.2f} GiB per GPU is below the "
                         f"{w.cap / g:.2f} GiB cap")
    worst = max(stages, key=lambda m: m.used_fraction)
    if worst.used_fraction > s.speed.max_memory_fraction and not c.reasons:
        c.reasons.append(f"GPU at {worst.used_fraction:.1%} of its memory "
                         f"(> {s.speed.max_memory_fraction:.0%}): no headroom")
    if not c.reasons and w.max_model_len and tokens < round_to_blocks(w.max_model_len, w.block_size):
        c.reasons.append(
            f"KV holds {tokens:,} tokens < the max model length {w.max_model_len:,} (one request needs "
            f"{c.kv.request_bytes / g:.2f} GiB per GPU)")
    if not c.reasons and c.kv.sequences < 1:
        c.reasons.append(f"KV holds no sequence of {w.avg_context:,} tokens")


def _speed(s: Search, c: Candidate) -> None:
    """Decode roofline per micro-batch slot, GPipe schedule, then the batch that meets the TPOT target."""
    model, gpu, sp, w, cl = s.model, s.cluster.gpu, s.speed, s.workload, s.cluster
    tp, pp = c.tp, c.pp or 1
    link = gpu.link
    hbm, flops = gpu.hbm_bandwidth * sp.hbm_efficiency, gpu.flops * sp.compute_efficiency
    heads, attn = model.num_heads // tp, attn_flops(model)
    stages = [max((r for r in c.weights if r.pp_stage == st), key=lambda r: r.read_bytes) for st in range(pp)]

    def slot(b: float) -> tuple[float, ...]:
        worst: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0)
        for st, rw in enumerate(stages):
            layers = rw.layers[1] - rw.layers[0]
            bpt = kv_bpt(model, layers, tp, w.kv_bytes)
            read = rw.read_bytes
            if rw.expert_bytes:  # MoE: a step reads the routed experts its tokens picked
                share = experts_touched(b, model.num_experts_per_tok, model.n_routed_experts)
                read -= rw.expert_bytes * (1 - share)
            mem = (read + b * w.avg_context * bpt) / hbm
            comp = b * (2 * rw.linear_params + layers * heads * attn * w.avg_context) / flops
            ar = 2 * layers * ring_allreduce_s(tp, b * model.hidden_size * ACT_BYTES,
                                               link.bandwidth * sp.link_efficiency, link.latency)
            ho = 0.0
            if st < pp - 1:
                hop = link if cl.node_of(st * tp) == cl.node_of((st + 1) * tp) else cl.inter_node
                ho = b * model.hidden_size * ACT_BYTES / (hop.bandwidth * sp.link_efficiency) + hop.latency
            total = max(mem, comp) + ar + ho
            if total > worst[0]:
                worst = (total, mem, comp, ar, ho, st)
        return worst

    def at(batch: int) -> Speed:
        m = min(sp.microbatches or pp, batch)
        t, mem, comp, ar, ho, st = slot(batch / m)
        tpot = (m + pp - 1) * t
        return Speed(batch, int(st), m, gpipe_bubble(pp, m), mem, comp, ar, ho, t, tpot, batch / tpot, "")

    kv = c.kv
    assert kv is not None
    cap = min(kv.sequences, sp.max_num_seqs)
    target = w.target_ms / 1e3
    lo, hi = 1, cap
    if at(cap).tpot_s <= target:
        lo = cap
    else:
        while lo < hi:  # the largest batch that meets the target; TPOT grows with the batch
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if at(mid).tpot_s <= target else (lo, mid - 1)
    best = at(lo)
    limited = "tpot" if lo < cap else ("kv" if kv.sequences <= sp.max_num_seqs else "max_num_seqs")
    c.speed = dataclasses.replace(best, limited_by=limited, tpot1_s=at(1).tpot_s)
    c.meets_target = best.tpot_s <= target
    world = tp * pp
    gpn, nodes = cl.gpus_per_node, cl.nodes
    per_node = gpn // world if world <= gpn else 0
    in_cluster = per_node * nodes if per_node else nodes // -(-world // gpn)
    need = math.ceil(w.demand_tokens_per_s / best.tokens_per_s) if w.demand_tokens_per_s else None
    c.cost = Cost(world, dollars_per_mtok(world, w.price_per_gpu_hour, best.tokens_per_s),
                  world * 1e6 / (best.tokens_per_s * 3600), per_node, in_cluster, need,
                  need * world if need is not None else None)
