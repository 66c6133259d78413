"""Candidate search: every (tp, pp, dtype) the cluster allows, judged with planner.py's arithmetic.

Rules (the issue's, in order): tp stays inside the NVLink domain and satisfies the head rules of the
Layout; pp stays within the layer count; tp x pp fits the GPUs available. A candidate fits when every
GPU holds its weights, the overheads and the KV cap, with no GPU above 95% of its memory. Tensor
parallelism comes first: pipeline candidates are only considered when no pp = 1 candidate fits. The
recommendation is the cheapest per million output tokens that meets the TPOT target, ties to the
smaller TP group. Infeasible candidates keep their reasons, so the table can say why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import LayoutError, PlanError
from .gpus import GIB, Cluster
from .model import ModelSpec
from .plan import DTYPES, Plan, plan_from_dict
from .planner import (
    ACT_BYTES,
    DTYPE_ORDER,
    KV_DTYPE_BYTES,
    Overheads,
    RankWeights,
    SpeedParams,
    Workload,
    dollars_per_mtok,
    gpipe_bubble,
    kv_blocks,
    kv_bytes_per_token,
    param_count,
    plan_dict,
    plan_name,
    rank_weights,
    request_kv_bytes,
    ring_allreduce_s,
    round_to_blocks,
    sequences_at,
)


# --- candidates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """The fullest GPU of a replica: where the memory rules bite first."""

    stage: int
    total: int
    utilization: float
    weights: int
    overheads: dict[str, int]
    kv_bytes_per_token: int
    kv_available: float  # total x utilization - weights - overheads (may be negative)
    kv_budget: float  # min(cap, available), or --kv-memory

    @property
    def usable(self) -> float:
        return self.total * self.utilization

    @property
    def overhead(self) -> int:
        return sum(self.overheads.values())

    @property
    def used(self) -> float:
        return self.weights + self.overhead + max(self.kv_budget, 0.0)

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


@dataclass(frozen=True)
class Speed:
    batch: int  # sequences decoded together
    microbatches: int
    bubble: float
    memory_s: float  # of the slowest stage, per micro-batch pass
    compute_s: float
    allreduce_s: float
    handoff_s: float
    slot_s: float  # one micro-batch through one stage (the slowest)
    tpot_s: float  # time per output token of every sequence: (m + p - 1) x slot
    tokens_per_s: float
    limited_by: str  # tpot | kv | max_num_seqs


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


Evaluator = Callable[[Candidate], None]
