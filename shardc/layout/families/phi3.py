"""The Phi-3 family (Phi3ForCausalLM): Llama's block (pre-norm RMSNorm, rotary attention with
grouped KV heads, a gated MLP, no biases) with two tensors stored fused, as transformers'
modeling_phi3.py holds them:

- ``self_attn.qkv_proj.weight`` [q + 2 kv, hidden]: q, then k, then v along dim 0;
- ``mlp.gate_up_proj.weight`` [2 inter, hidden]: gate, then up (``up * act(gate)``).

Each is one FUSED row whose parts are cut by their own split kind (q and gate/up column, k and v
kv_column: one whole replicated KV head per rank when tp > kv_heads); a rank holds its pieces end
to end, and ``Forward.fused`` tells runtime/weights.py which roles they are, so the decoder
computes Llama's math. ``sliding_window`` (Phi-3-medium: 2047) applies to every layer.

Rope does not change how a checkpoint is sharded, so a ``longrope`` Phi-3 (the 128k variants,
Phi-3.5) builds, reshards and exports; ``run`` and ``gate`` refuse it with one line
(runtime/support.py: the runtime computes default, linear and llama3 rope over every dimension,
so ``longrope`` / ``su`` and a ``partial_rotary_factor`` below 1, at the top level or inside
``rope_parameters``, are refused before a rank starts). The dropouts (``resid_pdrop``, ``embd_pdrop``,
``attention_dropout``) do nothing at inference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    FUSED,
    KV_COLUMN,
    ROW,
    Family,
    Forward,
    Preset,
    Row,
    count,
    norm_rows,
    outer_rows,
    windows_for,
)

if TYPE_CHECKING:
    from .family import ModelShape

def read(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = count(cfg, "num_hidden_layers") or 1
    window = count(cfg, "sliding_window")
    return {"windows": windows_for(("sliding_attention",) * layers, window),
            "activation": cfg.get("hidden_act", "silu")}


def tensors(m: ModelShape) -> list[Row]:
    h, hd, inter = m.hidden_size, m.head_dim, m.intermediate_size
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += [
            Row(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), FUSED, True,
                parts=((q, COLUMN), (kv, KV_COLUMN), (kv, KV_COLUMN))),
            Row(p + "self_attn.o_proj.weight", (h, q), ROW, True),
            Row(p + "mlp.gate_up_proj.weight", (2 * inter, h), FUSED, True,
                parts=((inter, COLUMN), (inter, COLUMN))),
            Row(p + "mlp.down_proj.weight", (h, inter), ROW, True),
        ]
    return rows


FUSED_ROLES = (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up")))


def forward(m: ModelShape) -> Forward:
    return Forward(windows=m.options["windows"], activation=m.options["activation"], fused=FUSED_ROLES)


PRESETS = {
    # microsoft/Phi-3-medium-4k-instruct's config.json (its transformers-4 spelling)
    "phi-3-medium": Preset({
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "sliding_window": 2047,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "torch_dtype": "bfloat16",
    }, ("microsoft/Phi-3-medium-4k-instruct",)),
}


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types={"Phi3ForCausalLM": "phi3"},
    read=read, tensors=tensors, forward=forward, presets=PRESETS,
)
