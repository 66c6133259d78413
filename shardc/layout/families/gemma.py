"""The Gemma 2 and Gemma 3 (text) families: the Llama block with Gemma's changes.

Both (transformers' modeling_gemma2.py / modeling_gemma3.py): RMSNorm weights are offsets from 1,
applied in fp32 (``norm="gemma"``); four norms per layer, the attention and MLP outputs each
normed before the residual add (``sandwich``); embeddings times sqrt(hidden_size), rounded to the
model dtype first; the softmax scale is ``query_pre_attn_scalar ** -0.5``, not head_dim's; the MLP
is GeGLU (``hidden_activation``, gelu_pytorch_tanh); layers alternate sliding-window and full
attention (``layer_types``, or the family's default pattern); the lm_head is the embedding.

Gemma 2: tanh soft-capping of attention scores (``attn_logit_softcapping``) and of the logits
(``final_logit_softcapping``); every other layer slides, the first included; one rope base.
Gemma 3: per-head q/k norms (replicated); five sliding layers then one full
(``sliding_window_pattern``); sliding layers rotate with their own base
(``rope_local_base_freq``, transformers 5: ``rope_parameters.sliding_attention``) and without
the global layers' scaling (``rope_scaling``, transformers 5: ``rope_parameters.full_attention``).
Soft-capping is off in the published Gemma 3 configs but read (and computed) when set.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .family import (
    Family,
    Forward,
    Preset,
    RopeReader,
    Row,
    attention_rows,
    count,
    layer_types,
    mlp_rows,
    norm_rows,
    number,
    outer_rows,
    refuse,
    windows_for,
)

if TYPE_CHECKING:
    from .family import ModelShape

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")
_GLOBAL_THETA = 1_000_000.0  # Gemma3TextConfig.default_theta
_LOCAL_THETA = 10_000.0


def _activation(cfg: dict[str, Any]) -> str:
    """transformers reads ``hidden_activation`` (Gemma's key); old configs carry ``hidden_act``
    too (the published Gemma 2 configs hold both, equal). Disagreeing spellings are refused."""
    act = cfg.get("hidden_activation")
    old = cfg.get("hidden_act")
    if act is None:
        return str(old) if old is not None else "gelu_pytorch_tanh"
    if old is not None and old != act:
        raise refuse("hidden_act", old, f"disagrees with hidden_activation={act!r}",
                     "keep one spelling (transformers reads hidden_activation for Gemma)")
    return str(act)


def _cap(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    return number(cfg, key, default) if key in cfg else default


def _per_layer_rope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        return params
    return None


def rope(cfg: dict[str, Any], _rope: RopeReader) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3's rope: the global layers' theta and scaling (what ModelSpec records) and the
    sliding layers' base, from transformers 5's per-layer-type ``rope_parameters`` or the old
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``; ``_rope`` reads one rope
    object in either spelling (layout/model.py's)."""
    params = _per_layer_rope(cfg)
    if params is None:
        glob: dict[str, Any] = {k: cfg[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in cfg}
        glob.setdefault("rope_theta", _GLOBAL_THETA)
        theta, scaling = _rope(glob)
        local = number(cfg, "rope_local_base_freq", _LOCAL_THETA)
        assert local is not None
        return theta, scaling, local
    unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
    if unknown:
        raise refuse("rope_parameters", params, f"has layer type {unknown[0]!r}; Gemma 3 has "
                     "full_attention and sliding_attention")
    full = params.get("full_attention") or {"rope_type": "default"}
    sliding = params.get("sliding_attention") or {"rope_type": "default"}
    if not isinstance(full, dict) or not isinstance(sliding, dict):
        raise refuse("rope_parameters", params, "must hold one object per layer type")
    glob = {"rope_parameters": {"rope_theta": _GLOBAL_THETA} | full}  # the same dict[str, Any]
    for old in ("rope_theta", "rope_scaling"):  # both spellings present: _rope makes them agree
        if cfg.get(old) is not None:
            glob[old] = cfg[old]
    theta, scaling = _rope(glob)
    kind = sliding.get("rope_type", sliding.get("type", "default"))
    if kind != "default" or set(sliding) - {"rope_type", "type", "rope_theta"}:
        raise refuse("rope_parameters.sliding_attention", sliding, "is not implemented by the shardc "
                     "runtime (sliding layers rotate with the default rope and their own theta)")
    local = number({"rope_parameters.sliding_attention.rope_theta": sliding.get("rope_theta")},
                   "rope_parameters.sliding_attention.rope_theta", _LOCAL_THETA)
    old_local = cfg.get("rope_local_base_freq")
    if old_local is not None and number(cfg, "rope_local_base_freq", None) != local:
        raise refuse("rope_local_base_freq", old_local, f"disagrees with rope_parameters."
                     f"sliding_attention.rope_theta={local!r}",
                     "keep one spelling (transformers 5 writes rope_parameters only)")
    assert local is not None
    return theta, scaling, local


def _local_theta(cfg: dict[str, Any]) -> float:
    """The sliding layers' base alone (the global rope is read by layout/model.py through
    ``rope``): both spellings, checked as ``rope`` checks them."""
    def one(obj: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
        return 1.0, None  # the global rope is not wanted here
    return rope(cfg, one)[2]


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    arch = cfg["architectures"][0]
    gemma3 = arch == GEMMA3
    layers = count(cfg, "num_hidden_layers") or 1
    for key in ("attention_bias", "mlp_bias"):  # transformers' Gemma has no MLP bias at all
        if cfg.get(key):
            raise refuse(key, cfg[key], "is not implemented for Gemma by the shardc runtime")
    if cfg.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", cfg["use_bidirectional_attention"],
                     "is not implemented by the shardc runtime (it computes causal attention)")
    if cfg.get("tie_word_embeddings") is False:
        raise refuse("tie_word_embeddings", False, "is not Gemma (its lm_head is the embedding)")
    if gemma3:
        pattern = count(cfg, "sliding_window_pattern", 6)
        assert pattern is not None
        types = layer_types(cfg, layers, lambda i: "sliding_attention" if (i + 1) % pattern
                            else "full_attention")
        local: float | None = _local_theta(cfg)
    else:
        types = layer_types(cfg, layers, lambda i: "sliding_attention" if (i + 1) % 2
                            else "full_attention")
        local = None
    window = count(cfg, "sliding_window", 4096)
    scalar = number(cfg, "query_pre_attn_scalar", 256)  # transformers' default, whatever head_dim
    assert scalar is not None
    return {
        "windows": windows_for(types, window),
        "rope_theta_local": local,
        "attn_scale": scalar ** -0.5,
        "attn_softcap": _cap(cfg, "attn_logit_softcapping", None if gemma3 else 50.0),
        "final_softcap": _cap(cfg, "final_logit_softcapping", None if gemma3 else 30.0),
        "activation": _activation(cfg),
        "tie_word_embeddings": True,  # transformers' default for Gemma: absent means tied
    }


def tensors(m: ModelShape) -> list[Row]:
    rows = outer_rows(m)
    gemma3 = m.architecture == GEMMA3
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        rows += norm_rows(m, p, _NORMS)
        rows += attention_rows(m, p, qkv_bias=False, o_bias=False)
        if gemma3:  # per head, so whole on every rank
            rows += norm_rows(m, p + "self_attn.", ("q_norm", "k_norm"), m.head_dim)
        rows += mlp_rows(m, p, bias=False)
    return rows


def forward(m: ModelShape) -> Forward:
    o = m.options
    return Forward(norm="gemma", qk_norm=m.architecture == GEMMA3, sandwich=True,
                   embed_scale=math.sqrt(m.hidden_size), embed_scale_in_dtype=True,
                   attn_scale=o["attn_scale"], attn_softcap=o["attn_softcap"],
                   final_softcap=o["final_softcap"], windows=o["windows"],
                   rope_theta_local=o["rope_theta_local"], activation=o["activation"])


# Published config.json values (google/gemma-2-9b-it; the text model of google/gemma-3-27b-it,
# whose own checkpoint is the multimodal Gemma3ForConditionalGeneration; google/gemma-3-1b-it).
_GEMMA2_9B = {
    "architectures": [GEMMA2],
    "model_type": "gemma2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 256000,
}


def _gemma3(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, scalar: int,
            window: int, vocab: int, max_pos: int, scaling: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "architectures": [GEMMA3],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": max_pos,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "pad_token_id": 0,
        "query_pre_attn_scalar": scalar,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": scaling,
        "rope_theta": 1000000.0,
        "sliding_window": window,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab,
    }


PRESETS_2 = {"gemma-2-9b": Preset(_GEMMA2_9B, ("google/gemma-2-9b-it", "google/gemma-2-9b"))}
PRESETS_3 = {
    # Gemma 3 27B's language model; its hub checkpoint is multimodal, so no repo to fetch from
    "gemma-3-27b": Preset(_gemma3(5376, 21504, 62, 32, 16, 128, 168, 1024, 262208, 131072,
                                  {"factor": 8.0, "rope_type": "linear"})),
    "gemma-3-1b": Preset(_gemma3(1152, 6912, 26, 4, 1, 256, 256, 512, 262144, 32768, None),
                         ("google/gemma-3-1b-it", "google/gemma-3-1b-pt")),
}

GEMMA2_FAMILY = Family(name="gemma2", architectures=(GEMMA2,), model_types={GEMMA2: "gemma2"}, read=read,
                       tensors=tensors, forward=forward, presets=PRESETS_2)
GEMMA3_FAMILY = Family(name="gemma3", architectures=(GEMMA3,), model_types={GEMMA3: "gemma3_text"}, read=read,
                       tensors=tensors, forward=forward, presets=PRESETS_3,
                       rope=lambda cfg, one: rope(cfg, one)[:2])
