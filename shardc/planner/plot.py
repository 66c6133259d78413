"""`shardc plan --plot`: the candidates as a picture, rendered by matplotlib (the `plot` extra).

Left: tokens/s per GPU against TPOT for every feasible candidate, each swept over concurrency 1,
2, 4, ... up to what its KV cache holds (a thin curve), the point the planner chose for it marked;
the Pareto front over all those points (no other point is both faster per token and more
productive per GPU) drawn as a line with the candidates on it named, the recommendation and the
fastest alternative labelled, the TPOT target dashed. Right: per-GPU
memory of each candidate, stacked (weights, KV pool, overheads, free), as the table's bars draw it.
Returns the bytes (SVG with text kept as text, or PNG); the CLI writes them atomically.
"""

from __future__ import annotations

import io
from typing import Any

from ..errors import PlanError
from .gpus import GIB
from .records import Candidate, Search

FORMATS = ("svg", "png")


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """(TPOT, tokens/s per GPU, label) points no other beats on both (lower TPOT, higher
    tokens/s per GPU), by TPOT."""
    front: list[tuple[float, float, str]] = []
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or p[1] > front[-1][1]:
            front.append(p)
    return front


def _points(c: Candidate) -> list[tuple[float, float, str]]:
    """The candidate's concurrency sweep as (TPOT ms, tokens/s per GPU, label) points."""
    curve = c.curve or ((c.serving,) if c.serving is not None else ())
    return [(v.tpot_s * 1e3, v.tokens_per_s_per_gpu, c.label) for v in curve]


# where a tag may sit around its point (offset in points, horizontal alignment), tried in order
_SPOTS = ((8, 8, "left"), (8, -16, "left"), (-8, 8, "right"), (-8, -16, "right"), (8, 22, "left"),
          (8, -30, "left"), (-8, 22, "right"), (-8, -30, "right"), (8, 36, "left"), (8, -44, "left"))


def _place(ax: Any, renderer: Any, placed: list[Any], text: str, xy: tuple[float, float], color: str) -> None:
    """Annotate ``xy`` with ``text`` at the first spot whose box overlaps no label already placed
    (nor leaves the axes); the last spot when none is free. Its box joins ``placed``."""
    frame = ax.get_window_extent(renderer)
    for dx, dy, ha in _SPOTS:
        t = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, color=color)
        box = t.get_window_extent(renderer)
        inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        if inside and not any(box.overlaps(b) for b in placed):
            break
        if (dx, dy, ha) != _SPOTS[-1]:
            t.remove()
    placed.append(box)


def figure(s: Search) -> Any:
    """The picture as a matplotlib figure; PlanError when matplotlib is missing or nothing fits."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise PlanError("matplotlib is not installed", key="plot",
                        hint="pip install 'shardc[plot]'") from None
    cands = [c for c in s.candidates if c.fits and not c.skipped and c.speed is not None and c.memory is not None]
    if not cands:
        raise PlanError("no candidate fits: nothing to plot", key="plot", hint="see the reasons in the table")
    matplotlib.rcParams["svg.fonttype"] = "none"  # labels stay text in the SVG
    matplotlib.rcParams["svg.hashsalt"] = "shardc"  # the same figures give the same bytes
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    # each candidate's concurrency sweep (1, 2, 4, ... its KV limit) as a thin curve: what it
    # trades in TPOT for tokens/s per GPU; the Pareto front over every point of every curve
    everything = []
    for c in cands:
        pts = _points(c)
        everything += pts
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#bdbdbd", linewidth=0.8, marker=".",
                markersize=4, zorder=1)
    ax.plot([], [], color="#bdbdbd", linewidth=0.8, marker=".", label="candidate at concurrency 1, 2, 4, ...")
    front = pareto(everything)
    ax.plot([p[0] for p in front], [p[1] for p in front], color="#2c7fb8", linewidth=2, label="Pareto front", zorder=2)
    for i, (x, y, label) in enumerate(front):  # each candidate named where its run on the front ends
        if i == len(front) - 1 or front[i + 1][2] != label:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -12), fontsize=7, color="#2c7fb8")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([t for t in (5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500)
                   if min(p[0] for p in everything) * 0.8 <= t <= max(p[0] for p in everything) * 1.25])
    ax.axvline(s.workload.target_ms, color="#999999", linestyle="--", linewidth=1, label="TPOT target")
    picks = [(c, tag, color) for c, tag, color in ((s.recommended, "recommended", "#31a354"),
                                                   (s.alternative, "fastest alternative", "#e6550d"))
             if c is not None and c.speed is not None]
    for c, _, color in picks:
        assert c.speed is not None
        ax.scatter([c.speed.tpot_s * 1e3], [c.speed.tokens_per_s_per_gpu], color=color, s=90, zorder=4)
    ax.set_xlabel("TPOT (ms per output token, prefill interleaved)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{s.model_name} on {s.cluster.gpu.name}: isl {s.workload.prompt:,}, osl {s.workload.output:,}",
                 parse_math=False)  # the model's name is text: a '$' in it is not mathtext (#41)
    # below the axes, where no curve, point or tag can be under it
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize="small", frameon=False)
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
    # the tags last, once the layout is final: each where its box overlaps no other label
    fig.canvas.draw()
    canvas = fig.canvas
    assert isinstance(canvas, FigureCanvasAgg)  # matplotlib.use("Agg") above
    renderer = canvas.get_renderer()
    placed = [t.get_window_extent(renderer) for t in ax.texts]  # the front's names
    for c, tag, color in picks:
        assert c.speed is not None
        _place(ax, renderer, placed, f"{tag}: {c.label}", (c.speed.tpot_s * 1e3, c.speed.tokens_per_s_per_gpu), color)
    return fig


def render(s: Search, fmt: str) -> bytes:
    """The picture as ``fmt`` (svg or png) bytes; PlanError when matplotlib is missing or nothing fits."""
    if fmt not in FORMATS:
        raise PlanError(f"unknown picture format {fmt!r}", key="plot", hint="name the file .svg or .png")
    import matplotlib.pyplot as plt

    fig = figure(s)
    out = io.BytesIO()
    fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return out.getvalue()
