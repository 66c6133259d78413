"""Granite (IBM Granite 3.x dense): the Llama block and tensors, with four multipliers that change
the math (transformers' modeling_granite.py): the embeddings times ``embedding_multiplier``, each
attention and MLP output times ``residual_multiplier`` before its residual add, attention scores
scaled by ``attention_multiplier`` (instead of head_dim ** -0.5), and the logits divided by
``logits_scaling``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import Family, Forward, Preset, Row, number
from .llama import tensors as llama_tensors

if TYPE_CHECKING:
    from .family import ModelShape


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": number(cfg, "embedding_multiplier", 1.0),
        "residual_multiplier": number(cfg, "residual_multiplier", 1.0),
        "attention_multiplier": number(cfg, "attention_multiplier", 1.0),
        "logits_scaling": number(cfg, "logits_scaling", 1.0),
        "activation": cfg.get("hidden_act", "silu"),
    }


def tensors(m: ModelShape) -> list[Row]:
    return llama_tensors(m)


def forward(m: ModelShape) -> Forward:
    o = m.options
    return Forward(embed_scale=o["embedding_multiplier"], residual_scale=o["residual_multiplier"],
                   attn_scale=o["attention_multiplier"], logits_divisor=o["logits_scaling"],
                   activation=o["activation"])


# ibm-granite/granite-3.1-8b-instruct's config.json
GRANITE_31_8B = {
    "architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 4096,
    "intermediate_size": 12800, "num_hidden_layers": 40, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 49155, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 10000000.0, "rope_scaling": None,
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
    "logits_scaling": 16.0, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16",
}

FAMILY = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types={"GraniteForCausalLM": "granite"},
    read=read, tensors=tensors, forward=forward,
    presets={"granite-3.1-8b": Preset(GRANITE_31_8B, ("ibm-granite/granite-3.1-8b-instruct",))},
)
