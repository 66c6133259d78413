"""Candidate search: every (tp, pp, dtype) the cluster allows, judged with formulas.py's arithmetic.

Rules, in order: tp stays inside one node and within the fabric's TP limit (the NVLink domain; 4 on
PCIe) and satisfies the head rules of the Layout; pp stays within the layer count; tp x pp fits the
GPUs available. A candidate fits when every GPU holds its weights (plus LoRA adapters and a draft
model) and the overheads, its KV pool (what vLLM would allocate, at most the cap) holds the KV
demand (the requests asked for), and no GPU is above 95% of its memory. Tensor parallelism comes
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
from ..layout.model import ModelSpec
from ..layout.plan import PLAN_DTYPES, plan_from_dict
from ..layout.ranks import MAX_TP_HINT, check_degrees, valid_tp_degrees
from .candidate import Candidate, evaluate, kv_bpt, lora_bytes, routing
from .checks import check_inputs
from .ep import ep_degrees, evaluate_ep, weights_for
from .formulas import (
    Overheads,
    SpeedParams,
    Workload,
    demand_tokens,
    demand_words,
    min_cards,
)
from .gpus import GIB, Cluster
from .models import param_count
from .policy import OBJECTIVES, FitTrail, recommend
from .weights import plan_dict, plan_name, rank_weights


@dataclass
class Search:
    """The inputs, every candidate with its figures or reasons, and the recommendation."""

    model: ModelSpec  # a family shardc builds: every figure comes from its Layout
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
            near = max(tried, key=lambda c: (c.memory.kv_available, -c.gpus))
            detail = f"closest is {near.label}: {near.reasons[0]}"
        else:
            near = self.candidates[0] if self.candidates else None
            detail = near.reasons[0] if near else "no tp/pp combination fits the GPU count"
        message = f"{self.model_name} fits no candidate on {where}; {detail}"
        valid = self.valid_tps(self.cluster.tp_limit)
        if self.candidates and not tried and not {c.tp for c in self.candidates} & set(self.valid_tps()):
            # every TP asked for breaks the head rules: more or larger GPUs would not help, another TP does
            raise PlanError(message, key="tp", hint=f"give `tp` {' or '.join(map(str, valid))}: the TP degrees "
                            f"{self.model_name} splits into, up to {self.cluster.tp_limit}")
        outside = self.overheads.outside(2)
        if tried and self.workload.kv_memory is None and outside > self.cluster.gpu.memory * (
                1 - self.workload.gpu_memory_utilization):  # every unit: no "closest" to name
            most = math.floor((1 - outside / self.cluster.gpu.memory) * 100) / 100
            raise PlanError(f"{self.model_name} fits no candidate on {where}; {near.reasons[0]}",
                            key="gpu_memory_utilization",
                            hint=f"use `gpu_memory_utilization` {most:g} or less: vLLM needs "
                            f"{outside / GIB:.2f} GiB outside its budget for the CUDA context and graphs")
        raise PlanError(
            message,
            key="model",
            hint="add GPUs (`nodes`), lower `max_model_len` or `concurrency`, "
            + ("" if {"int8", "fp8"} & set(self.dtypes) else "try `dtype` int8 or fp8, ")
            + "or pick a larger `gpu`",
        )

    def valid_tps(self, limit: int | None = None) -> list[int]:
        """TP degrees the model's heads and widths allow (the Layout's rule), up to ``limit``."""
        return valid_tp_degrees(self.model, limit or MAX_TP_HINT)

    def plan_for(self, cand: Candidate, source: str | None = None) -> dict[str, Any]:
        """The plan file for a fitting candidate; plan_from_dict validates it before it is returned."""
        assert cand.pp is not None and cand.dtype is not None and cand.speed is not None
        data = plan_dict(
            plan_name(self.model_name, cand.tp, cand.pp, cand.dtype, cand.ep), source or self.source, cand.tp,
            cand.pp, cand.dtype, kv_cache_cap_gib=math.floor((self.workload.cap if self.workload.capped else
                                                             cand.kv.budget) / GIB * 100) / 100,
            max_concurrent_sequences=cand.speed.batch, dp=cand.dp,
        )
        plan_from_dict(data)
        return data

    def fit_trail(self, dtype: str) -> FitTrail:
        """Rules 1 and 2 for one dtype: sharded and replicated memory, and the minimum card count.

        Sharded: weights, LoRA, the draft model and (GQA/MHA) the KV demand, whole, which TP splits
        by KV head; an MLA latent is whole on every GPU, so its demand is replicated. Replicated: the
        overheads. A card's room is what vLLM's budget (memory x utilization) leaves after the
        in-budget overheads; the CUDA context and graphs must fit in the headroom outside it. With a
        measured pool (`kv_memory`) the room is what the 95% limit leaves after every overhead.
        """
        w, sp, gpu, ov = self.workload, self.speed, self.cluster.gpu, self.overheads
        weights = rank_weights(self.model, plan_from_dict(plan_dict("probe", "src", 1, 1, dtype)))[0].nbytes
        lora = lora_bytes(self.model, w, self.model.num_layers)
        need = demand_tokens(w, self.model.max_position_embeddings)
        kv = need * kv_bpt(self.model, self.model.num_layers, 1, w.kv_bytes)
        kv_sharded, kv_rep = (0, kv) if self.model.forward.mla is not None else (kv, 0)
        if w.kv_memory is not None:  # the measured pool is a fixed block on every GPU; the demand is in it
            kv_sharded, kv_rep = 0, int(w.kv_memory)
        usable, limit = gpu.memory * w.gpu_memory_utilization, gpu.memory * sp.max_memory_fraction

        def room(world: int) -> float:
            if w.kv_memory is not None:  # the engine measured it: only the memory limit applies
                return limit - sum(ov.per_gpu(world).values()) - kv_rep
            return usable - ov.in_budget(world) - kv_rep  # the context and graphs sit in the headroom

        sharded = weights + lora + 2 * self.draft_params + kv_sharded
        one, many = room(1), room(2)
        minimum = 1 if sharded <= one else min_cards(sharded, many, 0)
        valid = sorted({c.tp for c in self.candidates if c.dtype == dtype and c.pp == 1})
        return FitTrail(dtype, weights, lora, 2 * self.draft_params, kv_sharded, kv_rep, need,
                        demand_words(w, self.model.max_position_embeddings), usable, limit,
                        ov.in_budget(2), sum(ov.per_gpu(2).values()), many, one, minimum,
                        self.cluster.tp_limit, valid, ov.outside(2), gpu.memory - usable)

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
            "workload": {**dataclasses.asdict(self.workload), "cap": self.workload.cap if self.workload.capped else None,
                         "target_ms": self.workload.target_ms,
                         "context": self.workload.context, "draft_params": self.draft_params},
            "parameters": {"overheads": dataclasses.asdict(self.overheads),
                           "speed": dataclasses.asdict(self.speed)},
            "dtypes": list(self.dtypes),
            "objective": self.objective,
            "candidates": [c.to_json() for c in self.candidates],
            "recommended": self.candidates.index(rec) if rec is not None else None,
            "alternative": self.candidates.index(alt) if alt is not None else None,
            "fit": [t.to_json() for t in self.trails],
            "warnings": list(self.warnings),
            "plan": self.plan_for(rec) if rec is not None else None,
        }


def default_dtypes(model: Any) -> tuple[str, ...]:
    """--dtype auto: the checkpoint's 16-bit dtype and both 8-bit weight formats, and first, for a
    checkpoint published quantized (a quantization_config shardc reads), its own form (source)."""
    from ..layout.sourcequant import detect_source

    own = ("source",) if detect_source(model.config) is not None else ()
    return (*own, "fp16" if model.torch_dtype == "float16" else "bf16", "int8", "fp8")


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
        if d not in PLAN_DTYPES:
            raise PlanError(f"unknown dtype {d!r}", key="dtype", hint=f"use auto or one of {', '.join(PLAN_DTYPES)}")
    if w.lora_adapters and model.forward.mla is not None:
        raise PlanError("LoRA memory is modelled for q/k/v/o and MLP projections, not MLA's latent ones",
                        key="lora_adapters", hint="plan without `lora_adapters`")
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
    first = {(tp, d): evaluate(s, tp, 1, d) for tp, pp in pairs if pp == 1 for d in dts}
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
                s.candidates.append(evaluate(s, tp, pp, d))
    # MoE: the EP ladder (ep.py) beside the dense units; `tp`/`pp` restrict the search to dense units
    if routing(model)[1] and not tps and not pps:
        for d in dts:
            ew = weights_for(s, d)
            s.candidates += [evaluate_ep(s, n, d, ew) for n in ep_degrees(s)]
    _check_ttft(s)
    recommend(s)
    return s


def _check_ttft(s: Search) -> None:
    """A TTFT target below one prefill of the prompt on the fastest candidate cannot be met by any
    concurrency or unit: one PlanError naming the floor instead of a table of misses."""
    w = s.workload
    floors = [c.serving.prefill_s for c in s.candidates if c.fits and not c.skipped and c.serving is not None]
    if w.ttft_ms is None or not floors or w.ttft_ms / 1e3 >= min(floors):
        return
    floor = min(floors) * 1e3
    raise PlanError(f"{w.ttft_ms:g} ms is below one prefill of the {w.prompt:,}-token prompt on the fastest "
                    f"candidate ({floor:.1f} ms)", key="ttft_ms",
                    hint=f"use `ttft_ms` {math.ceil(floor)} or more, or a shorter `isl`")


def _tp_problems(s: Search, tp: int, dtype: str) -> list[str]:
    try:
        check_degrees(s.model, plan_from_dict(plan_dict("probe", s.source, tp, 1, dtype)))
    except LayoutError as exc:
        return [exc.message]
    return []
