#!/usr/bin/env python3
"""Building a mixture-of-experts model streams like a dense one (#29): peak memory is bounded by the
largest tensor, not by the expert count, and the bytes/s match a dense model's.

Writes three seeded synthetic checkpoints of the same hidden size: a Mixtral-shaped one with E
experts, the same with 2E experts (twice the bytes), and a dense Llama-shaped one of about the
size of the 2E one; builds each with a tp=2 expert-parallel (MoE) or tp=2 (dense) bf16 plan from an
fp16 source, --repeat times, interleaved, and prints per build: median seconds, source GB/s, and
peak RSS of the build process; then the ratios 2E/E for RSS (target ~1.0: bounded by the largest
tensor) and MoE/dense for GB/s (target ~1.0).

Example: python scripts/bench_moe_build.py --experts 8 --layers 2 --repeat 3     (~2.5 GiB of disk)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardc.compiler.synthetic import write_checkpoint  # noqa: E402

H, INTER, VOCAB = 1024, 3584, 32000


def mixtral(experts: int, layers: int) -> dict:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
            "num_local_experts": experts, "num_experts_per_tok": 2, "torch_dtype": "float16"}


def llama(inter: int, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
            "torch_dtype": "float16"}


def timed(cmd: list[str]) -> tuple[float, int]:
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return time.perf_counter() - t0, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    work = ROOT / "build" / "bench-moe"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
    e = a.experts
    # the dense model's MLP as wide as 2E experts' MLPs: about the 2E checkpoint's bytes
    cases = {f"moe-{e}": (mixtral(e, a.layers), True), f"moe-{2 * e}": (mixtral(2 * e, a.layers), True),
             "dense": (llama(2 * e * INTER, a.layers), False)}
    runs: dict[str, dict] = {}
    try:
        for name, (cfg, ep) in cases.items():
            src = write_checkpoint(tmp / f"src-{name}", cfg)
            plan = tmp / f"{name}.yaml"
            rg = {"name": f"bench-{name}", "tp_degree": 2, "pp_degree": 1, "dtype": "bf16", "gpus_per_replica": 2}
            if ep:
                rg["expert_parallel"] = True
            plan.write_text(yaml.safe_dump({"replica_group": rg, "model": {"source": str(src)}}))
            cmd = [sys.executable, "-m", "shardc.cli", "build", str(plan), "--out", str(tmp / f"out-{name}"), "-q"]
            timed(cmd)  # hashes the source once (cached for the timed runs)
            shutil.rmtree(tmp / f"out-{name}")
            runs[name] = {"cmd": cmd, "bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
                          "times": [], "rss": []}
        for _ in range(a.repeat):
            for name, r in runs.items():
                dt, rss = timed(r["cmd"])
                r["times"].append(dt)
                r["rss"].append(rss)
                shutil.rmtree(tmp / f"out-{name}")
        for name, r in runs.items():
            med = statistics.median(r["times"])
            r["rate"], r["peak"] = r["bytes"] / med / 1e9, max(r["rss"])
            print(f"{name:8s} {r['bytes'] / 2**30:5.2f} GiB  median {med:6.2f} s  {r['rate']:5.2f} GB/s  "
                  f"peak RSS {r['peak'] / 2**20:7.1f} MiB  (runs: {', '.join(f'{t:.2f}' for t in r['times'])})")
        one, two, dense = runs[f"moe-{e}"], runs[f"moe-{2 * e}"], runs["dense"]
        print(f"peak RSS, {2 * e} experts / {e} experts: {two['peak'] / one['peak']:.2f}x "
              f"(the checkpoint is {two['bytes'] / one['bytes']:.2f}x; target ~1.0)")
        print(f"build GB/s, MoE ({2 * e} experts, expert parallel) / dense of the same size: "
              f"{two['rate'] / dense['rate']:.2f}x (target ~1.0)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
