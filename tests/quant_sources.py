"""Test helper: quantized sources written the way they are published, by the real libraries.

Block FP8: a tiny model made and saved by transformers (bf16, seeded), then each of its linear
projections quantized by transformers' own FineGrainedFP8 quantizer (``Fp8Quantize``, the op
``save_pretrained`` runs for an fp8 model) into ``X.weight`` F8_E4M3 + ``X.weight_scale_inv`` F32,
with the ``quantization_config`` DeepSeek-V3 / Qwen3-FP8 publish.

compressed-tensors: ``ct_model_compressor_source`` publishes a checkpoint the way
llm-compressor saves one, through compressed-tensors' own ``ModelCompressor`` (its config.json is
the library's, key for key), and ``ct_reference`` is the library's decompression of a weight.
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
    # DeepSeek's router and bias stay fp32, as transformers keeps them (_keep_in_fp32_modules_strict);
    # MiniMax-M2's bias sits on its MoE block (experts too), and transformers keeps it and its router
    # in the model dtype
    fp32 = getattr(model, "_keep_in_fp32_modules_strict", None)
    for module in model.modules():
        if fp32 and hasattr(module, "e_score_correction_bias"):
            module.float()
    model.save_pretrained(root)
    return root


def fp8_block_source(bf16: Path, out: Path, block: tuple[int, int] = (32, 32), *,
                     block_config: dict | None = None) -> Path:
    """``bf16`` re-published as block-scaled FP8 in ``out``; the modules a ``block_config``'s
    ``modules_to_not_convert`` names (as MiniMax-M2 publishes one) stay as saved, matched by
    transformers' own rule (``should_convert_module``, what its FP8 quantizer skips by).

    ``scale_fmt: ue8m0`` (DeepSeek-V3.2's config): the quantizer runs with that scale_fmt, so
    transformers' own ``Fp8Quantize`` rounds each block's scale up to the next power of two and
    quantizes the block by exactly that scale; it returns the scales as E8M0 bytes, which the
    published checkpoint stores as F32 (powers of two): saved here as F32 too (exact)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizers_utils import should_convert_module

    cfg = json.loads((bf16 / "config.json").read_text())
    qcfg = block_config or {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": list(block)}
    skip = qcfg.get("modules_to_not_convert") or None
    targets = {k for k in quantizable(model_from_config(cfg)) if should_convert_module(k.removesuffix(".weight"), skip)}
    from transformers import FineGrainedFP8Config

    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(
        weight_block_size=list(block), scale_fmt=qcfg.get("scale_fmt", "float"))))
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


# -- compressed-tensors sources made by compressed-tensors' own ModelCompressor -------------------

def ct_scheme(name: str):
    """A QuantizationScheme targeting Linear, from compressed-tensors' presets (group sizes cut to
    32 for the tiny models' 128-wide rows): the schemes shardc reads."""
    import compressed_tensors.quantization.quant_scheme as presets
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    base = {"w4a16-group": "W4A16", "w4a16-channel": "W4A16", "w8a16-group": "W8A16", "w8a8-channel": "INT8_W8A8",
            "fp8-channel": "FP8_DYNAMIC", "fp8-tensor": "FP8_DYNAMIC",
            # the microscaled presets as they are (16- and 32-value blocks fit the tiny rows)
            "nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16", "mxfp4": "MXFP4A16", "mxfp4a4": "MXFP4", "mxfp8": "MXFP8A16"}[name]
    scheme = {k: v.model_copy() for k, v in getattr(presets, base).items()}
    if name.endswith("-group"):
        scheme["weights"] = QuantizationArgs(**scheme["weights"].model_dump() | {"group_size": 32})
    elif name == "w4a16-channel":
        scheme["weights"] = QuantizationArgs(**scheme["weights"].model_dump() | {"strategy": "channel",
                                                                                 "group_size": None})
    elif name == "fp8-tensor":
        scheme["weights"] = QuantizationArgs(**scheme["weights"].model_dump() | {"strategy": "tensor"})
    return QuantizationScheme(targets=["Linear"], **scheme)


def _linear_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The checkpoint's tensors as a module tree under their own names: every 2-D ``X.weight``
    (but the embedding) an ``nn.Linear`` ``X``, the rest plain parameters. transformers 5 fuses
    MoE experts into 3-D parameters, which compressed-tensors does not target; llm-compressor
    calibrates MoE models through per-expert Linear modules, saved under these same names."""
    root = torch.nn.Module()

    def node(path: list[str], linear: torch.nn.Module | None = None) -> torch.nn.Module:
        mod = root
        for i, part in enumerate(path):
            if not hasattr(mod, part):
                mod.add_module(part, linear if linear is not None and i == len(path) - 1 else torch.nn.Module())
            mod = getattr(mod, part)
        return mod

    for name, t in tensors.items():
        path = name.split(".")
        if path[-1] == "weight" and t.ndim == 2 and "embed_tokens" not in name:
            lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(t, requires_grad=False)
            node(path[:-1], lin)
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = node(path)
        if not hasattr(mod, leaf):
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def ct_model_compressor_source(ckpt: Path, out: Path, scheme: str, dtype: torch.dtype = torch.bfloat16,
                               ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """``ckpt`` (a 16-bit checkpoint transformers saved) cast to ``dtype`` and published as
    compressed-tensors ``scheme`` the way llm-compressor saves one: the QuantizationConfig applied
    (``apply_quantization_config``), each weight's scale from its min/max by compressed-tensors'
    ``calculate_qparams`` (the default observer's formula; held in the weight's dtype, as
    ``initialize_qparams`` makes it), then ``ModelCompressor.compress_model``, the state dict
    saved and ``ModelCompressor.update_config`` writing the quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from safetensors import safe_open

    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k)
                tensors[k] = t.to(dtype) if t.is_floating_point() else t
    model = _linear_tree(tensors)
    sch = ct_scheme(scheme)
    config = QuantizationConfig(config_groups={"group_0": sch}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config, show_progress=False)
    args = sch.weights
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.float()
            g = w.reshape(w.shape[0], -1, args.group_size) if args.strategy in ("group", "tensor_group") else \
                w.reshape(w.shape[0], 1, -1) if args.strategy == "channel" else w.reshape(1, 1, -1)
            gs = None
            if hasattr(mod, "weight_global_scale"):  # NVFP4: the tensor's global scale first, as llm-compressor
                gs = generate_gparam(w.amin(), w.amax()).reshape(mod.weight_global_scale.shape)
                mod.weight_global_scale.data = gs.to(mod.weight_global_scale.dtype)
            if hasattr(mod, "input_global_scale"):  # what calibration over activations in [-4, 4] gives
                mod.input_global_scale.data = generate_gparam(torch.tensor(-4.0), torch.tensor(4.0)).reshape(
                    mod.input_global_scale.shape).to(mod.input_global_scale.dtype)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
            mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    compressor.update_config(str(out))
    return out


def ct_reference(raw: dict[str, torch.Tensor], name: str, block: dict) -> torch.Tensor:
    """compressed-tensors' own decompression of source weight ``name`` (the format's compressor,
    as ``ModelCompressor.decompress_model`` runs it): the weight in its scale's dtype."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = block["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    base = name.removesuffix(".weight")
    local = {k.removeprefix(base + "."): v for k, v in raw.items() if k.startswith(base + ".weight")}
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.decompress(local, scheme)["weight"]


# -- ModelOpt NVFP4, written as ModelOpt's HF export writes it ------------------------------------

MODELOPT_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def modelopt_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's NVFP4 quantizer written out (modelopt is not installed here): ``NVFP4QTensor``
    in modelopt/torch/quantization/qtensor/nvfp4_tensor.py. weight_scale_2 = amax / (6 * 448)
    (``get_weights_scaling_factor_2``, a 0-d tensor: ``reduce_amax`` squeezes scalars); the block
    scale = block amax / (6 * weight_scale_2), 0 -> 1, cast to float8_e4m3fn
    (``get_weights_scaling_factor``); values w / (scale.float() * weight_scale_2) rounded to E2M1
    by ``_cast_fp4`` (searchsorted on the bounds 0.25 ... 5, ties at 0.75, 1.75, 2.5 up), packed
    ``(q[..., 1::2] << 4) | q[..., 0::2]``."""
    w = w.float()
    s2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.reshape(w.shape[0], -1, 16)
    scale = blocks.abs().amax(-1) / (6.0 * s2)
    scale[scale == 0] = 1.0
    scale = scale.to(torch.float8_e4m3fn)
    scaled = (blocks / (scale.to(torch.float32) * s2).unsqueeze(-1)).reshape(w.shape)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    sign = (scaled < 0).to(torch.uint8)
    mag = scaled.abs()
    ordinal = torch.searchsorted(bounds, mag, out_int32=True).to(torch.uint8)
    ordinal += torch.any(mag.unsqueeze(-1) == bounds[[1, 3, 5]], dim=-1).to(torch.uint8)
    q = (sign << 3) + ordinal
    return (q[..., 1::2] << 4) | q[..., 0::2], scale, s2


def modelopt_dequantize(packed: torch.Tensor, scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """``NVFP4QTensor.dequantize`` (the non-fused path), float32 before its cast."""
    lut = torch.tensor(MODELOPT_E2M1)
    q = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long)
    q[:, 1::2], q[:, 0::2] = (packed >> 4).long(), (packed & 0x0F).long()
    per_block = scale.to(torch.float32) * s2
    return (lut[q].reshape(q.shape[0], -1, 16) * per_block.unsqueeze(-1)).reshape(q.shape)


def modelopt_source(ckpt: Path, out: Path, ignore: tuple[str, ...] = ("lm_head",), inputs: bool = True,
                    kv_fp8: bool = False) -> Path:
    """``ckpt`` published as ModelOpt NVFP4 in ``out``: each linear projection not excluded (vLLM's
    rule: equal, contained or an fnmatch wildcard) as ``X.weight`` U8, ``X.weight_scale`` F8_E4M3,
    ``X.weight_scale_2`` F32 [] and (W4A4) ``X.input_scale`` F32 []; config.json's
    quantization_config in the form NVIDIA's checkpoints carry (GLM-5.1-NVFP4's). ``kv_fp8``: its FP8
    KV cache too, ``kv_cache_scheme`` and every layer's ``self_attn.k_proj.k_scale`` /
    ``v_proj.v_scale`` scalars (ModelOpt's names, vLLM's ``maybe_remap_kv_scale_name``), excluded
    attention or not."""
    from fnmatch import fnmatch

    from safetensors import safe_open

    cfg = json.loads((ckpt / "config.json").read_text())
    targets = {k for k in quantizable(model_from_config(cfg))
               if not any(e == k[:-7] or e in k[:-7] or fnmatch(k[:-7], e) for e in ignore)}
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                t = s.get_tensor(k)
                if k in targets:
                    base = k.removesuffix("weight")
                    tensors[k], tensors[k + "_scale"], tensors[k + "_scale_2"] = modelopt_quantize(t)
                    if inputs:  # a static activation amax of 4.0, as calibration would record one
                        tensors[base + "input_scale"] = torch.tensor(4.0 / (6.0 * 448.0))
                else:
                    tensors[k] = t
                if kv_fp8 and k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                    kv = k.removesuffix("_proj.weight")[-1]  # k or v
                    tensors[k.removesuffix("weight") + f"{kv}_scale"] = torch.tensor(0.0125)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": args, "targets": ["Linear"]} | ({"input_activations": args} if inputs else {})
    cfg["quantization_config"] = {"config_groups": {"group_0": group}, "ignore": list(ignore), "quant_algo": "NVFP4",
                                  "producer": {"name": "modelopt", "version": "0.43.0"}, "quant_method": "modelopt"}
    if kv_fp8:
        cfg["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
