"""Qwen3 (dense): the Llama block plus a per-head RMSNorm of q and k before rope (``q_norm`` /
``k_norm``, one weight of head_dim, replicated on every TP rank since every head shares it), no
q/k/v biases unless ``attention_bias``, and Qwen2's sliding-window keys
(transformers' modeling_qwen3.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import Family, Forward, Preset, Row, attention_rows, mlp_rows, norm_rows, outer_rows
from .llama import qwen_windows

if TYPE_CHECKING:
    from .family import ModelShape


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"windows": qwen_windows(cfg), "activation": cfg.get("hidden_act", "silu")}


def tensors(m: ModelShape) -> list[Row]:
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += norm_rows(m, p + "self_attn.", ("q_norm", "k_norm"), size=m.head_dim)
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=m.o_bias)
        rows += mlp_rows(m, p, bias=m.mlp_bias)
    return rows


def forward(m: ModelShape) -> Forward:
    return Forward(qk_norm=True, windows=m.options["windows"], activation=m.options["activation"])


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> dict[str, Any]:
    """A published Qwen3 dense config.json (Qwen/Qwen3-*: head_dim 128, vocab 151936)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "tie_word_embeddings": tied, "attention_bias": False,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


# Qwen's dense FP8 releases (Qwen/Qwen3-8B-FP8, Qwen3-32B-FP8): the 16-bit release's config.json plus
# this quantization_config (block FP8 with 128 x 128 scales, no modules left out).
QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types={"Qwen3ForCausalLM": "qwen3"},
    read=read, tensors=tensors, forward=forward,
    presets={
        "qwen3-8b": Preset(_qwen3(4096, 12288, 36, 32, 8, False), ("Qwen/Qwen3-8B",)),
        "qwen3-32b": Preset(_qwen3(5120, 25600, 64, 64, 8, False), ("Qwen/Qwen3-32B",)),
        "qwen3-8b-fp8": Preset(_qwen3(4096, 12288, 36, 32, 8, False), ("Qwen/Qwen3-8B-FP8",), quantization=QWEN3_FP8),
        "qwen3-32b-fp8": Preset(_qwen3(5120, 25600, 64, 64, 8, False), ("Qwen/Qwen3-32B-FP8",),
                                quantization=QWEN3_FP8),
    },
)
