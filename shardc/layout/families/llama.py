"""The Llama family: Llama, Mistral and Qwen2 share one block (pre-norm RMSNorm, rotary attention
with grouped KV heads, a gated MLP) and one tensor naming scheme. They differ in which projections
carry biases (Qwen2's q/k/v; ``attention_bias`` / ``mlp_bias`` anywhere) and in sliding-window
attention: Mistral's ``sliding_window`` covers every layer; Qwen2's applies only with
``use_sliding_window``, to the layers ``layer_types`` (or ``max_window_layers``) names, as
transformers' configuration_qwen2.py derives them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    Family,
    Forward,
    Preset,
    Row,
    attention_rows,
    count,
    layer_types,
    mlp_rows,
    norm_rows,
    outer_rows,
    windows_for,
)

if TYPE_CHECKING:
    from .family import ModelShape


def qwen_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3 sliding windows: only with ``use_sliding_window``, on the layers
    ``layer_types`` names (default: from ``max_window_layers`` on), as their configurations say."""
    if not cfg.get("use_sliding_window"):
        return ()
    layers = count(cfg, "num_hidden_layers") or 1
    window = count(cfg, "sliding_window", 4096)
    first = count(cfg, "max_window_layers", 28)
    types = layer_types(cfg, layers, lambda i: "sliding_attention" if i >= first else "full_attention")
    return windows_for(types, window)


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    arch = cfg["architectures"][0]
    windows: tuple[int | None, ...] = ()
    if arch == "MistralForCausalLM":  # every layer, when set
        window = count(cfg, "sliding_window")
        layers = count(cfg, "num_hidden_layers") or 1
        windows = windows_for(("sliding_attention",) * layers, window)
    elif arch == "Qwen2ForCausalLM":
        windows = qwen_windows(cfg)
    return {"windows": windows, "activation": cfg.get("hidden_act", "silu"),
            "qkv_bias": arch == "Qwen2ForCausalLM"}


def tensors(m: ModelShape) -> list[Row]:
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=m.o_bias)
        rows += mlp_rows(m, p, bias=m.mlp_bias)
    return rows


def forward(m: ModelShape) -> Forward:
    return Forward(windows=m.options["windows"], activation=m.options["activation"])


_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _llama3(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": hidden // heads,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128009,
        "torch_dtype": "bfloat16",
    }


PRESETS = {
    "llama-3.1-8b": Preset(_llama3(4096, 14336, 32, 32),
                           ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B")),
    "llama-3.3-70b": Preset(_llama3(8192, 28672, 80, 64), ("meta-llama/Llama-3.3-70B-Instruct",)),
    "llama-3.1-70b": Preset(_llama3(8192, 28672, 80, 64),
                            ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B")),
    "llama-3.1-405b": Preset(_llama3(16384, 53248, 126, 128),
                             ("meta-llama/Llama-3.1-405B-Instruct", "meta-llama/Llama-3.1-405B")),
}


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    model_types={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"},
    read=read, tensors=tensors, forward=forward, presets=PRESETS,
)
