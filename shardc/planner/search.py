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
from typing import Any

from ..errors import LayoutError, PlanError
from ..layout.plan import PLAN_DTYPES, plan_from_dict
from ..layout.ranks import check_degrees
from .candidate import evaluate, routing
from .checks import check_inputs
from .ep import ep_degrees, evaluate_ep, weights_for
from .formulas import (
    Overheads,
    SpeedParams,
    Workload,
    speed_for,
)
from .gpus import Cluster
from .models import param_count
from .policy import OBJECTIVES, recommend
from .records import Candidate, Search
from .weights import plan_dict


def default_dtypes(model: Any) -> tuple[str, ...]:
    """--dtype auto: the checkpoint's 16-bit dtype and both 8-bit weight formats, and first, for a
    checkpoint published quantized (a quantization_config shardc reads), its own form (source)."""
    from ..layout.quant_formats import detect_source

    own = ("source",) if detect_source(model.config) is not None else ()
    return (*own, sixteen_bit(model), "int8", "fp8")


def fit_defaults(w: Workload, model: Any) -> Workload:
    """The workload with its default average context (2,048 tokens: 1,536-token prompts, 1,024-token
    outputs) lowered to 4/5 of the longest request when that is shorter, so that a default prompt
    plus its output fits it; given values are left as they are (and checked)."""
    if w.avg_context is not None or w.isl is not None or w.osl is not None:
        return w
    longest = w.max_model_len or model.max_position_embeddings
    if w.default_context * 5 // 4 <= longest:
        return w
    return dataclasses.replace(w, default_context=max(1, longest * 4 // 5))


def sixteen_bit(model: Any) -> str:
    """The checkpoint's 16-bit dtype (its compute dtype, and the KV cache's under --kv-dtype auto)."""
    return "fp16" if model.torch_dtype == "float16" else "bf16"


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
    w, ov, sp = fit_defaults(workload or Workload(), model), overheads or Overheads(), speed or speed_for(cluster.gpu)
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
            elif (fitted := fit[d]) is not None:
                s.candidates.append(Candidate(tp, pp, d, skipped=f"TP first: {fitted.label} fits inside the "
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
