"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM; GLM-5.1 to 5.3 too):
DeepSeek-V3's MLA and grouped-sigmoid MoE (families/deepseek.py, whose reader and table this module
extends) plus DeepSeek Sparse Attention (DSA), as transformers' modeling_deepseek_v32.py and
modeling_glm_moe_dsa.py compute it with eager attention.

DSA: each layer's lightning indexer (``self_attn.indexer.*``; the math in indexer.py) scores every
visible token and MLA attends to the ``index_topk`` best only; with fewer visible tokens that is
all of them, and the layer is exactly dense MLA. The two architectures differ in the indexer's
rope (DeepSeek-V3.2 rotates halves, GLM-5 interleaved pairs: ``indexer_rope_interleave``, each
fixed by its transformers class) and in GLM-5.x's ``indexer_types``: a "shared" layer has no
indexer and reuses the top-k of the nearest earlier "full" layer (GLM-5.3 runs one every 4 layers).

Split: the indexer is **replicated**, never cut by heads, as vLLM's ``Indexer`` (ReplicatedLinear).
Its score sums ReLU(q·k) over the indexer's heads before the top-k; heads cut over TP would need
that sum all-reduced, whose rounding can differ from one rank's sum and flip a near-tie, and then
ranks would attend to different tokens. Replicated, every rank computes the same fp32 scores and
picks the same tokens, so each rank's heads of MLA see exactly the one-GPU selection. The cost is
small: a layer's indexer is 2.6 % of DeepSeek-V3.2's attention weights. ``wq_b`` and ``wk`` are
linears (quantizable; the published FP8 holds them in FP8), ``k_norm`` is a LayerNorm (weight and
bias), and ``weights_proj`` stays 16-bit, never quantized, as published and as vLLM holds it (in
the plan's dtype; transformers keeps it in fp32 for an fp16 model only, ``_keep_in_fp32_modules``,
so the runtime computes it in fp32 there, from the fp16 weight).

The cache holds, per token and layer, MLA's latent and rotary key plus the indexer's key
(``index_head_dim`` values: the planner counts vLLM's FP8 form, 132 bytes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .deepseek import DEFAULTS, unused
from .deepseek import forward as mla_forward
from .deepseek import read as mla_read
from .deepseek import tensors as mla_tensors
from .family import REPLICATED, Family, Forward, Preset, Row, count, refuse, short
from .indexer import INDEXER, Indexer
from .names import LATENT, Names

if TYPE_CHECKING:
    from .family import ModelShape

V32, GLM = "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"
NAMES = Names(latent=LATENT + INDEXER)  # the runtime reads the indexer's tensors with MLA's latent ones
# transformers' GlmMoeDsaConfig defaults where they differ from DeepseekV32Config's (= DeepseekV3Config's)
GLM_DEFAULTS = {**DEFAULTS, "n_group": 1, "topk_group": 1, "q_lora_rank": 2048,
                "qk_nope_head_dim": 192, "v_head_dim": 256}
# (index_n_heads, index_head_dim, index_topk, indexer rope interleaved) by architecture
INDEXER_DEFAULTS = {V32: (64, 128, 2048, False), GLM: (32, 128, 2048, True)}


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or [V32]
    return GLM if GLM in archs else V32


def _fixed(cfg: dict[str, Any], key: str, value: bool, arch: str, what: str) -> None:
    """A rope layout transformers' class hard-codes: any other value in config.json is refused."""
    given = cfg.get(key, value)
    if given is not None and given != value:
        raise refuse(key, given, f"is not what transformers' {arch} computes: its {what} rope is "
                     f"{'interleaved' if value else 'on halves'} whatever the config says")


def _per_layer(cfg: dict[str, Any], key: str, layers: int, allowed: tuple[str, ...]) -> list[str] | None:
    given = cfg.get(key)
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != layers or any(v not in allowed for v in given):
        raise refuse(key, given, f"must list one of {', '.join(allowed)} for each of num_hidden_layers={layers}")
    return given


def _own(cfg: dict[str, Any], arch: str, layers: int) -> tuple[bool, ...]:
    """Which layers run their own indexer: GlmMoeDsaConfig's ``indexer_types``, else the pattern it
    derives (``index_topk_pattern``, else ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    types = _per_layer(cfg, "indexer_types", layers, ("full", "shared"))
    if arch == V32:  # DeepseekV32Config has no such key: every layer runs its indexer
        if types is not None and "shared" in types:
            raise refuse("indexer_types", short(types), f"is not read by transformers' {arch}: every "
                         "layer runs its own indexer")
        return (True,) * layers
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - {"F", "S"}:
            raise refuse("index_topk_pattern", pattern, f"must be F or S for each of num_hidden_layers={layers}")
        types = ["full" if c == "F" else "shared" for c in pattern]
    if types is None:
        freq, offset = count(cfg, "index_topk_freq", 1), count(cfg, "index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if types[0] != "full":
        raise refuse("indexer_types", short(types), "must start with a full layer (a shared layer reuses "
                     "an earlier layer's top-k)")
    return tuple(t == "full" for t in types)


def read(cfg: dict[str, Any]) -> dict[str, Any]:
    arch = _architecture(cfg)
    options = mla_read(cfg, GLM_DEFAULTS if arch == GLM else DEFAULTS)
    layers = len(options["sparse"])
    if options["q_lora"] is None:
        raise refuse("q_lora_rank", None, "must be set: DSA's indexer reads MLA's q latent")
    kinds = _per_layer(cfg, "mlp_layer_types", layers, ("dense", "sparse"))
    if kinds is not None:  # transformers reads it before first_k_dense_replace
        options["sparse"] = tuple(k == "sparse" for k in kinds)
    _per_layer(cfg, "layer_types", layers, ("indexed_attention",))
    heads, dim, topk, interleave = INDEXER_DEFAULTS[arch]
    _fixed(cfg, "rope_interleave", True, arch, "MLA's")
    _fixed(cfg, "indexer_rope_interleave", interleave, arch, "indexer's")
    router = cfg.get("moe_router_dtype", "float32")  # GLM-5.3's config.json: the router in fp32
    if router != "float32":
        raise refuse("moe_router_dtype", router, "is not computed by shardc (its router is fp32)")
    indexer = Indexer(heads=count(cfg, "index_n_heads", heads), head_dim=count(cfg, "index_head_dim", dim),
                      topk=count(cfg, "index_topk", topk), rope=options["qk_rope_head_dim"],
                      interleave=interleave, own=_own(cfg, arch, layers))
    if indexer.rope > indexer.head_dim:
        raise refuse("index_head_dim", indexer.head_dim, f"is below qk_rope_head_dim={indexer.rope} "
                     "(the indexer rotates that many of its dimensions)")
    # per layer, as "sparse" is: the planner's probe models keep one layer of each kind
    return {**options, "indexer": indexer, "indexed": indexer.own}


def tensors(m: ModelShape) -> list[Row]:
    rows = mla_tensors(m)
    ix: Indexer = m.options["indexer"]
    q_lora, h = m.options["q_lora"], m.hidden_size
    names = dict(INDEXER)
    for i in range(m.num_layers):
        if not m.options["indexed"][i]:
            continue
        p = f"model.layers.{i}."
        rows += [Row(p + names["ix_q"], (ix.heads * ix.head_dim, q_lora), REPLICATED, True),
                 Row(p + names["ix_k"], (ix.head_dim, h), REPLICATED, True),
                 Row(p + names["ix_k_norm"], (ix.head_dim,), REPLICATED),
                 Row(p + names["ix_k_bias"], (ix.head_dim,), REPLICATED),
                 Row(p + names["ix_weights"], (ix.heads, h), REPLICATED)]
    return rows


def forward(m: ModelShape) -> Forward:
    base = mla_forward(m)
    assert base.mla is not None
    indexer = dataclasses.replace(m.options["indexer"], own=m.options["indexed"])
    return dataclasses.replace(base, mla=dataclasses.replace(base.mla, indexer=indexer), names=NAMES)


# deepseek-ai/DeepSeek-V3.2's config.json as aiconfigurator 0.12 ships it
# (aiconfigurator_core/model_configs/deepseek-ai--DeepSeek-V3.2_config.json), less its
# quantization_config (below)
DEEPSEEK_V32 = {
    "architectures": [V32], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 2048, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
DEEPSEEK_V32_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                    "weight_block_size": [128, 128]}

# zai-org/GLM-5's config.json as aiconfigurator 0.12 ships it (zai-org--GLM-5_config.json; GLM-5.1's
# differs only in transformers_version). zai-org/GLM-5-FP8 is published separately: its
# quantization_config lists 712 modules kept in 16 bits, which the planner's sizing does not need
# (the norms, routers and indexer norms are a rounding error of its bytes).
GLM_5 = {
    "architectures": [GLM], "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16",
    "eos_token_id": [154820, 154827, 154829], "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "head_dim": 64, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
    "indexer_rope_interleave": True, "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512,
    "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "model_type": "glm_moe_dsa", "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "pad_token_id": 154820, "pretraining_tp": 1,
    "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "transformers_version": "5.0.2.dev0", "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
}


def _glm5_fp8_keep(layers: int, dense: int) -> list[str]:
    """zai-org/GLM-5-FP8's modules_to_not_convert: lm_head, the embedding, per layer (the MTP layer
    ``layers`` too) its norms, the indexer's k_norm and bias, ``self_attn.indexers_proj`` (naming no
    module of the model) and, past the dense layers, the router and its bias; the MTP layer's own
    modules; the final norm. Equal to the published list, 712 entries in this order (checked against
    aiconfigurator 0.12's zai-org--GLM-5-FP8_config.json, whose other keys are GLM-5's config.json)."""
    keep = ["lm_head", "model.embed_tokens"]
    for i in range(layers + 1):
        names = ["input_layernorm", "post_attention_layernorm", "self_attn.indexer.k_norm",
                 "self_attn.indexer.k_norm.bias", "self_attn.indexers_proj", "self_attn.kv_a_layernorm",
                 "self_attn.q_a_layernorm"] + (["mlp.gate", "mlp.gate.e_score_correction_bias"] if i >= dense else [])
        names += ["eh_proj", "enorm", "hnorm", "shared_head.norm"] if i == layers else []
        keep += [f"model.layers.{i}.{n}" for n in sorted(names)]
    return keep + ["model.norm"]


GLM_5_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
             "modules_to_not_convert": _glm5_fp8_keep(78, 3)}

# zai-org/GLM-5.3's config.json (aiconfigurator 0.12: zai-org--GLM-5.3_config.json): GLM-5's with these
# values; its 78-entry indexer_types and mlp_layer_types lists are written by the rule they follow
# (GlmMoeDsaConfig's freq 4 / offset 3 pattern: 21 full indexer layers; 3 dense layers), checked equal
GLM_5_3 = {
    **GLM_5, "head_dim": 192, "index_share_for_mtp_iteration": True, "index_skip_topk_offset": 3,
    "index_topk_freq": 4, "index_topk_pattern": None,
    "indexer_types": ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)],
    "max_position_embeddings": 1048576, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
    "moe_router_dtype": "float32", "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "transformers_version": "5.12.0",
}

FAMILY = Family(
    name="deepseek_v32",
    architectures=(V32, GLM),
    model_types={V32: "deepseek_v32", GLM: "glm_moe_dsa"},
    read=read, tensors=tensors, forward=forward, unused=unused,
    presets={"deepseek-v3.2": Preset(DEEPSEEK_V32, ("deepseek-ai/DeepSeek-V3.2",), quantization=DEEPSEEK_V32_FP8),
             "glm-5": Preset(GLM_5, ("zai-org/GLM-5",)),
             "glm-5-fp8": Preset(GLM_5, ("zai-org/GLM-5-FP8",), quantization=GLM_5_FP8),
             "glm-5.3": Preset(GLM_5_3, ("zai-org/GLM-5.3",))},
)
