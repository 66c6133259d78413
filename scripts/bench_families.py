#!/usr/bin/env python3
"""Build speed per model family, against Llama's, measured in the same run (#28).

For every registered family (--dense: the dense ones; MoE memory and expert-count scaling:
scripts/bench_moe_build.py), its first real-size preset (e.g. llama-3.1-8b, qwen3-8b,
minimax-m2.5) cut to the layers that make --gib GiB (the same fixed costs against the same bytes;
a MoE preset with its experts halved until two layers fit) is written as a seeded synthetic checkpoint, then built
with the same tp=2 bf16 plan (an fp16 source cast to bf16: every byte read, converted, written)
--repeat times, the families interleaved so the VM's drift hits them alike. Printed per family:
the median build seconds, source GB/s, and that rate as a ratio of the Llama family's rate
(target: 1.0, "the build of a new family runs at the same bytes/s as Llama's").

Example: python scripts/bench_families.py --gib 3 --repeat 3     (3 GiB of disk per family)
"""

from __future__ import annotations

import argparse
import copy
import math
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
from shardc.errors import ShardcError  # noqa: E402
from shardc.layout.families import FAMILIES  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.layout.tensors import valid_tp_degrees  # noqa: E402


def _bytes(cfg: dict) -> int:
    if isinstance(cfg.get("layer_types"), list):  # per-layer lists follow the layer count
        cfg = {**cfg, "layer_types": cfg["layer_types"][: cfg["num_hidden_layers"]]}
    m = model_from_config(cfg)
    return sum(2 * math.prod(r.shape) for r in m.spec.tensors(m))


EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")


def _fewer_experts(cfg: dict, gib: float) -> dict:
    """A mixture-of-experts preset with its routed experts halved until two layers fit in ``gib``
    (MiniMax-M2: 256 experts are 7 GiB a layer), as long as the family still reads the config (top-k,
    groups): the same tensor shapes, so the same bytes/s, at a size the disk and the run can take."""
    key = next((k for k in EXPERT_KEYS if isinstance(cfg.get(k), int)), None)
    while key is not None and _bytes({**cfg, "num_hidden_layers": 2}) > gib * 2**30:
        fewer = {**cfg, **{k: cfg[k] // 2 for k in EXPERT_KEYS if isinstance(cfg.get(k), int)}}
        try:
            model_from_config(fewer)
        except ShardcError:
            break
        cfg = fewer
    return cfg


# A family with no preset (no published config.json to write one from: GLM-4.5) is measured on a
# published model's sizes under its own keys: the bytes/s of a build depend on the tensors' shapes
BORROWED = {
    # Qwen3-30B-A3B's sizes (the qwen3-30b-a3b preset: 128 experts of 768, top 8, 32 heads over 4 of
    # 128) as a GLM-4.5 config, its first layer dense as GLM-4.5's is
    "glm4_moe": ("qwen3-30b-a3b", {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16"}),
    # Qwen/Qwen3.5-35B-A3B's text model (aiconfigurator 0.12's copy of its config.json) as a Qwen3-Next
    # config: 40 layers, every 4th full attention, 256 experts of 512
    "qwen3_next": ("qwen3.5-35b-a3b", {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 512, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
        "vocab_size": 248320, "torch_dtype": "bfloat16"}),
}


def config_for(family, gib: float) -> tuple[str, dict]:
    """The family's first preset (or its ``BORROWED`` sizes) cut to the number of layers that makes
    about ``gib`` GiB (at least one): every family's build then pays the same fixed costs (start-up,
    imports, side files) against the same bytes. A mixture-of-experts preset keeps fewer experts
    (``_fewer_experts``)."""
    if family.presets:
        name, preset = next(iter(family.presets.items()))
        config = preset.config
    else:
        shape, config = BORROWED[family.name]
        name = f"{shape} sizes"
    cfg = _fewer_experts(copy.deepcopy(config), gib)
    one, two = _bytes({**cfg, "num_hidden_layers": 1}), _bytes({**cfg, "num_hidden_layers": 2})
    layers = max(1, round((gib * 2**30 - one) / (two - one)) + 1)
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    cfg["torch_dtype"] = "float16"  # the build casts to bf16: every byte converted
    return name, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=3.0, help="checkpoint size per family [default: 3]")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="[default: build/bench-families]")
    ap.add_argument("--dense", action="store_true", help="the dense families only")
    ap.add_argument("--families", default=None,
                    help="comma-separated family names, llama always first [default: every family]")
    a = ap.parse_args()
    work = Path(a.workdir or ROOT / "build" / "bench-families")
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
    runs: dict[str, dict] = {}
    try:
        wanted = None if a.families is None else {"llama", *a.families.split(",")}
        for fam in FAMILIES:
            if wanted is not None and fam.name not in wanted:
                continue
            if a.dense and fam.forward(model_from_config(config_for(fam, a.gib)[1])).moe:
                continue  # --dense: mixture-of-experts builds are scripts/bench_moe_build.py's
            preset, cfg = config_for(fam, a.gib)
            src = write_checkpoint(tmp / f"src-{fam.name}", cfg)
            tp = next(t for t in valid_tp_degrees(model_from_config(cfg)) if t >= 2)
            plan = tmp / f"{fam.name}.yaml"
            plan.write_text(yaml.safe_dump({
                "replica_group": {"name": f"bench-{fam.name}", "tp_degree": tp, "pp_degree": 1,
                                  "dtype": "bf16", "gpus_per_replica": tp},
                "model": {"source": str(src)}}))
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            runs[fam.name] = {"preset": preset, "plan": plan, "bytes": size, "tp": tp, "times": [],
                              "layers": cfg["num_hidden_layers"]}
            # first build hashes the source (cached afterwards for every plan): not timed
            out = tmp / f"out-{fam.name}"
            subprocess.run([sys.executable, "-m", "shardc.cli", "build", str(plan), "--out", str(out), "-q",
                            "--manifests-dir", str(tmp / "records")], check=True)
            shutil.rmtree(out)
        for _ in range(a.repeat):
            for fam, r in runs.items():
                out = tmp / f"out-{fam}"
                subprocess.run(["sync"], check=True)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "shardc.cli", "build", str(r["plan"]), "--out", str(out),
                                "-q", "--manifests-dir", str(tmp / "records")], check=True)
                r["times"].append(time.perf_counter() - t0)
                shutil.rmtree(out)
        base = None
        for fam, r in runs.items():
            med = statistics.median(r["times"])
            rate = r["bytes"] / med / 1e9
            base = base or rate
            print(f"{fam:8s} {r['preset']:20s} {r['layers']:2d} layers tp={r['tp']}  {r['bytes'] / 2**30:5.2f} GiB  "
                  f"median {med:6.2f} s  {rate:5.2f} GB/s  = {rate / base:4.2f}x llama's bytes/s  "
                  f"(runs: {', '.join(f'{t:.2f}' for t in r['times'])})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
