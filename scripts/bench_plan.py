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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

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


if __name__ == "__main__":
    main()
