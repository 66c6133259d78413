"""The planner's records: what one candidate's arithmetic gives (GpuMemory, KvFigures, Speed,
Cost), the candidate itself, the fit rules' trail and the whole search (inputs, every candidate,
the pick). Shared by candidate.py (which works a candidate out), search.py (which makes them),
policy.py (which picks), ep.py, report.py, explain.py, plot.py and deploy.py; it imports none of
them, so the planner has no import loop, typing-only included.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError
from ..layout.model import ModelSpec
from ..layout.plan import Plan, plan_from_dict
from ..layout.tensors import MAX_TP_HINT, valid_tp_degrees
from .formulas import Overheads, SpeedParams, Workload
from .gpus import GIB, Cluster
from .serving import Serving
from .weights import RankWeights, plan_dict, plan_name

# --- the figures of one candidate -----------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """The fullest GPU of a replica: where the memory rules bite first."""

    stage: int
    total: int
    utilization: float
    weights: int
    overheads: dict[str, int]
    kv_bytes_per_token: int
    kv_available: float  # total x utilization - weights - extra - in-budget overheads (may be negative)
    kv_budget: float  # the pool this GPU would allocate: min(cap, available), or --kv-memory
    extra: int = 0  # LoRA adapters and the draft model on this GPU (sharded like the weights)
    in_budget: int = 0  # the overheads vLLM subtracts from total x utilization (activations, NCCL)
    kv_demand: int = 0  # KV bytes the demanded requests need on this GPU

    @property
    def usable(self) -> float:
        return self.total * self.utilization

    @property
    def overhead(self) -> int:
        return sum(self.overheads.values())

    @property
    def used(self) -> float:
        return self.weights + self.extra + self.overhead + max(self.kv_budget, 0.0)

    @property
    def used_fraction(self) -> float:
        return self.used / self.total


@dataclass(frozen=True)
class KvFigures:
    bytes_per_token: int  # per GPU, of the stage with the most layers
    budget: float  # per GPU, of the limiting GPU
    blocks: int  # per GPU, the minimum over stages: every stage must hold every token
    tokens: int
    max_model_len: int
    sequences: int  # at the average context
    request_len: int  # --max-model-len, else max_position_embeddings
    request_bytes: int  # KV one request of request_len needs per GPU
    demand_tokens: int = 0  # demand_tokens(): what the pool must hold at once
    demand_bytes: int = 0  # those tokens' KV on one GPU (of the stage with the most KV per token)
    state_bytes: int = 0  # a hybrid model's fixed state per sequence on the limiting GPU (linear layers)

    @property
    def served_len(self) -> int:
        """The longest request the unit serves: what the pool holds, at most the length asked for
        (the table's max len, the summary's, and the launch's --max-model-len)."""
        return min(self.max_model_len, self.request_len)


@dataclass(frozen=True)
class Speed:
    batch: int  # requests in flight (the concurrency): sequences decoded together
    stage: int  # the slowest stage, whose decode-step figures follow
    microbatches: int
    bubble: float
    memory_s: float  # of the slowest stage, per micro-batch pass of a decode-only step
    compute_s: float
    allreduce_s: float  # communication: TP all-reduces + PP hand-off (EP: all-to-alls)
    fixed_s: float  # fixed per-layer overheads of the stage (layer_overhead_us x layers)
    slot_s: float  # one micro-batch through one stage (the slowest)
    tpot_s: float  # time per output token with prefill interleaved (serving.py)
    tokens_per_s: float  # output tokens/s of the replica under the workload
    limited_by: str  # tpot | ttft | kv | max_num_seqs | concurrency (given)
    tpot1_s: float = 0.0  # time per output token at batch 1: the latency a lone request sees
    ttft_s: float = 0.0  # time to first token at this concurrency (serving.py)
    requests_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0


@dataclass(frozen=True)
class Cost:
    gpus: int
    dollars_per_mtok: float
    gpu_hours_per_mtok: float
    replicas_per_node: int  # 0 when a replica spans nodes
    replicas_in_cluster: int
    replicas_for_demand: int | None
    gpus_for_demand: int | None


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
    ep: int = 1  # expert-parallel degree: > 1 is an EP unit (tp 1, dp = ep GPUs, experts spread over them)
    dp: int = 1  # attention data-parallel groups (the plan's dp_degree)
    ep_detail: Any = None  # ep.EpWeights of an EP unit: what --explain restates
    serving: Serving | None = None  # the workload's figures at the chosen concurrency
    curve: tuple[Serving, ...] = ()  # the figures at concurrency 1, 2, 4, ... the cap (--plot)

    @property
    def gpus(self) -> int:
        """GPUs of one replica: tp x pp x dp (every dp group holds its own KV)."""
        return self.tp * (self.pp or 1) * self.dp

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

    def require_speed(self) -> Speed:
        """The speed figures, which every unit that fits has (worked out right after its memory
        when no memory rule failed: candidate.py, ep.py); asked of such units only."""
        assert self.speed is not None
        return self.speed

    @property
    def label(self) -> str:
        if self.ep > 1:
            return f"ep={self.ep} dp={self.dp} {self.dtype or '*'}"
        return f"tp={self.tp} pp={self.pp if self.pp else '*'} {self.dtype or '*'}"

    def to_json(self) -> dict[str, Any]:
        """Every figure of the candidate, plain JSON types."""
        out: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "dtype": self.dtype,
            "status": self.status, "reasons": self.reasons, "skipped": self.skipped,
            "gpus": self.gpus if self.pp else None,
            "kv_demand_bytes": self.kv.demand_bytes if self.kv is not None else None,
        }
        for name in ("memory", "kv", "speed", "cost"):
            part = getattr(self, name)
            out[name] = dataclasses.asdict(part) if part is not None else None
        v = self.serving
        for key in ("ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "requests_per_s", "concurrency"):
            out[key] = v.to_json()[key] if v is not None else None
        out["serving"] = v.to_json() if v is not None else None
        if self.memory is not None:
            m = self.memory
            out["memory"].update(usable=m.usable, overhead=m.overhead, used=m.used, used_fraction=m.used_fraction)
        out["ranks"] = [dataclasses.asdict(w) for w in self.weights]
        return out


@dataclass
class FitTrail:
    """The fit rules worked for one dtype, as --explain and --json show them."""

    dtype: str
    weights: int  # the whole model at this dtype (tp=1, pp=1)
    lora: int
    draft: int
    kv_demand: int  # the whole KV demand (every KV head), sharded; 0 for MLA
    kv_replicated: int  # MLA: the latent demand every GPU holds whole; 0 otherwise
    demand_tokens: int
    demand: str  # the demand in words
    usable: float  # memory x gpu_memory_utilization: vLLM's budget
    limit: float  # memory x max_memory_fraction
    in_budget: int  # overheads vLLM counts in its budget (activations, NCCL)
    replicated: int  # every overhead on a GPU of a multi-GPU unit
    room: float  # what a card of a multi-GPU unit has for the sharded part
    one_card_room: float  # the same on a single card (no NCCL)
    minimum: int | None  # cards; None: the replicated part alone fills a card
    tp_limit: int
    valid_tps: list[int]
    outside: int = 0  # the CUDA context and graphs: in vLLM's headroom, outside its budget
    headroom: float = 0.0  # memory x (1 - utilization): where they must fit for vLLM to start
    # MoE: the EP ladder walked before the dense path: (label, weights per GPU, in use per GPU, verdict)
    ep_ladder: list[tuple[str, int, float, str]] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)  # (label, verdict)
    chosen: str | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)  # smaller units and why they are out

    @property
    def sharded(self) -> int:
        return self.weights + self.lora + self.draft + self.kv_demand

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "sharded": self.sharded}


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
        if fitting and self.workload.target_set:
            fastest = min(fitting, key=lambda c: c.speed.tpot1_s if c.speed else math.inf)
            tpot = fastest.speed.tpot1_s * 1e3 if fastest.speed else math.inf
            raise PlanError(
                f"no candidate on {where} meets the TPOT target of {self.workload.target_ms:g} ms: "
                f"the fastest, {fastest.label}, needs {tpot:.1f} ms per token even at batch 1",
                key="target_tpot_ms",
                hint="raise `target_tpot_ms`, add GPUs (`nodes`) or pick a faster `gpu`",
            )
        tried = [c for c in self.candidates if c.memory is not None]

        def room(c: Candidate) -> tuple[float, int]:
            assert c.memory is not None  # one of ``tried``
            return c.memory.kv_available, -c.gpus

        near: Candidate | None
        if tried:
            near = max(tried, key=room)
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
            assert near is not None  # ``tried``'s closest
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
        assert cand.kv is not None  # a fitting candidate: fitting means its KV figures are there
        data = plan_dict(
            plan_name(self.model_name, cand.tp, cand.pp, cand.dtype, cand.ep), source or self.source, cand.tp,
            cand.pp, cand.dtype, kv_cache_cap_gib=math.floor((self.workload.cap if self.workload.capped else
                                                             cand.kv.budget) / GIB * 100) / 100,
            max_concurrent_sequences=cand.speed.batch, dp=cand.dp,
        )
        plan_from_dict(data)
        return data

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
                           "calibration": cl.calibration, "worst_cell": cl.worst_cell,
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
            # the picks themselves (as in ``candidates``), and where they sit in that list
            "recommended": rec.to_json() if rec is not None else None,
            "alternative": alt.to_json() if alt is not None else None,
            "recommended_index": self.candidates.index(rec) if rec is not None else None,
            "alternative_index": self.candidates.index(alt) if alt is not None else None,
            "fit": [t.to_json() for t in self.trails],
            "warnings": list(self.warnings),
            "plan": self.plan_for(rec) if rec is not None else None,
        }
