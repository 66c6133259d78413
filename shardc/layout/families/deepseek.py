"""DeepSeek-V3 (DeepseekV3ForCausalLM; transformers' modeling_deepseek_v3.py), also the architecture
of DeepSeek-R1 and Kimi-K2.

Attention is multi-head latent attention (MLA): q from ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is null), each head ``qk_nope_head_dim`` plain
plus ``qk_rope_head_dim`` rotary dimensions; keys and values from one latent per token,
``kv_a_proj_with_mqa`` (``kv_lora_rank`` latent + one shared rotary key of ``qk_rope_head_dim``),
the latent normed by ``kv_a_layernorm`` and expanded per head by ``kv_b_proj`` into
``qk_nope_head_dim`` key and ``v_head_dim`` value dimensions. The low-rank projections and their
norms are replicated; ``q_b_proj`` / ``q_proj`` / ``kv_b_proj`` split by rows, whole heads per rank
(num_attention_heads % tp); ``o_proj`` by columns. Rope is interleaved (``rope_interleave``, default
true) and usually YaRN, whose ``mscale_all_dim`` also scales the softmax (by mscale², as
transformers' ``yarn_apply_mscale``).

The first ``first_k_dense_replace`` layers have a dense MLP of ``intermediate_size``; the others
route ``num_experts_per_tok`` of ``n_routed_experts`` experts (``mlp.experts.N.*`` of
``moe_intermediate_size``) with sigmoid scores, ``e_score_correction_bias`` added for the choice
only, grouped top-k (``n_group`` groups, the best ``topk_group`` by the sum of their two best
scores), the chosen scores renormalized (``norm_topk_prob``) and times ``routed_scaling_factor``;
plus ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts x moe_intermediate_size``
(``mlp.shared_experts.*``, split over TP like a dense MLP). The router and its bias are replicated,
never quantized, and stored in fp32 as transformers keeps them (``Row.dtype``): a bf16 source's
values exactly, and an fp32 source's (the published checkpoints hold the bias in fp32) unrounded.
Multi-token-prediction layers (``num_nextn_predict_layers``, the published checkpoint's
``model.layers.61.*``) are not part of the forward (transformers skips them too): not in the table,
and a checkpoint's copy of them is left out of a build (``Family.unused``), so not exported either.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    REPLICATED,
    ROW,
    Family,
    Forward,
    Mla,
    Moe,
    Preset,
    Row,
    count,
    mlp_rows,
    norm_rows,
    number,
    outer_rows,
    refuse,
)
from .moe import expert_rows, flag, read_routing

if TYPE_CHECKING:
    from .family import ModelShape

ROUTER = "mlp.gate.weight"
BIAS = "mlp.gate.e_score_correction_bias"
EXPERT = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
SHARED = ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight")


def _choice(cfg: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = cfg.get(key, default)
    if value is not None and value not in allowed:
        raise refuse(key, value, f"is not computed by shardc (only {', '.join(map(str, allowed))})")


# transformers' DeepseekV3Config defaults, read where config.json omits the key (DeepSeek-V3.2's are
# the same; GLM-5's differ: families/deepseek_v32.py)
DEFAULTS = {"n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "moe_intermediate_size": 2048}


def read(cfg: dict[str, Any], defaults: dict[str, Any] = DEFAULTS) -> dict[str, Any]:
    """The keys MLA and the grouped-sigmoid MoE read, ``defaults`` where config.json omits one."""
    layers = count(cfg, "num_hidden_layers") or 1
    heads = count(cfg, "num_attention_heads") or 1
    kv = cfg.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise refuse("num_key_value_heads", kv, f"must equal num_attention_heads={heads} (MLA expands "
                     "the latent to every head; transformers' DeepSeek-V3 reads no other value)")
    if cfg.get("attention_bias"):
        raise refuse("attention_bias", cfg["attention_bias"], "is not computed by shardc for MLA "
                     "(the published models have no attention biases)")
    experts, top_k = read_routing(cfg, "n_routed_experts", defaults["num_experts_per_tok"])
    groups, topk_groups = read_groups(cfg, experts, top_k, defaults)
    # transformers 4 (the published remote code) spells the routing these ways; transformers 5
    # computes exactly noaux_tc with sigmoid scores and reads neither key
    _choice(cfg, "scoring_func", ("sigmoid",), "sigmoid")
    _choice(cfg, "topk_method", ("noaux_tc",), "noaux_tc")
    _choice(cfg, "moe_layer_freq", (1,), 1)
    dense = count(cfg, "first_k_dense_replace", defaults["first_k_dense_replace"])
    # null: one q_proj instead of the low-rank pair (DeepSeek-V2-Lite)
    q_lora = None if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None \
        else count(cfg, "q_lora_rank", defaults["q_lora_rank"])
    dims = {key: count(cfg, key, defaults[key])
            for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    if dims["qk_rope_head_dim"] % 2:
        raise refuse("qk_rope_head_dim", dims["qk_rope_head_dim"], "must be even (rope rotates pairs)")
    return {"experts": experts, "top_k": top_k, "groups": groups, "topk_groups": topk_groups,
            "norm_topk": flag(cfg, "norm_topk_prob", True),
            "scaling": number(cfg, "routed_scaling_factor", defaults["routed_scaling_factor"]),
            "shared": count(cfg, "n_shared_experts", defaults["n_shared_experts"]),
            "moe_inter": count(cfg, "moe_intermediate_size", defaults["moe_intermediate_size"]),
            "sparse": tuple(i >= dense for i in range(layers)), "q_lora": q_lora, **dims,
            "interleave": flag(cfg, "rope_interleave", True), "activation": cfg.get("hidden_act", "silu"),
            "mtp": mtp_layers(cfg)}


def read_groups(cfg: dict[str, Any], experts: int, top_k: int, defaults: dict[str, Any]) -> tuple[int, int]:
    """(n_group, topk_group) the grouped router computes: groups of at least two experts (a group
    scores by its two best), the chosen groups holding top_k experts (GLM-4.5's router too)."""
    groups = count(cfg, "n_group", defaults["n_group"])
    topk_groups = count(cfg, "topk_group", defaults["topk_group"])
    if experts % groups:
        raise refuse("n_group", groups, f"does not divide n_routed_experts={experts}")
    if experts // groups < 2:
        raise refuse("n_group", groups, f"leaves fewer than 2 of n_routed_experts={experts} per group "
                     "(a group scores by its two best experts)")
    if topk_groups > groups:
        raise refuse("topk_group", topk_groups, f"is more than n_group={groups}")
    if top_k > topk_groups * (experts // groups):
        raise refuse("num_experts_per_tok", top_k, f"is more than the {topk_groups * (experts // groups)} "
                     f"experts in topk_group={topk_groups} groups")
    return groups, topk_groups


def mtp_layers(cfg: dict[str, Any], default: int = 0) -> int:
    """Multi-token-prediction layers after the last decoder layer (transformers 4 spells it
    num_nextn_predict_layers, 5 num_mtp_layers and writes the old name): in a checkpoint, not in
    the forward; ``default`` (transformers' for the family) when neither is given."""
    old, new = count(cfg, "num_nextn_predict_layers"), count(cfg, "num_mtp_layers")
    if old is not None and new is not None and old != new:
        raise refuse("num_mtp_layers", new, f"disagrees with num_nextn_predict_layers={old}")
    given = old if old is not None else new
    return default if given is None else given




def unused(m: ModelShape, name: str) -> bool:
    """A multi-token-prediction layer's tensor (model.layers.{num_hidden_layers + i}.*), which
    transformers' loader skips too: the forward never reads it, a build leaves it out."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and m.num_layers <= int(layer.group(1)) < m.num_layers + m.options["mtp"]


def mla(m: ModelShape) -> Mla:
    o = m.options
    return Mla(q_lora_rank=o["q_lora"], kv_lora_rank=o["kv_lora_rank"], nope=o["qk_nope_head_dim"],
               rope=o["qk_rope_head_dim"], v=o["v_head_dim"], interleave=o["interleave"])


def softmax_scale(m: ModelShape) -> float:
    """transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale² with
    mscale = 0.1 · mscale_all_dim · ln(factor) + 1 when the rope is scaled and mscale_all_dim is
    set (yarn_apply_mscale), computed in the same order."""
    a = mla(m)
    scaling = (a.nope + a.rope) ** (-0.5)
    rope = m.rope_scaling or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = rope.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise refuse("rope_scaling.factor", factor, "must be a positive number with mscale_all_dim")
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    return float(scaling)  # a float already; the config's numbers are untyped JSON


def tensors(m: ModelShape) -> list[Row]:
    o, h = m.options, m.hidden_size
    a = mla(m)
    heads, qk = m.num_heads, a.nope + a.rope
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        if a.q_lora_rank is None:
            rows.append(Row(s + "q_proj.weight", (heads * qk, h), COLUMN, True))
        else:
            rows += [Row(s + "q_a_proj.weight", (a.q_lora_rank, h), REPLICATED, True),
                     Row(s + "q_a_layernorm.weight", (a.q_lora_rank,), REPLICATED),
                     Row(s + "q_b_proj.weight", (heads * qk, a.q_lora_rank), COLUMN, True)]
        rows += [Row(s + "kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.rope, h), REPLICATED, True),
                 Row(s + "kv_a_layernorm.weight", (a.kv_lora_rank,), REPLICATED),
                 Row(s + "kv_b_proj.weight", (heads * (a.nope + a.v), a.kv_lora_rank), COLUMN, True),
                 Row(s + "o_proj.weight", (h, heads * a.v), ROW, True)]
        if not o["sparse"][i]:
            rows += mlp_rows(m, p, bias=False)
            continue
        rows += routed_rows(m, p)
    return rows


def routed_rows(m: ModelShape, p: str) -> list[Row]:
    """One sparse layer's router and correction bias, routed and shared experts (GLM-4.5's too).
    transformers keeps the router and its bias in fp32 (_keep_in_fp32_modules_strict): so do the shards."""
    o, h = m.options, m.hidden_size
    inter = o["moe_inter"] * o["shared"]
    return [Row(p + ROUTER, (o["experts"], h), REPLICATED, dtype="F32"),
            Row(p + BIAS, (o["experts"],), REPLICATED, dtype="F32"),
            *expert_rows(m, p, EXPERT, o["experts"], o["moe_inter"]),
            Row(p + SHARED[0], (inter, h), COLUMN, True), Row(p + SHARED[1], (inter, h), COLUMN, True),
            Row(p + SHARED[2], (h, inter), ROW, True)]


def grouped_moe(m: ModelShape) -> Moe:
    """The grouped sigmoid router with a correction bias and shared experts, as read (GLM-4.5's too)."""
    o = m.options
    return Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=o["norm_topk"], weights_fp32=True,
               sparse=o["sparse"], router=ROUTER, expert=EXPERT, shared=SHARED, scoring="sigmoid",
               score_bias=BIAS, groups=o["groups"], topk_groups=o["topk_groups"], scaling=o["scaling"])


def forward(m: ModelShape) -> Forward:
    return Forward(activation=m.options["activation"], moe=grouped_moe(m), mla=mla(m), attn_scale=softmax_scale(m),
                   yarn=True)


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, less its auto_map and quantization_config (below)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# moonshotai/Kimi-K2-Instruct's config.json, less its auto_map and quantization_config (DEEPSEEK_V3_FP8's
# four keys, no module left out): DeepSeek-V3's with these values, as aiconfigurator 0.12 ships it
# (aiconfigurator_core/model_configs/moonshotai--Kimi-K2-Instruct_config.json; every key compared): 384
# routed experts in one group, 64 heads, one dense layer, no MTP layer, its own rope and vocabulary (and no
# ep_size key)
KIMI_K2 = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k != "ep_size"},
    "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827, "topk_group": 1, "transformers_version": "4.48.3", "vocab_size": 163840,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}

# The published checkpoint's quantization_config (block FP8, 128 x 128 scales), as deepseek-ai/DeepSeek-V3's
# README_WEIGHTS.md ("FP8 Weight Documentation") states it.
DEEPSEEK_V3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types={"DeepseekV3ForCausalLM": "deepseek_v3"},
    read=read, tensors=tensors, forward=forward, unused=unused,
    presets={"deepseek-v3": Preset(DEEPSEEK_V3, ("deepseek-ai/DeepSeek-V3",), quantization=DEEPSEEK_V3_FP8),
             "kimi-k2": Preset(KIMI_K2, ("moonshotai/Kimi-K2-Instruct",), quantization=DEEPSEEK_V3_FP8)},
)
