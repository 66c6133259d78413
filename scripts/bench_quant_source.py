#!/usr/bin/env python3
"""Building from a block-scaled FP8 source (#31): build time against ``cp -r`` of the source, and
peak memory with twice the layers (target ~1.0: bounded by one tensor, not by the model).

Writes two seeded synthetic Llama-shaped checkpoints (L and 2L layers), re-published as
DeepSeek-style block FP8 (``X.weight`` F8_E4M3 + ``X.weight_scale_inv`` F32 per 128x128 block,
``quant_method: fp8``), then for each and each plan dtype (``source``: kept as stored, ``bf16``:
dequantized, ``int8``: dequantized and requantized; tp=2) times the build --repeat times
(interleaved with a ``cp -r`` of the source) and prints: median seconds, the ratio to ``cp -r``,
and the build process's peak RSS; then RSS(2L) / RSS(L) per dtype.

Each source tensor is mapped once (Materializer keeps one tensor's value at a time: the F8 view
for ``source``, its float32 dequantization for ``bf16``/``int8``), so reading is one pass and
the dequantized form held is one tensor's per build thread.

Example: python scripts/bench_quant_source.py --layers 16 --repeat 3     (~1 GiB of disk)
"""

from __future__ import annotations

import argparse
import json
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

H, INTER, VOCAB, BLOCK = 1024, 3584, 32000, 128
DTYPES = ("source", "bf16", "int8")


def llama(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
            "torch_dtype": "bfloat16"}


def to_fp8(src: Path, out: Path) -> Path:
    """Re-publish a 16-bit checkpoint as block FP8 (transformers' Fp8Quantize arithmetic)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardc.layout.model import model_from_config
    from shardc.layout.quantization import quantizable

    cfg = json.loads((src / "config.json").read_text())
    targets = quantizable(model_from_config(cfg))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k).to(torch.bfloat16)
                if k not in targets:
                    tensors[k] = t
                    continue
                r, c = t.shape
                blocks = t.float().reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
                inv = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
                tensors[k] = (blocks / inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(r, c)
                tensors[k + "_scale_inv"] = inv
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


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
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # internal: write one FP8 source here
    a = ap.parse_args()
    if a.make:  # in a process of its own: the timed builds are forked from a parent without torch,
        # whose pages would otherwise count in their peak RSS
        to_fp8(write_checkpoint(a.make.with_name(a.make.name + "-bf16"), llama(a.layers)), a.make)
        shutil.rmtree(a.make.with_name(a.make.name + "-bf16"))
        return
    work = ROOT / "build" / "bench-quant-source"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
    try:
        results, medians, sizes = {}, {}, {}
        for layers in (a.layers, 2 * a.layers):
            src = tmp / f"fp8-{layers}"
            subprocess.run([sys.executable, __file__, "--layers", str(layers), "--make", str(src)], check=True)
            size = sum(f.stat().st_size for f in src.iterdir())
            cp = [["cp", "-r", str(src), str(tmp / "copy")]]
            cmds = {}
            for dtype in DTYPES:
                plan = tmp / f"{dtype}-{layers}.yaml"
                plan.write_text(yaml.safe_dump({"replica_group": {"name": f"bench-{dtype}", "tp_degree": 2,
                                                                  "pp_degree": 1, "dtype": dtype,
                                                                  "gpus_per_replica": 2},
                                                "model": {"source": str(src)}}))
                cmds[dtype] = [sys.executable, "-m", "shardc.cli", "build", str(plan), "--out",
                               str(tmp / "out"), "-q"]
            timed(cmds["source"])  # hashes the source once (cached for the timed runs)
            shutil.rmtree(tmp / "out")
            runs: dict[str, list] = {k: [] for k in ("cp", *DTYPES)}
            for _ in range(a.repeat):
                runs["cp"].append(timed(cp[0]))
                shutil.rmtree(tmp / "copy")
                for dtype in DTYPES:
                    runs[dtype].append(timed(cmds[dtype]))
                    shutil.rmtree(tmp / "out")
            cp_s = statistics.median(t for t, _ in runs["cp"])
            sizes[layers], medians[layers, "cp"] = size, cp_s
            print(f"{layers} layers, FP8 source {size / 2**20:.0f} MiB: cp -r median {cp_s:.2f} s")
            for dtype in DTYPES:
                med, peak = statistics.median(t for t, _ in runs[dtype]), max(r for _, r in runs[dtype])
                results[layers, dtype], medians[layers, dtype] = peak, med
                print(f"  dtype {dtype:6s} median {med:6.2f} s  {med / cp_s:5.2f}x cp -r  peak RSS "
                      f"{peak / 2**20:7.1f} MiB  (runs: {', '.join(f'{t:.2f}' for t, _ in runs[dtype])})")
        # the L more layers' cost: process start, imports and config reads cancel out
        extra = (sizes[2 * a.layers] - sizes[a.layers]) / 2**30
        cp_more = medians[2 * a.layers, "cp"] - medians[a.layers, "cp"]
        for dtype in DTYPES:
            more = medians[2 * a.layers, dtype] - medians[a.layers, dtype]
            print(f"marginal, dtype {dtype}: {more / extra:6.2f} s/GiB of source vs cp -r {cp_more / extra:5.2f} "
                  f"s/GiB ({more / cp_more if cp_more > 0 else float('nan'):.1f}x)")
        for dtype in DTYPES:
            print(f"peak RSS {2 * a.layers} / {a.layers} layers, dtype {dtype}: "
                  f"{results[2 * a.layers, dtype] / results[a.layers, dtype]:.2f}x (target ~1.0)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
