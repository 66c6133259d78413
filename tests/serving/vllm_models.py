"""Tiny checkpoints of every family shardc supports, made by transformers, sized for vLLM's CPU
backend: head_dim 32 (its attention kernels take 32, 64, 80, ... only), a vocabulary of 256 rows (a
multiple of 64 x tp, so that shardc's vocabulary cut is the rows vLLM gives each rank), and norms
perturbed from 1 so that a norm read into the wrong place shows. Import by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2)
ROPE_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
# name -> (config class, model class, config keys over BASE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03,
                     logits_scaling=16.0, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, attn_logit_softcapping=4.0, final_logit_softcapping=8.0, sliding_window=16,
                    query_pre_attn_scalar=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                    layer_types=["sliding_attention", "full_attention"])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=4,
                       num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                       head_dim=32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=64, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                         q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                         v_head_dim=32, rope_parameters=ROPE_YARN, topk_method="noaux_tc")),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    # vLLM reads rotary_dim and scoring_func (and use_routing_bias) from the config, transformers none of them
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(head_dim=32, rotary_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        scoring_func="sigmoid", use_routing_bias=True)),
    # DSA: DeepSeek-V3's shape (q latent, interleaved rope, YaRN) plus the indexer (GLM-5: interleaved rope
    # in the indexer too, layer 1 reusing layer 0's top-k)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(moe_intermediate_size=64, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                          num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                          q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                          v_head_dim=32, rope_parameters=ROPE_YARN, index_n_heads=4, index_head_dim=64,
                          index_topk=16)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(moe_intermediate_size=64, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                         q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                         v_head_dim=32, index_n_heads=4, index_head_dim=64, index_topk=16,
                         indexer_types=["full", "shared"])),
    # Qwen3-Next: three Gated DeltaNet layers, then a gated full-attention layer
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_hidden_layers=4, head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    # Qwen3.5: Qwen3-Next's layers with the in-projections apart (linear head dims 128, as Qwen3-Next's);
    # the dense model a gated MLP, the MoE model routed experts with a gated shared expert in every layer
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(num_hidden_layers=4, head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=2, linear_num_value_heads=4)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(num_hidden_layers=4, head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    # GLM-4.5: q/k/v biases, per-head q/k norms, half of each head rotated, grouped sigmoid routing
    # with a shared expert after one dense layer (vLLM keeps the router and its bias in fp32, as shardc does)
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=32, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, attention_bias=True,
                      use_qk_norm=True, partial_rotary_factor=0.5)),
}


def save(root: Path, name: str, **more: Any) -> Path:
    """Write family ``name``'s tiny bf16 checkpoint under ``root/name`` (seeded); returns it."""
    import torch
    import transformers

    config_cls, model_cls, keys = FAMILIES[name]
    torch.manual_seed(17)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **keys, **more}))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.3)
    model.to(torch.bfloat16).save_pretrained(root / name)
    return root / name
