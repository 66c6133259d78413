"""What the runtime API returns: one frozen dataclass per call, made once from a rank's result.

A rank sends its result back as plain data and tensors (``Wire``: what ``torch.load(...,
weights_only=True)`` reads back without trusting a pickle), through ``result.pt`` or, under
torchrun, in-process; the API turns it into one of these in the caller's process and never edits it.
Importing this module imports no torch (the tensor fields are typed ``Any``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A rank's result as it crosses the process boundary: plain data and tensors, keys as below.
Wire = dict[str, Any]


@dataclass(frozen=True)
class GenerateResult:
    """``generate``: the new tokens per prompt (prompt not included) and where the time went."""

    tokens: list[list[int]]
    seconds: float  # the holding rank's wall time for the whole generation
    load_seconds: float  # its shard load, before the first step
    cpu_seconds: float  # its process CPU time (all threads) while computing
    decode_seconds: float | None  # wall time after the first token (None: no token generated)

    @classmethod
    def from_wire(cls, w: Wire) -> GenerateResult:
        return cls([list(map(int, t)) for t in w["tokens"]], float(w["seconds"]), float(w["load_seconds"]),
                   float(w["cpu_seconds"]), w["decode_seconds"])


@dataclass(frozen=True)
class ScoreResult:
    """``score`` and ``save_baseline``: per-position NLL of the last stage, [windows * (T - 1)]
    fp64, and the measured pipeline; ``logits`` only when asked for (fp32, [N, T, vocab])."""

    nll: Any  # torch.Tensor
    tokens: int  # tokens in the windows
    batch_seconds: Any  # torch.Tensor: seconds between micro-batches' scores (the first includes the fill)
    trace: dict[int, list[list[float]]]  # per rank: [micro-batch, start, end] of its compute
    pipeline: dict[str, float]  # engine.pipeline_stats: measured bubble next to GPipe's formula
    seconds: float
    load_seconds: float
    cpu_seconds: float
    logits: Any = None  # torch.Tensor | None

    @classmethod
    def from_wire(cls, w: Wire, tp: int, pp: int) -> ScoreResult:
        from .engine import pipeline_stats

        trace = {int(r): t for r, t in w["trace"].items()}
        return cls(w["nll"], int(w["tokens"]), w["batch_seconds"], trace, pipeline_stats(trace, tp, pp),
                   float(w["seconds"]), float(w["load_seconds"]), float(w["cpu_seconds"]), w.get("logits"))


@dataclass(frozen=True)
class PositionScores:
    """Per-position figures of a candidate against its baseline: what the gate's metrics are made of."""

    nll_base: Any  # fp64, [windows * (T - 1)]
    nll_cand: Any  # fp64, same shape
    kl: Any  # KL(baseline || candidate) per position, fp64
    top1: Any  # bool: the two argmaxes agree


@dataclass(frozen=True)
class CompareResult:
    """``score_against`` and ``compare``: the per-position scores and the candidate pass's times."""

    scores: PositionScores
    tokens: int
    seconds: float
    load_seconds: float
    cpu_seconds: float

    @classmethod
    def from_wire(cls, w: Wire) -> CompareResult:
        return cls(PositionScores(w["nll_base"], w["nll_cand"], w["kl"], w["top1"]), int(w["tokens"]),
                   float(w["seconds"]), float(w["load_seconds"]), float(w["cpu_seconds"]))


@dataclass(frozen=True)
class ReferencePass:
    """The gate's baseline scored by transformers in this process (runtime/reference.py): its times."""

    seconds: float
    load_seconds: float
