"""Seeded synthetic checkpoints of any family and shape, for tests and benchmarks.

Writes a valid Hugging Face checkpoint directory: config.json, one or several
``model-0000i-of-0000n.safetensors`` files (+ ``model.safetensors.index.json`` when several).
Values are N(0, 0.02) for weights and 1 + N(0, 0.02) for norms, seeded per tensor name, so the same
arguments give the same bytes. Tensors are generated in row chunks: memory stays small even for
real Llama-3-70B shapes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..formats.safetensors import ShardWriter
from ..layout.dtypes import from_torch_name, torch_name
from ..layout.model import model_from_config
from ..layout.tensors import source_tensors


def llama_config(
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 96,
    tie_word_embeddings: bool = False,
    architecture: str = "LlamaForCausalLM",
    torch_dtype: str = "bfloat16",
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[architecture],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


LLAMA3_70B_SHAPES = dict(
    hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, vocab_size=128256,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    max_position_embeddings=131072, rope_theta=500000.0,
)


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def write_checkpoint(
    out_dir: str | Path, config: dict[str, Any], *, num_files: int = 1, seed: int = 0,
    chunk_elems: int = 1 << 24,
) -> Path:
    """Write a synthetic checkpoint for ``config`` into ``out_dir`` and return it."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model_from_config(config)
    dtype_name = from_torch_name(model.torch_dtype)
    assert dtype_name is not None, model.torch_dtype  # the configs this writes name a torch dtype
    tdtype = getattr(torch, torch_name(dtype_name))
    tensors = source_tensors(model)
    groups = [tensors[i::num_files] for i in range(num_files)] if num_files > 1 else [tensors]
    groups = [sorted(g, key=lambda t: t.name) for g in groups]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if num_files == 1 else f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        w = ShardWriter(out / fname, [(t.name, dtype_name, t.shape) for t in group], {"format": "pt"})
        try:
            for t in group:
                g = torch.Generator().manual_seed(_seed(seed, t.name))
                cols = t.shape[-1] if len(t.shape) > 1 else 1
                total = t.shape[0]
                step = max(1, chunk_elems // cols)
                for r0 in range(0, total, step):
                    rows = min(step, total - r0)
                    x = torch.randn((rows, *t.shape[1:]), generator=g) * 0.02
                    if "norm" in t.name:
                        x += 1.0
                    w.write(x.to(tdtype).reshape(-1).view(torch.uint8).numpy())
                weight_map[t.name] = fname
        except BaseException:
            w.abort()
            raise
        w.commit()
    if num_files > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return out
