"""No silent wrong answer (#28 item 3): every config key a family's transformers configuration
declares is either read by shardc (changing it changes the model shardc builds and runs, or is
refused with one line) or listed below as not changing the math of inference.

The keys come from transformers' own configuration classes, so a key transformers adds in a
later version fails this test until someone decides what it means for shardc.
"""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

from shardc.errors import ModelError  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.runtime.support import check_supported  # noqa: E402

# Keys that do not change inference: training-only, generation defaults, or token ids the
# tokenizer side owns. pretraining_tp: transformers 5's Llama no longer reads it. Phi-3's
# original_max_position_embeddings: read only by longrope, which run and gate refuse. The routers'
# jitter noise and auxiliary loss act in training only. DeepSeek-V3's multi-token-prediction layers
# (num_mtp_layers) serve speculative decoding only: the model's forward skips them.
NOT_MATH = {"initializer_range", "use_cache", "attention_dropout", "pad_token_id", "bos_token_id",
            "eos_token_id", "pretraining_tp", "resid_pdrop", "embd_pdrop", "original_max_position_embeddings",
            "router_jitter_noise", "output_router_logits", "router_aux_loss_coef", "num_mtp_layers"}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)
# a key whose effect transformers writes into another one on save: tested with that one absent
DERIVED = {"max_window_layers": "layer_types", "first_k_dense_replace": "mlp_layer_types"}
# keys one family's transformers modeling file never reads: gpt-oss's experts compute their own
# clamped SwiGLU, and nothing in modeling_gpt_oss.py reads hidden_act
UNREAD = {"GptOssConfig": {"hidden_act"}}
# family configuration class -> architecture, extra settings that make every key live
FAMILIES = {
    "LlamaConfig": ("LlamaForCausalLM", {}),
    "MistralConfig": ("MistralForCausalLM", {"sliding_window": 8}),
    "Qwen2Config": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 2}),
    "Qwen3Config": ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 2}),
    "GraniteConfig": ("GraniteForCausalLM", {}),
    "Phi3Config": ("Phi3ForCausalLM", {"sliding_window": 8}),
    "Gemma2Config": ("Gemma2ForCausalLM", {"sliding_window": 8}),
    "Gemma3TextConfig": ("Gemma3ForCausalLM", {"sliding_window": 8}),
    "MixtralConfig": ("MixtralForCausalLM", {"sliding_window": 8, "num_local_experts": 4}),
    "Qwen2MoeConfig": ("Qwen2MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                                               "max_window_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                               "decoder_sparse_step": 1, "mlp_only_layers": [3]}),
    "Qwen3MoeConfig": ("Qwen3MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                                               "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [3]}),
    "DeepseekV3Config": ("DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 16}),
    "GptOssConfig": ("GptOssForCausalLM", {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                           "head_dim": 16}),
    # a partial rope (transformers writes rope_parameters.partial_rotary_factor from rotary_dim)
    "MiniMaxM2Config": ("MiniMaxM2ForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                                 "rotary_dim": 8}),
    # DSA: DeepSeek-V3's keys plus the indexer's (GLM-5: one layer reusing the one before's top-k)
    "DeepseekV32Config": ("DeepseekV32ForCausalLM", {
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 16, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 8}),
    "GlmMoeDsaConfig": ("GlmMoeDsaForCausalLM", {
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 16, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 8, "indexer_types": ["full", "shared", "full", "full"]}),
    # Qwen3-Next: linear layers 0-2, a full layer 3, a dense layer 1
    "Qwen3NextConfig": ("Qwen3NextForCausalLM", {
        "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "mlp_only_layers": [1]}),
    # Qwen3.5: linear layers 0-2, a full layer 3 (the dense model's MLP in every layer, the MoE's routed)
    "Qwen3_5TextConfig": ("Qwen3_5ForCausalLM", {
        "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4}),
    "Qwen3_5MoeTextConfig": ("Qwen3_5MoeForCausalLM", {
        "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32}),
    # every GLM-4.5 key live: q/k norms, biases, groups of experts, a dense first layer
    "Glm4MoeConfig": ("Glm4MoeForCausalLM", {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                                             "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 16,
                                             "head_dim": 16, "use_qk_norm": True, "attention_bias": True}),
}


def _config(cls_name: str) -> dict:
    arch, extra = FAMILIES[cls_name]
    cfg = getattr(transformers, cls_name)(**{**SHAPE, **extra}).to_dict()
    cfg["architectures"] = [arch]
    return cfg


def _seen(cfg: dict):
    """What shardc makes of a config: its model record, forward and tensor table (or a refusal)."""
    try:
        m = model_from_config(cfg)
        check_supported(m)
    except ModelError as e:
        return ("refused", e.key)
    return (m.summary(), m.forward, sorted((r.name, r.shape, r.split) for r in m.spec.tensors(m)))


def _changed(value):
    """Another plausible value for a config key."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    if isinstance(value, float):
        return value * 3.0
    if isinstance(value, str):
        return {"silu": "gelu"}.get(value, value + "-other")
    if isinstance(value, list):
        if len(set(map(str, value))) > 1:
            return list(reversed(value))
        other = "full_attention" if value and value[0] == "sliding_attention" else "sliding_attention"
        return [other] + list(value[1:])
    if isinstance(value, dict):  # rope_parameters
        return {**value, "rope_theta": value.get("rope_theta", 10000.0) * 3}
    return 8  # None: a number turns the setting on


@pytest.mark.parametrize("cls_name", sorted(FAMILIES))
def test_every_config_key_is_read_or_declared_irrelevant(cls_name):
    cls = getattr(transformers, cls_name)
    base = _config(cls_name)
    before = _seen(base)
    assert before[0] != "refused", before
    ignored = []
    for key in (k for k in cls.__annotations__ if not k.startswith("_")):
        if key in NOT_MATH or key in UNREAD.get(cls_name, ()):
            continue
        ref = copy.deepcopy(base)
        ref.pop(DERIVED.get(key, ""), None)
        cfg = copy.deepcopy(ref)
        cfg[key] = _changed(cfg.get(key))
        if _seen(cfg) == _seen(ref):
            ignored.append(key)
    assert ignored == [], f"{cls_name}: changing {ignored} changes nothing shardc builds or runs"


def test_every_architecture_has_a_config_here():
    """A family registered without a config here would have none of its keys classified
    (docs/architecture.md §8): every architecture of ``FAMILIES`` is listed."""
    from shardc.layout.families import BY_ARCHITECTURE

    assert {arch for arch, _ in FAMILIES.values()} == set(BY_ARCHITECTURE)
