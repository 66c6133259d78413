"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; layout/families/deepseek_v32.py): what is
peculiar to it beyond the conformance suite (which builds, verifies, reshards, exports, runs at
tp 1 and 2 and expert parallel, and gates both tiny cases, "v32" and "glm5", of
tests/family_models.py).

The tiny models attend to the indexer's top 6 of 24 tokens, so sparse and dense attention differ;
transformers (eager) is the oracle for both.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_run import shardc_in
from family_models import MODELS, hf, hf_logits, ids, refused

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import ModelError  # noqa: E402
from shardc.layout.families.deepseek_v32 import GLM_5  # noqa: E402
from shardc.layout.model import load_model, model_from_config  # noqa: E402
from shardc.runtime.api import generate, open_build, score  # noqa: E402

CASES = MODELS["deepseek_v32"]


@pytest.fixture(scope="module")
def dsa(tiny_families):
    return {name: tiny_families.source(name) for name in CASES}, tiny_families.built


def _cfg(src) -> dict:
    return json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_differs_from_dense_and_shardc_follows_it(dsa, case):
    """Past index_topk visible tokens transformers' sparse attention differs from its dense
    attention (index_topk raised above the sequence), before it they agree; shardc's tp = 1 logits
    are the sparse ones, bit for bit."""
    srcs, built = dsa
    m = CASES[case]
    x = ids(1, m.T, m.vocab)
    sparse = hf_logits(srcs[case], x, **m.ref)
    dense = hf_logits(srcs[case], x, config_changes={"index_topk": 4 * m.T}, **m.ref)
    topk = m.keys["index_topk"]
    assert torch.equal(sparse[:, :topk], dense[:, :topk])
    assert (sparse[:, topk:] - dense[:, topk:]).abs().amax() > 0.1
    got = score(open_build(built(case, 1)), x, return_logits=True, timeout_s=120).logits
    assert torch.equal(got, sparse)


@pytest.mark.heavy
def test_greedy_generation_equals_transformers_generate(dsa):
    """Decoding through the latent cache and the indexer's key cache, past index_topk tokens, at
    tp = 1: transformers' own generate() tokens, exactly."""
    srcs, built = dsa
    prompt = ids(7, 24, 96)[:1, :10]
    for case, m in CASES.items():
        with torch.no_grad():
            ref = hf(srcs[case], **m.ref).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, 10:]
        got = generate(open_build(built(case, 1)), prompt.tolist(), max_new_tokens=12, eos=[], timeout_s=120)
        assert got.tokens[0] == ref.tolist(), case


@pytest.mark.parametrize("case", list(CASES))
def test_the_selection_is_transformers_indexer_top_k(dsa, case):
    """runtime/indexer.py's top-k, given what transformers' indexer was given in a forward (the
    normed input, the q latent, the rope tables), is the same set of tokens for every query of every
    layer that runs an indexer. Every TP rank computes it whole from the same inputs, so at any tp the
    ranks attend to exactly the tokens one GPU would choose from those hidden states."""
    from shardc.runtime.indexer import select

    srcs, _ = dsa
    m = CASES[case]
    model = hf(srcs[case], **m.ref)
    seen: list[tuple] = []
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda mod, args, kwargs, out, i=i: seen.append((i, mod, args, kwargs, out)), with_kwargs=True)
        for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    with torch.no_grad():
        model(ids(5, m.T, m.vocab))
    for h in hooks:
        h.remove()
    ix = model_from_config(_cfg(srcs[case])).forward.mla.indexer
    assert [i for i, *_ in seen] == [i for i, own in enumerate(ix.own) if own]
    for i, mod, args, _, out in seen:
        hidden, q_latent, (cos, sin) = args[:3]
        w = {"ix_q": mod.wq_b.weight, "ix_k": mod.wk.weight, "ix_k_norm": mod.k_norm.weight,
             "ix_k_bias": mod.k_norm.bias, "ix_weights": mod.weights_proj.weight.float()}
        with torch.no_grad():
            got = select(ix, w, hidden, q_latent, cos[0], sin[0], None, 0)
        assert torch.equal(got.sort(-1).values, out.long().sort(-1).values), i


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_below_index_topk_meets_deepseek_bound(dsa, case, tmp_path):
    """With index_topk above the sequence every query attends to every token (what DSA computes
    below index_topk): tp = 2 and tp = 2 expert-parallel meet DeepSeek-V3's bound against
    transformers, so the cut of the attention (heads split, indexer whole) loses nothing."""
    from family_models import latent_agree

    m = CASES[case]
    src = m.save(tmp_path / "dense", index_topk=4 * m.T)
    x = ids(2, m.T, m.vocab)
    want = hf_logits(src, x, **m.ref)
    for ep in (False, True):
        out = build(moe_plan(src, 2, ep), tmp_path / f"tp2-{ep}")
        latent_agree(score(open_build(out.manifest_path), x, return_logits=True, timeout_s=120).logits, want, 2)


@pytest.mark.heavy
def test_pipeline_stages_carry_the_selection_or_arerefused(dsa, tmp_path):
    """GLM-5's layer 1 reuses layer 0's top-k. Stages [0, 2) and [2, 3) run bit-equal to tp = 1; a
    stage beginning on layer 1 would need layer 0's selection from another stage: one line, exit 2,
    before any rank starts."""
    srcs, built = dsa
    m, src = CASES["glm5"], srcs["glm5"]
    x = ids(3, m.T, m.vocab)
    want = score(open_build(built("glm5", 1)), x, return_logits=True, timeout_s=120).logits
    for layers, ok in (((2, 1), True), ((1, 2), False)):
        plan = dataclasses.replace(moe_plan(src, 1, pp=2, name=f"glm5-pp-{layers[0]}"), pp_layers=layers)
        out = build(plan, tmp_path / plan.name)
        if ok:
            assert torch.equal(score(open_build(out.manifest_path), x, return_logits=True,
                                     timeout_s=120).logits, want)
            continue
        with pytest.raises(ModelError, match="begins at layer 1, whose indexer_types entry is 'shared'") as e:
            open_build(out.manifest_path)
        assert e.value.key == "indexer_types" and "\n" not in e.value.message
        r = shardc_in("run", "--manifest", out.manifest_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "1")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_shared_layers_hold_no_indexer_and_the_indexer_is_replicated(dsa, tiny_families):
    """The indexer is whole on every TP rank, byte for byte (families/deepseek_v32.py says why); a
    shared layer holds none; weights_proj is in the plan's dtype, as published and as vLLM holds it."""
    from safetensors.torch import load_file

    from shardc.formats.manifest import load

    path = tiny_families.built("glm5", 2)
    manifest = load(path)
    held = [load_file(path.parent / shard.file) for shard in manifest.shards]
    for shard, tensors in zip(manifest.shards, held, strict=True):
        assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in shard.tensors)
        for i in (0, 2):
            p = f"model.layers.{i}.self_attn.indexer."
            assert shard.tensors[p + "wq_b.weight"]["shape"] == [2 * 16, 24]
            assert shard.tensors[p + "wk.weight"]["shape"] == [16, 64]
            assert shard.tensors[p + "weights_proj.weight"]["dtype"] == "BF16"
            for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
                assert torch.equal(tensors[p + name], held[0][p + name])



def test_refusals_are_one_line(dsa):
    srcs, _ = dsa
    v32, glm = _cfg(srcs["v32"]), _cfg(srcs["glm5"])
    assert refused(v32, q_lora_rank=None).key == "q_lora_rank"
    assert refused(v32, rope_interleave=False).key == "rope_interleave"
    assert refused(v32, indexer_rope_interleave=True).key == "indexer_rope_interleave"
    assert refused(glm, indexer_rope_interleave=False).key == "indexer_rope_interleave"
    assert refused(v32, indexer_types=["full", "shared", "full"]).key == "indexer_types"
    assert refused(glm, indexer_types=["shared", "full", "full"]).key == "indexer_types"
    assert refused(glm, indexer_types=["full", "half", "full"]).key == "indexer_types"
    assert refused(glm, layer_types=["sliding_attention"] * 3).key == "layer_types"
    assert refused(glm, mlp_layer_types=["dense", "sparse"]).key == "mlp_layer_types"
    assert refused(glm, moe_router_dtype="bfloat16").key == "moe_router_dtype"
    assert refused(glm, index_head_dim=4).key == "index_head_dim"  # below qk_rope_head_dim 8
    assert refused(glm, index_topk=0).key == "index_topk"


def test_glm_indexer_pattern_and_mlp_layer_types_follow_transformers(dsa):
    """GlmMoeDsaConfig derives indexer_types from index_topk_pattern, else index_topk_freq and
    index_skip_topk_offset; mlp_layer_types wins over first_k_dense_replace: shardc reads the same."""
    srcs, _ = dsa
    glm = {k: v for k, v in _cfg(srcs["glm5"]).items() if k != "indexer_types"}
    for extra in ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, {"index_topk_pattern": "FSF"},
                  {"index_topk_freq": 2}):
        want = transformers.GlmMoeDsaConfig(**{**glm, **extra, "num_hidden_layers": 3}).indexer_types
        got = model_from_config({**glm, **extra}).forward.mla.indexer.own
        assert tuple(t == "full" for t in want) == got, extra
    m = model_from_config({**glm, "mlp_layer_types": ["sparse", "dense", "sparse"], "first_k_dense_replace": 1})
    assert m.forward.moe.sparse == (True, False, True)


def test_planner_counts_the_indexer_keys_by_hand(tmp_path):
    """KV per token: MLA's latent (kv_lora_rank + qk_rope_head_dim) in the KV dtype on every layer,
    plus vLLM's indexer key (128 FP8 bytes and a 4-byte scale) on each layer that runs its own
    indexer: DeepSeek-V3.2 at bf16, 61 x 576 x 2 + 61 x 132; a GLM-5 whose layers 1-3 of every 4
    share, 78 x 576 x 2 + 21 x 132 (GlmMoeDsaConfig's pattern for freq 4, offset 3)."""
    from shardc.planner.candidate import kv_bpt

    v32 = load_model("deepseek-v3.2")
    assert kv_bpt(v32, 61, 8, 2) == 61 * 576 * 2 + 61 * 132 == 78_324
    glm = model_from_config({**GLM_5, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    own = glm.forward.mla.indexer.own
    assert sum(own) == 21 and own[:8] == (True, True, True, False, False, False, True, False)
    assert kv_bpt(glm, 78, 8, 2) == 78 * 576 * 2 + 21 * 132
    assert kv_bpt(glm, 39, 8, 2, first=39) == 39 * 576 * 2 + sum(own[39:]) * 132
    r = shardc_in("plan", "--model", "deepseek-v3.2", "--gpu", "h200", "--gpus", "8", "--tp", "8", "--dtype", "fp8",
                  "--explain")
    assert r.returncode == 0, r.stderr
    assert "61 indexer layers x 132 B" in r.stdout and "= 78,324 B" in r.stdout, r.stdout


def test_presets_are_the_published_configs_and_count_the_indexer():
    """DeepSeek-V3.2 is DeepSeek-V3 (671B without its MTP layer) plus 61 indexers; GLM-5 is 744B
    (zai-org's model card, 40B active) with its MTP layer, which shardc leaves out."""
    def params(model) -> int:
        return sum(int(torch.tensor(r.shape).prod()) for r in model.spec.tensors(model))

    v3, v32 = load_model("deepseek-v3"), load_model("deepseek-v3.2")
    ix = 64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168
    assert params(v32) == params(v3) + 61 * ix
    assert v32.forward.mla.indexer.interleave is False and load_model("glm-5").forward.mla.indexer.interleave
    glm = load_model("glm-5")
    assert abs(params(glm) / 744e9 - 1) < 0.02, params(glm)
    assert glm.forward.mla.indexer.heads == 32 and glm.forward.mla.nope == 192 and glm.forward.mla.v == 256
    # GLM-5.3: an indexer every 4 layers from layer 3 (and layers 0-2): 21 of 78, so 21 indexer keys a
    # token; its shared layers hold no indexer: 57 fewer than GLM-5's
    glm53 = load_model("glm-5.3")
    assert sum(glm53.forward.mla.indexer.own) == 21 and glm53.forward.moe.sparse == (False,) * 3 + (True,) * 75
    assert params(glm) - params(glm53) == 57 * (32 * 128 * 2048 + 128 * 6144 + 2 * 128 + 32 * 6144)
    from shardc.planner.candidate import kv_bpt

    assert kv_bpt(glm53, 78, 8, 2) == 78 * 576 * 2 + 21 * 132
    # GLM-5-FP8: GLM-5 as published in block FP8, 712 modules kept in 16 bits
    fp8 = load_model("glm-5-fp8").config["quantization_config"]
    assert fp8["quant_method"] == "fp8" and len(fp8["modules_to_not_convert"]) == 712
    assert "model.layers.78.eh_proj" in fp8["modules_to_not_convert"]
