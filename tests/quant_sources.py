"""Test helper: quantized sources written the way they are published, by the real libraries.

Block FP8: a tiny model made and saved by transformers (bf16, seeded), then each of its linear
projections quantized by transformers' own FineGrainedFP8 quantizer (``Fp8Quantize``, the op
``save_pretrained`` runs for an fp8 model) into ``X.weight`` F8_E4M3 + ``X.weight_scale_inv`` F32,
with the ``quantization_config`` DeepSeek-V3 / Qwen3-FP8 publish.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from safetensors.torch import save_file

from shardc.layout.model import model_from_config
from shardc.layout.quantization import quantizable

LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, initializer_range=0.2)


def save_tiny(root: Path, config_cls: str = "LlamaConfig", model_cls: str = "LlamaForCausalLM",
              seed: int = 5, **cfg) -> Path:
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**(LLAMA | cfg)))
    model.to(torch.bfloat16)
    for module in model.modules():  # DeepSeek's router and bias stay fp32, as transformers keeps them
        if hasattr(module, "e_score_correction_bias"):
            module.float()
    model.save_pretrained(root)
    return root


def fp8_block_source(bf16: Path, out: Path, block: tuple[int, int] = (32, 32), *,
                     block_config: dict | None = None) -> Path:
    """``bf16`` re-published as block-scaled FP8 in ``out``."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = json.loads((bf16 / "config.json").read_text())
    qcfg = block_config or {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": list(block)}
    targets = quantizable(model_from_config(cfg))
    from transformers import FineGrainedFP8Config

    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=list(block))))
    tensors: dict[str, torch.Tensor] = {}
    from safetensors import safe_open

    for f in sorted(bf16.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k)
                if k in targets:
                    q = op._quantize_one(k, t)
                    assert set(q) == {k, k + "_scale_inv"}, sorted(q)
                    tensors[k], tensors[k + "_scale_inv"] = q[k], q[k + "_scale_inv"].to(torch.float32)
                else:
                    tensors[k] = t
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# name -> (format, weights args) of compressed-tensors schemes as llm-compressor writes them
CT_SCHEMES = {
    "w4a16-group": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 32, "dynamic": False, "actorder": None}),
    "w8a16-channel": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                        "group_size": None, "dynamic": False}),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                        "strategy": "channel", "group_size": None, "dynamic": False}),
}


def ct_args(scheme: str):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**CT_SCHEMES[scheme][1])


def ct_source(bf16: Path, out: Path, scheme: str) -> Path:
    """``bf16`` re-published as compressed-tensors ``scheme``: values quantized by compressed-tensors'
    ``quantize`` with symmetric min-max scales in the model dtype (what its default observer
    gives), packed by its ``pack_to_int32``, under the names and config its compressors write."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from safetensors import safe_open

    fmt, wargs = CT_SCHEMES[scheme]
    args = ct_args(scheme)
    cfg = json.loads((bf16 / "config.json").read_text())
    targets = quantizable(model_from_config(cfg))
    qmax = {"int": float(2 ** (args.num_bits - 1) - 1), "float": 448.0}[wargs["type"]]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(bf16.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k)
                if k not in targets:
                    tensors[k] = t
                    continue
                g = wargs["group_size"] or t.shape[1]
                amax = t.float().reshape(t.shape[0], -1, g).abs().amax(-1)
                scale = (amax / qmax).clamp(min=1e-8).to(t.dtype)
                q = quantize(t, scale, None, args, dtype=torch.int8 if wargs["type"] == "int" else
                             torch.float8_e4m3fn)
                base = k.removesuffix(".weight")
                tensors[base + ".weight_scale"] = scale
                if fmt == "pack-quantized":
                    tensors[base + ".weight_packed"] = pack_to_int32(q, args.num_bits)
                    tensors[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
                else:
                    tensors[k] = q
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": wargs, "input_activations": None,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": None}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
