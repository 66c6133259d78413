"""gpt-oss (GptOssForCausalLM; transformers' modeling_gpt_oss.py).

Attention: q/k/v/o with biases (``attention_bias``, default true), grouped KV heads, and one learned
**sink** logit per head (``self_attn.sinks``, split by head like q) that joins each query's softmax
and is dropped after it; layers alternate sliding-window (``sliding_window``, even layers by
default, or ``layer_types``) and full attention. Rope is YaRN; a config with no rope keys gets
transformers' default (factor 32 over 4,096 positions, theta 150,000, ``truncate`` false).
RMSNorm multiplies by its weight in fp32 before the cast (``Forward.norm = "rms_upcast"``).

Every layer is a mixture of experts whose experts are **stacked** per layer, as transformers holds
them: ``mlp.experts.gate_up_proj`` [E, hidden, 2·inter] (gate and up interleaved along the last
dimension), ``gate_up_proj_bias`` [E, 2·inter], ``down_proj`` [E, inter, hidden],
``down_proj_bias`` [E, hidden], computed as x @ W + b with the clamped SwiGLU (``swiglu_limit``,
``swiglu_alpha``). Expert parallelism gives each rank its experts' block of dim 0 (vLLM's linear
placement is contiguous); without it TP cuts gate_up's last dimension (a contiguous block of
columns holds whole gate/up pairs), its bias likewise, down's inter rows, and down's bias stays
whole (added once). The router (``mlp.router.weight`` and ``.bias``) is replicated: logits with
the bias, the top ``num_experts_per_tok`` softmaxed in the model dtype.

int8 / fp8 plans are refused (layout/quantization.py): the stacked experts have no int8/fp8 form
that transformers or vLLM loads, and quantizing only the attention is not what such a plan says.
Sources published with MXFP4 experts (``quantization_config.quant_method: mxfp4``, tensors
``*_blocks`` / ``*_scales``) are read by layout/quant_formats/mxfp4.py: dequantized as transformers
does, or kept as stored (``dtype: source``: whole experts per rank under expert parallelism, else
each expert cut by tp on whole 32-value blocks, layout/quant_formats/mxfp4.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import (
    COLUMN,
    REPLICATED,
    STACKED,
    Family,
    Forward,
    Moe,
    Preset,
    RopeReader,
    Row,
    attention_rows,
    count,
    layer_types,
    norm_rows,
    number,
    outer_rows,
    windows_for,
)
from .moe import flag, read_routing

if TYPE_CHECKING:
    from .family import ModelShape

ROUTER, ROUTER_BIAS = "mlp.router.weight", "mlp.router.bias"
STACK = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
         "mlp.experts.down_proj_bias")
# transformers' GptOssConfig when config.json names no rope (its __post_init__ and default_theta)
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = count(cfg, "num_hidden_layers") or 1
    experts, top_k = read_routing(cfg, "num_local_experts")
    types = layer_types(cfg, layers, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    bias = flag(cfg, "attention_bias", True)
    return {"windows": windows_for(types, count(cfg, "sliding_window", 128)), "experts": experts,
            "top_k": top_k, "qkv_bias": bias, "o_bias": bias,
            "swiglu": (number(cfg, "swiglu_alpha", 1.702), number(cfg, "swiglu_limit", 7.0))}


def rope(cfg: dict[str, Any], reader: RopeReader) -> tuple[float, dict[str, Any] | None]:
    """transformers' defaults where config.json is silent: the YaRN above, theta 150,000."""
    cfg = dict(cfg)
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        cfg["rope_scaling"] = dict(DEFAULT_ROPE)
    params = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        cfg["rope_theta"] = DEFAULT_THETA
    return reader(cfg)


def tensors(m: ModelShape) -> list[Row]:
    e, h, inter = m.options["experts"], m.hidden_size, m.intermediate_size
    gate_up, gate_up_bias, down, down_bias = STACK
    rows = outer_rows(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, ("input_layernorm", "post_attention_layernorm"))
        rows += attention_rows(m, p, qkv_bias=m.qkv_bias, o_bias=m.o_bias)
        rows += [Row(p + "self_attn.sinks", (m.num_heads,), COLUMN),
                 Row(p + ROUTER, (e, h), REPLICATED), Row(p + ROUTER_BIAS, (e,), REPLICATED),
                 Row(p + gate_up, (e, h, 2 * inter), STACKED, tp_dim=2),
                 Row(p + gate_up_bias, (e, 2 * inter), STACKED, tp_dim=1),
                 Row(p + down, (e, inter, h), STACKED, tp_dim=1),
                 Row(p + down_bias, (e, h), STACKED)]
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    moe = Moe(experts=o["experts"], top_k=o["top_k"], norm_topk=False, weights_fp32=False,
              sparse=(True,) * m.num_layers, router=ROUTER, expert=(), scoring="topk_softmax",
              router_bias=ROUTER_BIAS, stacked=STACK, swiglu=o["swiglu"])
    return Forward(norm="rms_upcast", windows=o["windows"], moe=moe, yarn=True, sinks=True)


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """A published gpt-oss config.json (openai/gpt-oss-*), less its quantization_config (MXFP4)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "rope_scaling": dict(DEFAULT_ROPE),
        "sliding_window": 128, "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                               for i in range(layers)],
        "attention_bias": True, "tie_word_embeddings": False, "hidden_act": "silu",
        "num_local_experts": experts, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9, "output_router_logits": False, "eos_token_id": 200002,
        "pad_token_id": 199999, "torch_dtype": "bfloat16",
    }


# The published checkpoints' quantization_config: the routed experts in MXFP4, the rest bf16; as
# transformers' models/gpt_oss/convert_gpt_oss_weights_to_hf.py writes it into the hub's config.json.
GPT_OSS_MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                            "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}

FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types={"GptOssForCausalLM": "gpt_oss"},
    read=read, tensors=tensors, forward=forward, rope=rope,
    presets={"gpt-oss-120b": Preset(_gpt_oss(36, 128), ("openai/gpt-oss-120b",), quantization=GPT_OSS_MXFP4),
             "gpt-oss-20b": Preset(_gpt_oss(24, 32), ("openai/gpt-oss-20b",), quantization=GPT_OSS_MXFP4)},
)
