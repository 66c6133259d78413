"""int8 / fp8 weight-only plans: exact against an independent reference, TP-invariant, bounded error."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from plan_helpers import plan as make_plan
from reassemble import load_source, reassemble
from safetensors.torch import load_file, save_file

from shardc.compiler.compile import build

# The Llama family's linear projections, written out here as the oracle (the code derives them
# from the family's tensor table).
QUANTIZABLE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")

CFG = dict(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8, num_kv_heads=2,
           vocab_size=100)


def plan(dtype: str, tp: int, pp: int = 1, **quant) -> object:
    return make_plan(tp, pp, dtype, name=f"q-{dtype}", **({"quantization": quant} if quant else {}))


def ref_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """docs/architecture.md §5 in numpy: scale = absmax/127 (fp32), round half to even, clamp ±127."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    scale[scale == 0] = 1
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)  # np.round: half to even
    return q, scale.astype(np.float32)


def ref_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scale = absmax/448; clamp to ±448 before the (non-saturating) e4m3fn cast."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    scale[scale == 0] = 1
    return torch.clamp(w / scale, -448, 448).to(torch.float8_e4m3fn), scale


@pytest.fixture
def ckpt(make_ckpt):
    """A synthetic model with an all-zero row and a single huge outlier planted in layer 0."""
    src = make_ckpt(**CFG)
    f = src / "model.safetensors"
    sd = load_file(f)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    q[3] = 0
    q[5, 7] = 60.0  # an outlier ~3000x the other weights in its row
    sd["model.layers.0.mlp.down_proj.weight"][10] = 0
    save_file(sd, str(f))
    return src


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_exact_against_reference_and_tp_invariant(ckpt, tmp_path, dtype):
    src = load_source(ckpt)
    builds = {tp: reassemble(build(plan(dtype, tp, pp).with_source(str(ckpt)), tmp_path / f"tp{tp}").out_dir)
              for tp, pp in ((1, 1), (2, 3), (4, 2))}
    quantized = [n for n in src if QUANTIZABLE.fullmatch(n)]
    assert quantized
    for name in quantized:
        w = src[name]
        if dtype == "int8":
            q_ref, s_ref = (torch.from_numpy(a) for a in ref_int8(w.float().numpy()))
        else:
            q_ref, s_ref = ref_fp8(w)
        for tp, got in builds.items():
            assert got[name].dtype == q_ref.dtype, (tp, name)
            assert torch.equal(got[name].view(torch.uint8), q_ref.view(torch.uint8)), (tp, name)
            assert torch.equal(got[name + "_scale"], s_ref), (tp, name)
    # not quantized: embeddings, lm_head, norms keep the base 16-bit dtype, byte for byte
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.1.input_layernorm.weight"):
        assert torch.equal(builds[2][name], src[name]), name


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_error_bounds_zero_rows_and_outlier(ckpt, tmp_path, dtype):
    src = load_source(ckpt)
    got = reassemble(build(plan(dtype, 2).with_source(str(ckpt)), tmp_path / "o").out_dir)
    for name in (n for n in src if QUANTIZABLE.fullmatch(n)):
        w, q, s = src[name].float(), got[name], got[name + "_scale"]
        deq = q.float() * s
        err = (deq - w).abs()
        if dtype == "int8":
            # round-to-nearest: at most half a quantization step, plus fp32 rounding of w/scale
            assert bool((err <= s / 2 * (1 + 1e-5) + 1e-12).all()), name
        else:
            # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 * scale
            assert bool((err <= w.abs() * 2**-4 + s * 2**-10 + 1e-12).all()), name
    zero = got["model.layers.0.self_attn.q_proj.weight"][3]
    assert not zero.float().any() and got["model.layers.0.self_attn.q_proj.weight_scale"][3].item() == 1.0
    assert got["model.layers.0.mlp.down_proj.weight_scale"][10].item() == 1.0
    row = got["model.layers.0.self_attn.q_proj.weight"][5].float() * got["model.layers.0.self_attn.q_proj.weight_scale"][5]
    assert abs(row[7].item() - 60.0) < 1e-4  # the outlier is the row max: reproduced exactly


def test_manifest_config_and_ignore(ckpt, tmp_path):
    res = build(plan("int8", 2, ignore=["lm_head", "embed_tokens", "layers.0"]).with_source(str(ckpt)), tmp_path / "o")
    cfg = json.loads((res.out_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"]) == (8, "int", True, "channel")
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"]
    shard = res.manifest.shards[0].tensors
    assert shard["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "BF16"  # ignored: layer 0
    assert "model.layers.1.self_attn.q_proj.weight" not in shard  # int8 is stored pack-quantized
    rec = shard["model.layers.1.self_attn.q_proj.weight_packed"]
    assert (rec["dtype"], rec["quant"], rec["pack"]) == ("I32", "int8", 4)
    assert rec["scale"] == "model.layers.1.self_attn.q_proj.weight_scale"
    assert 0 < rec["stats"]["rel_rms_err"] < 0.02 and rec["stats"]["max_abs_err"] > 0
    # row-parallel o_proj at tp=2: half the input columns, a quarter of that in int32 words
    o = shard["model.layers.1.self_attn.o_proj.weight_packed"]
    assert (o["dim"], o["start"], o["stop"], o["shape"]) == (1, 0, 32, [64, 8])
    assert shard["model.layers.1.self_attn.o_proj.weight_shape"]["value"] == [64, 32]
    assert shard["model.layers.1.self_attn.o_proj.weight_scale"]["split"] == "replicated"


def test_nan_is_rejected_and_nothing_written(make_ckpt, tmp_path):
    from click.testing import CliRunner

    from shardc.cli import main

    src = make_ckpt(**CFG)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.2.mlp.up_proj.weight"][1, 2] = float("nan")
    save_file(sd, str(src / "model.safetensors"))
    import yaml

    pf = tmp_path / "p.yaml"
    pf.write_text(yaml.safe_dump(plan("fp8", 2, 3).data))  # NaN in the last stage
    r = CliRunner().invoke(main, ["build", str(pf), "--source", str(src), "--out", str(tmp_path / "o"),
                                  "--manifests-dir", str(tmp_path / "m"), "--quiet"])
    assert r.exit_code == 2
    assert "'model.layers.2.mlp.up_proj.weight' holds NaN or Inf" in r.stderr
    assert not list((tmp_path / "o").glob("*.safetensors")) and not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_named_for_every_source_dtype(dtype, scheme, bad):
    from shardc.compiler.quantize import quantize
    from shardc.errors import QuantizationError

    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    w[37, 5] = bad
    with pytest.raises(QuantizationError, match=r"'w\.x' holds NaN or Inf \(first at index \[37, 5\]\)"):
        quantize("w.x", w.to(dtype), scheme, workers=2)


def test_dequantize_roundtrip_function():
    from shardc.compiler.quantize import dequantize, quantize

    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    q, s, stats = quantize("w", w, "int8")
    assert torch.allclose(dequantize(q, s), w, atol=float(s.max()) / 2 + 1e-6)
    assert stats["rel_rms_err"] < 0.01


def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows at the edges of the kernels' arithmetic: all zero, one outlier, scales too small to
    be normal floats (w / scale can overflow: the clamp matters there), huge scales, and, in
    fp32, squares past fp32's range (the sums are float64)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 300, generator=g) * 0.02
    w[0] = 0
    w[1, 7] = 60.0
    if dtype == torch.float32:
        w[2] = torch.randn(300, generator=g) * 1e-39  # subnormal weights: subnormal scales
        w[3, :4] = torch.tensor([3e-40, -1e-45, 0.0, 1e-41])
        w[4] = torch.randn(300, generator=g) * 3e5  # scales >= 2^8
        w[5, 0] = -3.0e38  # the squares overflow fp32
    elif dtype == torch.bfloat16:
        w[2] = torch.randn(300, generator=g) * 1e-38
        w[4] = torch.randn(300, generator=g) * 1e30
    else:
        w[2] = torch.randn(300, generator=g) * 1e-6  # fp16 subnormals
        w[4] = torch.randn(300, generator=g).clamp(-4, 4) * 1.5e4
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_kernel_edge_rows_values_and_stats_against_reference(dtype, scheme):
    """Values and scales byte for byte; the error statistics against float64 arithmetic on the
    fp32 dequantized weights."""
    from shardc.compiler.quantize import quantize

    w = _edge_rows(dtype)
    for workers in (1, 2):
        q, s, stats = quantize("w", w, scheme, workers=workers)
        if scheme == "int8":
            q_ref, s_ref = (torch.from_numpy(a) for a in ref_int8(w.float().numpy()))
        else:
            q_ref, s_ref = ref_fp8(w)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)
        deq = q_ref.float() * s_ref  # as the runtime dequantizes: the product rounded to fp32
        err = w.double() - deq.double()
        max_err = float(err.abs().max())
        rel = float(err.square().sum().sqrt() / w.double().square().sum().sqrt())
        assert stats["max_abs_err"] == pytest.approx(max_err, rel=1e-3)
        assert stats["rel_rms_err"] == pytest.approx(rel, rel=1e-3)
        assert all(np.isfinite(v) for v in stats.values())


def test_fp8_kernel_cast_matches_torch_on_ties_boundaries_and_subnormals():
    """The kernel's e4m3 rounding against torch's cast, with scale 1: every e4m3 value, the
    midpoints between neighbours (ties to even) and the floats either side of them, a sweep
    over the subnormal range and the lowest binades, random values across the range, and
    values past ±448 (clamped), with both signs. Its error output is exact too."""
    from shardc.compiler.kernels import fp8_rows

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    near = [np.nextafter(v, np.float32(np.inf)) for v in (grid, mids)]
    near += [np.nextafter(v, np.float32(0)) for v in (grid, mids)]
    sweep = np.arange(0, 0x3D000000, 4099, dtype=np.uint32).view(np.float32)  # up to 2^-5
    rand = np.random.default_rng(0).uniform(0, 448, 1 << 16).astype(np.float32)
    top = np.float32([448 * (1 + 2**-23), 460, 1e30, 1e-45, 1e-30])
    y = np.concatenate([grid, mids, *near, sweep, rand, top]).astype(np.float32)
    y = np.concatenate([y, -y]).reshape(1, -1)
    want = torch.from_numpy(y).clamp(-448, 448).to(torch.float8_e4m3fn)
    q, err = np.empty(y.shape, np.uint8), np.empty(y.shape, np.float32)
    fp8_rows(y, np.ones((1, 1), np.float32), q, err)
    assert np.array_equal(q, want.view(torch.uint8).numpy())
    assert np.array_equal(err, np.abs(y) - want.float().abs().numpy())


def test_kernels_compile_without_a_writable_cache():
    """Where numba finds nowhere to cache machine code (here: a function with no source file),
    the kernels still compile, in memory, instead of failing the build."""
    from shardc.compiler.kernels import _jit

    ns: dict = {}
    exec("def f(a):\n    return a + 1\n", ns)
    f = _jit(ns["f"])
    assert f(np.float32(1)) == 2
    assert type(f._cache).__name__ == "NullCache"
