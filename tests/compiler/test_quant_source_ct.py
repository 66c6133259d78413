"""compressed-tensors sources as llm-compressor saves them (#41 items 11 and 13): made by
compressed-tensors' own ``ModelCompressor`` (tests/quant_sources.py ``ct_model_compressor_source``)
for every scheme shardc reads, with scales in float32, bfloat16 and float16, built by shardc kept
as stored and dequantized to bf16 and fp16, and compared with compressed-tensors' own
decompression.

The rounding: compressed-tensors dequantizes as ``q.to(scale.dtype) * scale`` (one rounding, to
the scale's dtype); a build to another 16-bit dtype then casts that result (a second rounding,
round to nearest even, as ``.to(dtype)`` does). shardc reproduces both, so every weight is
compared for bit equality, never within a tolerance: a 16-bit build of an fp16-scaled source is
not the single rounding of the exact product to bf16, and the test would see the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc
from plan_helpers import plan

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from quant_sources import ct_model_compressor_source, ct_reference, save_tiny  # noqa: E402
from reassemble import load_source, reassemble  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import SourceError  # noqa: E402

SCHEMES = ("w4a16-group", "w4a16-channel", "w8a16-group", "w8a8-channel", "fp8-channel", "fp8-tensor")
SCALES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16}
MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-bf16")
    return {"llama": save_tiny(root / "llama"),
            "qwen3_moe": save_tiny(root / "moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **MOE)}


def _check_build(src: Path, out: Path, dtype: str, tp: int = 1) -> int:
    """A 16-bit build of ``src``: each quantized weight compressed-tensors' decompression cast to
    the build's dtype, every other tensor the source's cast; returns how many were dequantized."""
    build(plan(tp, 1, dtype, name="ct", source=src), out)
    block = json.loads((src / "config.json").read_text())["quantization_config"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    got, raw = reassemble(out), load_source(src)
    n = 0
    for k, t in got.items():
        assert t.dtype == OUT[dtype], k
        if k.removesuffix(".weight") + ".weight_scale" in raw:
            want = ct_reference(raw, k, block)
            assert want.dtype == raw[k.removesuffix(".weight") + ".weight_scale"].dtype
            assert torch.equal(t, want.to(OUT[dtype])), k
            n += 1
        else:
            assert torch.equal(t, raw[k].to(OUT[dtype])), k
    return n


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_compressor_source_builds_as_compressed_tensors_reads_it(bf16, tmp_path, scheme, scale):
    """A ModelCompressor checkpoint (its config as update_config writes it: moe_sparsity_config
    null, sparsity_config and transform_config empty, version) is read: kept as stored at tp=1 it
    is the source byte for byte with its quantization_config; to bf16 and to fp16 every weight
    is compressed-tensors' decompression, then the cast. (An F32 checkpoint is not kept: its
    16-bit tensors would be narrowed to the base dtype, so ``dtype: source`` is refused.)"""
    src = ct_model_compressor_source(bf16["llama"], tmp_path / "src", scheme, SCALES[scale])
    block = json.loads((src / "config.json").read_text())["quantization_config"]
    assert block["moe_sparsity_config"] is None and block["version"]  # what 0.20 writes: read, not refused
    raw = load_source(src)
    assert {raw[k].dtype for k in raw if k.endswith(".weight_scale")} == {SCALES[scale]}
    for dtype in OUT:
        assert _check_build(src, tmp_path / dtype, dtype) == 14  # 2 layers x 7 projections
    if scale == "F32":
        with pytest.raises(SourceError, match="is F32, but .* stores it as BF16; dtype: source would not copy"):
            build(plan(1, 1, "source", name="ct", source=src), tmp_path / "keep")
        return
    build(plan(1, 1, "source", name="ct", source=src), tmp_path / "keep")
    kept = load_source(tmp_path / "keep")
    assert sorted(kept) == sorted(raw)
    assert all(kept[k].dtype == raw[k].dtype and torch.equal(kept[k].view(torch.uint8), raw[k].view(torch.uint8))
               for k in raw)
    assert json.loads((tmp_path / "keep" / "config.json").read_text())["quantization_config"] == block


@pytest.mark.parametrize("scheme", ["w4a16-group", "fp8-channel"])
def test_model_compressor_moe_source(bf16, tmp_path, scheme):
    """A Qwen3-MoE quantized per expert (llm-compressor calibrates MoE models through per-expert
    Linear modules; the router ignored, as its recipes do): kept as stored over 2 ranks with
    expert parallelism (whole experts a rank), put back together it is the source; dequantized
    at tp=2 every expert and projection is compressed-tensors' decompression."""
    src = ct_model_compressor_source(bf16["qwen3_moe"], tmp_path / "src", scheme,
                                     ignore=("lm_head", "re:.*mlp.gate$"))
    raw = load_source(src)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" in raw and "model.layers.0.mlp.gate.weight" in raw
    from moe_plans import moe_plan

    build(moe_plan(src, 2, True, dtype="source"), tmp_path / "ep")
    r = shardc("export", "--manifest", tmp_path / "ep" / "manifest.json", "--out", tmp_path / "ex", "--quiet")
    assert r.returncode == 0, r.stderr
    back = load_source(tmp_path / "ex")  # the ranks' stored tensors put back: the source's, byte for byte
    assert sorted(back) == sorted(raw)
    assert all(torch.equal(back[k].view(torch.uint8), raw[k].view(torch.uint8)) for k in raw)
    assert _check_build(src, tmp_path / "bf16", "bf16", tp=2) == 2 * (4 + 4 * 3)  # attention + 4 experts x 3
