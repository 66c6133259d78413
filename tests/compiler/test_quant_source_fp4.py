"""compressed-tensors' microscaled formats (#46): NVFP4 (``nvfp4-pack-quantized``, W4A4 and
W4A16), MXFP4 (``mxfp4-pack-quantized``) and MXFP8 (``mxfp8-quantized``), each published by
compressed-tensors' own ``ModelCompressor`` from a model transformers made
(tests/quant_sources.py ``ct_model_compressor_source``), and loaded back by transformers itself.

The oracles: compressed-tensors' decompression of every weight (``ct_reference``) and
transformers' logits of the checkpoint it loads (``CompressedTensorsConfig(run_compressed=False)``
decompresses with the same compressors). Kept as stored (``dtype: source``), a rank's tensors are
the source's cut on whole 16- or 32-value blocks, written out here by hand; the global scales are
per tensor and go to every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc
from plan_helpers import plan, write_plan

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from quant_sources import ct_model_compressor_source, ct_reference, save_tiny  # noqa: E402
from reassemble import load_source, reassemble  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402

SCHEMES = ("nvfp4", "nvfp4a16", "mxfp4", "mxfp8")
BLOCK = {"nvfp4": 16, "nvfp4a16": 16, "mxfp4": 32, "mxfp8": 32}
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16}
MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # cut by rows (output)
ROW = ("o_proj", "down_proj")  # cut by columns (input): on whole blocks
X = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp4")
    llama = save_tiny(root / "llama")
    out = {s: ct_model_compressor_source(llama, root / s, s) for s in SCHEMES}
    moe = save_tiny(root / "moe-bf16", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **MOE)
    out["moe"] = ct_model_compressor_source(moe, root / "moe", "nvfp4", ignore=("lm_head", "re:.*mlp.gate$"))
    return out


class Builds(dict):
    """One build per (scheme, dtype, tp), made when a test first asks for it, shared after."""

    def __init__(self, root: Path, sources: dict[str, Path]) -> None:
        super().__init__()
        self.root, self.sources = root, sources

    def __missing__(self, key: tuple[str, str, int]) -> Path:
        scheme, dtype, tp = key
        out = self.root / f"{scheme}-{dtype}-{tp}"
        build(plan(tp, 1, dtype, name="fp4", source=self.sources[scheme]), out)
        self[key] = out
        return out


@pytest.fixture(scope="module")
def builds(sources, tmp_path_factory) -> Builds:
    return Builds(tmp_path_factory.mktemp("fp4-builds"), sources)


def _block(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_builds_are_compressed_tensors_decompression(sources, tmp_path, scheme):
    """To bf16 and to fp16: every quantized weight is compressed-tensors' own decompression
    (bfloat16, for every one of these formats) cast to the build's dtype, bit for bit; every other
    tensor the source's."""
    src = sources[scheme]
    raw, block = load_source(src), _block(src)
    assert {k.rpartition(".")[2] for k in raw if "layers.0.self_attn.q_proj" in k} == (
        {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"} if scheme == "nvfp4" else
        {"weight_packed", "weight_scale", "weight_global_scale"} if scheme == "nvfp4a16" else
        {"weight_packed", "weight_scale"} if scheme == "mxfp4" else {"weight", "weight_scale"})
    for dtype, want_dtype in OUT.items():
        build(plan(1, 1, dtype, name="fp4", source=src), tmp_path / dtype)
        got = reassemble(tmp_path / dtype)
        n = 0
        for k, t in got.items():
            base = k.removesuffix(".weight")
            if base + ".weight_scale" in raw:
                want = ct_reference(raw, k, block)
                assert want.dtype == torch.bfloat16
                assert torch.equal(t, want.to(want_dtype)), k
                n += 1
            else:
                assert torch.equal(t, raw[k].to(want_dtype)), k
        assert n == 14  # 2 layers x 7 projections


@pytest.mark.heavy
@pytest.mark.parametrize("scheme", ("nvfp4", "mxfp4", "mxfp8"))
def test_runs_as_transformers_loads_the_checkpoint(sources, builds, scheme):
    """transformers loads the compressed-tensors checkpoint (decompressed): the bf16 build's logits
    are its logits bit for bit, the checkpoint kept as stored runs the same weights at tp=1, and
    at tp=2 the kept build computes what the bf16 build of the same degrees does."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        sources[scheme], quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    want = ref(X).logits.float()

    def logits(key):
        return score(open_build(builds[key]), X, return_logits=True, timeout_s=120).logits

    assert torch.equal(logits((scheme, "bf16", 1)), want)
    assert torch.equal(logits((scheme, "source", 1)), want)
    assert torch.equal(logits((scheme, "source", 2)), logits((scheme, "bf16", 2)))


def _rank(build_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(build_dir / f"model-tp{tp_rank:02d}-pp00.safetensors")


@pytest.mark.parametrize("scheme", ("nvfp4", "mxfp4", "mxfp8"))
def test_kept_tp2_cuts_whole_blocks_and_carries_global_scales(sources, builds, scheme):
    """``dtype: source`` at tp=2, written out: a column-parallel weight's values and block scales
    are the rank's rows; a row-parallel one's are its columns, in bytes (two values a byte) and in
    blocks; the per-tensor global and input scales are the source's on both ranks. The config's
    quantization_config is the source's; verify --deep passes against the source, and export puts
    the source back byte for byte."""
    src, out = sources[scheme], builds[scheme, "source", 2]
    raw = load_source(src)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == _block(src)
    values = "weight" if scheme == "mxfp8" else "weight_packed"
    per_byte = 1 if scheme == "mxfp8" else 2
    checked = 0
    for r in range(2):
        shard = _rank(out, r)
        for k, t in shard.items():
            base, _, role = k.rpartition(".")
            proj = base.rpartition(".")[2]
            if proj not in COLUMN + ROW or role not in (values, "weight_scale", "weight_global_scale",
                                                        "input_global_scale"):
                continue
            whole = raw[k]
            if role in ("weight_global_scale", "input_global_scale"):
                want = whole
            elif proj in COLUMN:
                n = whole.shape[0] // 2
                want = whole[r * n:(r + 1) * n]
            else:
                cols = whole.shape[1] // 2  # the rank's half of the input, in this tensor's columns
                want = whole[:, r * cols:(r + 1) * cols]
                if role == "weight_scale":  # whole blocks: the scales' cut is the values' over the block
                    assert cols * BLOCK[scheme] == shard[base + "." + values].shape[1] * per_byte
            assert t.dtype == whole.dtype and torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), k
            checked += 1
    assert checked == 2 * 14 * (4 if scheme == "nvfp4" else 2)
    r = shardc("verify", "--manifest", out / "manifest.json", "--deep", src)
    assert r.returncode == 0, r.stderr


@pytest.mark.heavy
def test_kept_builds_export_and_reshard_byte_for_byte(sources, builds, tmp_path):
    """Export of a tp=2 kept build is the source's every tensor, byte for byte, and transformers
    loads it (NVFP4) computing the bf16 build's logits; a reshard of it to tp=1 is the direct tp=1
    build."""
    for scheme in ("nvfp4", "mxfp4", "mxfp8"):
        src = sources[scheme]
        ex = tmp_path / f"ex-{scheme}"
        r = shardc("export", "--manifest", builds[scheme, "source", 2] / "manifest.json", "--out", ex, "--quiet")
        assert r.returncode == 0, r.stderr
        back, raw = load_source(ex), load_source(src)
        assert sorted(back) == sorted(raw)
        assert all(back[k].dtype == raw[k].dtype and back[k].shape == raw[k].shape
                   and torch.equal(back[k].view(torch.uint8), raw[k].view(torch.uint8)) for k in raw)
        if scheme == "nvfp4":  # and transformers loads the export as it loads the source
            import transformers

            ref = transformers.AutoModelForCausalLM.from_pretrained(
                ex, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
            got = score(open_build(builds[scheme, "bf16", 1]), X, return_logits=True, timeout_s=120).logits
            assert torch.equal(ref(X).logits.float(), got)
    rs = tmp_path / "reshard"
    r = shardc("reshard", "--manifest", builds["nvfp4", "source", 2] / "manifest.json",
               "--plan", write_plan(tmp_path / "tp1.yaml", 1, 1, "source", name="fp4", source=sources["nvfp4"]),
               "--out", rs, "--quiet")
    assert r.returncode == 0, r.stderr
    direct = builds["nvfp4", "source", 1] / "model-tp00-pp00.safetensors"
    assert (rs / "model-tp00-pp00.safetensors").read_bytes() == direct.read_bytes()


def test_fused_parts_keep_their_own_global_scales(sources, builds):
    """q/k/v and gate/up carry global scales of their own (the source's differ: computed per
    tensor). A loader that fuses them must choose one per fused layer: vLLM takes the largest and
    warns when they differ (compressed_tensors_w4a4_nvfp4.py ``process_weights_after_loading``).
    shardc keeps every part's on every rank, so that rule sees exactly the source's scales, and
    shardc's own runtime dequantizes each part by its own."""
    raw = load_source(sources["nvfp4"])
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        for layer in range(2):
            names = [f"model.layers.{layer}.{'self_attn' if 'proj' in g and g[0] in 'qkv' else 'mlp'}.{g}"
                     for g in group]
            src_scales = [raw[n + ".weight_global_scale"].item() for n in names]
            assert len(set(src_scales)) > 1  # the case the rule is for
            for r in range(2):
                shard = _rank(builds["nvfp4", "source", 2], r)
                assert [shard[n + ".weight_global_scale"].item() for n in names] == src_scales
                assert max(shard[n + ".weight_global_scale"].item() for n in names) == max(src_scales)


def test_requantize_records_both_steps(sources, tmp_path):
    """``dtype: int8`` from NVFP4: dequantized by compressed-tensors' rule, then quantized per
    channel; the manifest names both steps and the error against the dequantized source."""
    build(plan(1, 1, "int8", name="fp4", source=sources["nvfp4"]), tmp_path / "b")
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["source_quantization"] == {"format": "compressed-tensors nvfp4 (e2m1, fp8 scale per 16)",
                                        "quant_method": "compressed-tensors",
                                        "applied": "dequantized, then quantized to int8 per channel"}
    stats = [rec["stats"] for s in m["shards"].values() for rec in s["tensors"].values() if "stats" in rec]
    assert len(stats) == 14 and all(0 < s["rel_rms_err"] < 0.02 for s in stats)


@pytest.mark.heavy
def test_moe_experts_kept_over_expert_parallel_and_dequantized_at_tp2(sources, tmp_path):
    """Qwen3-MoE in NVFP4 per expert (the router ignored): kept over 2 expert-parallel ranks and
    exported, it is the source byte for byte; dequantized at tp=2 every expert is
    compressed-tensors' decompression."""
    from moe_plans import moe_plan

    src = sources["moe"]
    build(moe_plan(src, 2, True, dtype="source"), tmp_path / "ep")
    r = shardc("export", "--manifest", tmp_path / "ep" / "manifest.json", "--out", tmp_path / "ex", "--quiet")
    assert r.returncode == 0, r.stderr
    back, raw = load_source(tmp_path / "ex"), load_source(src)
    assert sorted(back) == sorted(raw)
    assert all(torch.equal(back[k].view(torch.uint8), raw[k].view(torch.uint8)) for k in raw)
    build(plan(2, 1, "bf16", name="fp4", source=src), tmp_path / "tp2")
    got, block = reassemble(tmp_path / "tp2"), _block(src)
    experts = [k for k in got if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 4 * 3
    assert all(torch.equal(got[k], ct_reference(raw, k, block)) for k in experts)


# -- bad input: one line, exit 2, nothing written -------------------------------------------------

def _damaged(src: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``src`` whose tensors ``edit`` changed."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_source(src)
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def _refused(tmp_path: Path, src: Path, dtype: str, *words: str) -> None:
    out = tmp_path / f"out-{dtype}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    r = shardc("build", write_plan(tmp_path / f"{dtype}.yaml", 2, 1, dtype, name="fp4", source=src),
               "--out", out, "--quiet")
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists() or not (list(out.glob("*.safetensors")) or (out / "manifest.json").exists())


Q = "model.layers.1.self_attn.q_proj"


def test_refusals(sources, tmp_path):
    """A scale of the wrong shape, a missing global scale, a NaN block scale and a global scale
    of inf or 0 are each one line naming the tensor, exit 2, kept and dequantized alike."""
    nv, mx = sources["nvfp4"], sources["mxfp4"]

    def short_scale(t):
        t[Q + ".weight_scale"] = t[Q + ".weight_scale"][:, :-1].contiguous()
    _refused(tmp_path / "a", _damaged(nv, tmp_path / "a", short_scale), "source",
             f"{Q}.weight_scale", "has shape [128, 7]", "implies [128, 8]")

    def no_global(t):
        del t[Q + ".weight_global_scale"]
    _refused(tmp_path / "b", _damaged(nv, tmp_path / "b", no_global), "bf16", f"{Q}.weight_global_scale", "missing")

    def nan_scale(t):
        s = t[Q + ".weight_scale"].view(torch.uint8).clone()
        s[3, 2] = 0x7F
        t[Q + ".weight_scale"] = s.view(torch.float8_e4m3fn)
    bad = _damaged(nv, tmp_path / "c", nan_scale)
    for dtype in ("source", "bf16"):
        _refused(tmp_path / "c" / dtype, bad, dtype, f"{Q}.weight_scale", "NaN block scale at [3, 2]")

    def e8m0_nan(t):
        t[Q + ".weight_scale"][0, 1] = 0xFF
    _refused(tmp_path / "d", _damaged(mx, tmp_path / "d", e8m0_nan), "source", "NaN block scale at [0, 1]")

    for value, words in ((float("inf"), "[inf]"), (0.0, "[0.0]")):
        def bad_global(t, value=value):
            t[Q + ".weight_global_scale"] = torch.tensor([value])
        where = tmp_path / f"e{value}"
        _refused(where, _damaged(nv, where, bad_global), "bf16", f"{Q}.weight_global_scale", words,
                 "one finite positive number")


def test_config_refusals():
    """A block size other than the format's, a width that is not whole blocks, and an fp4 weight
    declared in another format are refused by key before any tensor is read."""
    from shardc.errors import QuantizationError
    from shardc.layout.quant_formats import detect_source

    def cfg(**weights):
        w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
             "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"} | weights
        return {"torch_dtype": "bfloat16", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "format": "nvfp4-pack-quantized"}}}}

    fmt = detect_source(cfg())
    with pytest.raises(QuantizationError, match="is 16, which does not divide the 200 columns") as e:
        fmt.check_shapes({"model.layers.0.mlp.down_proj.weight": (64, 200)})
    assert e.value.key == "quantization_config.config_groups.group_0.weights.group_size"
    for weights, key, words in (({"group_size": 32}, "group_size", "is 32; nvfp4-pack-quantized stores one scale per 16"),
                                ({"strategy": "group"}, "strategy", "is 'group'; nvfp4-pack-quantized stores strategy"),
                                ({"type": "int"}, "", "type int with 4 bits in nvfp4-pack-quantized is not read")):
        with pytest.raises(QuantizationError, match=words) as e:
            detect_source(cfg(**weights))
        assert e.value.key == "quantization_config.config_groups.group_0.weights" + (f".{key}" if key else "")


@pytest.mark.heavy
def test_gate_passes_the_kept_tp2_build_against_transformers(builds, tmp_path):
    """The gate scores the NVFP4 checkpoint kept as stored at tp=2 against the tp=1 bf16 build
    (compressed-tensors' decompression) scored by transformers itself: it passes with the delta of
    tp=2's sums, as a 16-bit model does."""
    from family_models import char_tokenizer

    from shardc.runtime.gate import run_gate

    tok = char_tokenizer(tmp_path / "tokenizer.json", 96)
    report = run_gate(builds["nvfp4", "bf16", 1], builds["nvfp4", "source", 2], max_tokens=128, window=64,
                      tokenizer=tok, timeout_s=120, reference="transformers")
    assert report.passed and report.baseline.scored_by["name"] == "transformers", report
    assert abs(report.ppl_delta_pct) < 1.0 and report.top1_agreement > 0.9, report


@pytest.mark.heavy
def test_moe_kept_over_expert_parallel_runs_the_dequantized_weights(sources, tmp_path):
    """The NVFP4 MoE kept over 2 expert-parallel ranks computes what the bf16 build of the same
    plan computes, bit for bit."""
    from moe_plans import moe_plan

    for dtype in ("source", "bf16"):
        build(moe_plan(sources["moe"], 2, True, dtype=dtype), tmp_path / dtype)
    x = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    a, b = (score(open_build(tmp_path / d), x, return_logits=True, timeout_s=120).logits for d in ("source", "bf16"))
    assert torch.equal(a, b)


def test_a_tp_cut_inside_a_block_is_refused_naming_the_degrees_that_work():
    """MXFP4's 32-value blocks on an MLP 96 wide: tp=2 would give each rank 48 columns of
    down_proj, a block and a half; refused before anything is written, naming the tensor and the
    tp degrees that keep every block whole."""
    from shardc.errors import LayoutError
    from shardc.layout.model import model_from_config
    from shardc.layout.quant_formats import detect_source
    from shardc.layout.quant_formats.slicing import check_source_cuts

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
           "torch_dtype": "bfloat16", "quantization_config": {
               "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "weights": {
                   "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                   "dynamic": False, "scale_dtype": "torch.uint8"}}}}}
    model = model_from_config(cfg)
    fmt = detect_source(cfg)
    assert check_source_cuts(model, plan(1, 1, "source", source="x"), fmt)
    with pytest.raises(LayoutError) as e:
        check_source_cuts(model, plan(2, 1, "source", source="x"), fmt)
    assert e.value.key == "replica_group.tp_degree"
    assert "model.layers.0.mlp.down_proj.weight [128, 96]" in e.value.message and "at tp=2" in e.value.message
    assert "tp_degree values that keep every compressed-tensors mxfp4 (e2m1, e8m0 scale per 32) cell whole: 1 " \
        in e.value.hint, e.value.hint


def test_an_expert_missing_a_stored_tensor_is_refused_not_dropped(sources, tmp_path):
    """One expert's block scales missing from an NVFP4 MoE checkpoint (what SGLang #34448 met as
    experts silently dropped): one line naming the tensor, exit 2, for every plan dtype."""
    gone = "model.layers.1.mlp.experts.3.down_proj.weight_scale"

    def drop(t):
        del t[gone]
    bad = _damaged(sources["moe"], tmp_path / "m", drop)
    for dtype in ("source", "bf16"):
        _refused(tmp_path / "m" / dtype, bad, dtype, gone, "missing")
