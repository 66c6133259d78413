"""Qwen3-Next (layout/families/qwen3_next.py; hybrid.py; runtime/deltanet.py): what is peculiar to
it beyond the conformance suite (which builds, verifies, reshards, exports, runs at tp 1 and 2 and
expert parallel, and gates the tiny "qwen3_next" model of tests/family_models.py: three Gated
DeltaNet layers, one gated full-attention layer, a prompt past the delta rule's 64-token chunk).
The Gated DeltaNet functions themselves are tested against transformers' in tests/runtime/test_deltanet.py.
"""

from __future__ import annotations

import json

import pytest
from family_models import MODELS, QWEN3_NEXT_SHAPE, hf, hf_logits, ids, refused

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import LayoutError  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.layout.ranks import build_layout  # noqa: E402
from shardc.runtime.api import generate, open_build, score  # noqa: E402

M = MODELS["qwen3_next"]["qwen3_next"]


@pytest.fixture(scope="module")
def qn(tiny_families):
    return tiny_families.source("qwen3_next"), tiny_families.built


def _cfg(src) -> dict:
    return json.loads((src / "config.json").read_text())


def test_tp2_gives_each_rank_whole_key_heads(qn):
    """4 key heads of 8 over tp = 2: rank r holds key heads 2r, 2r+1 with their value heads; the
    fused qkvz rows of those key heads (each key head's q, k, v, z contiguous), the conv's q, k and v
    channels of those heads (three pieces), A_log and dt_bias of their value heads, out_proj's columns."""
    src, _ = qn
    model = model_from_config(_cfg(src))
    layout = build_layout(model, moe_plan(src, 2))
    per_key = 2 * 8 + 2 * 2 * 8  # q, k, then 2 value heads' v and z
    for r, rank in enumerate(layout.ranks):
        t = {x.name: x for x in rank.tensors}
        p = "model.layers.0.linear_attn."
        assert (t[p + "in_proj_qkvz.weight"].start, t[p + "in_proj_qkvz.weight"].stop) == (2 * r * per_key,
                                                                                          2 * (r + 1) * per_key)
        assert t[p + "conv1d.weight"].pieces == ((16 * r, 16 * r + 16), (32 + 16 * r, 32 + 16 * r + 16),
                                                 (64 + 32 * r, 64 + 32 * r + 32))
        assert t[p + "conv1d.weight"].shape == (64, 1, 4)
        assert (t[p + "A_log"].start, t[p + "A_log"].stop) == (4 * r, 4 * r + 4)
        assert t[p + "out_proj.weight"].shape == (64, 32) and t[p + "norm.weight"].shape == (8,)
        assert t["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 2 * 16, 64)  # query and gate
    with pytest.raises(LayoutError, match="linear_num_key_heads=2 is not divisible by tp=4"):
        build_layout(model_from_config({**_cfg(src), "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                        "num_attention_heads": 4, "num_key_value_heads": 4}), moe_plan(src, 4))


def test_the_layer_cut_over_tp2_is_one_rounding(qn):
    """A Gated DeltaNet layer of the tp = 2 build, its two ranks' out_proj partial sums added in
    fp32 and rounded once: transformers' layer on the same input within one bf16 rounding (the whole
    model then compounds such roundings and routing flips: family_models.hybrid_agree)."""
    from safetensors.torch import load_file

    from shardc.runtime.deltanet import DeltaNetState, linear_attention

    src, built = qn
    layer = hf(src, **M.ref).model.layers[0].linear_attn
    torch.manual_seed(0)
    h = torch.randn(1, 70, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = layer(h).float()
    x = model_from_config(_cfg(src)).forward.hybrid
    parts = []
    for r in range(2):
        t = load_file(built("qwen3_next", 2).parent / f"model-tp{r:02d}-pp00.safetensors")
        p = "model.layers.0.linear_attn."
        w = {role: t[p + name] for role, name in (("qkvz", "in_proj_qkvz.weight"), ("ba", "in_proj_ba.weight"),
                                                  ("conv", "conv1d.weight"), ("A_log", "A_log"),
                                                  ("dt_bias", "dt_bias"), ("norm", "norm.weight"))}
        with torch.no_grad():
            a = linear_attention(x, w, h, 1e-6, DeltaNetState(), r)
            parts.append(torch.nn.functional.linear(a, t[p + "out_proj.weight"]).float())
    got = (parts[0] + parts[1]).to(torch.bfloat16).float()
    # each rank's partial rounded to bf16, their sum rounded once, against transformers' bf16 GEMM:
    # within an ulp (2^-8 relative) of each of the four
    bound = (parts[0].abs() + parts[1].abs() + got.abs() + want.abs()) * 2**-8
    assert bool(((got - want).abs() <= bound).all()), ((got - want).abs() - bound).max()


@pytest.mark.heavy
def test_tp2_with_dense_mlps_meets_the_dense_bound(qn, tmp_path):
    """Every MLP dense (no routing to flip): tp = 2 within half a logit of transformers everywhere
    over the 72 tokens the delta rule's state carries, 97 % of positions within DeepSeek's bound and
    95 % the same top-1 (measured over 3 seeds: at most 0.41, 98.6-100 %, 96.5-98.6 %)."""
    src = M.save(tmp_path / "dense", mlp_only_layers=[0, 1, 2, 3])
    out = build(moe_plan(src, 2), tmp_path / "tp2")
    x = ids(3, M.T, M.vocab)
    got = score(open_build(out.manifest_path), x, return_logits=True, timeout_s=120).logits
    want = hf_logits(src, x, **M.ref)
    assert (got - want).abs().max() <= 0.5
    assert ((got - want).abs() <= 0.25 + 0.01 * want.abs()).all(-1).float().mean() >= 0.97
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@pytest.mark.heavy
def test_greedy_generation_equals_transformers_generate(qn):
    """Decoding through the conv and delta-rule states after a 70-token prefill (one full chunk and
    a partial one), at tp = 1: transformers' own generate() tokens, exactly."""
    src, built = qn
    prompt = ids(4, 72, M.vocab)[:1, :70]
    with torch.no_grad():
        ref = hf(src, **M.ref).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, 70:]
    got = generate(open_build(built("qwen3_next", 1)), prompt.tolist(), max_new_tokens=10, eos=[], timeout_s=120)
    assert got.tokens[0] == ref.tolist()



def test_refusals_are_one_line(qn):
    src, _ = qn
    cfg = _cfg(src)
    assert refused(cfg, layer_types=["linear_attention", "sliding_attention", "full_attention",
                                      "full_attention"]).key == "layer_types"
    assert refused(cfg, layer_types=["full_attention"]).key == "layer_types"
    assert refused(cfg, linear_num_value_heads=6).key == "linear_num_value_heads"
    assert refused(cfg, hidden_act="gelu").key == "hidden_act"
    assert refused(cfg, mamba_ssm_dtype="int8").key == "mamba_ssm_dtype"
    assert refused(cfg, rope_parameters={**cfg["rope_parameters"], "partial_rotary_factor": 0.1}).key.endswith(
        "partial_rotary_factor")


def test_layer_types_default_and_the_multi_token_prediction_module(qn, tmp_path):
    """Without layer_types every full_attention_interval-th layer is full attention, as
    Qwen3NextConfig derives it; a checkpoint's mtp.* module is left out of a build."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = qn
    cfg = {k: v for k, v in _cfg(src).items() if k != "layer_types"}
    for interval in (2, 4):
        want = transformers.Qwen3NextConfig(**{**QWEN3_NEXT_SHAPE, "full_attention_interval": interval}).layer_types
        got = model_from_config({**cfg, "full_attention_interval": interval}).forward.hybrid.linear
        assert got == tuple(t == "linear_attention" for t in want)
    mtp = tmp_path / "mtp"
    shutil.copytree(src, mtp)
    tensors = load_file(mtp / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}, mtp / "model.safetensors",
              metadata={"format": "pt"})
    out = build(moe_plan(mtp, 1), tmp_path / "b")
    assert not any(n.startswith("mtp.") for s in json.loads(out.manifest_path.read_text())["shards"].values()
                   for n in s["tensors"])


def test_planner_holds_kv_for_full_layers_and_a_state_per_sequence():
    """A Qwen3.5-shaped config (Qwen/Qwen3.5-35B-A3B's sizes as Qwen3-Next keys: 40 layers, every 4th
    full attention; 16 heads over 2 KV heads of 256; 16 key heads and 32 value heads of 128, a conv of
    4; vLLM's state in fp32), worked by hand: KV only on the 10 full layers, 10 x 2 x 2 x 256 x 2 B =
    20,480 B per token at tp = 1; per sequence the 30 linear layers' state, 30 x (8,192 channels x 3
    x 2 B + 32 x 128 x 128 x 4 B) = 64,389,120 B, halved at tp = 2 (the KV heads too); the
    concurrency is what the pool holds of (a request's blocks + its state)."""
    from shardc.planner.candidate import kv_bpt, sequences_with_state, state_bytes

    cfg = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 40,
           "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 512,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "vocab_size": 248320,
           "mamba_ssm_dtype": "float32", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
           "torch_dtype": "bfloat16"}
    m = model_from_config(cfg)
    assert kv_bpt(m, 40, 1, 2) == 10 * 2 * 2 * 256 * 2 == 20_480
    assert state_bytes(m, 40, 1) == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 64_389_120
    assert state_bytes(m, 40, 2) == 64_389_120 // 2 and kv_bpt(m, 40, 2, 2) == 20_480 // 2
    assert state_bytes(m, 20, 1, first=20) == 15 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    # 10 GiB of pool at 4,096 tokens a sequence: 4,096 x 20,480 B + 64,389,120 B each
    budget = 10 * 2**30
    blocks = budget // (16 * 20_480)
    assert sequences_with_state(blocks, budget, 20_480, 64_389_120, 4096, 16) == budget // (4096 * 20_480 + 64_389_120)
    # --explain on a published Qwen3.5 (27B: 64 layers, 16 of them full attention over 4 KV heads of 256)
    from cli_run import shardc_in

    r = shardc_in("plan", "--model", "qwen3.5-27b", "--gpu", "h100", "--gpus", "2", "--tp", "1", "--explain")
    assert r.returncode == 0, r.stderr
    assert "2 (K and V) x 16 full-attention layers x max(1, 4 // 1) KV heads x 256 head_dim x 2 B = 65,536 B" \
        in r.stdout, r.stdout
    assert "B linear-attention state = " in r.stdout and "state of the linear-attention layers" in r.stdout
