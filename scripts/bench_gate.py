#!/usr/bin/env python3
"""Gate scoring throughput: the shardc runtime vs transformers on the same model, tokens and dtype.

Scores the golden set (pydoc, non-overlapping windows) with the demo model (SmolLM2-135M, bf16):
  * transformers LlamaForCausalLM in this process: forward, fp32 log-softmax, per-token NLL;
  * the shardc runtime at tp1pp1 (one worker process) and tp3pp2 (six processes, gloo), doing the
    same work per window. Runtime figures are the workers' compute time after every rank has loaded
    (process start-up and loading are reported separately).
Each measurement is repeated, interleaved (background load hits both sides alike), and the best run
kept; that best-of-N tokens/s is checked against the issue's target, tp1pp1 >= 0.8x transformers.
Because a shared machine's load comes in bursts, per-window rates (best and median; the first window,
cold on both sides, is dropped) and the process CPU time of the single-process runs are reported too.

Usage: python scripts/bench_gate.py [--max-tokens 4096] [--window 512] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _build(src: Path, out: Path, tp: int, pp: int) -> Path:
    from shardc.compiler.compile import build
    from shardc.layout.plan import plan_from_dict

    name = f"bench-demo-tp{tp}pp{pp}-bf16"
    plan = plan_from_dict({
        "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": "bf16",
                          "gpus_per_replica": tp * pp},
        "model": {"source": str(src)},
    })
    return build(plan, out_dir=out / name).manifest_path


def _hf_score(src: Path, windows: list[list[int]]) -> tuple[float, float, float, list[float]]:
    """(seconds, CPU seconds, summed NLL, per-window seconds) for transformers scoring every window
    like the runtime does."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    x = torch.tensor(windows)
    total = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    marks = [t0]
    with torch.inference_mode():
        for w in x.split(1):
            logits = model(w).logits
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            total += float(-lp.gather(-1, w[:, 1:, None]).double().sum())
            marks.append(time.perf_counter())
    per = [b - a for a, b in itertools.pairwise(marks)]
    return time.perf_counter() - t0, time.process_time() - c0, total, per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-tp3pp2", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from setup_demo import ensure_demo_model
    from tokenizers import Tokenizer

    from shardc.runtime.api import open_build, score
    from shardc.runtime.gate import golden_text, make_windows

    src = ensure_demo_model(ROOT / ".cache" / "demo")
    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(golden_text("pydoc")[0]).ids
    windows = make_windows(ids, a.window, a.max_tokens)
    tokens = len(windows) * a.window
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="shardc-bench-") as tmp:
        builds = {"tp1pp1": _build(src, Path(tmp), 1, 1)}
        if not a.skip_tp3pp2:
            builds["tp3pp2"] = _build(src, Path(tmp), 3, 2)
        hf_best, hf_cpu, nll_hf = float("inf"), float("inf"), 0.0
        per_window: dict[str, list[float]] = {"transformers": [], **{k: [] for k in builds}}
        best = {k: {"seconds": float("inf")} for k in builds}
        for _ in range(a.repeats):  # interleaved, so background load hits both sides alike
            s, c, nll_hf, per = _hf_score(src, windows)
            hf_best, hf_cpu = min(hf_best, s), min(hf_cpu, c)
            per_window["transformers"] += per[1:]  # the first window is cold on both sides
            for k, manifest in builds.items():
                t0 = time.perf_counter()
                r = score(open_build(manifest), windows, timeout_s=300)
                wall = time.perf_counter() - t0
                assert r is not None  # the built-in launcher: this process holds the result
                per_window[k] += r.batch_seconds.tolist()[1:]  # the first includes pipeline fill
                if r.seconds < best[k]["seconds"]:
                    best[k] = {"seconds": r.seconds, "load_seconds": r.load_seconds, "wall": wall,
                               "nll_sum": float(r.nll.sum()), "pipeline": r.pipeline}
                if k == "tp1pp1":
                    best[k]["cpu_seconds"] = min(best[k].get("cpu_seconds", float("inf")),
                                                 r.cpu_seconds)
    results["transformers"] = {"seconds": hf_best, "tokens_per_s": tokens / hf_best, "nll_sum": nll_hf,
                               "cpu_seconds": hf_cpu}
    for k, v in best.items():
        v["tokens_per_s"] = tokens / v["seconds"]
        v["ratio_vs_transformers"] = v["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        results[k] = v
    hf_w = per_window["transformers"]
    for k, per in per_window.items():  # per-window rates: robust to bursts of background load
        results[k]["best_window_tokens_per_s"] = a.window / min(per)
        results[k]["median_window_tokens_per_s"] = a.window / statistics.median(per)
        results[k]["best_window_ratio_vs_transformers"] = min(hf_w) / min(per)
        results[k]["median_window_ratio_vs_transformers"] = statistics.median(hf_w) / statistics.median(per)
    results["tp1pp1"]["cpu_ratio_vs_transformers"] = (
        results["transformers"]["cpu_seconds"] / results["tp1pp1"]["cpu_seconds"])
    summary = {"model": "SmolLM2-135M bf16", "windows": len(windows), "window": a.window,
               "tokens": tokens, "repeats": a.repeats, "results": results}
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"scoring {tokens} golden tokens ({len(windows)} x {a.window}), bf16, best of {a.repeats}")
    t = results["transformers"]
    print(f"  transformers      {t['tokens_per_s']:8.1f} tok/s  ({t['seconds']:.2f}s); windows: best "
          f"{t['best_window_tokens_per_s']:.1f}, median {t['median_window_tokens_per_s']:.1f} tok/s")
    for k in builds:
        v = results[k]
        print(f"  shardc {k:10s} {v['tokens_per_s']:8.1f} tok/s  ({v['seconds']:.2f}s compute, "
              f"{v['wall']:.2f}s wall incl. {v['load_seconds']:.2f}s load)  "
              f"ratio {v['ratio_vs_transformers']:.3f}x")
        print(f"      windows: best {v['best_window_tokens_per_s']:.1f} tok/s "
              f"({v['best_window_ratio_vs_transformers']:.3f}x), median "
              f"{v['median_window_tokens_per_s']:.1f} tok/s ({v['median_window_ratio_vs_transformers']:.3f}x)")
        pipe = v.get("pipeline") or {}
        if pipe and k != "tp1pp1":
            print(f"      pipeline: {pipe['micro_batches']} micro-batches, bubble measured "
                  f"{pipe['bubble_measured']:.2f} vs formula {pipe['bubble_formula']:.2f}")
    cpu_ratio = results["tp1pp1"]["cpu_ratio_vs_transformers"]
    print(f"  CPU time: transformers {t['cpu_seconds']:.2f}s, shardc tp1pp1 "
          f"{results['tp1pp1']['cpu_seconds']:.2f}s -> tokens per CPU-second ratio {cpu_ratio:.3f}x")
    ratio = results["tp1pp1"]["ratio_vs_transformers"]
    verdict = "ok" if ratio >= 0.8 else "BELOW TARGET"
    print(f"tp1pp1 / transformers = {ratio:.3f} (best-of-{a.repeats} tokens/s over the golden set; "
          f"target >= 0.8): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
