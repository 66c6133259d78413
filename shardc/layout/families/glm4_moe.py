"""GLM-4.5, GLM-4.6 and GLM-4.7 (Glm4MoeForCausalLM; transformers' modeling_glm4_moe.py).

Attention is Llama's grouped q/k/v/o: q, k and v carry biases when ``attention_bias`` (o_proj never
does: transformers builds it bias-free whatever the key says); with ``use_qk_norm`` a per-head
RMSNorm of q and of k (``self_attn.q_norm`` / ``k_norm``, one weight of head_dim, eps
``rms_norm_eps``) before rope, as Qwen3's. Rope is partial: the first head_dim x
``partial_rotary_factor`` (truncated; 0.5 when no spelling gives it, Glm4MoeConfig's default)
dimensions of each head turn NeoX-style (rotate_half over those dimensions), the rest pass.
Over TP, q and its bias split by rows (``column``), k and v with theirs by whole KV heads
(``kv_column``: a KV head copied when num_key_value_heads < tp), o by columns (``row``): each rank
attends with whole heads. The q/k norm weights are replicated: every head shares them.

The first ``first_k_dense_replace`` layers have a dense MLP of ``intermediate_size`` (split like
Llama's); the others route ``num_experts_per_tok`` of ``n_routed_experts`` experts
(``mlp.experts.N.*`` of ``moe_intermediate_size``) by DeepSeek-V3's router, which
Glm4MoeTopkRouter is step for step (runtime/moe.py ``grouped_route``): fp32 logits from the fp32
router, sigmoid scores, ``e_score_correction_bias`` added for the choice only, the best
``topk_group`` of ``n_group`` groups by the sum of their two best scores, top-k among them, the
unbiased scores renormalized (``norm_topk_prob``) and times ``routed_scaling_factor``; plus
``n_shared_experts`` x ``moe_intermediate_size`` of shared expert (``mlp.shared_experts.*``, split
over TP like a dense MLP), added after the routed sum. The router and its bias are replicated (every
rank routes every token), never quantized, and stored in fp32 as transformers keeps them
(``_keep_in_fp32_modules_strict``); routed experts split over TP like a dense MLP, or are placed
whole by expert parallelism. Multi-token-prediction layers (``num_nextn_predict_layers``,
transformers 5's ``num_mtp_layers``, default 1: ``model.layers.{num_hidden_layers + i}.*``) are not
part of the forward: transformers skips them, and a build leaves a checkpoint's copy out
(``Family.unused``). Where a config omits ``rms_norm_eps`` or ``num_key_value_heads``,
transformers' defaults (1e-5, 8) differ from the ones layout/model.py reads for every family, so
such a config is refused.

No preset: no copy of the published zai-org/GLM-4.5 (or 4.6, 4.7) config.json was available to
write one from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .deepseek import grouped_moe, mtp_layers, read_groups, routed_rows, unused
from .family import (
    Family,
    Forward,
    Row,
    attention_rows,
    count,
    mlp_rows,
    norm_rows,
    number,
    outer_rows,
    refuse,
)
from .minimax_m2 import factor_rotary_dims
from .moe import flag, read_routing

if TYPE_CHECKING:
    from .family import ModelShape

# transformers' Glm4MoeConfig defaults where config.json omits a key (the rope factor: its
# __post_init__'s); layout/model.py reads the keys every family has with its own defaults
DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "n_shared_experts": 1, "moe_intermediate_size": 1408,
            "num_nextn_predict_layers": 1}
SCALING, FACTOR = 1.0, 0.5  # routed_scaling_factor, partial_rotary_factor
# the keys whose transformers default is not layout/model.py's: refused when absent
OWN_DEFAULTS = {"rms_norm_eps": 1e-05, "num_key_value_heads": 8}


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    for key, default in OWN_DEFAULTS.items():
        if cfg.get(key) is None:
            raise refuse(key, None, f"must be given for GLM-4.5 (transformers' default {default} is not "
                         "the one shardc reads for every family)", hint="pass the checkpoint's own config.json")
    layers = count(cfg, "num_hidden_layers") or 1
    hidden, heads = count(cfg, "hidden_size") or 1, count(cfg, "num_attention_heads") or 1
    head_dim = count(cfg, "head_dim") or hidden // heads
    if cfg.get("n_routed_experts") is None and cfg.get("num_local_experts") is None:
        cfg = {**cfg, "n_routed_experts": DEFAULTS["n_routed_experts"]}
    experts, top_k = read_routing(cfg, "n_routed_experts", DEFAULTS["num_experts_per_tok"])
    groups, topk_groups = read_groups(cfg, experts, top_k, DEFAULTS)
    dense = count(cfg, "first_k_dense_replace", DEFAULTS["first_k_dense_replace"])
    return {"experts": experts, "top_k": top_k, "groups": groups, "topk_groups": topk_groups,
            "norm_topk": flag(cfg, "norm_topk_prob", True),
            "scaling": number(cfg, "routed_scaling_factor", SCALING),
            "shared": count(cfg, "n_shared_experts", DEFAULTS["n_shared_experts"]),
            "moe_inter": count(cfg, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"]),
            "sparse": tuple(i >= dense for i in range(layers)), "qk_norm": flag(cfg, "use_qk_norm", False),
            "rotary_dim": factor_rotary_dims(cfg, head_dim, FACTOR), "activation": cfg.get("hidden_act", "silu"),
            "mtp": mtp_layers(cfg, DEFAULTS["num_nextn_predict_layers"])}


def tensors(m: ModelShape) -> list[Row]:
    o = m.options
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        if o["qk_norm"]:
            rows += norm_rows(m, p + "self_attn.", ("q_norm", "k_norm"), size=m.head_dim)
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=False)
        if not o["sparse"][i]:
            rows += mlp_rows(m, p, bias=False)
            continue
        rows += routed_rows(m, p)
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    rotary = o["rotary_dim"] if o["rotary_dim"] < m.head_dim else None
    return Forward(activation=o["activation"], moe=grouped_moe(m), qk_norm=o["qk_norm"], rotary_dim=rotary)


FAMILY = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types={"Glm4MoeForCausalLM": "glm4_moe"},
    read=read, tensors=tensors, forward=forward, unused=unused,
)
