"""Gemma 2 and Gemma 3 (text), against transformers as the oracle (#28).

Each model is made and saved by transformers (tiny shapes, seeded, bf16, norm weights randomized
so the (1 + w) form matters), with a sliding window shorter than the test sequence, a
query_pre_attn_scalar other than head_dim, and for Gemma 2 soft-caps small enough to bite. The
runtime's logits are compared with transformers' eager forward; each feature is shown to matter
by turning it off in the reference (same weights) and seeing the logits move beyond the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc_in
from family_models import GEMMA_SHAPE as SHAPE
from family_models import MODELS, hf_logits, ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardc.errors import ModelError  # noqa: E402
from shardc.layout.model import load_model, model_from_config  # noqa: E402
from shardc.runtime.api import generate, open_build  # noqa: E402

T = 40  # tokens: beyond the window of 16 below
# the models of tests/family_models.py (norm weights drawn, so that the (1 + w) form matters)
CASES = {"gemma2": MODELS["gemma2"]["gemma2"], "gemma3": MODELS["gemma3"]["gemma3"]}
# tp1: Gemma 3 against transformers' eager attention (measured 0.078; bit-equal to
# transformers' SDPA); Gemma 2 is bit-equal to eager (both: test_conformance.py, family_models.py);
# tp2: o/down partial sums rounded to bf16 in another order, a few ulps per layer, as for Llama.
ATOL = {1: 0.125, 2: 0.2}
TOP1 = {1: 1.0, 2: 0.95}


def _hf(src: Path, x: torch.Tensor, impl: str = "eager", **changes) -> torch.Tensor:
    """transformers' logits of the saved model (eager attention unless told), optionally with
    config keys changed."""
    return hf_logits(src, x, changes, attn_implementation=impl)


def _ids(seed: int) -> torch.Tensor:
    return ids(seed, T, SHAPE["vocab_size"])


@pytest.fixture(scope="module")
def saved(tiny_families):
    return tiny_families.root, {f: tiny_families.source(f) for f in CASES}


@pytest.fixture(scope="module")
def builds(tiny_families):
    """One build per (family, tp, dtype), made when first asked for."""
    return lambda family, tp, dtype="bf16": tiny_families.built(family, tp, dtype=dtype)


@pytest.fixture(scope="module")
def want(saved):
    _, models = saved
    return {f: _hf(models[f], _ids(1)) for f in CASES}


def test_transformers_writes_what_the_family_reads(saved):
    _, models = saved
    g2 = json.loads((models["gemma2"] / "config.json").read_text())
    g3 = json.loads((models["gemma3"] / "config.json").read_text())
    assert g3["architectures"] == ["Gemma3ForCausalLM"] and set(g3["rope_parameters"]) == {
        "full_attention", "sliding_attention"}  # per layer type: refused for Llama, read here
    m2, m3 = model_from_config(g2), model_from_config(g3)
    assert m2.tie_word_embeddings and m3.tie_word_embeddings
    f2, f3 = m2.forward, m3.forward
    assert (f2.attn_softcap, f2.final_softcap, f2.attn_scale) == (4.0, 8.0, 24 ** -0.5)
    assert f2.windows == (16, None, 16, None) and f2.rope_theta_local is None
    assert f3.windows == (16, 16, None) and f3.qk_norm and f3.attn_softcap is None
    assert (m3.rope_theta, m3.rope_scaling, f3.rope_theta_local) == (100.0, {"rope_type": "linear", "factor": 4.0}, 10.0)
    from safetensors import safe_open
    for m, family in ((m2, "gemma2"), (m3, "gemma3")):  # the table is what transformers saves
        with safe_open(str(models[family] / "model.safetensors"), "pt") as f:
            assert set(f.keys()) == {r.name for r in m.spec.tensors(m)}


@pytest.mark.heavy
@pytest.mark.parametrize("family, changes", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"sliding_window": 4096}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"sliding_window": 4096}),
    ("gemma3", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}}),
])
def test_each_feature_matters(saved, want, family, changes):
    """The reference with one feature turned off moves beyond the tp2 bound: the runtime's
    agreement with it is not an accident of that feature doing nothing on these shapes."""
    _, models = saved
    other = _hf(models[family], _ids(1), **changes)
    assert (other - want[family]).abs().max() > 2 * ATOL[2]


@pytest.mark.heavy
def test_greedy_decode_past_the_window_matches_transformers(saved, builds):
    """The KV-cache path: decoding 30 tokens after a 10-token prompt crosses the window of 16."""
    _, models = saved
    prompt = _ids(3)[:1, :10]
    for family in CASES:
        m = transformers.AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.bfloat16,
                                                              attn_implementation="eager").eval()
        with torch.no_grad():
            ref = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, 10:].tolist()
        got = generate(open_build(builds(family, 1)), prompt.tolist(), max_new_tokens=30, eos=[],
                       timeout_s=120).tokens[0]
        assert got == ref, family


def _cfg(family: str, **extra) -> dict:
    return CASES[family].config_dict(**extra)


@pytest.mark.parametrize("family, change, key", [
    ("gemma2", {"hidden_activation": "quick_gelu"}, "hidden_activation"),
    ("gemma3", {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}, "hidden_act"),
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("gemma3", {"mlp_bias": True}, "mlp_bias"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"tie_word_embeddings": False}, "tie_word_embeddings"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "chunked_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ("gemma3", {"rope_local_base_freq": 5.0}, "rope_local_base_freq"),
])
def test_refusals_name_the_key(family, change, key):
    with pytest.raises(ModelError) as e:
        load_model_from(_cfg(family, **change))
    assert e.value.key == key and "\n" not in str(e.value) and key.split(".")[0] in str(e.value)


def load_model_from(cfg: dict):
    m = model_from_config(cfg)
    from shardc.runtime.support import check_supported
    check_supported(m)
    return m


def test_run_refuses_a_global_rope_the_runtime_lacks():
    cfg = _cfg("gemma3", rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ModelError, match="rope_type='yarn' is not implemented") as e:
        load_model_from(cfg)
    assert e.value.key == "rope_parameters"


def test_llama_still_refuses_per_layer_type_rope():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4).to_dict()
    cfg.update(architectures=["LlamaForCausalLM"],
               rope_parameters={"full_attention": {"rope_theta": 1e6, "rope_type": "default"}})
    with pytest.raises(ModelError, match="rope_parameters must be one object"):
        model_from_config(cfg)


@pytest.mark.parametrize("preset, window, pattern, tp", [("gemma-2-9b", 4096, 2, 8), ("gemma-3-27b", 1024, 6, 8),
                                                         ("gemma-3-1b", 512, 6, 4)])
def test_presets_read_and_dry_run(tmp_path, preset, window, pattern, tp):
    m = load_model(preset)
    f = m.forward
    assert m.tie_word_embeddings and f.windows[0] == window and f.windows[pattern - 1] is None
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"replica_group:\n  name: {preset}\n  tp_degree: {tp}\n  pp_degree: 1\n  dtype: bf16\n"
                    f"  gpus_per_replica: {tp}\nmodel:\n  source: hf://example/none\n")
    r = shardc_in("build", plan, "--model", preset, "--out", tmp_path / "out", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr


def test_plan_sizes_the_gemma_3_27b_preset():
    r = shardc_in("plan", "--model", "gemma-3-27b", "--gpu", "h100")
    assert r.returncode == 0, r.stderr
    assert "gemma-3-27b" in r.stdout and "62 layers" in r.stdout and "tied embeddings" in r.stdout


def test_transformers4_spelling_reads_the_same(saved):
    """The old keys (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern)
    describe the same Gemma 3 as transformers 5's per-layer-type rope_parameters and layer_types."""
    _, models = saved
    new = json.loads((models["gemma3"] / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=10.0,
               sliding_window_pattern=3)
    a, b = model_from_config(new), model_from_config(old)
    assert (a.rope_theta, a.rope_scaling, a.forward) == (b.rope_theta, b.rope_scaling, b.forward)
    g2 = json.loads((models["gemma2"] / "config.json").read_text())
    old2 = {k: v for k, v in g2.items() if k not in ("rope_parameters", "layer_types", "hidden_activation")}
    old2.update(rope_theta=g2["rope_parameters"]["rope_theta"], hidden_act=g2["hidden_activation"])
    assert model_from_config(old2).forward == model_from_config(g2).forward
