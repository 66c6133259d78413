"""Qwen2-MoE and Qwen3-MoE (transformers' modeling_qwen2_moe.py, modeling_qwen3_moe.py).

Both route ``num_experts_per_tok`` of ``num_experts`` experts (``mlp.experts.N.gate_proj`` /
``up_proj`` / ``down_proj``, each of ``moe_intermediate_size``) through the router ``mlp.gate``:
softmax in fp32, top-k, renormalized only with ``norm_topk_prob``, the weights cast to the model
dtype. Layers in ``mlp_only_layers``, or whose index + 1 is not a multiple of
``decoder_sparse_step``, have a dense MLP of ``intermediate_size`` instead.

- Qwen2-MoE adds a shared expert to every sparse layer (``mlp.shared_expert.*`` of
  ``shared_expert_intermediate_size``, split over TP like a dense MLP) scaled by
  sigmoid(``mlp.shared_expert_gate`` · x); q/k/v carry biases unless ``qkv_bias`` is false;
  with ``use_sliding_window`` the layers ``layer_types`` names (default: odd-numbered ones below
  ``max_window_layers``) are windowed.
- Qwen3-MoE adds per-head q/k RMSNorm (as Qwen3), no shared expert, and with
  ``use_sliding_window`` windows every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    REPLICATED,
    ROW,
    Family,
    Forward,
    Moe,
    Preset,
    Row,
    attention_rows,
    count,
    layer_types,
    mlp_rows,
    norm_rows,
    outer_rows,
    refuse,
    windows_for,
)
from .moe import expert_rows, flag, read_routing, router_row

if TYPE_CHECKING:
    from .family import ModelShape

ROUTER = "mlp.gate.weight"
EXPERT = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
          "mlp.shared_expert.down_proj.weight")
SHARED_GATE = "mlp.shared_expert_gate.weight"


def sparse_layers(cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    step = count(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if isinstance(only, list) and len(only) > layers:  # before its entries are looked at
        raise refuse("mlp_only_layers", only, f"lists {len(only)} entries; there are {layers} layers")
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in only):
        raise refuse("mlp_only_layers", only, f"must list layer indices below {layers}")
    dense = set(only)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    qwen2 = cfg["architectures"][0] == "Qwen2MoeForCausalLM"
    layers = count(cfg, "num_hidden_layers") or 1
    experts, top_k = read_routing(cfg, "num_experts")
    windows: tuple[int | None, ...] = ()
    if cfg.get("use_sliding_window"):
        window = count(cfg, "sliding_window", 4096)
        if qwen2:
            first = count(cfg, "max_window_layers", 28)
            assert first is not None
            types = layer_types(cfg, layers, lambda i: "sliding_attention" if (i + 1) % 2 and i < first
                                else "full_attention")
        else:
            types = ("sliding_attention",) * layers
        windows = windows_for(types, window)
    out = {"windows": windows, "activation": cfg.get("hidden_act", "silu"), "experts": experts,
           "top_k": top_k, "norm_topk": flag(cfg, "norm_topk_prob", False),
           "sparse": sparse_layers(cfg, layers), "moe_inter": count(cfg, "moe_intermediate_size"),
           "qwen2": qwen2}
    if qwen2:
        out["shared_inter"] = count(cfg, "shared_expert_intermediate_size")
        out["qkv_bias"] = flag(cfg, "qkv_bias", True)
        if cfg.get("attention_bias"):
            raise refuse("attention_bias", cfg["attention_bias"], "is not a Qwen2-MoE key (its q/k/v "
                         "biases follow qkv_bias, o_proj has none)")
    return out


def tensors(m: ModelShape) -> list[Row]:
    o, h = m.options, m.hidden_size
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        if not o["qwen2"]:
            rows += norm_rows(m, p + "self_attn.", ("q_norm", "k_norm"), size=m.head_dim)
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=m.o_bias and not o["qwen2"])
        if not o["sparse"][i]:
            rows += mlp_rows(m, p, bias=False)
            continue
        rows.append(router_row(m, p, ROUTER, o["experts"]))
        rows += expert_rows(m, p, EXPERT, o["experts"], o["moe_inter"])
        if o["qwen2"]:
            s = o["shared_inter"]
            rows += [Row(p + SHARED[0], (s, h), COLUMN, True), Row(p + SHARED[1], (s, h), COLUMN, True),
                     Row(p + SHARED[2], (h, s), ROW, True), Row(p + SHARED_GATE, (1, h), REPLICATED)]
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    qwen2 = o["qwen2"]
    moe = Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=o["norm_topk"], weights_fp32=False,
              sparse=o["sparse"], router=ROUTER, expert=EXPERT, shared=SHARED if qwen2 else None,
              shared_gate=SHARED_GATE if qwen2 else None)
    return Forward(qk_norm=not qwen2, windows=o["windows"], activation=o["activation"], moe=moe)


def _qwen3_moe(hidden: int, layers: int, heads: int, kv: int, experts: int, moe_inter: int) -> dict[str, Any]:
    """A published Qwen3-MoE config.json (Qwen/Qwen3-*-A*B: head_dim 128, 8 of E experts)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": moe_inter * 8, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "num_experts": experts, "num_experts_per_tok": 8,
        "moe_intermediate_size": moe_inter, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


def _qwen3_moe_fp8(layers: int) -> dict[str, Any]:
    """The quantization_config of Qwen's MoE FP8 releases (Qwen/Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8):
    block FP8 with 128 x 128 scales, lm_head and every layer's router (mlp.gate) and two norms left out,
    in this order. Read from the config.json copies aiconfigurator 0.12 ships
    (aiconfigurator_core/model_configs/Qwen--Qwen3-30B-A3B-FP8_config.json, ...-235B-A22B-FP8_...:
    145 and 283 entries, equal to this list); the rest of each config.json is the 16-bit release's."""
    keep = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(layers)
                          for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": keep, "quant_method": "fp8",
            "weight_block_size": [128, 128]}


QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "vocab_size": 151936, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 21, "num_experts": 60, "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
    "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
}

QWEN2_MOE = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types={"Qwen2MoeForCausalLM": "qwen2_moe"},
    read=read, tensors=tensors, forward=forward,
    presets={"qwen1.5-moe-a2.7b": Preset(QWEN15_MOE_A27B, ("Qwen/Qwen1.5-MoE-A2.7B",))},
)
QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types={"Qwen3MoeForCausalLM": "qwen3_moe"},
    read=read, tensors=tensors, forward=forward,
    presets={
        "qwen3-30b-a3b": Preset(_qwen3_moe(2048, 48, 32, 4, 128, 768), ("Qwen/Qwen3-30B-A3B",)),
        "qwen3-235b-a22b": Preset(_qwen3_moe(4096, 94, 64, 4, 128, 1536), ("Qwen/Qwen3-235B-A22B",)),
        "qwen3-30b-a3b-fp8": Preset(_qwen3_moe(2048, 48, 32, 4, 128, 768), ("Qwen/Qwen3-30B-A3B-FP8",),
                                    quantization=_qwen3_moe_fp8(48)),
        "qwen3-235b-a22b-fp8": Preset(_qwen3_moe(4096, 94, 64, 4, 128, 1536), ("Qwen/Qwen3-235B-A22B-FP8",),
                                      quantization=_qwen3_moe_fp8(94)),
    },
)
