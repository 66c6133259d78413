"""The families' tiny transformers-made models, written once (#44 item 6): ``MODELS[family][case]``
for every family in ``shardc.layout.families.FAMILIES`` (the first case of a family is the one
``families/test_conformance.py`` runs), the transformers reference (``hf``, ``hf_logits``), the
token ids (``ids``) and the build cache (``TinyFamilies``; the session fixture ``tiny_families``
in conftest.py). Import by name: ``from family_models import MODELS, hf_logits, ids``.

Each case is saved exactly as the family test that measured its tolerances saved it (config,
seed, the order of the bf16 cast and the perturbation of norms or router), so the bytes, the
logits and hence every measured bound stay the ones the tests were written against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the dense families' and transformers 5 configs' shape (tests/families/test_dense.py,
# test_transformers5_configs.py)
DENSE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, initializer_range=0.2)
MOE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=96, max_position_embeddings=256, initializer_range=0.2)
GEMMA_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=96, max_position_embeddings=256, initializer_range=0.2,
                   query_pre_attn_scalar=24, sliding_window=16)
PHI3_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
DEEPSEEK_SHAPE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=96, max_position_embeddings=256,
                      initializer_range=0.2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=12)
# DSA (DeepSeek-V3.2, GLM-5): DeepSeek's shape with a q latent and an indexer whose top 6 of the 24
# tokens leave most queries attending to a subset (sparse and dense attention differ from token 7)
DSA_SHAPE = dict(DEEPSEEK_SHAPE, q_lora_rank=24, index_n_heads=2, index_head_dim=16, index_topk=6)
# Qwen3-Next: layers 0-2 Gated DeltaNet (4 key heads of 8, 8 value heads of 8, a conv of 4), layer 3
# full attention (4 heads over 2 KV heads of 16, a quarter of each rotated, an output gate); layer 1
# a dense MLP, the others 4 routed experts with a gated shared expert
QWEN3_NEXT_SHAPE = dict(MOE_SHAPE, num_hidden_layers=4, intermediate_size=96, head_dim=16, linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
                        linear_num_value_heads=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, mlp_only_layers=[1])
# Qwen3.5: Qwen3-Next's layers (its in-projections stored apart), the dense model a gated MLP of 96
# in every layer, the MoE model 4 routed experts with a gated shared expert in every layer
QWEN3_5_SHAPE = {k: v for k, v in QWEN3_NEXT_SHAPE.items() if k not in (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers")}
QWEN3_5_MOE_SHAPE = {k: v for k, v in QWEN3_NEXT_SHAPE.items() if k not in ("intermediate_size", "mlp_only_layers")}
# MiniMax-M2: 4 heads over 2 KV heads (tp = 2 splits both), a partial rope (8 of 16 dimensions; the
# saved config.json spells it twice, rotary_dim and rope_parameters.partial_rotary_factor)
MINIMAX_SHAPE = dict(MOE_SHAPE, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, head_dim=16,
                     rotary_dim=8)
# GLM-4.5: 4 heads over 2 KV heads, q/k/v biases and per-head q/k norms, a partial rope (8 of 16
# dimensions), one dense layer then two routed ones (8 experts in 4 groups, the best 2 groups, top 2,
# scaled by 1.5) with a shared expert; one multi-token-prediction layer declared (transformers saves
# none: tests/families/test_glm4_moe.py adds its tensors)
GLM_SHAPE = dict(MOE_SHAPE, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                 first_k_dense_replace=1, routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True,
                 partial_rotary_factor=0.5, num_nextn_predict_layers=1)
GPT_OSS_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=96, max_position_embeddings=256, initializer_range=0.2, intermediate_size=32,
                      num_local_experts=6, num_experts_per_tok=2, sliding_window=8)


# --- how a case's weights are made after transformers initializes them -------------------------

def _bf16(model: Any) -> Any:
    import torch

    return model.to(torch.bfloat16)


def _norms_added(model: Any) -> Any:
    """Norms perturbed from 1 (fp32, then cast): a norm weight read into the wrong place shows."""
    import torch

    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(torch.bfloat16)


def _norms_drawn(model: Any) -> Any:
    """Gemma: transformers starts the norms at zero, so (1 + w) would not be tested; drawn in bf16."""
    import torch

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def _router_biased(model: Any) -> Any:
    """DeepSeek-V3: transformers initializes the correction bias to zero; make it choose. The router
    and its bias in fp32, as transformers holds them (and saves a loaded model), with values bf16
    cannot hold."""
    import torch

    model.to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers[DEEPSEEK_SHAPE["first_k_dense_replace"]:]:
            layer.mlp.gate.float()
            layer.mlp.gate.weight.normal_(0, DEEPSEEK_SHAPE["initializer_range"])
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(DEEPSEEK_SHAPE["n_routed_experts"]) * 0.5)
    return model


def _dsa_made(model: Any) -> Any:
    """DSA: DeepSeek's biased router, and the indexer's LayerNorm drawn away from (1, 0) so a weight
    or bias read into the wrong place changes the chosen tokens."""
    import torch

    model = _router_biased(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "indexer.k_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _minimax_made(model: Any) -> Any:
    """MiniMax-M2: norms perturbed from 1 (the whole-width q/k norms too: a slice on the wrong rank
    shows) and a nonzero correction bias that changes choices (transformers starts it at zero); all
    bf16, as transformers holds a bf16 model's router and bias."""
    import torch

    model = _norms_added(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(MINIMAX_SHAPE["num_local_experts"]) * 0.5)
    return model


def _glm_made(model: Any) -> Any:
    """GLM-4.5: norms perturbed from 1 (the q/k norms too), q/k/v biases drawn (transformers starts
    them at zero), then bf16; the routers and their correction biases in fp32 as transformers holds
    them, with values bf16 cannot hold and a bias that changes choices."""
    import torch

    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.3)
            elif key.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
    model.to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers[GLM_SHAPE["first_k_dense_replace"]:]:
            layer.mlp.gate.float()
            layer.mlp.gate.weight.normal_(0, GLM_SHAPE["initializer_range"])
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(GLM_SHAPE["n_routed_experts"]) * 0.5)
    return model


# --- how a tp > 1 run agrees with transformers (each family's measured bound) -------------------

def dense_agree(got: Any, want: Any, tp: int, *, rtol: float = 0.01, atol: float = 0.2, top1: float = 0.95) -> None:
    """Row-parallel partial sums rounded to bf16 in another order: a few ulps per layer."""
    import torch

    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= top1


def routed_agree(got: Any, want: Any, tp: int, *, atol: float = 0.2, top1: float = 0.9) -> None:
    """Every position but those whose routing a last-bit change flipped (at most 1 in 16)."""
    assert ((got - want).abs().amax(-1) > atol).float().mean() <= 1 / 16
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= top1


def latent_agree(got: Any, want: Any, tp: int, *, atol: float = 0.25, top1: float = 0.9) -> None:
    """DeepSeek: a router near-tie can flip one token's expert; that token and those attending to it
    then differ by more (up to 1.4 measured, 1 of 48 positions)."""
    close = ((got - want).abs() <= atol + 0.01 * want.abs()).all(-1).float().mean()
    assert close >= 0.9, close
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= top1


def sparse_agree(got: Any, want: Any, tp: int) -> None:
    """DSA: where a query sees at most index_topk tokens its attention is dense, and DeepSeek's bound
    holds; past that, tp = 2's last-bit differences in the hidden state can swap a token at the edge
    of the indexer's top-k, and a tiny model attending to 6 tokens then moves by up to 5.5 (measured
    over 3 seeds per case: 75-96 % of later positions within DeepSeek's bound, 88-100 % same top-1).
    tests/families/test_deepseek_v32.py holds what is exact: the selection itself equals transformers'
    for the same input, and tp = 2 with the top-k above the sequence (dense) meets DeepSeek's bound."""
    k = DSA_SHAPE["index_topk"]
    latent_agree(got[:, :k], want[:, :k], tp)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


def hybrid_agree(got: Any, want: Any, tp: int) -> None:
    """Qwen3-Next: a token a last-bit change routes to another expert enters the delta rule's state,
    which every later token reads, so one flip reaches the rest of the 72 tokens (measured over 3 seeds:
    82-90 % of positions within DeepSeek's bound, 92-94 % the same top-1; with every MLP dense 98.6-100 %
    and 97 %: tests/families/test_qwen3_next.py holds that, and the layer's tp = 2 cut to one rounding)."""
    close = ((got - want).abs() <= 0.25 + 0.01 * want.abs()).all(-1).float().mean()
    assert close >= 0.8, close
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def hybrid_routed_agree(got: Any, want: Any, tp: int) -> None:
    """Qwen3.5-MoE: hybrid_agree's flips, with every layer routed (Qwen3-Next's tiny model has one
    dense layer) more of them (measured over 3 seeds at tp = 2 and tp = 2 expert parallel: 76.4-81.2 %
    of positions within DeepSeek's bound, 86.8-91.7 % the same top-1; the dense Qwen3.5 meets
    hybrid_agree: 96.5-99.3 % and 95.1-98.6 %); the bound leaves room for another CPU's flips."""
    close = ((got - want).abs() <= 0.25 + 0.01 * want.abs()).all(-1).float().mean()
    assert close >= 0.65, close
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def _gemma_agree(got: Any, want: Any, tp: int) -> None:
    dense_agree(got, want, tp, rtol=0.0)


@dataclass(frozen=True)
class Tiny:
    """One tiny model: transformers' config and model classes, the config keys, the seed, how its
    weights are finished (``make``), its sequence length ``T``, the transformers reference's keyword
    arguments (``ref``: eager experts or attention where the runtime follows those) and
    ``tp1_ref`` (the reference a tp=1 run equals bit for bit), ``agree`` (tp > 1 against the
    reference), ``seed_of`` (the ids' seed of a (tp, ep, dp) run), ``dirname``, ``moe`` (routed
    experts) and ``gate_ppl`` (the gate's perplexity bound for its tp = 2 build: the product's
    0.5 %, or for routed experts the room a routing flip takes, see ``ROUTED_GATE_PPL``) and ``gate_top1``
    (its top-1 agreement: DSA's 0.85, a token swapped at the edge of the indexer's top-k, see
    ``sparse_agree``; measured 0.865)."""

    config_cls: str
    model_cls: str
    keys: dict[str, Any]
    seed: int
    make: Callable[[Any], Any] = _bf16
    T: int = 40
    ref: dict[str, Any] = field(default_factory=dict)
    tp1_ref: dict[str, Any] | None = None
    agree: Callable[..., None] = dense_agree
    seed_of: Callable[[int, bool, int], int] = lambda tp, ep, dp: tp  # noqa: E731
    dirname: str | None = None
    moe: bool = False
    gate_ppl: float = 0.5
    tp1_near_ref: float | None = None  # with tp1_ref: also within this of ``ref``, same argmax
    gate_top1: float = 0.9  # the gate's top-1 agreement of the tp = 2 build over the tp = 1 baseline

    @property
    def vocab(self) -> int:
        return self.keys["vocab_size"]

    def config(self, **changes: Any) -> Any:
        import transformers

        return getattr(transformers, self.config_cls)(**{**self.keys, **changes})

    def config_dict(self, **extra: Any) -> dict:
        """The config as config.json holds it (``architectures`` set), with ``extra`` keys."""
        cfg = self.config().to_dict()
        cfg.update(architectures=[self.model_cls], **extra)
        return cfg

    def save(self, path: Path, **changes: Any) -> Path:
        """Made by transformers (seeded, finished by ``make``) and saved at ``path``; ``changes``:
        config keys over the case's (the same weights drawn, another config)."""
        import torch
        import transformers

        torch.manual_seed(self.seed)
        model = getattr(transformers, self.model_cls)(self.config(**changes))
        self.make(model).save_pretrained(path)
        return path


# a last-bit change flips a token's expert (at most 1 position in 16, the families' files measure):
# over the gate's 128 golden tokens on a tiny random model such a flip moves the perplexity by up to
# 1.9 % (measured: DeepSeek "lora" 1.86 %, Qwen3-MoE 0.55 %; the dense families stay within 0.5 %)
ROUTED_GATE_PPL = 3.0


def _dense(config_cls: str, model_cls: str, seed: int = 11, make: Callable = _norms_added, **extra: Any) -> Tiny:
    return Tiny(config_cls, model_cls, {**DENSE_SHAPE, **extra}, seed, make)


def _moe(config_cls: str, model_cls: str, **extra: Any) -> Tiny:
    return Tiny(config_cls, model_cls, {**MOE_SHAPE, **extra}, 5, T=24, ref={"experts_implementation": "eager"},
                agree=routed_agree, seed_of=lambda tp, ep, dp: tp + dp, moe=True, gate_ppl=ROUTED_GATE_PPL)


def _gemma(config_cls: str, model_cls: str, tp1_ref: dict[str, Any] | None = None, **extra: Any) -> Tiny:
    return Tiny(config_cls, model_cls, {**GEMMA_SHAPE, **extra}, 11, _norms_drawn, ref={"attn_implementation": "eager"},
                tp1_ref=tp1_ref, agree=_gemma_agree, seed_of=lambda tp, ep, dp: 1,
                tp1_near_ref=0.125 if tp1_ref else None)


def _deepseek(**extra: Any) -> Tiny:
    return Tiny("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DEEPSEEK_SHAPE, **extra}, 7, _router_biased, T=24,
                ref={"experts_implementation": "eager", "attn_implementation": "eager"}, agree=latent_agree,
                seed_of=lambda tp, ep, dp: tp + ep, moe=True, gate_ppl=ROUTED_GATE_PPL)


def _dsa(config_cls: str, model_cls: str, **extra: Any) -> Tiny:
    return Tiny(config_cls, model_cls, {**DSA_SHAPE, **extra}, 7, _dsa_made, T=24,
                ref={"experts_implementation": "eager", "attn_implementation": "eager"}, agree=sparse_agree,
                seed_of=lambda tp, ep, dp: tp + ep, moe=True, gate_ppl=ROUTED_GATE_PPL, gate_top1=0.85)


_LLAMA = ("LlamaConfig", "LlamaForCausalLM")
# family -> case -> model; the first case of each family is the conformance suite's
MODELS: dict[str, dict[str, Tiny]] = {
    "llama": {
        "mistral-window": _dense("MistralConfig", "MistralForCausalLM", sliding_window=12, head_dim=16),
        "qwen2-window": _dense("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=12,
                               max_window_layers=1),
        # transformers 5's configs (test_transformers5_configs.py): seed 7, norms left at 1, T 48
        **{name: Tiny(*_LLAMA, {**DENSE_SHAPE, **cfg}, 7, T=48) for name, cfg in {
            "theta-500k": dict(rope_theta=500000.0),
            "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
            "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
            "gelu": dict(hidden_act="gelu"),
            "gelu-tanh": dict(hidden_act="gelu_pytorch_tanh"),
            "default": {},  # what shardc read before: default rope, SiLU
        }.items()},
    },
    "qwen3": {
        "qwen3": _dense("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
        "qwen3-window": _dense("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, use_sliding_window=True,
                               sliding_window=12, max_window_layers=1),
    },
    "granite": {
        "granite": _dense("GraniteConfig", "GraniteForCausalLM", embedding_multiplier=12.0, residual_multiplier=0.22,
                          attention_multiplier=0.0078125, logits_scaling=16.0, tie_word_embeddings=True),
    },
    "phi3": {
        "phi3": Tiny("Phi3Config", "Phi3ForCausalLM", {**PHI3_SHAPE, "sliding_window": 16}, 7,
                     seed_of=lambda tp, ep, dp: 3, dirname="src"),
    },
    "gemma2": {
        "gemma2": _gemma("Gemma2Config", "Gemma2ForCausalLM", num_hidden_layers=4, attn_logit_softcapping=4.0,
                         final_logit_softcapping=8.0),
    },
    "gemma3": {
        # tp=1 is bit-equal to transformers' SDPA and within 0.125 of its eager forward (measured
        # 0.078), greedy tokens identical: the eager path rounds the scores to bf16 before the softmax
        # where SDPA does not, a last-ulp difference in attention outputs that the norms carry on
        "gemma3": _gemma("Gemma3TextConfig", "Gemma3ForCausalLM", {"attn_implementation": "sdpa"},
                         num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}),
    },
    # 6 experts: over 4 EP ranks, vLLM's linear placement gives 2, 2, 1, 1
    "mixtral": {
        "mixtral": _moe("MixtralConfig", "MixtralForCausalLM", intermediate_size=64, num_local_experts=6,
                        num_experts_per_tok=2),
    },
    "qwen2_moe": {  # layer 1 dense (mlp_only_layers), layer 0 sparse with a shared expert
        "qwen2_moe": _moe("Qwen2MoeConfig", "Qwen2MoeForCausalLM", intermediate_size=96, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                          mlp_only_layers=[1]),
    },
    "qwen3_moe": {
        "qwen3_moe": _moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM", intermediate_size=96, moe_intermediate_size=32,
                          num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
    },
    "deepseek_v3": {
        # q_lora_rank, interleaved rope, YaRN with attention factor 1
        "lora": _deepseek(q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=True,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                           "beta_fast": 32, "beta_slow": 1}),
        # one q_proj, rope not interleaved, a YaRN whose attention factor is not 1
        "direct": _deepseek(q_lora_rank=None, n_group=4, topk_group=2, rope_interleave=False, routed_scaling_factor=1.5,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                                             "mscale_all_dim": 0.8, "original_max_position_embeddings": 32}),
    },
    "gpt_oss": {
        "gpt_oss": Tiny("GptOssConfig", "GptOssForCausalLM", dict(GPT_OSS_CONFIG), 5, T=24,
                        ref={"experts_implementation": "eager"}, agree=routed_agree,
                        seed_of=lambda tp, ep, dp: tp + dp, dirname="src", moe=True, gate_ppl=ROUTED_GATE_PPL),
    },
    "deepseek_v32": {
        # the indexer's rope on halves, MLA's interleaved, YaRN
        "v32": _dsa("DeepseekV32Config", "DeepseekV32ForCausalLM", n_group=2, topk_group=1,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 32, "beta_slow": 1}),
        # GLM-5: the indexer's rope interleaved, layer 1 reusing layer 0's top-k ("shared"), the default rope
        "glm5": _dsa("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", n_group=1, topk_group=1, qk_nope_head_dim=16,
                     v_head_dim=12, indexer_types=["full", "shared", "full"]),
    },
    "qwen3_next": {
        # a prompt past the delta rule's chunk of 64 tokens
        "qwen3_next": Tiny("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(QWEN3_NEXT_SHAPE), 5, _norms_drawn, T=72,
                           ref={"experts_implementation": "eager"}, agree=hybrid_agree,
                           seed_of=lambda tp, ep, dp: tp + dp, moe=True, gate_ppl=ROUTED_GATE_PPL),
    },
    "qwen3_5": {
        # a prompt past the delta rule's chunk of 64 tokens
        "qwen3_5": Tiny("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(QWEN3_5_SHAPE), 5, _norms_drawn, T=72,
                        agree=hybrid_agree),
    },
    "qwen3_5_moe": {
        "qwen3_5_moe": Tiny("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(QWEN3_5_MOE_SHAPE), 5, _norms_drawn,
                            T=72, ref={"experts_implementation": "eager"}, agree=hybrid_routed_agree,
                            seed_of=lambda tp, ep, dp: tp + dp, moe=True, gate_ppl=ROUTED_GATE_PPL),
    },
    "minimax_m2": {
        "minimax_m2": Tiny("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(MINIMAX_SHAPE), 5, _minimax_made, T=24,
                           ref={"experts_implementation": "eager"}, agree=routed_agree,
                           seed_of=lambda tp, ep, dp: tp + dp, moe=True, gate_ppl=ROUTED_GATE_PPL),
    },
    "glm4_moe": {
        "glm4_moe": Tiny("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(GLM_SHAPE), 7, _glm_made, T=24,
                         ref={"experts_implementation": "eager"}, agree=routed_agree,
                         seed_of=lambda tp, ep, dp: tp + dp, moe=True, gate_ppl=ROUTED_GATE_PPL),
    },
}
CASES: dict[str, Tiny] = {case: m for cases in MODELS.values() for case, m in cases.items()}
FAMILY_OF: dict[str, str] = {case: family for family, cases in MODELS.items() for case in cases}


def refused(cfg: dict, **change: Any) -> Any:
    """The ModelError ``cfg`` with ``change`` is refused with (a key changed to ``...`` removed), its
    message checked to be one line: how every family's file checks its refusals."""
    import pytest

    from shardc.errors import ModelError
    from shardc.layout.model import model_from_config

    with pytest.raises(ModelError) as e:
        model_from_config({k: v for k, v in {**cfg, **change}.items() if v is not ...})
    assert "\n" not in e.value.message, e.value.message
    return e.value


def first_case(family: str) -> str:
    """The case of ``family`` the conformance suite runs."""
    return next(iter(MODELS[family]))


# the conformance suite's cases: each family's first, and DeepSeek's second attention form (one
# q_proj, rope not interleaved)
SUITE: tuple[str, ...] = (*(first_case(f) for f in MODELS), "direct", "glm5")


# --- the transformers reference and the inputs --------------------------------------------------

def hf(src: Path, config_changes: dict[str, Any] | None = None, **kw: Any) -> Any:
    """transformers' own model of the saved checkpoint ``src`` (bf16, eval), ``kw`` passed to
    ``from_pretrained`` (``experts_implementation="eager"``, ``attn_implementation=...``),
    ``config_changes`` set on its config first."""
    import torch
    import transformers

    if config_changes:
        cfg = transformers.AutoConfig.from_pretrained(src)
        for k, v in config_changes.items():
            setattr(cfg, k, v)
        kw["config"] = cfg
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, **kw).eval()


def hf_logits(src: Path, x: Any, config_changes: dict[str, Any] | None = None, **kw: Any) -> Any:
    """transformers' logits (float32) of ``x`` through ``hf(src, ...)``."""
    import torch

    with torch.no_grad():
        return hf(src, config_changes, **kw)(x).logits.float()


def ids(seed: int, T: int, vocab: int = 96, batch: int = 2) -> Any:
    """``batch`` x ``T`` token ids drawn from a generator seeded ``seed``."""
    import torch

    return torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(seed))


def model_of(src: Path, **over: Any) -> Any:
    """shardc's model of a saved checkpoint's config.json (with keys ``over`` changed)."""
    from shardc.layout.model import model_from_config

    return model_from_config({**json.loads((src / "config.json").read_text()), **over})


# --- the builds, each made once ------------------------------------------------------------------

class TinyFamilies:
    """The saved sources (``source(case)``, saved when first asked) and the builds (``build(plan)``:
    one per plan, its manifest path; ``built(case, tp, ...)``: ``moe_plans.moe_plan``'s plan of the
    case), under one root. A build is keyed by its plan's data, so two tests asking for the same
    plan share one build and a test's own plan (name, hence sha256 and bytes) is the one built."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._sources: dict[str, Path] = {}
        self._builds: dict[str, Path] = {}

    def source(self, case: str) -> Path:
        if case not in self._sources:
            m = CASES[case]
            self._sources[case] = m.save(self.root / "src" / case / (m.dirname or case))
        return self._sources[case]

    def build(self, plan: Any) -> Path:
        from shardc.compiler.compile import build

        key = json.dumps(plan.data, sort_keys=True, default=str)
        if key not in self._builds:
            out = self.root / "builds" / f"{len(self._builds)}" / plan.name
            self._builds[key] = build(plan, out).manifest_path
        return self._builds[key]

    def built(self, case: str, tp: int, ep: bool = False, dtype: str = "bf16", dp: int = 1, pp: int = 1) -> Path:
        from moe_plans import moe_plan

        return self.build(moe_plan(self.source(case), tp, ep, dtype, dp=dp, pp=pp))


def char_tokenizer(path: Path, vocab: int = 96) -> Path:
    """A tokenizer.json of one token per printable ASCII character (the rest one unknown token), so
    that the gate's golden text fits a tiny model's ``vocab`` rows; returns ``path``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    table = {"[UNK]": 0} | {chr(32 + i): i + 1 for i in range(min(95, vocab - 1))}
    tok = Tokenizer(models.WordLevel(table, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.save(str(path))
    return path
