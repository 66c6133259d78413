"""Qwen3.5 (layout/families/qwen3_5.py; hybrid.py LINEAR_SPLIT; runtime/deltanet.py): what is
peculiar to it beyond the conformance suite (which builds, verifies, reshards, exports, runs at tp 1
and 2 and expert parallel, and gates the tiny "qwen3_5" and "qwen3_5_moe" models of
tests/family_models.py): the linear in-projections stored apart and their cut, its refusals, the
presets, and decoding through the states.
"""

from __future__ import annotations

import json
import math

import pytest
from family_models import MODELS, hf, ids, refused

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.layout.model import load_model, model_from_config  # noqa: E402
from shardc.layout.ranks import build_layout  # noqa: E402
from shardc.runtime.api import generate, open_build  # noqa: E402

DENSE, MOE = MODELS["qwen3_5"]["qwen3_5"], MODELS["qwen3_5_moe"]["qwen3_5_moe"]


def _cfg(src) -> dict:
    return json.loads((src / "config.json").read_text())


def test_tp2_cuts_in_proj_qkv_in_the_convs_three_parts(tiny_families):
    """4 key heads of 8, 8 value heads of 8 over tp = 2: rank r holds key heads 2r, 2r+1 and value
    heads 4r..4r+3. in_proj_qkv (rows [all q | all k | all v], 32 + 32 + 64) in three pieces, the
    same as the conv1d's; in_proj_z's rows of those value heads, in_proj_b / in_proj_a one row each."""
    src = tiny_families.source("qwen3_5")
    layout = build_layout(model_from_config(_cfg(src)), moe_plan(src, 2))
    p = "model.layers.0.linear_attn."
    for r, rank in enumerate(layout.ranks):
        t = {x.name: x for x in rank.tensors}
        pieces = ((16 * r, 16 * r + 16), (32 + 16 * r, 32 + 16 * r + 16), (64 + 32 * r, 64 + 32 * r + 32))
        assert t[p + "in_proj_qkv.weight"].pieces == pieces and t[p + "in_proj_qkv.weight"].shape == (64, 64)
        assert t[p + "conv1d.weight"].pieces == pieces
        assert (t[p + "in_proj_z.weight"].start, t[p + "in_proj_z.weight"].stop) == (32 * r, 32 * r + 32)
        for name in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            assert (t[p + name].start, t[p + name].stop) == (4 * r, 4 * r + 4), name
        assert t[p + "out_proj.weight"].shape == (64, 32) and t[p + "norm.weight"].shape == (8,)


def test_the_layer_on_each_rank_is_the_slice_of_the_whole(tiny_families):
    """A Gated DeltaNet layer of the tp = 2 build: each rank's output before out_proj equals the
    tp = 1 layer's value heads of that rank, bit for bit (every op per head or per channel)."""
    from safetensors.torch import load_file

    from shardc.runtime.deltanet import DeltaNetState, linear_attention

    src = tiny_families.source("qwen3_5")
    x = model_from_config(_cfg(src)).forward.hybrid
    assert x is not None and not x.fused_qkvz
    p = "model.layers.0.linear_attn."
    roles = (("qkv", "in_proj_qkv.weight"), ("z", "in_proj_z.weight"), ("b", "in_proj_b.weight"),
             ("a", "in_proj_a.weight"), ("conv", "conv1d.weight"), ("A_log", "A_log"), ("dt_bias", "dt_bias"),
             ("norm", "norm.weight"))
    torch.manual_seed(0)
    h = torch.randn(1, 70, 64).to(torch.bfloat16)

    def run(tp: int, r: int) -> torch.Tensor:
        t = load_file(tiny_families.built("qwen3_5", tp).parent / f"model-tp{r:02d}-pp00.safetensors")
        with torch.no_grad():
            return linear_attention(x, {role: t[p + name] for role, name in roles}, h, 1e-6, DeltaNetState(), r)

    whole = run(1, 0)
    assert torch.equal(torch.cat([run(2, 0), run(2, 1)], dim=-1), whole)


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_generation_equals_transformers_generate(tiny_families, case):
    """Decoding through the conv and delta-rule states after a 70-token prefill, at tp = 1:
    transformers' own generate() tokens, exactly."""
    m = MODELS[case][case]
    src = tiny_families.source(case)
    prompt = ids(4, 72, m.vocab)[:1, :70]
    with torch.no_grad():
        ref = hf(src, **m.ref).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, 70:]
    got = generate(open_build(tiny_families.built(case, 1)), prompt.tolist(), max_new_tokens=10, eos=[],
                   timeout_s=120)
    assert got.tokens[0] == ref.tolist()



def test_refusals_are_one_line():
    dense, moe = DENSE.config_dict(), MOE.config_dict()
    for cfg in (dense, moe):
        assert refused(cfg, attn_output_gate=False).key == "attn_output_gate"
        assert refused(cfg, mlp_only_layers=[1]).key == "mlp_only_layers"
        assert refused(cfg, layer_types=["full_attention"]).key == "layer_types"
        assert refused(cfg, linear_num_value_heads=6).key == "linear_num_value_heads"
        assert refused(cfg, hidden_act="gelu").key == "hidden_act"
    assert refused(moe, norm_topk_prob=False).key == "norm_topk_prob"
    # accepted: what the published configs carry, and the multimodal rope's keys (for text the
    # ordinary rope: module docstring)
    rope = {**dense["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    for cfg in (dense, moe):
        plain = model_from_config(cfg)
        m = model_from_config({**cfg, "attn_output_gate": True, "mlp_only_layers": [], "rope_parameters": rope,
                               "mtp_num_hidden_layers": 1, "mamba_ssm_dtype": "float32"})
        assert m.forward.rotary_dim == plain.forward.rotary_dim == 4 and m.rope_theta == plain.rope_theta


def test_mrope_keys_give_transformers_the_same_logits(tiny_families, tmp_path):
    """The text model with mrope_section / mrope_interleaved in rope_parameters computes the same
    logits as without them (1-D text positions): accepting them changes nothing."""
    src = tiny_families.source("qwen3_5")
    cfg = _cfg(src)
    x = ids(1, 24, DENSE.vocab)
    want = hf(src)(x).logits
    rope = {**cfg["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    got = hf(src, {"rope_parameters": rope})(x).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("preset, params", [("qwen3.5-27b", 27e9), ("qwen3.5-35b-a3b", 35e9),
                                            ("qwen3.5-122b-a10b", 122e9), ("qwen3.5-397b-a17b", 397e9)])
def test_presets_count_their_published_parameters(preset, params):
    """The text model only (the published sizes include the vision encoder and the MTP module):
    26.90B, 34.66B, 122.11B, 396.35B, each within 1 % of the name."""
    model = load_model(preset)
    assert abs(sum(math.prod(r.shape) for r in model.spec.tensors(model)) / params - 1) < 0.02
    assert model.forward.hybrid is not None and not model.forward.hybrid.fused_qkvz
    assert sum(model.forward.hybrid.linear) == model.num_layers * 3 // 4
