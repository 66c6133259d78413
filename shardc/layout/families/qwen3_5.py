"""Qwen3.5's text models (transformers' models/qwen3_5 and qwen3_5_moe): Qwen3-Next's hybrid layers
(qwen3_next.py) with the linear-attention in-projections stored apart. Two families:
``QWEN3_5`` (Qwen3_5ForCausalLM, ``qwen3_5_text``: a dense MLP in every layer) and ``QWEN3_5_MOE``
(Qwen3_5MoeForCausalLM, ``qwen3_5_moe_text``: every layer routed).

What differs from Qwen3-Next (transformers' modeling files compared line by line):
- **linear attention**: ``in_proj_qkv`` (rows [all q | all k | all v], the conv's channel order,
  not grouped per key head), ``in_proj_z`` (value heads), ``in_proj_b`` and ``in_proj_a`` (one row
  per value head) instead of the fused ``in_proj_qkvz`` / ``in_proj_ba`` (hybrid.py ``LINEAR_SPLIT``,
  ``Hybrid.fused_qkvz`` False). Over TP ``in_proj_qkv`` splits in the conv1d's three parts, z, b
  and a by rows (a rank's key heads own its contiguous value heads); the rest as Qwen3-Next.
- **rope**: ``rope_parameters`` may carry ``mrope_section`` / ``mrope_interleaved`` (the multimodal
  model's 3-D positions). The text model's rotary embedding expands 1-D text positions to three
  equal rows (temporal, height, width) and then takes each frequency from one of them, so for text
  every frequency is the ordinary rope's at that position (Qwen3_5TextRotaryEmbedding.forward:
  ``recomposition_frequencies`` copies equal values): both keys are accepted and change nothing.
- **full attention**: always gated (no config key in transformers; the published configs carry
  ``attn_output_gate: true``, which vLLM reads: false is refused, transformers would gate anyway).
- **MLP**: the dense model's is Llama's gated MLP (``intermediate_size``); the MoE model's is
  Qwen3-Next's sparse block in every layer (softmax top-k always renormalized): transformers has
  no ``norm_topk_prob`` or ``mlp_only_layers`` (the published configs carry ``[]``), so a value
  that would change the math elsewhere (false; a layer listed) is refused rather than ignored;
  ``decoder_sparse_step``, which Qwen3-Next reads, is not read here either. Its config has no
  ``intermediate_size``: the model record takes the shared expert's (the one MLP every layer splits
  like a dense one).
- the norms are Qwen3-Next's: (1 + w) in fp32, the gated norm plain w.
``mtp_num_hidden_layers`` / ``mtp_use_dedicated_embeddings`` size the multi-token-prediction module
(``mtp.*``), which the forward never runs and a build leaves out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    FUSED,
    REPLICATED,
    ROW,
    Family,
    Forward,
    Preset,
    Row,
    count,
    mlp_rows,
    norm_rows,
    outer_rows,
    refuse,
)
from .hybrid import LINEAR_SPLIT, Hybrid
from .moe import flag, read_routing
from .names import Names
from .qwen3_next import gated_attention_rows, moe, read_linear, sparse_rows, unused
from .qwen3_next import hybrid as next_hybrid

if TYPE_CHECKING:
    from .family import ModelShape

# transformers' Qwen3_5MoeTextConfig defaults where config.json omits a key
MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512}
NAMES = Names(linear=LINEAR_SPLIT)


def _read_common(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = count(cfg, "num_hidden_layers") or 1
    if cfg.get("attn_output_gate", True) is not True:
        raise refuse("attn_output_gate", cfg["attn_output_gate"],
                     "is not computed by shardc for Qwen3.5 (transformers always gates full attention)")
    if cfg.get("mlp_only_layers") not in (None, []):
        raise refuse("mlp_only_layers", cfg["mlp_only_layers"],
                     "is not read by transformers' Qwen3.5 (its MLPs are all dense or all routed)")
    return read_linear(cfg, layers, "Qwen3.5")


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    return _read_common(cfg)


def read_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    options = _read_common(cfg)
    layers = count(cfg, "num_hidden_layers") or 1
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is None:
        cfg = {**cfg, "num_experts": MOE_DEFAULTS["num_experts"]}
    experts, top_k = read_routing(cfg, "num_experts", MOE_DEFAULTS["num_experts_per_tok"])
    if not flag(cfg, "norm_topk_prob", True):
        raise refuse("norm_topk_prob", False, "is not read by transformers' Qwen3.5-MoE (it always renormalizes)")
    shared = count(cfg, "shared_expert_intermediate_size", MOE_DEFAULTS["shared_expert_intermediate_size"])
    return {**options, "experts": experts, "top_k": top_k, "norm_topk": True, "sparse": (True,) * layers,
            "moe_inter": count(cfg, "moe_intermediate_size", MOE_DEFAULTS["moe_intermediate_size"]),
            "shared_inter": shared, "intermediate_size": shared}


def hybrid(m: ModelShape) -> Hybrid:
    return replace(next_hybrid(m), fused_qkvz=False)


def _linear_rows(m: ModelShape, p: str) -> list[Row]:
    x, h = hybrid(m), m.hidden_size
    names = dict(LINEAR_SPLIT)
    keys, values = x.key_heads * x.key_dim, x.value_heads * x.value_dim
    parts = ((keys, COLUMN), (keys, COLUMN), (values, COLUMN))  # [all q | all k | all v], as the conv's
    return [Row(p + names["qkv"], (2 * keys + values, h), FUSED, True, parts=parts),
            Row(p + names["z"], (values, h), COLUMN, True),
            Row(p + names["b"], (x.value_heads, h), COLUMN, True), Row(p + names["a"], (x.value_heads, h), COLUMN, True),
            Row(p + names["conv"], (x.conv_channels, 1, x.conv_kernel), FUSED, parts=parts),
            Row(p + names["A_log"], (x.value_heads,), COLUMN), Row(p + names["dt_bias"], (x.value_heads,), COLUMN),
            Row(p + names["norm"], (x.value_dim,), REPLICATED), Row(p + names["o"], (h, values), ROW, True)]


def tensors(m: ModelShape) -> list[Row]:
    sparse = m.options.get("sparse")
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += _linear_rows(m, p) if m.options["linear"][i] else gated_attention_rows(m, p)
        rows += sparse_rows(m, p) if sparse else mlp_rows(m, p, bias=False)
    return rows


def forward(m: ModelShape) -> Forward:
    rotary = m.options["rotary_dim"] if m.options["rotary_dim"] < m.head_dim else None
    return Forward(norm="gemma", qk_norm=True, rotary_dim=rotary, moe=moe(m) if "sparse" in m.options else None,
                   hybrid=hybrid(m), names=NAMES)


# The published Qwen3.5 checkpoints are the multimodal Qwen3_5(Moe)ForConditionalGeneration, their
# text model under ``text_config`` and its tensors under model.language_model.*: each preset is that
# text model's config as aiconfigurator 0.12 ships it (aiconfigurator_core/model_configs/<file>
# named above each), ``text_config`` verbatim with ``architectures`` set to the CausalLM class and
# ``tie_word_embeddings`` from the top level; every value copied from the file by a script (its
# ``layer_types``, every 4th layer full attention, written as the expression that equals the file's
# list). No hub repository: those hold the multimodal checkpoint, which is not this config.
def _layer_types(layers: int) -> list[str]:
    return (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)


_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default", "rope_theta": 10000000,
         "partial_rotary_factor": 0.25}
# Qwen--Qwen3.5-27B_config.json
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17408, "layer_types": _layer_types(64), "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "use_cache": True, "vocab_size": 248320, "mamba_ssm_dtype": "float32", "rope_parameters": _ROPE,
    "tie_word_embeddings": False,
}
# Qwen--Qwen3.5-35B-A3B_config.json
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "layer_types": _layer_types(40), "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "use_cache": True, "vocab_size": 248320,
    "mamba_ssm_dtype": "float32", "rope_parameters": _ROPE, "tie_word_embeddings": False,
}
# Qwen--Qwen3.5-122B-A10B_config.json: 35B-A3B's keys and values but these, every key compared
QWEN3_5_122B_A10B = {**QWEN3_5_35B_A3B, "hidden_size": 3072, "layer_types": _layer_types(48),
                     "linear_num_value_heads": 64, "moe_intermediate_size": 1024, "num_attention_heads": 32,
                     "num_hidden_layers": 48, "shared_expert_intermediate_size": 1024}
# Qwen--Qwen3.5-397B-A17B_config.json: 122B-A10B's keys and values but these, every key compared
QWEN3_5_397B_A17B = {**QWEN3_5_122B_A10B, "hidden_size": 4096, "layer_types": _layer_types(60),
                     "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 60}

QWEN3_5 = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM",),
    model_types={"Qwen3_5ForCausalLM": "qwen3_5_text"},
    read=read, tensors=tensors, forward=forward, unused=unused,
    presets={"qwen3.5-27b": Preset(QWEN3_5_27B)},
)
QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM",),
    model_types={"Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"},
    read=read_moe, tensors=tensors, forward=forward, unused=unused,
    presets={"qwen3.5-35b-a3b": Preset(QWEN3_5_35B_A3B), "qwen3.5-122b-a10b": Preset(QWEN3_5_122B_A10B),
             "qwen3.5-397b-a17b": Preset(QWEN3_5_397B_A17B)},
)
