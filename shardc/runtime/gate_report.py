"""What the gate returns: a frozen report (``shardc.results.to_json`` is the JSON that ``shardc gate
--json`` prints and ``--report`` writes; its keys are the field names, ``pass`` for ``passed``),
and its text form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..results import StrEnum, optional

DEFAULT_MAX_PPL_DELTA_PCT = 0.5


@dataclass(frozen=True)
class Thresholds:
    """What the candidate must hold to pass (None: not checked)."""

    max_ppl_delta_pct: float = DEFAULT_MAX_PPL_DELTA_PCT
    max_kl: float | None = None  # mean KL(baseline || candidate), nats per token
    min_top1: float | None = None  # fraction of positions whose argmax agrees


class Metric(StrEnum):
    """The figures a threshold can hold the candidate to."""

    PPL_DELTA_PCT = "ppl_delta_pct"
    KL_MEAN = "kl_mean"
    TOP1_AGREEMENT = "top1_agreement"


class CacheStatus(StrEnum):
    """What became of ``--baseline-cache``."""

    NONE = "none"  # no cache given
    HIT = "hit"  # read: the baseline was not scored
    NEW = "new"  # no cache file yet: written now
    STALE = "stale"  # of another baseline (or unreadable): recomputed
    MISMATCH = "mismatch"  # does not match its digest (edited or damaged): recomputed


@dataclass(frozen=True)
class GateCheck:
    """One threshold: the figure, its limit, the rule as words, and whether it holds."""

    name: Metric
    value: float
    limit: float
    rule: str
    ok: bool


@dataclass(frozen=True)
class GateMetrics:
    """The comparison's figures and verdict (``summarize``): perplexities over ``positions`` scored
    tokens, the delta with its paired-bootstrap 95% interval, KL(baseline || candidate), top-1."""

    # spelled "pass" in the JSON (results.to_json); a direct field() call, which mypy reads as a
    # field without a default
    passed: bool = field(metadata={"json": "pass"})
    checks: tuple[GateCheck, ...]
    positions: int
    baseline_ppl: float
    candidate_ppl: float
    ppl_delta_pct: float
    ppl_delta_ci95_pct: tuple[float, float]
    kl_mean: float
    kl_p99: float
    top1_agreement: float


@dataclass(frozen=True)
class GateSide:
    """The baseline's or the candidate's build; ``scored_by`` only for a baseline scored by
    transformers (``--reference transformers``: its name and versions)."""

    plan: str
    manifest: str
    plan_sha256: str
    tp: int
    pp: int
    dtype: str
    scored_by: Mapping[str, Any] | None = optional()


@dataclass(frozen=True)
class GoldenRecord:
    source: str  # "pydoc" or the file
    sha256: str  # of the text
    text_tokens: int
    windows: int
    window: int
    tokens: int  # windows x window: what was scored


@dataclass(frozen=True)
class CacheRecord:
    path: str | None
    status: CacheStatus


@dataclass(frozen=True)
class GateSeconds:
    """Wall time of the scoring, the candidate's compute and load, the baseline's (None on a hit)."""

    wall: float
    compute: float | None
    load: float | None
    baseline_compute: float | None
    baseline_load: float | None


@dataclass(frozen=True)
class GateReport(GateMetrics):
    """A gate: the figures and verdict, what was compared, on what, against which thresholds."""

    baseline: GateSide
    candidate: GateSide
    golden: GoldenRecord
    thresholds: Thresholds
    baseline_cache: CacheRecord
    seconds: GateSeconds


def format_report(r: GateReport) -> str:
    """Human-readable summary (the JSON report carries the same numbers)."""
    b, c, g = r.baseline, r.candidate, r.golden
    lo, hi = r.ppl_delta_ci95_pct
    by = b.scored_by
    lines = [
        f"gate: {c.plan} (tp{c.tp} pp{c.pp} {c.dtype}) vs baseline {b.plan} (tp{b.tp} pp{b.pp} {b.dtype})"
        + (f", baseline scored by {by['name']} {by.get(by['name'], '')}".rstrip() if by else ""),
        f"golden: {g.source}, {g.windows} windows x {g.window} tokens, {r.positions} scored positions",
        f"perplexity: baseline {r.baseline_ppl:.4f}  candidate {r.candidate_ppl:.4f}  "
        f"delta {r.ppl_delta_pct:+.4f}% (95% CI {lo:+.4f}% .. {hi:+.4f}%)",
        f"KL(baseline||candidate): mean {r.kl_mean:.3e}  p99 {r.kl_p99:.3e} nats/token",
        f"top-1 agreement: {r.top1_agreement * 100:.2f}%",
    ]
    for ch in r.checks:
        mark = "ok  " if ch.ok else "FAIL"
        lines.append(f"{mark} {ch.name} = {ch.value:.6g} ({ch.rule}, limit {ch.limit:g})")
    lines.append("PASS" if r.passed else "FAIL: the candidate does not match the baseline")
    return "\n".join(lines)
