"""Mixtral (MixtralForCausalLM): Mistral's attention block with a routed mixture of experts as the
MLP of every layer (transformers' modeling_mixtral.py). The checkpoint stores each expert as
``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down), and the router as
``block_sparse_moe.gate``. Routing: softmax over all experts in fp32, the top ``num_experts_per_tok``,
renormalized, the weights kept in fp32 when they scale the expert outputs.
``sliding_window`` covers every layer when set. ``router_jitter_noise`` and the aux-loss keys act
only in training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    Family,
    Forward,
    Moe,
    Preset,
    Row,
    attention_rows,
    count,
    norm_rows,
    outer_rows,
    windows_for,
)
from .moe import expert_rows, read_routing, router_row

if TYPE_CHECKING:
    from .family import ModelShape

ROUTER = "block_sparse_moe.gate.weight"
EXPERT = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
          "block_sparse_moe.experts.{e}.w2.weight")


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = count(cfg, "num_hidden_layers") or 1
    experts, top_k = read_routing(cfg, "num_local_experts")
    return {"windows": windows_for(("sliding_attention",) * layers, count(cfg, "sliding_window")),
            "activation": cfg.get("hidden_act", "silu"), "experts": experts, "top_k": top_k}


def tensors(m: ModelShape) -> list[Row]:
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=m.o_bias)
        rows.append(router_row(m, p, ROUTER, m.options["experts"]))
        rows += expert_rows(m, p, EXPERT, m.options["experts"], m.intermediate_size)
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    moe = Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=True, weights_fp32=True,
              sparse=(True,) * m.num_layers, router=ROUTER, expert=EXPERT)
    return Forward(windows=o["windows"], activation=o["activation"], moe=moe)


MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "num_local_experts": 8,
    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}

FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types={"MixtralForCausalLM": "mixtral"},
    read=read, tensors=tensors, forward=forward,
    presets={"mixtral-8x7b": Preset(MIXTRAL_8X7B, ("mistralai/Mixtral-8x7B-Instruct-v0.1",
                                                   "mistralai/Mixtral-8x7B-v0.1"))},
)
