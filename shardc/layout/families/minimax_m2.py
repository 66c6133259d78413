"""MiniMax-M2 (MiniMaxM2ForCausalLM; transformers' modeling_minimax_m2.py), also the architecture of
MiniMax-M2.5 and M2.7.

Attention is Llama's grouped q/k/v/o without biases, plus an RMSNorm of q over the whole projected
width (``self_attn.q_norm``: num_attention_heads x head_dim) and of k over its own
(``self_attn.k_norm``: num_key_value_heads x head_dim) before rope. The norm weights are cut with
their heads (q's ``column``, k's ``kv_column``: a whole KV head per rank, copied, when
num_key_value_heads < tp), and the runtime all-reduces the fp32 sum of squares over TP, each KV
head counted once (runtime/qk.py). Rope is partial: the first ``rotary_dim`` dimensions of each
head turn NeoX-style, the rest pass (transformers 5 writes ``rope_parameters.partial_rotary_factor``
= rotary_dim / head_dim; every spelling given must agree); theta defaults to 5,000,000.

Every layer routes ``num_experts_per_tok`` of ``num_local_experts`` experts
(``block_sparse_moe.experts.N.w1`` gate, ``w3`` up, ``w2`` down, each of ``intermediate_size``):
router logits in the model dtype (``block_sparse_moe.gate``: transformers keeps no fp32 copy, nor
of the bias), sigmoid scores in fp32, ``block_sparse_moe.e_score_correction_bias`` added for the
choice only, top-k, the chosen scores renormalized, the weights kept in fp32 when they scale the
expert outputs (transformers' MiniMaxM2TopKRouter). No groups, no shared experts.

The published config.json's own keys (transformers reads none of them): ``use_qk_norm`` true,
``qk_norm_type`` per_layer, ``use_routing_bias`` true, ``scoring_func`` sigmoid,
``shared_intermediate_size`` 0 and ``attn_type_list`` all 1 (softmax attention in every layer)
are what the forward computes; any other value is refused with one line. Multi-token-prediction
modules (``num_mtp_modules``, the published checkpoint's ``model.layers.62.*`` to ``64.*``;
``use_mtp``, ``mtp_transformer_layers``) are not part of the forward: transformers' loader skips
them, vLLM drops them, and a build leaves a checkpoint's copy out (``Family.unused``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    KV_COLUMN,
    REPLICATED,
    Family,
    Forward,
    Moe,
    Preset,
    RopeReader,
    Row,
    attention_rows,
    count,
    norm_rows,
    outer_rows,
    refuse,
)
from .moe import expert_rows, flag, read_routing, router_row

if TYPE_CHECKING:
    from .family import ModelShape

ROUTER = "block_sparse_moe.gate.weight"
BIAS = "block_sparse_moe.e_score_correction_bias"
EXPERT = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
          "block_sparse_moe.experts.{e}.w2.weight")
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
THETA = 5000000.0  # transformers' MiniMaxM2Config.default_theta, when a config gives none


def _choice(cfg: dict[str, Any], key: str, allowed: Any, why: str) -> None:
    value = cfg.get(key)
    if value is not None and value != allowed:
        raise refuse(key, value, f"is not computed by shardc (only {allowed!r}: {why})")


def rotary_dims(cfg: dict[str, Any], head_dim: int) -> int:
    """The rotated dimensions of a head: ``rotary_dim`` (the published spelling), or
    head_dim x ``partial_rotary_factor`` truncated (transformers' formula), top level or in the
    rope object; all given must agree; none: every dimension."""
    found: list[tuple[str, Any, int]] = []
    dim = cfg.get("rotary_dim")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 2 <= dim <= head_dim or dim % 2:
            raise refuse("rotary_dim", dim, f"must be an even whole number from 2 to head_dim={head_dim}")
        found.append(("rotary_dim", dim, dim))
    where = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    rope = cfg.get(where)
    for key, block in (("partial_rotary_factor", cfg), (f"{where}.partial_rotary_factor", rope)):
        factor = block.get("partial_rotary_factor") if isinstance(block, dict) else None
        if factor is None:
            continue
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise refuse(key, factor, "must be a number above 0 and at most 1")
        turned = int(head_dim * factor)
        if turned < 2 or turned % 2:
            raise refuse(key, factor, f"turns {turned} of head_dim={head_dim} dimensions; rope turns pairs")
        found.append((key, factor, turned))
    for key, value, turned in found[1:]:
        if turned != found[0][2]:
            first, given, dims = found[0]
            raise refuse(key, value, f"turns {turned} dimensions of each head where {first}={given!r} turns {dims}",
                         hint="give one spelling (transformers 5 writes rope_parameters)")
    return found[0][2] if found else head_dim


def factor_rotary_dims(cfg: dict[str, Any], head_dim: int, default: float) -> int:
    """``rotary_dims`` for a family whose transformers class reads ``partial_rotary_factor`` only
    (top level or in the rope object; both given must agree), ``default`` where neither gives it:
    ``rotary_dim`` is not read, as transformers' and vLLM's GLM-4.5 and Qwen3-Next ignore it."""
    where = cfg.get("rope_parameters") if cfg.get("rope_parameters") is not None else cfg.get("rope_scaling")
    given = cfg.get("partial_rotary_factor") is not None or (
        isinstance(where, dict) and where.get("partial_rotary_factor") is not None)
    factors = {k: v for k, v in cfg.items() if k != "rotary_dim"}
    if not given:
        factors["partial_rotary_factor"] = default
    return rotary_dims(factors, head_dim)


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = count(cfg, "hidden_size") or 1, count(cfg, "num_attention_heads") or 1
    head_dim = count(cfg, "head_dim") or hidden // heads
    experts, top_k = read_routing(cfg, "num_experts")  # transformers maps num_experts to num_local_experts
    if cfg.get("attention_bias"):
        raise refuse("attention_bias", cfg["attention_bias"], "is not computed by shardc for MiniMax-M2 "
                     "(transformers' MiniMax-M2 has no attention biases; vLLM would read q/k/v biases)")
    if not flag(cfg, "use_qk_norm", True):
        raise refuse("use_qk_norm", False, "is not computed by shardc (transformers' MiniMax-M2 always norms q and k)")
    _choice(cfg, "qk_norm_type", "per_layer", "one norm over all heads, as transformers computes it")
    if not flag(cfg, "use_routing_bias", True):
        raise refuse("use_routing_bias", False, "is not computed by shardc (transformers' MiniMax-M2 always "
                     "adds e_score_correction_bias to the scores it chooses by)")
    _choice(cfg, "scoring_func", "sigmoid", "transformers' MiniMax-M2 scores by sigmoid")
    shared = cfg.get("shared_intermediate_size")
    if shared not in (None, 0):
        raise refuse("shared_intermediate_size", shared, "is not computed by shardc (MiniMax-M2 as transformers "
                     "computes it has no shared expert)")
    kinds = cfg.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(k != 1 or isinstance(k, bool) for k in kinds)):
        raise refuse("attn_type_list", kinds, "is not computed by shardc (only 1, softmax attention, in every "
                     "layer: transformers' MiniMax-M2 has no other)")
    return {"experts": experts, "top_k": top_k, "activation": cfg.get("hidden_act", "silu"),
            "rotary_dim": rotary_dims(cfg, head_dim), "mtp": count(cfg, "num_mtp_modules", 0)}


def rope(cfg: dict[str, Any], reader: RopeReader) -> tuple[float, dict[str, Any] | None]:
    """The rope from either spelling, theta defaulting to MiniMax-M2's own (``THETA``)."""
    params = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        cfg = {**cfg, "rope_theta": THETA}
    return reader(cfg)


def unused(m: ModelShape, name: str) -> bool:
    """A multi-token-prediction module's tensor (model.layers.{num_hidden_layers + i}.*, i below
    num_mtp_modules): vLLM drops these, transformers' loader skips them, a build leaves them out."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and m.num_layers <= int(layer.group(1)) < m.num_layers + m.options["mtp"]


def tensors(m: ModelShape) -> list[Row]:
    o, hd = m.options, m.head_dim
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        # the whole-width q/k norms, cut with their heads (the runtime all-reduces their sums of squares)
        rows += [Row(p + Q_NORM, (m.num_heads * hd,), COLUMN), Row(p + K_NORM, (m.num_kv_heads * hd,), KV_COLUMN)]
        rows += attention_rows(m, p, qkv_bias=False, o_bias=False)
        rows += [router_row(m, p, ROUTER, o["experts"]), Row(p + BIAS, (o["experts"],), REPLICATED)]
        rows += expert_rows(m, p, EXPERT, o["experts"], m.intermediate_size)
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    moe = Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=True, weights_fp32=True,
              sparse=(True,) * m.num_layers, router=ROUTER, expert=EXPERT, scoring="sigmoid_bias", score_bias=BIAS)
    rotary = o["rotary_dim"] if o["rotary_dim"] < m.head_dim else None
    return Forward(activation=o["activation"], moe=moe, qk_norm_whole=True, rotary_dim=rotary)


# MiniMaxAI/MiniMax-M2.5's config.json as aiconfigurator 0.12 ships it
# (aiconfigurator_core/model_configs/MiniMaxAI--MiniMax-M2.5_config.json), less its auto_map (remote
# code shardc never runs) and its quantization_config (MINIMAX_FP8, below); every value copied from it
MINIMAX_M25 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "num_hidden_layers": 62,
    "hidden_size": 3072, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 1536, "vocab_size": 200064, "num_experts_per_tok": 8, "num_local_experts": 256,
    "max_position_embeddings": 196608, "rope_theta": 5000000, "rotary_dim": 64, "hidden_act": "silu",
    "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False, "use_qk_norm": True,
    "qk_norm_type": "per_layer", "use_routing_bias": True, "use_mtp": True, "mtp_transformer_layers": 1,
    "num_mtp_modules": 3, "shared_intermediate_size": 0, "scoring_func": "sigmoid",
    "transformers_version": "4.46.1",
}
# MiniMaxAI/MiniMax-M2.7's (aiconfigurator_core/model_configs/MiniMaxAI--MiniMax-M2.7_config.json, the same
# two keys left out): M2.5's keys and values but for these, every key compared: attn_type_list (62 entries,
# each 1), dtype bfloat16 and max_position_embeddings 204800
MINIMAX_M27 = {**MINIMAX_M25, "attn_type_list": [1] * 62, "dtype": "bfloat16", "max_position_embeddings": 204800}
# Both configs' quantization_config, verbatim (block FP8, 128 x 128 scales; the routers, their correction
# biases and lm_head kept in 16 bits: layout/quant_formats/fp8_block.py reads modules_to_not_convert)
MINIMAX_FP8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}

# nvidia/MiniMax-M2.5-NVFP4's config.json (aiconfigurator_core/model_configs/nvidia--MiniMax-M2.5-NVFP4_config.json,
# less auto_map): M2.5's keys and values plus these, every key compared; and its quantization_config:
# ModelOpt NVFP4 (W4A4) with an FP8 KV cache, every layer's attention and router left out (the 125-entry
# ignore list written by its rule; layout/quant_formats/modelopt.py). Config and block were compared with
# aiconfigurator's copy when written: equal, key for key, but auto_map.
MINIMAX_M25_NVFP4 = {**MINIMAX_M25, "attention_dropout": 0.0, "attn_type_list": [1] * 62, "bos_token_id": 1,
                     "dtype": "bfloat16", "eos_token_id": 2, "initializer_range": 0.02, "output_router_logits": False,
                     "partial_rotary_factor": 0.5, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
                     "sliding_window": None, "transformers_version": "4.57.1"}
_NVFP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
MINIMAX_NVFP4 = {
    "config_groups": {"group_0": {"input_activations": _NVFP4_ARGS, "weights": _NVFP4_ARGS, "targets": ["Linear"]}},
    "ignore": ["lm_head", *sorted(e for i in range(62) for e in (f"model.layers.{i}.block_sparse_moe.gate",
                                                                 f"model.layers.{i}.self_attn*"))],
    "quant_algo": "NVFP4", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.0.1.dev507+gbb6639d33"}, "quant_method": "modelopt",
}

FAMILY = Family(
    name="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    model_types={"MiniMaxM2ForCausalLM": "minimax_m2"},
    read=read, tensors=tensors, forward=forward, rope=rope, unused=unused,
    presets={"minimax-m2.5": Preset(MINIMAX_M25, ("MiniMaxAI/MiniMax-M2.5",), quantization=MINIMAX_FP8),
             "minimax-m2.7": Preset(MINIMAX_M27, ("MiniMaxAI/MiniMax-M2.7",), quantization=MINIMAX_FP8),
             "minimax-m2.5-nvfp4": Preset(MINIMAX_M25_NVFP4, ("nvidia/MiniMax-M2.5-NVFP4",),
                                          quantization=MINIMAX_NVFP4)},
)
