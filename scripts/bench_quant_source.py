#!/usr/bin/env python3
"""Building from quantized sources (#31 block FP8, #46 NVFP4 / MXFP4): build time against
``cp -r`` of the source, and peak memory with twice the layers (target ~1.0, #46: at most 1.15:
bounded by one tensor, not by the model).

Writes two seeded synthetic Llama-shaped checkpoints (L and 2L layers) and re-publishes them in
each of ``--formats`` (default: all three):

- ``fp8-block``: DeepSeek-style block FP8 (``X.weight`` F8_E4M3 + ``X.weight_scale_inv`` F32 per
  128x128 block, ``quant_method: fp8``);
- ``nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (preset ``NVFP4``, W4A4: ``X.weight_packed``,
  F8_E4M3 ``X.weight_scale`` per 16, ``X.weight_global_scale``, ``X.input_global_scale``);
- ``mxfp4``: compressed-tensors ``mxfp4-pack-quantized`` (preset ``MXFP4A16``: ``X.weight_packed``,
  E8M0 ``X.weight_scale`` per 32).

The compressed-tensors sources are published by the library itself, one tensor at a time (fast
enough for GiB-sized checkpoints on 2 cores): the checkpoint's Linear tree on the meta device gets
``apply_quantization_config``; each weight's global scale (``generate_gparam``) and block scales
(``calculate_qparams`` over each group's min/max) are computed as llm-compressor's min/max observer
does, then the format's compressor (``NVFP4PackedCompressor`` / ``MXFP4PackedCompressor``)
``compress``es the module's state dict; the config.json's ``quantization_config`` is written by
``ModelCompressor.from_pretrained_model(...).update_config`` (status ``compressed``, as
``compress_model`` leaves it), as ``tests/quant_sources.py`` ``ct_model_compressor_source`` does
with a whole model. lm_head stays bf16 (``ignore: [lm_head]``).

Then for each format, each layer count and each plan dtype (``source``: kept as stored, ``bf16``:
dequantized, ``int8``: dequantized and requantized; tp=2) it times the build --repeat times
(interleaved with a ``cp -r`` of that source) and prints: median seconds, the ratio to ``cp -r``,
and the build process's peak RSS (ru_maxrss); then the marginal cost of the L extra layers and
RSS(2L) / RSS(L) per dtype. With any format but ``fp8-block`` alone, each format's lines follow a
``== format ==`` header and a closing table (Markdown) gathers the figures per format and dtype.

Each source tensor is mapped once (Materializer keeps one tensor's value at a time: the stored
view for ``source``, its float32 dequantization for ``bf16``/``int8``), so reading is one pass and
the dequantized form held is one tensor's per build thread. At a few hundred MiB the peak RSS of
identical builds spreads by ~10-15% (docs/performance.md, #46, says where from).

Example: python scripts/bench_quant_source.py --layers 16 --repeat 3     (~1 GiB of disk at a time)
         python scripts/bench_quant_source.py --formats nvfp4,mxfp4 --layers 4 --repeat 2
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
# --formats name: (label in the printed lines, compressed-tensors preset or None for block FP8)
FORMATS = {"fp8-block": ("FP8", None), "nvfp4": ("NVFP4", "NVFP4"), "mxfp4": ("MXFP4", "MXFP4A16")}


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


def to_ct(src: Path, out: Path, preset: str) -> Path:
    """Re-publish a 16-bit checkpoint as compressed-tensors ``preset`` with the library's own
    scale calculation and compressor, one tensor at a time (the module docstring)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(src.glob("*.safetensors"))
    shapes = {}
    for f in files:
        with safe_open(f, "pt") as s:
            shapes |= {k: s.get_slice(k).get_shape() for k in s.keys()}  # noqa: SIM118
    # the checkpoint's modules on the meta device, every 2-D X.weight but the embedding an
    # nn.Linear X (tests/quant_sources.py _linear_tree; the other tensors are no Linear's, so they
    # are neither targeted nor in the ignore list)
    root = torch.nn.Module()
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name:
            *path, leaf = name.removesuffix(".weight").split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.add_module(leaf, torch.nn.Linear(shape[1], shape[0], bias=False, device="meta",
                                                 dtype=torch.bfloat16))
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(root, config, show_progress=False)
    model_compressor = ModelCompressor.from_pretrained_model(root)  # also sets each scheme's format
    modules = dict(root.named_modules())

    tensors = {}
    for f in files:
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k).to(torch.bfloat16)
                base = k.removesuffix(".weight")
                mod = modules.get(base) if k.endswith(".weight") else None
                if mod is None or not hasattr(mod, "weight_scale"):  # not a Linear, or ignored
                    tensors[k] = t
                    continue
                scheme, args = mod.quantization_scheme, mod.quantization_scheme.weights
                w = t.float()
                state = {"weight": t}
                gs = None
                if hasattr(mod, "weight_global_scale"):  # NVFP4: the tensor's global scale first
                    gs = generate_gparam(w.amin(), w.amax()).reshape(mod.weight_global_scale.shape)
                    state["weight_global_scale"] = gs.to(mod.weight_global_scale.dtype)
                if hasattr(mod, "input_global_scale"):  # what calibration over activations in [-4, 4] gives
                    state["input_global_scale"] = generate_gparam(torch.tensor(-4.0), torch.tensor(4.0)).reshape(
                        mod.input_global_scale.shape).to(mod.input_global_scale.dtype)
                groups = w.reshape(w.shape[0], -1, args.group_size)
                scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
                # held in the weight's dtype, as initialize_qparams makes the parameter
                state["weight_scale"] = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
                if hasattr(mod, "weight_zero_point"):  # initialized to zeros; compress drops it (symmetric)
                    state["weight_zero_point"] = torch.zeros(mod.weight_zero_point.shape,
                                                             dtype=mod.weight_zero_point.dtype)
                compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
                for name, v in compressor.compress(state, scheme).items():
                    tensors[f"{base}.{name}"] = v.contiguous()
                del w, groups, state
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    del tensors
    (out / "config.json").write_text((src / "config.json").read_text())
    # what compress_model leaves before save_pretrained runs update_config
    model_compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    model_compressor.update_config(str(out))
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
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated source formats among {', '.join(FORMATS)} (default: all)")
    ap.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # internal: write one source here
    ap.add_argument("--make-format", default="fp8-block", help=argparse.SUPPRESS)  # ... in this format
    a = ap.parse_args()
    if a.make:  # in a process of its own: the timed builds are forked from a parent without torch,
        # whose pages would otherwise count in their peak RSS
        bf16 = write_checkpoint(a.make.with_name(a.make.name + "-bf16"), llama(a.layers))
        preset = FORMATS[a.make_format][1]
        if preset is None:
            to_fp8(bf16, a.make)
        else:
            to_ct(bf16, a.make, preset)
        shutil.rmtree(bf16)
        return
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if not formats or set(formats) - set(FORMATS):
        ap.error(f"--formats: choose among {', '.join(FORMATS)} (got {a.formats!r})")
    many = formats != ["fp8-block"]  # fp8-block alone prints exactly what it printed before #46
    work = ROOT / "build" / "bench-quant-source"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
    table = []
    try:
        for fmt in formats:
            label = FORMATS[fmt][0]
            if many:
                print(f"== {fmt} ==")
            results, medians, sizes = {}, {}, {}
            for layers in (a.layers, 2 * a.layers):
                src = tmp / f"{fmt}-{layers}"
                subprocess.run([sys.executable, __file__, "--layers", str(layers), "--make", str(src),
                                "--make-format", fmt], check=True)
                size = sum(f.stat().st_size for f in src.iterdir())
                cp = [["cp", "-r", str(src), str(tmp / "copy")]]
                cmds = {}
                for dtype in DTYPES:
                    plan = tmp / f"{dtype}-{layers}.yaml"
                    plan.write_text(yaml.safe_dump({"replica_group": {"name": f"bench-{dtype}", "tp_degree": 2,
                                                                      "pp_degree": 1, "dtype": dtype,
                                                                      "gpus_per_replica": 2},
                                                    "model": {"source": str(src)}}))
                    # each source's builds of a plan name keep their record (build --manifests-dir)
                    # apart: build refuses to replace the record of a build from another source
                    cmds[dtype] = [sys.executable, "-m", "shardc.cli", "build", str(plan), "--out",
                                   str(tmp / "out"), "--manifests-dir", str(tmp / "manifests" / src.name), "-q"]
                timed(cmds["source"])  # hashes the source once (cached for the timed runs)
                shutil.rmtree(tmp / "out")
                runs: dict[str, list] = {k: [] for k in ("cp", *DTYPES)}
                for _ in range(a.repeat):
                    runs["cp"].append(timed(cp[0]))
                    shutil.rmtree(tmp / "copy")
                    for dtype in DTYPES:
                        runs[dtype].append(timed(cmds[dtype]))
                        shutil.rmtree(tmp / "out")
                shutil.rmtree(src)
                cp_s = statistics.median(t for t, _ in runs["cp"])
                sizes[layers], medians[layers, "cp"] = size, cp_s
                print(f"{layers} layers, {label} source {size / 2**20:.0f} MiB: cp -r median {cp_s:.2f} s")
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
                table.append((fmt, dtype, *((sizes[n], medians[n, dtype], medians[n, dtype] / medians[n, "cp"],
                                             results[n, dtype]) for n in (a.layers, 2 * a.layers))))
        if many:
            n1, n2 = a.layers, 2 * a.layers
            print(f"\n| format | dtype | build s, {n1} / {n2} layers | vs cp -r | peak RSS MiB | "
                  f"RSS {n2}/{n1} (target <= 1.15) |")
            print("|---|---|---|---|---|---|")
            for fmt, dtype, (s1, t1, r1, m1), (s2, t2, r2, m2) in table:
                print(f"| {fmt} ({s1 / 2**20:.0f} / {s2 / 2**20:.0f} MiB) | {dtype} | {t1:.2f} / {t2:.2f} | "
                      f"{r1:.2f}x / {r2:.2f}x | {m1 / 2**20:.0f} / {m2 / 2**20:.0f} | {m2 / m1:.2f}x |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
