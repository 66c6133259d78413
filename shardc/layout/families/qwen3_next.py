"""Qwen3-Next (Qwen3NextForCausalLM; transformers' modeling_qwen3_next.py): hybrid linear attention.

``layer_types`` (default: every ``full_attention_interval``-th layer, 4, full attention, the rest
linear) picks each layer's token mixer:
- **linear attention** (``linear_attn.*``, Gated DeltaNet; hybrid.py, runtime/deltanet.py):
  ``in_proj_qkvz`` and ``in_proj_ba`` stored fused per key head (each key head's q, k, its value
  heads' v and z; its value heads' b and a), a causal depthwise ``conv1d`` over q, k and v
  (channels: all q, all k, all v), ``A_log`` and ``dt_bias`` per value head, a gated RMSNorm
  (``norm``, one weight of ``linear_value_head_dim``) and ``out_proj``. Over TP a rank holds whole
  key heads (``linear_num_key_heads`` % tp) and their value heads: the two in-projections split by
  rows (a key head's rows are contiguous), the conv1d by its three parts (``fused``), A_log and
  dt_bias by value heads, out_proj by columns; the norm weight is replicated.
- **full attention** (``self_attn.*``): grouped q/k/v/o (biases on all four with ``attention_bias``)
  with per-head q/k RMSNorm, partial rope
  (``partial_rotary_factor``, 0.25 when absent), and an output gate: ``q_proj`` holds each head's
  query and gate side by side (split by whole heads like q), the output times sigmoid(gate).

Every RMSNorm scales by 1 + w in fp32 (Gemma's form). The MLP is Qwen2-MoE's (qwen_moe.py):
softmax routing (``norm_topk_prob``, default true), a shared expert scaled by sigmoid of
``shared_expert_gate``, dense layers per ``mlp_only_layers`` / ``decoder_sparse_step``. The
multi-token-prediction module (``mtp.*``) is not part of the forward: transformers skips it, a
build leaves it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    FUSED,
    KV_COLUMN,
    REPLICATED,
    ROW,
    Family,
    Forward,
    Moe,
    Row,
    count,
    mlp_rows,
    norm_rows,
    outer_rows,
    refuse,
)
from .hybrid import LINEAR, Hybrid
from .minimax_m2 import factor_rotary_dims
from .moe import expert_rows, flag, read_routing, router_row
from .names import LLAMA, Names
from .qwen_moe import EXPERT, ROUTER, SHARED, SHARED_GATE, sparse_layers

if TYPE_CHECKING:
    from .family import ModelShape

# transformers' Qwen3NextConfig defaults where config.json omits a key
DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts_per_tok": 10,
            "num_experts": 512, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
FACTOR, INTERVAL = 0.25, 4  # partial_rotary_factor, full_attention_interval
MIXERS = ("linear_attention", "full_attention")
NAMES = Names(linear=LINEAR)


def _linear_layers(cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    given = cfg.get("layer_types")
    if given is None:
        interval = count(cfg, "full_attention_interval", INTERVAL)
        return tuple(bool((i + 1) % interval) for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(t not in MIXERS for t in given):
        raise refuse("layer_types", given, f"must list {' or '.join(MIXERS)} for each of num_hidden_layers={layers}")
    return tuple(t == "linear_attention" for t in given)


def read_linear(cfg: dict[str, Any], layers: int, label: str) -> dict[str, Any]:
    """The options of the linear-attention layers and the partial rope (Qwen3-Next and Qwen3.5):
    ``linear``, ``sizes``, ``state_fp32``, ``rotary_dim``; ``label`` names the model in a refusal."""
    head_dim = count(cfg, "head_dim", 256)
    sizes = {key: count(cfg, key, DEFAULTS[key]) for key in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads")}
    key_heads, value_heads = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    if value_heads % key_heads:
        raise refuse("linear_num_value_heads", value_heads, f"is not a multiple of linear_num_key_heads={key_heads}")
    if cfg.get("hidden_act", "silu") != "silu":  # the conv's and the gated norm's activation too
        raise refuse("hidden_act", cfg["hidden_act"], f"is not computed by shardc for {label} (only silu)")
    ssm = cfg.get("mamba_ssm_dtype")  # vLLM's dtype of the delta rule's state (Qwen3.5 publishes float32)
    if ssm not in (None, "float32", "bfloat16", "float16", "auto"):
        raise refuse("mamba_ssm_dtype", ssm, "is not a dtype vLLM keeps the state in (float32, bfloat16, float16)")
    return {"state_fp32": ssm == "float32", "linear": _linear_layers(cfg, layers), "sizes": sizes,
            "rotary_dim": factor_rotary_dims(cfg, head_dim, FACTOR)}


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = count(cfg, "num_hidden_layers") or 1
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is None:
        cfg = {**cfg, "num_experts": DEFAULTS["num_experts"]}
    experts, top_k = read_routing(cfg, "num_experts", DEFAULTS["num_experts_per_tok"])
    linear = read_linear(cfg, layers, "Qwen3-Next")
    return {"experts": experts, "top_k": top_k, "norm_topk": flag(cfg, "norm_topk_prob", True),
            "sparse": sparse_layers(cfg, layers), "moe_inter": count(cfg, "moe_intermediate_size",
                                                                     DEFAULTS["moe_intermediate_size"]),
            "shared_inter": count(cfg, "shared_expert_intermediate_size", DEFAULTS["shared_expert_intermediate_size"]),
            **linear}


def hybrid(m: ModelShape) -> Hybrid:
    s = m.options["sizes"]
    return Hybrid(linear=m.options["linear"], key_heads=s["linear_num_key_heads"],
                  value_heads=s["linear_num_value_heads"], key_dim=s["linear_key_head_dim"],
                  value_dim=s["linear_value_head_dim"], conv_kernel=s["linear_conv_kernel_dim"],
                  state_fp32=m.options["state_fp32"])


def _linear_rows(m: ModelShape, p: str) -> list[Row]:
    x, h = hybrid(m), m.hidden_size
    names = dict(LINEAR)
    keys, values = x.key_heads * x.key_dim, x.value_heads * x.value_dim
    return [Row(p + names["qkvz"], (2 * keys + 2 * values, h), COLUMN, True),
            Row(p + names["ba"], (2 * x.value_heads, h), COLUMN, True),
            Row(p + names["conv"], (x.conv_channels, 1, x.conv_kernel), FUSED,
                parts=((keys, COLUMN), (keys, COLUMN), (values, COLUMN))),
            Row(p + names["A_log"], (x.value_heads,), COLUMN), Row(p + names["dt_bias"], (x.value_heads,), COLUMN),
            Row(p + names["norm"], (x.value_dim,), REPLICATED), Row(p + names["o"], (h, values), ROW, True)]


def gated_attention_rows(m: ModelShape, p: str) -> list[Row]:
    """A full-attention layer: q_proj with each head's query and gate, k, v, o, the q/k norms."""
    h, hd = m.hidden_size, m.head_dim
    a = p + "self_attn."
    return [Row(p + LLAMA.projection("q") + ".weight", (2 * m.num_heads * hd, h), COLUMN, True),
            Row(p + LLAMA.projection("k") + ".weight", (m.num_kv_heads * hd, h), KV_COLUMN, True),
            Row(p + LLAMA.projection("v") + ".weight", (m.num_kv_heads * hd, h), KV_COLUMN, True),
            Row(p + LLAMA.projection("o") + ".weight", (h, m.num_heads * hd), ROW, True),
            *norm_rows(m, a, ("q_norm", "k_norm"), size=hd),
            *([Row(p + LLAMA.projection("q") + ".bias", (2 * m.num_heads * hd,), COLUMN),
               Row(p + LLAMA.projection("k") + ".bias", (m.num_kv_heads * hd,), KV_COLUMN),
               Row(p + LLAMA.projection("v") + ".bias", (m.num_kv_heads * hd,), KV_COLUMN),
               Row(p + LLAMA.projection("o") + ".bias", (h,), REPLICATED)] if m.qkv_bias else [])]


def sparse_rows(m: ModelShape, p: str) -> list[Row]:
    """A sparse layer's MLP: the router, the routed experts and the gated shared expert."""
    o, h, s = m.options, m.hidden_size, m.options["shared_inter"]
    return [router_row(m, p, ROUTER, o["experts"]), *expert_rows(m, p, EXPERT, o["experts"], o["moe_inter"]),
            Row(p + SHARED[0], (s, h), COLUMN, True), Row(p + SHARED[1], (s, h), COLUMN, True),
            Row(p + SHARED[2], (h, s), ROW, True), Row(p + SHARED_GATE, (1, h), REPLICATED)]


def tensors(m: ModelShape) -> list[Row]:
    o = m.options
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += _linear_rows(m, p) if o["linear"][i] else gated_attention_rows(m, p)
        rows += sparse_rows(m, p) if o["sparse"][i] else mlp_rows(m, p, bias=False)
    return rows


def moe(m: ModelShape) -> Moe:
    o = m.options
    return Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=o["norm_topk"], weights_fp32=False,
               sparse=o["sparse"], router=ROUTER, expert=EXPERT, shared=SHARED, shared_gate=SHARED_GATE)


def forward(m: ModelShape) -> Forward:
    rotary = m.options["rotary_dim"] if m.options["rotary_dim"] < m.head_dim else None
    return Forward(norm="gemma", qk_norm=True, rotary_dim=rotary, moe=moe(m), hybrid=hybrid(m), names=NAMES)


def unused(m: ModelShape, name: str) -> bool:
    """The multi-token-prediction module (``mtp.*``): transformers' loader skips it, a build leaves it out."""
    return name.startswith("mtp.")


FAMILY = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types={"Qwen3NextForCausalLM": "qwen3_next"},
    read=read, tensors=tensors, forward=forward, unused=unused,
)
