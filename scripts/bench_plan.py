#!/usr/bin/env python3
"""Benchmark `shardc plan` against bare interpreter start-up, measured in the same run.

`shardc plan` must answer in well under a second and never import torch. Absolute times depend
on the machine, so the figure reported is a ratio: the median wall time of
`shardc plan --model llama-3.3-70b --gpu a100-80gb` over the median wall time of `python -c pass`
(the floor any Python CLI pays). Also reported: the in-process search time (the 70B case, and the
largest search of the README: 405B on one 16-GPU H200 domain, every dtype), and whether torch was
imported.

Example:  python scripts/bench_plan.py            (7 runs each)
          python scripts/bench_plan.py --runs 15 --json

--peer compares the speed model with NVIDIA's aiconfigurator 0.12 (the `bench` extra: pip install
'shardc[bench]'; it runs on CPU from its shipped, measured vLLM kernel tables) on the grid of issue
#33: Llama-3.1 8B and 70B, bf16 and fp8, H100-SXM and H200, tp 1, 2, 4, 8, concurrency 1 to the KV
limit, isl 1536 / osl 1024. It prints shardc / aiconfigurator per cell for TPOT and tokens/s/GPU
(target: within +-15 % on every cell) and fails when a cell is outside. aiconfigurator's answers
are cached (--peer-cache) so a rerun costs only shardc's arithmetic. --fit searches the efficiency
parameters (SpeedParams: hbm_efficiency, compute_efficiency, layer_overhead_us, step_overhead_ms)
that minimise the worst cell, one set for every cell, and prints them.

          python scripts/bench_plan.py --peer                 (~3 min the first time)
          python scripts/bench_plan.py --peer --fit
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN_ARGS = ["plan", "--model", "llama-3.3-70b", "--gpu", "a100-80gb"]


def wall(cmd: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` runs of a child process (output discarded; failure aborts)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return times


MODELS = {"llama-3.1-8b": "8B", "llama-3.1-70b": "70B"}
SYSTEMS = {"h100-sxm": "h100_sxm", "h200": "h200_sxm"}
DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ISL, OSL = 1536, 1024
TOLERANCE = 0.15


def peer_cells() -> list[tuple[str, str, str, int, int]]:
    """(model, gpu, dtype, tp, concurrency) of the grid shardc says fit: concurrency up to the KV limit
    of a deployment whose longest request is isl + osl (max-model-len 2,560, aiconfigurator's max_seq_len)."""
    from shardc.planner.formulas import Workload
    from shardc.planner.gpus import Cluster, get_gpu
    from shardc.planner.models import resolve_model
    from shardc.planner.search import search

    cells = []
    for model in MODELS:
        spec = resolve_model(model)[0]
        for gpu in SYSTEMS:
            for dt in DTYPES:
                for tp in (1, 2, 4, 8):
                    w = Workload(isl=ISL, osl=OSL, max_model_len=ISL + OSL)
                    s = search(spec, Cluster(get_gpu(gpu)), w, dtypes=[dt], tps=[tp], pps=[1])
                    c = s.candidates[0]
                    if not c.fits:
                        continue
                    limit = min(c.kv.sequences, 256)
                    cells += [(model, gpu, dt, tp, b) for b in BATCHES if b <= limit]
    return cells


def run_peer(cells: list[tuple[str, str, str, int, int]], cache: Path) -> dict[str, dict[str, float]]:
    """aiconfigurator's TTFT, TPOT and tokens/s/GPU per cell (vLLM backend, agg mode), cached by cell."""
    import logging
    import tempfile

    done: dict[str, dict[str, float]] = json.loads(cache.read_text()) if cache.exists() else {}
    todo = [c for c in cells if _key(c) not in done]
    if not todo:
        return done
    try:
        from aiconfigurator.cli.api import cli_estimate
    except ImportError:
        raise SystemExit("aiconfigurator is not installed: pip install 'shardc[bench]'") from None
    from shardc.layout.model import PRESETS

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        for cell in todo:
            model, gpu, dt, tp, b = cell
            path = Path(tmp) / model
            if not path.exists():
                path.mkdir()
                (path / "config.json").write_text(json.dumps(PRESETS[model]))
            r = cli_estimate(str(path), SYSTEMS[gpu], backend_name="vllm", isl=ISL, osl=OSL, batch_size=b,
                             tp_size=tp, gemm_quant_mode=DTYPES[dt], kvcache_quant_mode="bfloat16",
                             fmha_quant_mode="bfloat16")
            latency = float(r.ttft) + (OSL - 1) * float(r.tpot)
            done[_key(cell)] = {"ttft_ms": float(r.ttft), "tpot_ms": float(r.tpot),
                                "tokens_per_s_per_gpu": b * OSL / (latency / 1e3) / tp}
            cache.write_text(json.dumps(done, indent=1, sort_keys=True))
            print(f"  aiconfigurator {cell}: TPOT {float(r.tpot):.2f} ms", file=sys.stderr)
    return done


def _key(cell: tuple[str, str, str, int, int]) -> str:
    return "/".join(map(str, cell))


_SEARCHES: dict[str, object] = {}


def shardc_cells(cells: list[tuple[str, str, str, int, int]], speed: object | None = None) -> dict[str, dict[str, float]]:
    """shardc's figures per cell at a fixed concurrency (``speed``: SpeedParams to try, else the
    defaults). The memory side of a cell is worked out once; a new ``speed`` reruns only the speed model."""
    from shardc.planner.candidate import _speed
    from shardc.planner.formulas import SpeedParams, Workload
    from shardc.planner.gpus import Cluster, get_gpu
    from shardc.planner.models import resolve_model
    from shardc.planner.search import search

    out = {}
    for cell in cells:
        model, gpu, dt, tp, b = cell
        s = _SEARCHES.get(_key(cell))
        if s is None:
            w = Workload(isl=ISL, osl=OSL, max_model_len=ISL + OSL, concurrency=b, target_tpot_ms=1e6)
            s = search(resolve_model(model)[0], Cluster(get_gpu(gpu)), w, dtypes=[dt], tps=[tp], pps=[1])
            _SEARCHES[_key(cell)] = s
        c = s.candidates[0]  # type: ignore[attr-defined]
        if not c.fits:
            continue
        s.speed = speed or SpeedParams()  # type: ignore[attr-defined]
        _speed(s, c)
        v = c.serving
        out[_key(cell)] = {"ttft_ms": v.ttft_s * 1e3, "tpot_ms": v.tpot_s * 1e3,
                           "tokens_per_s_per_gpu": v.tokens_per_s_per_gpu}
    return out


def ratios(ours: dict[str, dict[str, float]], peer: dict[str, dict[str, float]]) -> dict[str, tuple[float, float, float]]:
    return {k: tuple(ours[k][f] / peer[k][f] for f in ("tpot_ms", "tokens_per_s_per_gpu", "ttft_ms"))  # type: ignore[misc]
            for k in ours if k in peer}


def worst(r: dict[str, tuple[float, float, float]]) -> float:
    return max(max(abs(a - 1), abs(b - 1)) for a, b, _ in r.values())


FITTED = ("hbm_efficiency", "w8_hbm_efficiency", "kv_hbm_efficiency", "compute_efficiency",
          "fp8_compute_efficiency", "link_efficiency", "layer_overhead_us", "step_overhead_ms")


def fit(cells: list[tuple[str, str, str, int, int]], peer: dict[str, dict[str, float]]) -> object:
    """One parameter set for the whole grid (FITTED; the rest stay): Nelder-Mead
    (scipy, which aiconfigurator brings) on the 8-norm of the cells' log ratios for TPOT and
    tokens/s/GPU, a smooth stand-in for the worst cell that still sees the others."""
    import dataclasses
    import math

    from scipy.optimize import minimize

    from shardc.planner.formulas import SpeedParams

    start = SpeedParams()

    def params(x: list[float]) -> SpeedParams:
        v = dict(zip(FITTED, x, strict=True))
        for k in FITTED[:6]:
            v[k] = min(max(v[k], 0.05), 0.95)  # a share of a peak: never all of it
        v["layer_overhead_us"] = max(v["layer_overhead_us"], 0.0)
        v["step_overhead_ms"] = max(v["step_overhead_ms"], 0.0)
        return dataclasses.replace(start, **v)

    def loss(x: list[float]) -> float:
        r = ratios(shardc_cells(cells, params(x)), peer)
        logs = [math.log(a) for a, b, _ in r.values()] + [math.log(b) for a, b, _ in r.values()]
        return (sum(v ** 8 for v in logs) / len(logs)) ** (1 / 8)

    x0 = [getattr(start, k) for k in FITTED]
    res = minimize(loss, x0, method="Nelder-Mead", options={"maxfev": 1200, "xatol": 1e-3, "fatol": 1e-5})
    best = params(list(res.x))
    rounded = dataclasses.replace(best, **{k: round(getattr(best, k), 2 if k.endswith("efficiency") else 1)
                                           for k in FITTED})
    print(f"  fitted ({res.nfev} evaluations): " + ", ".join(f"{k}={getattr(rounded, k):g}" for k in FITTED),
          file=sys.stderr)
    return rounded


def peer_main(a: argparse.Namespace) -> None:
    cells = peer_cells()
    if a.quick:
        cells = [c for c in cells if c[4] in (1, 16, 64)]
    peer = run_peer(cells, Path(a.peer_cache))
    speed = fit(cells, peer) if a.fit else None
    r = ratios(shardc_cells(cells, speed), peer)
    if a.json:
        print(json.dumps({"cells": {k: {"tpot": v[0], "tokens_per_s_per_gpu": v[1], "ttft": v[2]}
                                    for k, v in r.items()}, "worst": worst(r)}, indent=1, sort_keys=True))
    else:
        print(f"{'model':<15}{'gpu':<10}{'dtype':<6}{'tp':>3}{'conc':>6}{'TPOT':>8}{'tok/s/GPU':>11}{'TTFT':>8}"
              "   (shardc / aiconfigurator 0.12, vLLM)")
        for k, (t, x, f) in r.items():
            m, g, d, tp, b = k.split("/")
            flag = "" if max(abs(t - 1), abs(x - 1)) <= TOLERANCE else "  <- outside +-15 %"
            print(f"{m:<15}{g:<10}{d:<6}{tp:>3}{b:>6}{t:>8.2f}{x:>11.2f}{f:>8.2f}{flag}")
        print(f"worst |ratio - 1| over {len(r)} cells (TPOT, tokens/s/GPU): {worst(r):.1%} (target {TOLERANCE:.0%})")
    if worst(r) > TOLERANCE:
        raise SystemExit("FAIL: a cell is outside the tolerance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", action="store_true", help="compare the speed model with aiconfigurator")
    ap.add_argument("--peer-cache", default=str(Path(tempfile_dir()) / "shardc-bench-plan-peer.json"))
    ap.add_argument("--fit", action="store_true", help="with --peer: fit the efficiency parameters")
    ap.add_argument("--quick", action="store_true", help="with --peer: concurrency 1, 16, 64 only")
    a = ap.parse_args()
    if a.peer:
        peer_main(a)
        return

    wall([sys.executable, "-c", "pass"], 1)  # warm the page cache before measuring either side
    base = wall([sys.executable, "-c", "pass"], a.runs)
    plan = wall([sys.executable, "-m", "shardc.cli", *PLAN_ARGS], a.runs)
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys; from click.testing import CliRunner; from shardc.cli import main; "
         f"r = CliRunner().invoke(main, {PLAN_ARGS!r}); print(r.exit_code, 'torch' in sys.modules)"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout.split()

    from shardc.planner.gpus import Cluster, get_gpu
    from shardc.planner.models import resolve_model
    from shardc.planner.search import search

    model, name, source = resolve_model("llama-3.3-70b")
    t0 = time.perf_counter()
    search(model, Cluster(get_gpu("a100-80gb")), model_name=name, source=source)
    search_s = time.perf_counter() - t0
    big, name, source = resolve_model("llama-3.1-405b")
    t0 = time.perf_counter()
    search(big, Cluster(get_gpu("h200"), gpus_per_node=16), model_name=name, source=source)
    big_s = time.perf_counter() - t0

    res = {
        "python_pass_s": statistics.median(base),
        "shardc_plan_s": statistics.median(plan),
        "ratio": statistics.median(plan) / statistics.median(base),
        "search_s": search_s,
        "search_405b_h200x16_s": big_s,
        "exit_code": int(probe[0]),
        "torch_imported": probe[1] == "True",
        "runs": a.runs,
    }
    if a.json:
        print(json.dumps(res, indent=1, sort_keys=True))
        return
    print(f"python -c pass          {res['python_pass_s'] * 1e3:8.1f} ms (median of {a.runs})")
    print(f"shardc plan (70B, A100) {res['shardc_plan_s'] * 1e3:8.1f} ms (median of {a.runs})")
    print(f"ratio                   {res['ratio']:8.2f}x  (target: total well under 1 s)")
    print(f"search in-process       {res['search_s'] * 1e3:8.1f} ms")
    print(f"search 405B, 16 x H200  {res['search_405b_h200x16_s'] * 1e3:8.1f} ms")
    print(f"torch imported          {res['torch_imported']}")
    if res["torch_imported"] or res["exit_code"] != 0 or res["shardc_plan_s"] >= 1.0:
        raise SystemExit("FAIL: shardc plan imported torch, failed, or took a second or more")


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


if __name__ == "__main__":
    main()
