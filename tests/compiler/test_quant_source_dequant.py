"""Every source format's dequantization against its library's own, for every scale dtype a source
may hold and every 16-bit dtype a build offers (#41 item 13).

- compressed-tensors: ``dequantize`` computes ``q.to(scale.dtype) * scale`` (one rounding, to the
  scale's dtype) and a 16-bit build then casts (a second rounding when the dtypes differ). Every
  int8 value and fp8 byte against scales spread over the 16-bit ranges, bit for bit; the double
  rounding is shown to matter, so the comparison could fail.
- block FP8: transformers' ``Fp8Dequantize`` (float32 values times float32 scales, one cast to the
  model dtype) for F32, BF16 and F16 scales, through real builds to bf16 and fp16.
- MXFP4: tests/compiler/test_quant_source_mxfp4.py compares every (byte, scale) pair in both
  16-bit dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from plan_helpers import plan

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from quant_sources import fp8_block_source, save_tiny  # noqa: E402
from reassemble import load_source, reassemble  # noqa: E402

from shardc.compiler.arrays import from_torch  # noqa: E402
from shardc.compiler.compile import build  # noqa: E402
from shardc.layout.quant_formats.compressed import CompressedTensors  # noqa: E402

SCALES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _values(kind: str) -> torch.Tensor:
    """[256, 256]: every int8 value (or every finite fp8 e4m3 byte) in each row."""
    if kind == "int":
        row = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    else:
        row = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
        row = torch.where(row.float().isnan(), torch.zeros((), dtype=torch.float8_e4m3fn), row)
    return row.repeat(256, 1)


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize(("kind", "strategy"), [("int", "channel"), ("int", "group"), ("float", "channel"),
                                                ("float", "tensor")])
def test_compressed_tensors_dequantize_every_value(kind, strategy, scale, out):
    """shardc's float32 result cast to the build dtype equals compressed-tensors' ``dequantize``
    then the same cast, for every value against scales from 2^-20 to 2^4 (fp16 subnormals
    included)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q = _values(kind)
    gen = torch.Generator().manual_seed(7)
    groups = {"channel": 1, "group": 8, "tensor": 1}[strategy]
    rows = 1 if strategy == "tensor" else 256
    s = (torch.rand(rows, groups, generator=gen) + 0.5) * torch.exp2(torch.randint(-20, 5, (rows, 1), generator=gen))
    s = s.reshape(-1) if strategy == "tensor" else s
    s = s.to(SCALES[scale])
    args = QuantizationArgs(num_bits=8, type=kind, strategy=strategy, symmetric=True,
                            group_size=32 if strategy == "group" else None)
    want = dequantize(q, s, None, args).to(OUT[out])
    w = {"num_bits": 8, "type": kind, "strategy": strategy, "group_size": 32 if strategy == "group" else None}
    sq = CompressedTensors({"ignore": []}, "int-quantized" if kind == "int" else "float-quantized", w, scale)
    tensors = {"x.weight": from_torch(q), "x.weight_scale": from_torch(s)}
    got = torch.from_numpy(sq.dequantize("x.weight", (256, 256), tensors.__getitem__)).to(OUT[out])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if SCALES[scale] not in (torch.float32, OUT[out]) and strategy != "tensor":  # (one scale: 256 products)
        once = (q.float() * (s.float().repeat_interleave(32, 1) if strategy == "group" else s.float())).to(OUT[out])
        assert not torch.equal(once, want)  # the scale dtype's rounding shows: a single rounding would be wrong


@pytest.fixture(scope="module")
def fp8_sources(tmp_path_factory) -> dict[str, Path]:
    """A block-FP8 Llama (transformers' quantizer, F32 scales), and copies holding its scales in
    BF16 and F16 (as some publishers store them; shardc reads them widened exactly)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("fp8deq")
    src = fp8_block_source(save_tiny(root / "bf16"), root / "F32", (32, 32))
    out = {"F32": src}
    for name in ("BF16", "F16"):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text((src / "config.json").read_text())
        t = load_source(src)
        save_file({k: v.to(SCALES[name]) if k.endswith("_scale_inv") else v for k, v in t.items()},
                  d / "model.safetensors", metadata={"format": "pt"})
        out[name] = d
    return out


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_block_fp8_builds_equal_transformers(fp8_sources, tmp_path, scale, out):
    """A 16-bit build at tp=2 of a block-FP8 source with ``scale`` scales: every quantized weight is
    transformers' ``Fp8Dequantize`` in the build's dtype, bit for bit; the rest copied (cast)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src = fp8_sources[scale]
    build(plan(2, 1, out, name="f", source=src), tmp_path / "b")
    assert "quantization_config" not in json.loads((tmp_path / "b" / "config.json").read_text())
    got, raw = reassemble(tmp_path / "b"), load_source(src)
    deq, n = Fp8Dequantize(None), 0
    for k, t in got.items():
        if k + "_scale_inv" in raw:
            assert raw[k + "_scale_inv"].dtype == SCALES[scale]
            assert torch.equal(t, deq._dequantize_one(raw[k], raw[k + "_scale_inv"], OUT[out])), k
            n += 1
        else:
            assert torch.equal(t, raw[k].to(OUT[out])), k
    assert n == 14


def test_fp8_block_dequantize_is_float32_products():
    """The float32 result itself (before any cast) is transformers' float32 one, with F16 scales."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from shardc.layout.quant_formats import detect_source

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 96, generator=g) * 40).to(torch.float8_e4m3fn)
    s = (torch.rand(2, 3, generator=g) * 1e-3).to(torch.float16)
    sq = detect_source({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}})
    tensors = {"x.weight": from_torch(w), "x.weight_scale_inv": from_torch(s)}
    got = sq.dequantize("x.weight", (64, 96), tensors.__getitem__)
    assert np.array_equal(got, Fp8Dequantize(None)._dequantize_one(w, s, torch.float32).numpy())
