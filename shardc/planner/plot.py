"""`shardc plan --plot`: the candidates as a picture, rendered by matplotlib (the `plot` extra).

Left: tokens/s per GPU against TPOT for every feasible candidate, at the concurrency the planner
chose for it; the Pareto front (no other candidate is both faster per token and more productive
per GPU) drawn as a line, the recommendation and the fastest alternative labelled. Right: per-GPU
memory of each candidate, stacked (weights, KV pool, overheads, free), as the table's bars draw it.
Returns the bytes (SVG with text kept as text, or PNG); the CLI writes them atomically.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from ..errors import PlanError
from .gpus import GIB

if TYPE_CHECKING:
    from .candidate import Candidate
    from .search import Search

FORMATS = ("svg", "png")


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both TPOT (lower) and tokens/s per GPU (higher), by TPOT."""
    front = []
    for c in sorted(cands, key=lambda c: (c.speed.tpot_s, -c.speed.tokens_per_s_per_gpu)):  # type: ignore[union-attr]
        if not front or c.speed.tokens_per_s_per_gpu > front[-1].speed.tokens_per_s_per_gpu:  # type: ignore[union-attr]
            front.append(c)
    return front


def render(s: Search, fmt: str) -> bytes:
    """The picture as ``fmt`` (svg or png) bytes; PlanError when matplotlib is missing or nothing fits."""
    if fmt not in FORMATS:
        raise PlanError(f"unknown picture format {fmt!r}", key="plot", hint="name the file .svg or .png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("matplotlib is not installed", key="plot",
                        hint="pip install 'shardc[plot]'") from None
    cands = [c for c in s.candidates if c.fits and not c.skipped and c.speed is not None and c.memory is not None]
    if not cands:
        raise PlanError("no candidate fits: nothing to plot", key="plot", hint="see the reasons in the table")
    matplotlib.rcParams["svg.fonttype"] = "none"  # labels stay text in the SVG
    matplotlib.rcParams["svg.hashsalt"] = "shardc"  # the same figures give the same bytes
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    xs = [c.speed.tpot_s * 1e3 for c in cands]  # type: ignore[union-attr]
    ys = [c.speed.tokens_per_s_per_gpu for c in cands]  # type: ignore[union-attr]
    ax.scatter(xs, ys, color="#7f8c8d", s=24, label="feasible candidate")
    front = pareto(cands)
    ax.plot([c.speed.tpot_s * 1e3 for c in front], [c.speed.tokens_per_s_per_gpu for c in front],  # type: ignore[union-attr]
            color="#2c7fb8", marker="o", label="Pareto front")
    for c, tag, color in ((s.alternative, "fastest alternative", "#e6550d"), (s.recommended, "recommended", "#31a354")):
        if c is None or c.speed is None:
            continue
        x, y = c.speed.tpot_s * 1e3, c.speed.tokens_per_s_per_gpu
        ax.scatter([x], [y], color=color, s=90, zorder=3)
        ax.annotate(f"{tag}: {c.label}", (x, y), textcoords="offset points", xytext=(8, 8), color=color)
    ax.axvline(s.workload.target_ms, color="#999999", linestyle="--", linewidth=1)
    ax.set_xlabel("TPOT (ms per output token, prefill interleaved)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{s.model_name} on {s.cluster.gpu.name}: isl {s.workload.prompt:,}, osl {s.workload.output:,}")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    shown = sorted(cands, key=lambda c: (c is not s.recommended, c.gpus, c.label))[:16]
    labels = [c.label for c in shown]
    parts = {"weights": [], "KV pool": [], "overheads": [], "free": []}  # type: dict[str, list[float]]
    for c in shown:
        m = c.memory
        assert m is not None
        kv = max(m.kv_budget, 0.0)
        parts["weights"].append(m.weights / GIB)
        parts["KV pool"].append(kv / GIB)
        parts["overheads"].append(m.overhead / GIB)
        parts["free"].append(max(m.total - m.weights - kv - m.overhead, 0) / GIB)
    left = [0.0] * len(shown)
    for (name, values), color in zip(parts.items(), ("#636363", "#3182bd", "#fdae6b", "#e5e5e5"), strict=True):
        bars.barh(labels, values, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    bars.invert_yaxis()
    bars.set_xlabel("GiB per GPU (fullest GPU of the unit)")
    bars.set_title("memory per GPU")
    bars.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return out.getvalue()
