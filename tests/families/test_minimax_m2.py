"""MiniMax-M2 (MiniMaxM2ForCausalLM): what is peculiar to it beside the conformance suite
(tests/families/test_conformance.py builds, verifies, reshards, exports, runs and gates the tiny
model of tests/family_models.py at tp 1, tp 2 and with expert parallelism).

- q_norm / k_norm are one RMSNorm over all heads' width: under TP each rank holds its heads' slice
  of the weight and the runtime all-reduces the fp32 sum of squares (runtime/qk.py). Checked here
  against transformers' own norm, split as the Layout cuts it, over 2 and 4 ranks, including KV
  heads fewer than the ranks (each KV head then held by several ranks and counted once), and end to
  end at tp = 2 with one KV head copied on both ranks.
- Partial rope (``rotary_dim``, or ``partial_rotary_factor``): the tables against transformers'.
- Sigmoid routing with the correction bias (runtime/moe.py ``biased_route``): against transformers'
  router, bit for bit.
- The published config keys transformers does not read: the values the forward computes, anything
  else one line; multi-token-prediction modules left out of a build.
- The presets (MiniMax-M2.5 and M2.7 as aiconfigurator 0.12 ships their config.json, block FP8 as
  published): sized by ``shardc plan`` at their stored bytes, worked out by hand below.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_run import shardc_in
from family_models import MINIMAX_SHAPE as SHAPE
from family_models import MODELS, hf, hf_logits, ids, refused, routed_agree

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import ModelError, SourceError  # noqa: E402
from shardc.layout.cuts import slice_for_rank  # noqa: E402
from shardc.layout.families.family import Split  # noqa: E402
from shardc.layout.model import PRESETS, load_model, model_from_config  # noqa: E402
from shardc.layout.ranks import build_layout  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402
from shardc.runtime.qk import whole_qk_norm  # noqa: E402
from shardc.runtime.support import check_supported  # noqa: E402

TINY = MODELS["minimax_m2"]["minimax_m2"]


@pytest.fixture(scope="module")
def src(tiny_families) -> Path:
    return tiny_families.source("minimax_m2")


def _cfg(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())



# ---- the whole-width q/k norm ------------------------------------------------------------------

class _Group:
    """A TP group of threads: each rank's ``all_reduce_sum`` is Comm's, the parts added in fp32 in
    rank order and rounded once to the part's dtype."""

    def __init__(self, tp: int) -> None:
        self.tp, self.parts = tp, [None] * tp
        self.barrier = threading.Barrier(tp, timeout=30)

    def rank(self, r: int):
        group = self

        class Rank:
            tp, tp_rank = group.tp, r

            def all_reduce_sum(self, x, what):
                group.parts[r] = x
                group.barrier.wait()
                total = group.parts[0].float()
                for p in group.parts[1:]:
                    total = total + p.float()
                group.barrier.wait()
                return total.to(x.dtype)

        return Rank()


def _norms_of(heads: int, kv: int, tp: int, seed: int = 3):
    """transformers' q and k norms of one random token batch, and the runtime's over ``tp`` ranks
    of the Layout's cuts, concatenated (a KV head copied on several ranks: each copy)."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    hd, eps = SHAPE["head_dim"], 1e-6
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, heads * hd, generator=g).to(torch.bfloat16) * 3
    k = torch.randn(2, 5, kv * hd, generator=g).to(torch.bfloat16) * 3
    ref_q, ref_k = MiniMaxM2RMSNorm(heads * hd, eps), MiniMaxM2RMSNorm(kv * hd, eps)
    with torch.no_grad():
        for norm in (ref_q, ref_k):
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g) * 0.3)
        ref_q, ref_k = ref_q.to(torch.bfloat16), ref_k.to(torch.bfloat16)
        want = ref_q(q), ref_k(k)
    model = model_from_config({**TINY.config_dict(), "num_attention_heads": heads, "num_key_value_heads": kv})

    def one(r: int):
        qc = slice_for_rank(Split.COLUMN, (heads * hd,), r, model, tp)
        kc = slice_for_rank(Split.KV_COLUMN, (kv * hd,), r, model, tp)
        qs, ks = slice(qc.start or 0, qc.stop), slice(kc.start or 0, kc.stop)
        return kc, whole_qk_norm(q[..., qs], k[..., ks], ref_q.weight.data[qs], ref_k.weight.data[ks], eps,
                                 heads, kv, hd, group.rank(r), "test")

    group = _Group(tp)
    with ThreadPoolExecutor(tp) as pool:
        got = list(pool.map(one, range(tp)))
    return want, got


def test_whole_norm_at_tp1_is_transformers_bit_for_bit():
    (want_q, want_k), [(_, (q, k))] = _norms_of(4, 2, 1)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (8, 2, 4)])
def test_whole_norm_split_over_tp_is_transformers_norm(heads, kv, tp):
    """Each rank's slice of q (column) and of k (kv_column: with fewer KV heads than ranks, each
    rank a whole KV head that others hold too) normed as a part of the whole width: within a bf16
    rounding of transformers' norm of the whole (the sum of squares added in another order)."""
    (want_q, want_k), got = _norms_of(heads, kv, tp)
    torch.testing.assert_close(torch.cat([q for _, (q, _) in got], -1), want_q, rtol=0.016, atol=0.016)
    for kc, (_, k) in got:
        torch.testing.assert_close(k, want_k[..., slice(kc.start or 0, kc.stop)], rtol=0.016, atol=0.016)
    copies = {kc.kv_head for kc, _ in got}
    assert (kv < tp) == (len(copies) == kv and None not in copies)


@pytest.mark.heavy
def test_tp2_with_one_kv_head_on_both_ranks_agrees_with_transformers(tiny_families, tmp_path):
    """End to end: one KV head, copied on both ranks of tp = 2: its k norm counted once."""
    one = TINY.save(tmp_path / "kv1", num_key_value_heads=1)
    x = ids(4, TINY.T, TINY.vocab)
    got = score(open_build(tiny_families.build(moe_plan(one, 2))), x, return_logits=True, timeout_s=120).logits
    routed_agree(got, hf_logits(one, x, **TINY.ref), 2)


# ---- rope and routing against transformers' modules ---------------------------------------------

def test_partial_rope_tables_and_rotation_are_transformers(src):
    from transformers.models.minimax_m2 import modeling_minimax_m2 as hf_mod

    from shardc.runtime.qk import apply_rope
    from shardc.runtime.rope import rope_tables

    cfg = transformers.AutoConfig.from_pretrained(src)
    spec = model_from_config(_cfg(src))
    assert spec.forward.rotary_dim == SHAPE["rotary_dim"] < spec.head_dim
    cos, sin = rope_tables({**spec.summary(), "head_dim": spec.forward.rotary_dim}, 40, torch.bfloat16)
    x = torch.zeros(1, 40, 64, dtype=torch.bfloat16)
    want_cos, want_sin = hf_mod.MiniMaxM2RotaryEmbedding(cfg)(x, torch.arange(40)[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    q, k = torch.randn(2, 4, 40, 16).to(torch.bfloat16), torch.randn(2, 2, 40, 16).to(torch.bfloat16)
    want_q, want_k = hf_mod.apply_rotary_pos_emb(q, k, want_cos, want_sin)
    assert torch.equal(apply_rope(q, cos, sin), want_q) and torch.equal(apply_rope(k, cos, sin), want_k)


def test_biased_sigmoid_routing_is_transformers_router(src):
    from shardc.runtime.moe import route
    from shardc.runtime.rankweights import MoeWeights

    layer = hf(src, **TINY.ref).model.layers[1].mlp
    spec = model_from_config(_cfg(src))
    x = torch.randn(64, SHAPE["hidden_size"]).to(torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_e = layer.gate(x, layer.e_score_correction_bias)
    assert layer.gate.weight.dtype == layer.e_score_correction_bias.dtype == torch.bfloat16
    mw = MoeWeights(router=layer.gate.weight.data, experts={}, score_bias=layer.e_score_correction_bias)
    weights, chosen = route(spec.forward.moe, mw, x)
    assert torch.equal(chosen, want_e) and torch.equal(weights, want_w) and weights.dtype == torch.float32
    # the bias changes choices (so the tiny model tests it)
    with torch.no_grad():
        _, _, plain = layer.gate(x, torch.zeros(SHAPE["num_local_experts"]))
    assert not torch.equal(plain.sort(-1)[0], want_e.sort(-1)[0])


# ---- config keys ---------------------------------------------------------------------------------

def test_refusals_are_one_line(src):
    cfg = _cfg(src)
    assert cfg["rotary_dim"] == 8 and cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert refused(cfg, use_qk_norm=False).key == "use_qk_norm"
    assert refused(cfg, qk_norm_type="per_head").key == "qk_norm_type"
    assert refused(cfg, use_routing_bias=False).key == "use_routing_bias"
    assert refused(cfg, scoring_func="softmax").key == "scoring_func"
    assert refused(cfg, shared_intermediate_size=64).key == "shared_intermediate_size"
    assert refused(cfg, attn_type_list=[0, 1]).key == "attn_type_list"
    assert refused(cfg, attention_bias=True).key == "attention_bias"
    assert refused(cfg, rotary_dim=7).key == "rotary_dim"  # rope turns pairs
    assert refused(cfg, rotary_dim=32).key == "rotary_dim"  # above head_dim 16
    e = refused(cfg, rotary_dim=4)  # the factor 0.5 in rope_parameters turns 8
    assert e.key == "rope_parameters.partial_rotary_factor" and "rotary_dim=4" in e.message
    assert refused(cfg, num_experts=8).key == "num_experts"  # transformers' alias disagrees
    assert refused(cfg, num_mtp_modules=-1).key == "num_mtp_modules"
    # the published values are read, and so is the transformers 4 spelling (rope_theta, rotary_dim)
    published = {k: v for k, v in PRESETS["minimax-m2.7"].items() if k in (
        "use_qk_norm", "qk_norm_type", "use_routing_bias", "scoring_func", "shared_intermediate_size", "use_mtp",
        "mtp_transformer_layers", "num_mtp_modules")}
    old = {k: v for k, v in {**cfg, **published}.items() if k != "rope_parameters"}
    a, b = model_from_config(cfg), model_from_config({**old, "rope_theta": cfg["rope_parameters"]["rope_theta"]})
    assert a.forward == b.forward and a.rope_theta == b.rope_theta == 5000000.0
    assert model_from_config({k: v for k, v in old.items() if k != "rope_theta"}).rope_theta == 5000000.0
    check_supported(a)
    check_supported(b)
    # a partial rope stays refused where the family's forward turns every dimension
    with pytest.raises(ModelError, match="partial_rotary_factor=0.5 is not implemented"):
        check_supported(model_from_config({**load_model("llama-3.1-8b").config, "partial_rotary_factor": 0.5}))


def test_multi_token_prediction_modules_are_left_out(src, tmp_path):
    """A checkpoint holding MTP modules after its last layer (model.layers.{num_hidden_layers}.*, as
    the published one holds layers 62 to 64) builds without them; not declared, they are refused."""
    from safetensors.torch import load_file, save_file

    mtp = tmp_path / "mtp"
    shutil.copytree(src, mtp)
    tensors = load_file(mtp / "model.safetensors")
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    save_file(tensors, mtp / "model.safetensors", metadata={"format": "pt"})
    cfg = _cfg(src)
    (mtp / "config.json").write_text(json.dumps({**cfg, "use_mtp": True, "num_mtp_modules": 1}))
    spec = model_from_config(_cfg(mtp))
    assert not any(t.name.startswith("model.layers.2.") for t in build_layout(spec, moe_plan(mtp, 1)).ranks[0].tensors)
    assert build(moe_plan(mtp, 1), tmp_path / "build").manifest_path.exists()
    (mtp / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="unexpected tensor 'model.layers.2."):
        build(moe_plan(mtp, 1), tmp_path / "build0")


# ---- the presets ----------------------------------------------------------------------------------

def _minimax_m25_fp8_bytes() -> int:
    """MiniMaxAI/MiniMax-M2.5 as published: every projection e4m3 with an fp32 scale per 128 x 128
    block; the routers and their correction biases (modules_to_not_convert), norms, embeddings and
    lm_head 16-bit; the MTP modules are not part of a build."""
    hidden, heads, kv, head_dim, inter, experts, vocab, layers = 3072, 48, 8, 128, 1536, 256, 200064, 62
    q, kvw = heads * head_dim, kv * head_dim

    def fp8(out: int, inp: int) -> int:
        return out * inp + math.ceil(out / 128) * math.ceil(inp / 128) * 4

    attention = fp8(q, hidden) + 2 * fp8(kvw, hidden) + fp8(hidden, q) + (q + kvw) * 2
    moe = experts * (2 * fp8(inter, hidden) + fp8(hidden, inter)) + (experts * hidden + experts) * 2
    return layers * (attention + 2 * hidden * 2 + moe) + (2 * vocab * hidden + hidden) * 2


def test_presets_load_with_their_published_fp8_and_plan_sizes_them():
    from shardc.layout.quant_formats import detect_source
    from shardc.planner.formulas import Workload
    from shardc.planner.gpus import GIB, Cluster, get_gpu
    from shardc.planner.search import search

    for name, positions in (("minimax-m2.5", 196608), ("minimax-m2.7", 204800)):
        m = load_model(name)
        f = m.forward
        assert (m.family, m.num_layers, m.max_position_embeddings, f.rotary_dim) == ("minimax_m2", 62, positions, 64)
        assert (f.moe.experts, f.moe.top_k, f.moe.scoring, f.qk_norm_whole) == (256, 8, "sigmoid_bias", True)
        fp8 = detect_source(m.config)
        kept = fp8.quantized(m)
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in kept
        assert "model.layers.0.self_attn.q_proj.weight" in kept
        assert not any("gate.weight" in n or "lm_head" in n for n in kept)
    s = search(load_model("minimax-m2.5"), Cluster(get_gpu("h200")), Workload(), model_name="minimax-m2.5")
    one = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("source", 1, 1))
    assert f"{_minimax_m25_fp8_bytes() / GIB:.2f} GiB" in one.reasons[0], one.reasons
    r = shardc_in("plan", "--model", "minimax-m2.5", "--gpu", "h200")
    assert r.returncode == 0, r.stderr


def test_real_size_preset_lays_out_tp8_expert_parallel(tmp_path):
    """8 ranks: 6 q heads and one KV head each (the norms cut with them), 32 whole experts each."""
    plan = tmp_path / "p.yaml"
    plan.write_text(json.dumps({"replica_group": {"name": "m25", "tp_degree": 8, "pp_degree": 1, "dtype": "bf16",
                                                  "gpus_per_replica": 8, "expert_parallel": True},
                                "model": {"source": "/nonexistent"}}))
    r = shardc_in("build", plan, "--dry-run", "--model", "minimax-m2.5", "--json")
    assert r.returncode == 0, r.stderr
    layout = build_layout(load_model("minimax-m2.5"), moe_plan(Path("/nonexistent"), 8, ep=True))
    rank = {t.name: t for t in layout.ranks[3].tensors}
    assert rank["model.layers.0.self_attn.q_norm.weight"].shape == (6 * 128,)
    assert (rank["model.layers.0.self_attn.k_norm.weight"].start, rank["model.layers.0.self_attn.k_norm.weight"].stop) \
        == (3 * 128, 4 * 128)
    assert sum(n.startswith("model.layers.0.block_sparse_moe.experts.") for n in rank) == 32 * 3


def _minimax_m25_nvfp4_bytes() -> int:
    """nvidia/MiniMax-M2.5-NVFP4 as published: every routed expert's w1/w2/w3 in NVFP4 (two E2M1
    values a byte, an fp8 scale per 16 values, the fp32 scalars weight_scale_2 and input_scale);
    attention and routers left out by its ignore list, so 16-bit like the norms, embeddings and
    lm_head; its FP8 KV-cache scales are no weights and no build holds them."""
    hidden, heads, kv, head_dim, inter, experts, vocab, layers = 3072, 48, 8, 128, 1536, 256, 200064, 62
    q, kvw = heads * head_dim, kv * head_dim

    def nvfp4(out: int, inp: int) -> int:
        return out * inp // 2 + out * inp // 16 + 4 + 4

    attention = (q * hidden + 2 * kvw * hidden + hidden * q + q + kvw) * 2
    moe = experts * (2 * nvfp4(inter, hidden) + nvfp4(hidden, inter)) + (experts * hidden + experts) * 2
    return layers * (attention + 2 * hidden * 2 + moe) + (2 * vocab * hidden + hidden) * 2


def test_nvfp4_preset_is_sized_at_its_stored_bytes():
    """nvidia/MiniMax-M2.5-NVFP4 (ModelOpt, W4A4, FP8 KV cache): the experts are what its ignore list
    leaves quantized, and ``source`` at tp=1 is the stored bytes worked out by hand (125.17 GiB
    against the FP8 release's 214.23); ``source`` comes first and is the pick on H200s, with a 16-bit
    KV cache (what a build serves: the KV-cache scales are not carried)."""
    from shardc.layout.quant_formats import detect_source
    from shardc.planner.formulas import Workload
    from shardc.planner.gpus import GIB, Cluster, get_gpu
    from shardc.planner.search import default_dtypes, search

    m = load_model("minimax-m2.5-nvfp4")
    fmt = detect_source(m.config)
    kept = fmt.quantized(m)
    assert fmt.kv_cache_dtype() == "fp8" and default_dtypes(m)[0] == "source"
    assert "model.layers.61.block_sparse_moe.experts.255.w2.weight" in kept
    assert not any("self_attn" in n or "gate.weight" in n or "lm_head" in n for n in kept)
    assert len(kept) == 62 * 256 * 3
    s = search(m, Cluster(get_gpu("h200")), Workload(), model_name="minimax-m2.5-nvfp4")
    one = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("source", 1, 1))
    assert one.memory is not None and one.memory.weights == _minimax_m25_nvfp4_bytes()
    assert f"{one.memory.weights / GIB:.2f}" == "125.17" and f"{_minimax_m25_fp8_bytes() / GIB:.2f}" == "214.23"
    assert s.recommended is not None and s.recommended.dtype == "source" and s.workload.kv_bytes == 2
