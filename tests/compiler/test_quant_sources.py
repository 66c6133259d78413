"""Quantized sources (#31): block-scaled FP8 checkpoints kept as stored (``dtype: source``),
dequantized to 16 bits, or requantized, with transformers as the oracle.

The sources are tiny models saved by transformers and quantized by transformers' own
FineGrainedFP8 quantizer (tests/quant_sources.py). transformers loads FP8 checkpoints on CPU by
dequantizing them (``Fp8Dequantize``), which is the reference a 16-bit build must equal bit for bit
and what a ``dtype: source`` build must load to, exactly like its source.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_models import MINIMAX_SHAPE, MODELS
from plan_helpers import plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quant_sources import fp8_block_source, save_tiny  # noqa: E402
from reassemble import load_source, reassemble  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.layout.families.deepseek_v32 import DEEPSEEK_V32_FP8  # noqa: E402
from shardc.layout.families.minimax_m2 import MINIMAX_FP8  # noqa: E402
from shardc.layout.plan import plan_from_dict  # noqa: E402

# family -> (config class, model class, extra config, weight_block_size)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, (32, 32)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32), (32, 32)),
    # DeepSeek-V3 as published: MLA projections, routed and shared experts in fp8, the router not
    "deepseek": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                 dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=12, q_lora_rank=24, n_group=2, topk_group=1), (8, 8)),
    # MiniMax-M2(.5) as published: attention and routed experts in fp8, the router, its correction
    # bias and lm_head in 16 bits by modules_to_not_convert (PUBLISHED); 16x16 blocks: at tp=2 k/v_proj
    # [32, 64] and w1/w3 [32, 64] cut at row 16, w2 [64, 32] at column 16, all on block lines
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(MINIMAX_SHAPE), (16, 16)),
    # DeepSeek-V3.2 and GLM-5 as published: DeepSeek-V3's FP8 plus the lightning indexer's wq_b and
    # wk in fp8, its weights_proj and k_norm in 16 bits (no quantizable row: fp8_block_source leaves
    # them as saved); the family tests' tiny DSA models (family_models.py "v32", "glm5": layer 1 of
    # "glm5" is a "shared" layer without an indexer). 8x8 blocks: every quantized projection tiles
    # whole (q_lora_rank 24), and at tp=2 q_b_proj [96, 24] and kv_b_proj [112, 16] cut at rows 48
    # and 56, o_proj [64, 48] at column 24, the MLPs at 48 and the experts at 16, all on block lines;
    # the indexer is replicated, never cut
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(MODELS["deepseek_v32"]["v32"].keys), (8, 8)),
    "glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(MODELS["deepseek_v32"]["glm5"].keys), (8, 8)),
    # GLM-4.5 and Qwen3-Next in block FP8 (zai-org/GLM-4.5-FP8, Qwen/Qwen3-Next-80B-A3B-*-FP8 publish it;
    # their config.json is not here, so the format's plain form): their tiny models, 8x8 blocks so that
    # at tp=2 every cut (Qwen3-Next's in_proj_qkvz at row 96, in_proj_ba at 8) is on a block line; the
    # conv1d (3-D), A_log, dt_bias and the norms are not linears and stay 16-bit
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(MODELS["glm4_moe"]["glm4_moe"].keys), (8, 8)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(MODELS["qwen3_next"]["qwen3_next"].keys), (8, 8)),
}


def _glm5_fp8(extra: dict) -> dict:
    """zai-org/GLM-5-FP8's quantization_config for the tiny GLM-5: DeepSeek-V3.2's without
    scale_fmt, and modules_to_not_convert naming what the published list names for each layer (as
    aiconfigurator 0.12's copy of its config.json has it, zai-org--GLM-5-FP8_config.json: 712
    entries, per layer input_layernorm, post_attention_layernorm, self_attn.indexer.k_norm and its
    .bias, self_attn.indexers_proj, kv_a_layernorm, q_a_layernorm; per MoE layer mlp.gate and its
    e_score_correction_bias; lm_head, model.embed_tokens, model.norm; and the MTP layer's own),
    self_attn.indexers_proj included, which names no module of transformers' model: the indexer's
    weights_proj is 16-bit all the same (no quantizable row; vLLM's loader reads it unquantized)."""
    keep = ["lm_head", "model.embed_tokens", "model.norm"]
    for i in range(extra["num_hidden_layers"]):
        p = f"model.layers.{i}."
        keep += [p + m for m in ("input_layernorm", "post_attention_layernorm", "self_attn.indexer.k_norm",
                                 "self_attn.indexer.k_norm.bias", "self_attn.indexers_proj",
                                 "self_attn.kv_a_layernorm", "self_attn.q_a_layernorm")]
        if i >= extra["first_k_dense_replace"]:
            keep += [p + "mlp.gate", p + "mlp.gate.e_score_correction_bias"]
    glm = {k: v for k, v in DEEPSEEK_V32_FP8.items() if k != "scale_fmt"}
    return glm | {"modules_to_not_convert": keep}


# family -> its published quantization_config, but the block size: MiniMax-M2.5's and M2.7's (the
# preset's, fmt and modules_to_not_convert verbatim: its entries name the tiny model's modules as
# they name the published one's); DeepSeek-V3.2's (the preset's: scale_fmt ue8m0, so the source's
# scales are powers of two, tests/quant_sources.py); GLM-5-FP8's
PUBLISHED = {"minimax_m2": MINIMAX_FP8, "deepseek_v32": DEEPSEEK_V32_FP8, "glm5": _glm5_fp8(FAMILIES["glm5"][2])}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qsrc")
    out = {}
    for fam, (cc, mc, extra, block) in FAMILIES.items():
        qcfg = PUBLISHED[fam] | {"weight_block_size": list(block)} if fam in PUBLISHED else None
        out[fam] = fp8_block_source(save_tiny(root / f"{fam}-bf16", cc, mc, **extra), root / f"{fam}-fp8", block,
                                    block_config=qcfg)
    return out


def _as_stored(fam: str, name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` is source tensor ``want`` as stored, byte for byte."""
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _plan(src: Path, dtype: str, tp: int = 1) -> object:
    return plan(tp, 1, dtype, name="q", source=src)


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_keep_source_loads_like_the_source(sources, tmp_path, fam):
    """tp=1 ``dtype: source``: every source tensor byte for byte, the source's quantization_config,
    and transformers' FP8 loader gives the same weights from the build as from the source."""
    src = sources[fam]
    build(_plan(src, "source"), tmp_path / "b")
    got, want = load_source(tmp_path / "b"), load_source(src)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert _as_stored(fam, k, got[k], t), k
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]
    a, b = _hf_state(tmp_path / "b"), _hf_state(src)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_keep_source_tp2_slices_whole_blocks(sources, tmp_path, fam):
    """tp=2: each rank's F8 values and block scales are the source's, cut on block lines; put
    back together they are the source."""
    src = sources[fam]
    build(_plan(src, "source", 2), tmp_path / "b")
    build(_plan(src, "source", 2), tmp_path / "again")  # determinism: the same bytes, manifest included
    files = sorted(p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith("."))
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir() if not p.name.startswith("."))
    assert all((tmp_path / "b" / f).read_bytes() == (tmp_path / "again" / f).read_bytes() for f in files)
    got, want = reassemble(tmp_path / "b"), load_source(src)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert _as_stored(fam, k, got[k], t), k


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_to_bf16_equals_transformers_dequantization(sources, tmp_path, fam):
    """``dtype: bf16``: at tp=2 every weight is transformers' ``Fp8Dequantize`` of the source's, bit
    for bit (the others copied); at tp=1 transformers loads the build to exactly the weights its
    FP8 loader makes of the source."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src = sources[fam]
    build(_plan(src, "bf16", 2), tmp_path / "b2")
    got, raw = reassemble(tmp_path / "b2"), load_source(src)
    assert "quantization_config" not in json.loads((tmp_path / "b2" / "config.json").read_text())
    assert sorted(got) == sorted(k for k in raw if not k.endswith("_scale_inv"))
    deq = Fp8Dequantize(None)
    for k, t in got.items():
        if k + "_scale_inv" in raw:
            assert torch.equal(t, deq._dequantize_one(raw[k], raw[k + "_scale_inv"], torch.bfloat16)), k
        else:
            assert torch.equal(t, raw[k]), k
    build(_plan(src, "bf16"), tmp_path / "b1")
    a, b = _hf_state(tmp_path / "b1"), _hf_state(src)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_requantize_records_both_steps(sources, tmp_path):
    """``dtype: int8`` from FP8: the error stats are against the source's dequantized weights, and
    the manifest names the source's quantization."""
    src = sources["llama"]
    build(_plan(src, "int8"), tmp_path / "b")
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["source_quantization"] == {"format": "fp8 block 32x32", "quant_method": "fp8",
                                        "applied": "dequantized, then quantized to int8 per channel"}
    stats = [rec["stats"] for s in m["shards"].values() for rec in s["tensors"].values() if "stats" in rec]
    assert stats and all(0 < s["rel_rms_err"] < 0.02 for s in stats)


def _cli_build(tmp_path: Path, src: Path, dtype: str = "source", tp: int = 1):
    from click.testing import CliRunner

    from shardc.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({"replica_group": {"name": "q", "tp_degree": tp, "pp_degree": 1, "dtype": dtype,
                                                  "gpus_per_replica": tp}, "model": {"source": str(src)}}))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["build", str(plan), "--out", str(out), "--manifests-dir", str(tmp_path / "m"),
                                  "--quiet"])
    return r, out


def _copy(src: Path, dst: Path, qcfg: dict | None = None, tensors: dict | None = None) -> Path:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    if qcfg is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = qcfg
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(load_source(src) | tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
K = "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize(("case", "needle"), [
    ("method", "quant_method 'awq' is not a source format shardc reads"),
    ("block", "quantization_config.weight_block_size: is [0, 32]; it must be two positive integers"),
    ("static", "quantization_config.activation_scheme: is 'static'"),
    ("unknown-key", "quantization_config.group_size: is a key of this fp8 config that shardc does not implement"),
    ("scale-shape", f"tensor '{K}_scale_inv' has shape [2, 2], but weight {K} [64, 128] with fp8 block "
                    "32x32 implies [2, 4]"),
    ("scale-dtype", f"tensor '{K}_scale_inv' has dtype I32"),
    ("tp-cut", f"tensor {K} [64, 128]: a rank would hold rows [0, 32), 0.5 of the 64-row blocks that each element "
               "of weight_scale_inv covers (fp8 block 64x64) at tp=2"),
])
def test_bad_quantized_source(sources, tmp_path, case, needle):
    """One line naming the key or tensor, exit 2, nothing written."""
    src, tp = sources["llama"], 1
    if case == "method":
        src = _copy(src, tmp_path / "s", {"quant_method": "awq", "bits": 4})
    elif case == "block":
        src = _copy(src, tmp_path / "s", FP8 | {"weight_block_size": [0, 32]})
    elif case == "static":
        src = _copy(src, tmp_path / "s", FP8 | {"activation_scheme": "static"})
    elif case == "unknown-key":
        src = _copy(src, tmp_path / "s", FP8 | {"group_size": 64})
    elif case == "scale-shape":
        src = _copy(src, tmp_path / "s", tensors={K + "_scale_inv": torch.ones(2, 2)})
    elif case == "scale-dtype":
        src = _copy(src, tmp_path / "s", tensors={K + "_scale_inv": torch.ones(2, 4, dtype=torch.int32)})
    elif case == "tp-cut":
        src, tp = fp8_block_source(sources["llama"].parent / "llama-bf16", tmp_path / "s", (64, 64)), 2
    r, out = _cli_build(tmp_path, src, tp=tp)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.stderr
    if case == "tp-cut":
        assert "tp_degree values that keep every fp8 block 64x64 cell whole: 1 " in lines[0]
    assert not (out.exists() and [p for p in out.iterdir() if not p.name.startswith(".")])


O1 = "model.layers.1.self_attn.o_proj"  # a quantizable projection a MiniMax source may keep 16-bit


def _minimax(sources, out: Path, keep: list[str]) -> Path:
    """The tiny MiniMax-M2 published with MiniMax-M2.5's quantization_config, ``keep`` its
    modules_to_not_convert (what transformers' quantizer leaves unquantized)."""
    block = list(FAMILIES["minimax_m2"][3])
    return fp8_block_source(sources["minimax_m2"].parent / "minimax_m2-bf16", out, tuple(block),
                            block_config=MINIMAX_FP8 | {"weight_block_size": block, "modules_to_not_convert": keep})


def test_modules_to_not_convert_stay_16_bit(sources, tmp_path):
    """MiniMax-M2.5's modules_to_not_convert (router, correction bias, lm_head) and one more entry
    naming a quantizable projection: transformers loads that projection as stored (16-bit); a tp=2
    ``dtype: source`` build keeps each listed module 16-bit, no scales, byte for byte; a bf16 build
    copies them."""
    keep = [*MINIMAX_FP8["modules_to_not_convert"], O1]
    src = _minimax(sources, tmp_path / "src", keep)
    raw = load_source(src)
    listed = [k for k in raw if k.startswith(("lm_head.", O1 + ".")) or ".block_sparse_moe.gate." in k
              or k.endswith(".e_score_correction_bias")]
    assert len(listed) == 2 + 2 * FAMILIES["minimax_m2"][2]["num_hidden_layers"]
    assert all(raw[k].dtype == torch.bfloat16 and k + "_scale_inv" not in raw for k in listed), listed
    assert raw["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn  # only layer 1's kept
    assert torch.equal(_hf_state(src)[O1 + ".weight"], raw[O1 + ".weight"])
    for dtype in ("source", "bf16"):
        build(_plan(src, dtype, 2), tmp_path / dtype)
        got = reassemble(tmp_path / dtype)
        assert all(k + "_scale_inv" not in got for k in listed)
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], raw[k]) for k in listed), dtype


IX = "self_attn.indexer."
IX_FP8, IX_16 = ("wq_b.weight", "wk.weight"), ("weights_proj.weight", "k_norm.weight", "k_norm.bias")


def _indexed(raw: dict[str, torch.Tensor]) -> list[int]:
    """The layers whose indexer the checkpoint holds (GLM-5's "shared" layers hold none)."""
    return sorted(int(k.split(".")[2]) for k in raw if k.endswith(IX + "wk.weight"))


@pytest.mark.parametrize(("fam", "indexed"), [("deepseek_v32", [0, 1, 2]), ("glm5", [0, 2])])
def test_dsa_source_as_published(sources, tmp_path, fam, indexed):
    """DeepSeek-V3.2 / GLM-5 FP8 as published: the indexer's wq_b and wk in F8_E4M3 with F32 block
    scales (DeepSeek-V3.2's, scale_fmt ue8m0, all powers of two, as every scale of its source), its
    weights_proj and k_norm in 16 bits with no scale; transformers loads those as stored. A tp=2
    ``dtype: source`` build holds the whole indexer on each rank (replicated, never cut): wq_b and wk
    F8_E4M3 with their F32 scales, k_norm and weights_proj BF16 as stored, byte for byte."""
    src = sources[fam]
    raw = load_source(src)
    qcfg = json.loads((src / "config.json").read_text())["quantization_config"]
    assert qcfg == PUBLISHED[fam] | {"weight_block_size": [8, 8]}
    if fam == "deepseek_v32":
        assert qcfg["scale_fmt"] == "ue8m0"
        scales = [t for k, t in raw.items() if k.endswith("_scale_inv")]
        assert scales and all(t.dtype == torch.float32 and (torch.frexp(t).mantissa == 0.5).all() for t in scales)
    assert _indexed(raw) == indexed
    fp8 = [f"model.layers.{i}.{IX}{w}" for i in indexed for w in IX_FP8]
    kept = [f"model.layers.{i}.{IX}{w}" for i in indexed for w in IX_16]
    for k in fp8:
        s = raw[k + "_scale_inv"]
        assert raw[k].dtype == torch.float8_e4m3fn and s.dtype == torch.float32, k
        assert list(s.shape) == [-(-n // 8) for n in raw[k].shape], k
    assert all(raw[k].dtype == torch.bfloat16 and k + "_scale_inv" not in raw for k in kept)
    hf = _hf_state(src)
    assert all(torch.equal(hf[k], raw[k]) for k in kept)
    build(_plan(src, "source", 2), tmp_path / "b")
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert len(m["shards"]) == 2
    for shard in m["shards"].values():
        for k in fp8 + kept:
            rec = shard["tensors"][k]
            assert rec["split"] == "replicated" and rec["shape"] == list(raw[k].shape), (k, rec)
        for k in fp8:
            assert shard["tensors"][k]["dtype"] == "F8_E4M3" and shard["tensors"][k + "_scale_inv"]["dtype"] == "F32"
        assert all(shard["tensors"][k]["dtype"] == "BF16" for k in kept)
    got = reassemble(tmp_path / "b")
    assert all(_as_stored(fam, k, got[k], raw[k]) for k in fp8 + [k + "_scale_inv" for k in fp8] + kept)


@pytest.mark.parametrize("fam", ["deepseek_v32", "glm5"])
def test_dsa_kept_build_keeps_weights_proj_16_bit(sources, tmp_path, fam):
    """``dtype: source`` keeps the indexer's weights_proj as the source stores it (BF16, as published):
    each stored tensor byte for byte, no tensor rewritten in another dtype."""
    src = sources[fam]
    build(_plan(src, "source"), tmp_path / "b")
    got, raw = load_source(tmp_path / "b"), load_source(src)
    names = [k for k in raw if k.endswith(IX + "weights_proj.weight")]
    assert names and all(got[k].dtype == raw[k].dtype == torch.bfloat16 for k in names), \
        {k: str(got[k].dtype) for k in names}
    assert all(torch.equal(got[k], raw[k]) for k in names)


@pytest.mark.parametrize(("case", "needle"), [
    # listed in modules_to_not_convert, stored in FP8 all the same
    ("listed-stored-fp8", f"tensor '{O1}.weight' is stored quantized ({O1}.weight_scale_inv), but shardc reads "
                          "fp8 block 16x16 quantization only"),
    # stored 16-bit, not listed: the config says it is quantized
    ("unlisted-stored-16-bit", f"tensor '{O1}.weight' has dtype BF16; fp8 block 16x16 stores it as F8_E4M3"),
])
def test_modules_to_not_convert_must_match_the_stored_tensors(sources, tmp_path, case, needle):
    """A MiniMax source whose modules_to_not_convert and stored tensors disagree (compiler/quantized.py
    ``check_stored``): one line naming the tensor, exit 2, nothing written."""
    published = MINIMAX_FP8["modules_to_not_convert"]
    qcfg = json.loads((sources["minimax_m2"] / "config.json").read_text())["quantization_config"]
    if case == "listed-stored-fp8":
        src = _copy(sources["minimax_m2"], tmp_path / "s", qcfg | {"modules_to_not_convert": [*published, O1]})
    else:
        src = _copy(_minimax(sources, tmp_path / "kept", [*published, O1]), tmp_path / "s", qcfg)
    r, out = _cli_build(tmp_path, src)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.stderr
    assert not (out.exists() and [p for p in out.iterdir() if not p.name.startswith(".")])


def test_verify_reshard_export_keep_the_source_format(sources, tmp_path):
    """A tp=2 ``dtype: source`` build passes ``verify --deep`` against its source; exported, it is
    the source's tensors byte for byte with its quantization_config; resharding it to bf16 is
    lossy, so it needs --dequantize, and then equals a bf16 build from the source."""
    from click.testing import CliRunner

    from shardc.cli import main

    src = sources["llama"]

    def plan(dtype: str, tp: int) -> Path:
        p = tmp_path / f"{dtype}{tp}.yaml"
        p.write_text(json.dumps({"replica_group": {"name": f"{dtype}{tp}", "tp_degree": tp, "pp_degree": 1,
                                                   "dtype": dtype, "gpus_per_replica": tp},
                                 "model": {"source": str(src)}}))
        return p

    def run(*args) -> object:
        return CliRunner().invoke(main, [str(a) for a in args])

    m = tmp_path / "s2" / "manifest.json"
    assert run("build", plan("source", 2), "--out", tmp_path / "s2", "--quiet").exit_code == 0
    r = run("verify", "--manifest", m, "--deep", src)
    assert r.exit_code == 0 and "deep" in r.output, r.output
    assert run("export", "--manifest", m, "--out", tmp_path / "ex", "--quiet").exit_code == 0
    got, want = load_source(tmp_path / "ex"), load_source(src)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]
    r = run("reshard", "--manifest", m, "--plan", plan("bf16", 2), "--out", tmp_path / "b2", "--quiet")
    assert r.exit_code == 2 and "--dequantize" in r.stderr, r.stderr
    assert run("reshard", "--manifest", m, "--plan", plan("bf16", 2), "--out", tmp_path / "b2", "--quiet",
               "--dequantize").exit_code == 0
    # the reshard's record of plan bf162 is another build's (its source is the fp8 build): this
    # build keeps its own record elsewhere rather than replace that one (--replace would)
    assert run("build", plan("bf16", 2), "--out", tmp_path / "b2x", "--quiet",
               "--manifests-dir", tmp_path / "m2").exit_code == 0
    a, b = reassemble(tmp_path / "b2"), reassemble(tmp_path / "b2x")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a 16-bit build no longer holds the fp8 tensors: dtype: source from it is one line, nothing written
    r = run("reshard", "--manifest", tmp_path / "b2x" / "manifest.json", "--plan", plan("source", 1),
            "--out", tmp_path / "s1", "--quiet")
    assert r.exit_code == 2 and "needs the source's quantized tensors as stored, but the input build holds " \
        "them as bf16" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "s1").exists() or not list((tmp_path / "s1").glob("*.safetensors"))


def _flat(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the runtime's StageWeights, by its path."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, val in items for k, v in _flat(val, f"{prefix}.{key}").items()}


@pytest.mark.parametrize("fam", ["deepseek", "qwen3", "minimax_m2", "deepseek_v32", "glm5", "ct:w4a16-group"])
def test_runtime_weights_of_a_kept_source(request, tmp_path, fam):
    """The runtime dequantizes a ``dtype: source`` build's rank slices as the format's reference
    does: at tp=2 every rank's weights equal those of the bf16 build of the same source, bit for
    bit, so its forward is the 16-bit build's (whose logits equal transformers', the family tests).
    The weights are loaded in-process (runtime.weights.load_stage): a forward costs process starts."""
    from shardc.formats.manifest import loads
    from shardc.runtime.weights import load_stage

    src = (request.getfixturevalue("ct_sources")[fam[3:]] if fam.startswith("ct:")
           else request.getfixturevalue("sources")[fam])
    ranks = {}
    for dtype in ("source", "bf16"):
        build(_plan(src, dtype, 2), tmp_path / dtype)
        m = loads((tmp_path / dtype / "manifest.json").read_bytes())
        ranks[dtype] = [_flat(load_stage(m, tmp_path / dtype, m.to_layout(), r, 0, torch.device("cpu")))
                        for r in range(2)]
    for a, b in zip(ranks["source"], ranks["bf16"], strict=True):
        assert sorted(a) == sorted(b) and a
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# -- compressed-tensors ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ct_sources(sources) -> dict[str, Path]:
    """The bf16 Llama published by compressed-tensors' own ModelCompressor (as llm-compressor saves)."""
    from quant_sources import ct_model_compressor_source

    bf16 = sources["llama"].parent / "llama-bf16"
    return {s: ct_model_compressor_source(bf16, bf16.parent / f"llama-{s}", s)
            for s in ("w4a16-group", "w8a8-channel", "fp8-channel")}


def _ct_reference(raw: dict[str, torch.Tensor], name: str, src: Path) -> torch.Tensor:
    """compressed-tensors' own decompression of a source weight (in its scales' dtype, bf16)."""
    from quant_sources import ct_reference

    return ct_reference(raw, name, json.loads((src / "config.json").read_text())["quantization_config"])


@pytest.mark.parametrize("scheme", ["w4a16-group", "w8a8-channel", "fp8-channel"])
def test_compressed_tensors_source(ct_sources, tmp_path, scheme):
    """A compressed-tensors source: kept as stored at tp=2 (packed int4 rows, group scales cut
    with their columns; put together: the source, byte for byte, its config kept), and to bf16
    equal to compressed-tensors' own dequantization, bit for bit; a kept tp=2 build passes
    ``verify --deep`` and its export is the source again."""
    from click.testing import CliRunner

    from shardc.cli import main

    src = ct_sources[scheme]
    raw = load_source(src)
    build(_plan(src, "bf16", 2), tmp_path / "b")
    got = reassemble(tmp_path / "b")
    n = 0
    for k, t in got.items():
        if k.removesuffix(".weight") + ".weight_scale" in raw:
            assert torch.equal(t, _ct_reference(raw, k, src)), k
            n += 1
    assert n == 14
    build(_plan(src, "source", 2), tmp_path / "s")
    m = tmp_path / "s" / "manifest.json"
    r = CliRunner().invoke(main, ["verify", "--manifest", str(m), "--deep", str(src)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", "--manifest", str(m), "--out", str(tmp_path / "ex"), "--quiet"])
    assert r.exit_code == 0, r.output
    back = load_source(tmp_path / "ex")
    assert sorted(back) == sorted(raw)
    assert all(torch.equal(back[k].view(torch.uint8), raw[k].view(torch.uint8)) for k in raw)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]


def _ct_edit(block: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(block))
    node = out
    *head, last = path.split(".")
    for k in head:
        node = node[k]
    node[last] = value
    return out


W = "config_groups.group_0.weights"


@pytest.mark.parametrize(("path", "value", "needle"), [
    (f"{W}.symmetric", False, f"quantization_config.{W}.symmetric: is false: zero points are not read"),
    (f"{W}.actorder", "group", f"quantization_config.{W}.actorder: is 'group': g_idx reordering is not read"),
    (f"{W}.num_bits", 2, "type int with 2 bits in pack-quantized is not read"),
    ("config_groups.group_0.input_activations", {"num_bits": 8, "dynamic": False},
     "input_activations: are static: their scales are not read"),
    ("transform_config", {"config_groups": {"u": {"type": "hadamard", "apply": [{"targets": ["Linear"],
                                                                                "location": "weight_input"}]}}},
     "quantization_config.transform_config: is set"),
    ("format", "nvfp4-pack-quantized", "quantization_config.format: is 'nvfp4-pack-quantized'"),
    ("lm_head", None, "tensor 'lm_head.weight' is stored quantized (lm_head.weight_packed), but shardc reads"),
    ("scale-dtype", None, "is F32, but compressed-tensors int4 packed per group 32 per its config.json stores it "
                          "as BF16; dtype: source would not copy it exactly"),
])
def test_bad_compressed_tensors_source(ct_sources, tmp_path, path, value, needle):
    """A compressed-tensors config or tensor shardc would misread: one line, exit 2, nothing written."""
    src = ct_sources["w4a16-group"]
    if path == "scale-dtype":  # scales stored wider than the config says: dequantizing is fine, keeping is not
        k = "model.layers.0.mlp.up_proj.weight_scale"
        src = _copy(src, tmp_path / "s", tensors={k: load_source(src)[k].float()})
        r, out = _cli_build(tmp_path, src, dtype="bf16")
        assert r.exit_code == 0, r.stderr
        import shutil

        shutil.rmtree(out)
    elif path == "lm_head":  # llm-compressor without lm_head in ignore: targets Linear takes it too
        from safetensors.torch import save_file

        tensors = load_source(src)
        tensors["lm_head.weight_packed"] = torch.zeros(96, 16, dtype=torch.int32)
        del tensors["lm_head.weight"]
        src = _copy(src, tmp_path / "s")
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    else:
        block = json.loads((src / "config.json").read_text())["quantization_config"]
        src = _copy(src, tmp_path / "s", _ct_edit(block, path, value))
    r, out = _cli_build(tmp_path, src)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.stderr
    assert not (out.exists() and [p for p in out.iterdir() if not p.name.startswith(".")])


def test_deepseek_v3_real_shapes_split_on_whole_blocks():
    """DeepSeek-V3's real tensor shapes (4 of its 61 layers) with its published fp8 config, under
    plans/deepseek-v3-fp8-tp8.yaml: at tp=8 every rank's scales are the block rows/columns of its
    slice (written out by hand here); tp=32 would cut a 128x128 block and is refused with the
    degrees that work."""
    import dataclasses

    from shardc.errors import LayoutError
    from shardc.layout.families.deepseek import DEEPSEEK_V3
    from shardc.layout.model import model_from_config
    from shardc.layout.plan import load_plan
    from shardc.layout.ranks import build_layout

    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    model = model_from_config(dict(DEEPSEEK_V3, num_hidden_layers=4, quantization_config=fp8))
    plan = dataclasses.replace(load_plan(Path(__file__).parents[2] / "plans" / "deepseek-v3-fp8-tp8.yaml"), pp=1)
    rank3 = {t.name: t for t in build_layout(model, plan).ranks[3].tensors}
    down = "model.layers.3.mlp.experts.7.down_proj.weight"  # [7168, 2048], row-parallel: 256 columns a rank
    assert (rank3[down].dtype, rank3[down].shape, rank3[down].start, rank3[down].stop) == ("F8_E4M3", (7168, 256), 768, 1024)
    s = rank3[down + "_scale_inv"]
    assert (s.dtype, s.shape, s.dim, s.start, s.stop) == ("F32", (56, 2), 1, 6, 8)
    qb = rank3["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]  # [24576, 1536]: 16 heads x 192 rows
    assert (qb.shape, qb.dim, qb.start, qb.stop) == ((24, 12), 0, 72, 96)
    kva = rank3["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]  # 576 rows: 4.5 blocks
    assert (kva.shape, kva.dim) == ((5, 56), None)
    with pytest.raises(LayoutError) as e:
        build_layout(model, dataclasses.replace(plan, tp=32))
    assert "mlp.down_proj.weight [7168, 18432]: a rank would hold columns [0, 576), 4.5 of the 128-column blocks " \
        "that each element of weight_scale_inv covers (fp8 block 128x128) at tp=32" in e.value.message
    assert e.value.hint.startswith("tp_degree values that keep every fp8 block 128x128 cell whole: 1, 2, 4, 8, 16 ")


def test_fp8_dequantize_partial_blocks_equals_transformers():
    """Weights whose sides are not multiples of the block (DeepSeek-V3's kv_a_proj_with_mqa: 576
    rows of 128-row blocks) dequantize as transformers' ``_dequantize_fp8_weight`` does."""
    import numpy as np
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from shardc.compiler.arrays import from_torch
    from shardc.layout.quant_formats import detect_source

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(72, 100, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(3, 4, generator=g) + 0.01  # 32x32 blocks: 2.25 x 3.125
    sq = detect_source({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}})
    tensors = {"x.weight": from_torch(w), "x.weight_scale_inv": from_torch(s)}
    got = sq.dequantize("x.weight", (72, 100), tensors.__getitem__)
    want = _dequantize_fp8_weight(w, s, [32, 32], torch.float32)
    assert np.array_equal(got, want.numpy())


@pytest.mark.parametrize("scheme", ["w4a16-group", "w8a8-channel"])
def test_compressed_tensors_keep_loads_like_the_source(ct_sources, tmp_path, scheme):
    """tp=1 ``dtype: source``: transformers' compressed-tensors loader reads the build exactly as it
    reads the source (fp8 float-quantized is left out: that loader cannot run it on CPU, 'Promotion
    for Float8 Types is not supported'; its bytes are checked above)."""
    src = ct_sources[scheme]
    build(_plan(src, "source"), tmp_path / "b")
    a, b = _hf_state(tmp_path / "b"), _hf_state(src)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_dtype_source_plan_refuses_quantization_keys(tmp_path):
    """``quantization.ignore`` / ``base_dtype`` would mean dequantizing some weights; a ``dtype:
    source`` plan keeps the source's own choice, so either key is refused, not ignored."""
    from shardc.errors import PlanError

    with pytest.raises(PlanError) as e:
        plan_from_dict({"replica_group": {"name": "q", "tp_degree": 1, "pp_degree": 1, "dtype": "source",
                                          "gpus_per_replica": 1}, "model": {"source": "x"},
                        "quantization": {"ignore": ["lm_head"]}})
    assert e.value.key == "quantization.ignore" and "dtype: source keeps" in e.value.message
