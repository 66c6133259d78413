"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): what is peculiar to it beside the conformance suite
(tests/families/test_conformance.py builds, verifies, reshards, exports, runs and gates the tiny
model of tests/family_models.py at tp 1, tp 2 and with expert parallelism; tp = 1 bit-equal to
transformers with its eager experts loop).

- The Layout: q/k/v biases cut with their heads, no o_proj bias, per-head q/k norms, the router and
  its bias in fp32, the first layer dense, the shared expert split like a dense MLP.
- The config: transformers' Glm4MoeConfig defaults read where a key is absent (128 experts, top 8,
  half the head rotated, one MTP layer, ...); both rope spellings; refusals one line each.
- Partial rope and grouped sigmoid routing against transformers' own modules, bit for bit.
- Multi-token-prediction layers left out of a build; greedy decoding through the KV cache equal to
  transformers' generate(); a second form (no q/k norms, no biases, the rope factor left to its
  default) bit-equal at tp = 1.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from family_models import GLM_SHAPE as SHAPE
from family_models import MODELS, hf, hf_logits, ids, refused

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import ModelError, SourceError  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.layout.ranks import build_layout  # noqa: E402
from shardc.runtime.api import generate, open_build, score  # noqa: E402
from shardc.runtime.support import check_supported  # noqa: E402

TINY = MODELS["glm4_moe"]["glm4_moe"]


@pytest.fixture(scope="module")
def src(tiny_families) -> Path:
    return tiny_families.source("glm4_moe")


def _cfg(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())



def test_layout_cuts_heads_with_their_biases_and_keeps_the_router_fp32(src):
    """tp = 2 with expert parallelism, by hand: 2 of 4 q heads and 1 of 2 KV heads per rank with
    their biases, o_proj without one, the head_dim norms and the fp32 router whole, experts 4-7."""
    layout = build_layout(model_from_config(_cfg(src)), moe_plan(src, 2, ep=True))
    r1 = layout.ranks[1]
    a = "model.layers.1.self_attn."
    for name, split, start, stop in ((a + "q_proj.weight", "column", 32, 64), (a + "q_proj.bias", "column", 32, 64),
                                     (a + "k_proj.bias", "kv_column", 16, 32), (a + "v_proj.bias", "kv_column", 16, 32),
                                     (a + "o_proj.weight", "row", 32, 64)):
        t = r1.tensor(name)
        assert (t.split, t.start, t.stop) == (split, start, stop), name
    names = {t.name for t in r1.tensors}
    assert a + "o_proj.bias" not in names
    for name, shape, dtype in ((a + "q_norm.weight", (16,), "BF16"), (a + "k_norm.weight", (16,), "BF16"),
                               ("model.layers.1.mlp.gate.weight", (8, 64), "F32"),
                               ("model.layers.1.mlp.gate.e_score_correction_bias", (8,), "F32")):
        t = r1.tensor(name)
        assert (t.split, t.shape, t.dtype) == ("replicated", shape, dtype), name
    assert r1.experts == (4, 5, 6, 7) and "model.layers.2.mlp.experts.3.up_proj.weight" not in names
    shared = r1.tensor("model.layers.2.mlp.shared_experts.down_proj.weight")
    assert (shared.split, shared.start, shared.stop) == ("row", 16, 32)
    dense = r1.tensor("model.layers.0.mlp.gate_proj.weight")  # first_k_dense_replace = 1
    assert (dense.start, dense.stop) == (48, 96) and not any("layers.0.mlp.experts" in n for n in names)


# ---- the config ---------------------------------------------------------------------------------

def test_absent_keys_read_as_transformers_defaults(src):
    """A config naming only the sizes: shardc reads what Glm4MoeConfig makes of it (its
    to_dict(), every default written out), and a transformers 4 spelling of the rope the same."""
    sizes = {k: SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "head_dim")}
    bare = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "rms_norm_eps": 1e-5, **sizes}
    full = {**transformers.Glm4MoeConfig(**sizes).to_dict(), "architectures": ["Glm4MoeForCausalLM"]}
    a, b = model_from_config(bare), model_from_config(full)
    assert a.forward == b.forward and a.options == b.options
    assert (a.options["experts"], a.options["top_k"], a.options["mtp"], a.forward.rotary_dim) == (128, 8, 1, 8)
    assert (a.options["moe_inter"], a.forward.moe.scaling, a.forward.qk_norm, a.qkv_bias) == (1408, 1.0, False, False)
    # transformers 4's spelling (the published config.json's: top-level rope_theta and factor); rotary_dim,
    # which neither transformers nor vLLM reads for GLM, changes nothing
    cfg = _cfg(src)
    rope = cfg.pop("rope_parameters")
    old = {**cfg, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
           "rotary_dim": 4}
    assert model_from_config(old).forward == model_from_config(_cfg(src)).forward
    check_supported(model_from_config(old))
    whole = model_from_config({**cfg, "partial_rotary_factor": 1.0})
    assert whole.forward.rotary_dim is None
    check_supported(whole)


def test_refusals_are_one_line(src):
    cfg = _cfg(src)
    assert refused(cfg, n_group=3).key == "n_group"  # does not divide 8 experts
    assert refused(cfg, n_group=8).key == "n_group"  # groups of one expert
    assert refused(cfg, topk_group=5).key == "topk_group"  # more than n_group 4
    assert refused(cfg, num_experts_per_tok=5).key == "num_experts_per_tok"  # 2 groups of 2 experts
    assert refused(cfg, num_mtp_layers=2).key == "num_mtp_layers"  # disagrees with num_nextn_predict_layers
    assert "disagrees" in refused(cfg, num_local_experts=16).message
    assert refused(cfg, use_qk_norm="yes").key == "use_qk_norm"
    assert refused(cfg, norm_topk_prob=1).key == "norm_topk_prob"
    assert refused(cfg, routed_scaling_factor=0).key == "routed_scaling_factor"
    # transformers' GLM defaults that are not the ones shardc reads for every family: given or refused
    assert refused(cfg, rms_norm_eps=...).key == "rms_norm_eps"
    assert refused(cfg, num_key_value_heads=...).key == "num_key_value_heads"
    # the factor in two places must agree, and turn pairs
    e = refused(cfg, partial_rotary_factor=0.25)
    assert e.key == "rope_parameters.partial_rotary_factor" and "partial_rotary_factor=0.25" in e.message
    rope = cfg["rope_parameters"]
    assert refused(cfg, rope_parameters={**rope, "partial_rotary_factor": 0.1}).key == \
        "rope_parameters.partial_rotary_factor"
    with pytest.raises(ModelError, match="rope_type='yarn' is not implemented"):
        check_supported(model_from_config({**cfg, "rope_parameters": {**rope, "rope_type": "yarn", "factor": 4.0}}))


# ---- rope and routing against transformers' modules ---------------------------------------------

def test_partial_rope_tables_and_rotation_are_transformers(src):
    from transformers.models.glm4_moe import modeling_glm4_moe as hf_mod

    from shardc.runtime.qk import apply_rope
    from shardc.runtime.rope import rope_tables

    cfg = transformers.AutoConfig.from_pretrained(src)
    spec = model_from_config(_cfg(src))
    assert spec.forward.rotary_dim == 8 < spec.head_dim
    cos, sin = rope_tables({**spec.summary(), "head_dim": spec.forward.rotary_dim}, 40, torch.bfloat16)
    x = torch.zeros(1, 40, 64, dtype=torch.bfloat16)
    want_cos, want_sin = hf_mod.Glm4MoeRotaryEmbedding(cfg)(x, torch.arange(40)[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    q, k = torch.randn(2, 4, 40, 16).to(torch.bfloat16), torch.randn(2, 2, 40, 16).to(torch.bfloat16)
    want_q, want_k = hf_mod.apply_rotary_pos_emb(q, k, want_cos, want_sin)
    assert torch.equal(apply_rope(q, cos, sin), want_q) and torch.equal(apply_rope(k, cos, sin), want_k)


def test_grouped_sigmoid_routing_is_transformers_router(src):
    """runtime/moe.py ``route`` against Glm4MoeTopkRouter on the loaded model (router and bias fp32):
    the same experts and weights, bit for bit; the bias and the groups each change choices."""
    from shardc.runtime.moe import route
    from shardc.runtime.rankweights import MoeWeights

    gate = hf(src, **TINY.ref).model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    moe = model_from_config(_cfg(src)).forward.moe
    x = torch.randn(64, SHAPE["hidden_size"]).to(torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_e = gate(x)
    mw = MoeWeights(router=gate.weight.data, experts={}, score_bias=gate.e_score_correction_bias.data)
    weights, chosen = route(moe, mw, x)
    assert torch.equal(chosen, want_e) and torch.equal(weights, want_w) and weights.dtype == torch.float32

    def picked(m, bias):
        return route(m, MoeWeights(router=gate.weight.data, experts={}, score_bias=bias), x)[1].sort(-1)[0]

    assert not torch.equal(picked(moe, torch.zeros(SHAPE["n_routed_experts"])), want_e.sort(-1)[0])
    assert not torch.equal(picked(dataclasses.replace(moe, groups=1, topk_groups=1), mw.score_bias),
                           want_e.sort(-1)[0])


# ---- checkpoints, decoding, another form ------------------------------------------------------------

def test_multi_token_prediction_layers_are_left_out(src, tmp_path):
    """A checkpoint holding its MTP layer (model.layers.{num_hidden_layers}.*, as the published GLM-4.5
    holds layer 92) builds without it; undeclared, the same tensors are refused."""
    from safetensors.torch import load_file, save_file

    mtp = tmp_path / "mtp"
    shutil.copytree(src, mtp)
    tensors = load_file(mtp / "model.safetensors")
    tensors |= {"model.layers.3.eh_proj.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
                "model.layers.3.enorm.weight": torch.ones(64, dtype=torch.bfloat16),
                "model.layers.3.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
                "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}
    save_file(tensors, mtp / "model.safetensors", metadata={"format": "pt"})
    cfg = _cfg(mtp)
    assert cfg["num_nextn_predict_layers"] == 1
    layout = build_layout(model_from_config(cfg), moe_plan(mtp, 1))
    assert not any(t.name.startswith("model.layers.3.") for t in layout.ranks[0].tensors)
    assert build(moe_plan(mtp, 1), tmp_path / "build").manifest_path.exists()
    (mtp / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(SourceError, match="unexpected tensor 'model.layers.3."):
        build(moe_plan(mtp, 1), tmp_path / "build0")


def test_greedy_generation_equals_transformers_generate(tiny_families, src):
    """Through the KV cache (partial rope, q/k norms and biases at every position) at tp = 1:
    transformers' own generate() tokens, exactly."""
    prompt = ids(7, 8, TINY.vocab)[:1]
    with torch.no_grad():
        ref = hf(src, **TINY.ref).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    got = generate(open_build(tiny_families.built("glm4_moe", 1)), prompt.tolist(), max_new_tokens=16, eos=[],
                   timeout_s=120)
    assert got.tokens[0] == ref


def test_plain_form_at_tp1_equals_transformers(tiny_families, tmp_path):
    """No q/k norms, no attention biases and no rope factor in config.json (Glm4MoeConfig's 0.5
    then): tp = 1 bit-equal to transformers."""
    plain = TINY.save(tmp_path / "plain", use_qk_norm=False, attention_bias=False)
    cfg = _cfg(plain)
    del cfg["rope_parameters"]["partial_rotary_factor"]
    (plain / "config.json").write_text(json.dumps(cfg))
    spec = model_from_config(cfg)
    assert (spec.forward.qk_norm, spec.qkv_bias, spec.forward.rotary_dim) == (False, False, 8)
    x = ids(3, TINY.T, TINY.vocab)
    got = score(open_build(tiny_families.build(moe_plan(plain, 1))), x, return_logits=True, timeout_s=120).logits
    assert torch.equal(got, hf_logits(plain, x, **TINY.ref))
