"""Real clients read shardc builds right: transformers (+ compressed-tensors) loads a tp = 1 build
directory as a Hugging Face checkpoint, and every quantization_config is what compressed-tensors'
own models and vLLM's scheme rules (tests/vllm_rules.py, cited from its source) accept.

Oracles: compressed-tensors' pack_to_int32 / unpack_from_int32 and pydantic models, transformers'
loader and forward pass, the source checkpoint, and (demo) shardc's runtime, which is itself
checked against transformers in runtime/test_runtime.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
)
from golden_windows import golden_windows
from plan_helpers import plan
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from vllm_rules import Rejected, vllm_scheme, vllm_tensors

from shardc.cli import main
from shardc.compiler.compile import build
from shardc.compiler.outputs import INDEX
from shardc.compiler.quantize import pack_int8, quantization_config, unpack_int8
from shardc.formats.manifest import load
from shardc.verify.checks import verify_build

SCHEMES = ("int8", "fp8")


def make_plan(src: Path, tp: int, pp: int, dtype: str, **quant):
    return plan(tp, pp, dtype, name=f"{src.name}-tp{tp}pp{pp}-{dtype}", source=src,
                **({"quantization": quant} if quant else {}))


def hf_load(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()


def dequantized_source(src: Path, scheme: str, *, ignored: frozenset[str] = frozenset()) -> torch.nn.Module:
    """The source model with every quantized projection replaced by q * scale as the readers of
    the files compute it: compressed-tensors keeps weight_scale in the model's dtype (its
    initialize.py: scale dtype = the weight's), so w = bf16(q * bf16(scale)); vLLM's W8A16 schemes
    and shardc's runtime do the same. q and scale come from an independent quantizer (torch)."""
    from shardc.compiler.quantize import quantize

    model = hf_load(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.weight") and name not in ignored:
                q, scale, _ = quantize(name, p.detach(), scheme)
                s = scale.to(p.dtype).float()
                p.copy_((q.float() * s).to(p.dtype))
    return model


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x).logits.float()


# -- int8 packing: bit for bit what compressed-tensors packs -----------------------------------------
@pytest.mark.parametrize("shape", [(1, 4), (3, 8), (17, 64), (5, 1028)])
def test_pack_int8_is_compressed_tensors_packing(shape):
    rng = np.random.default_rng(shape[1])
    q = rng.integers(-128, 128, size=shape, dtype=np.int8)
    q.reshape(-1)[: min(q.size, 256)] = np.arange(-128, 128, dtype=np.int16)[: min(q.size, 256)].astype(np.int8)
    want = pack_to_int32(torch.from_numpy(q.copy()), 8).numpy()
    got = pack_int8(q.copy())
    assert got.dtype == np.dtype("<i4") and got.shape == want.shape == (shape[0], shape[1] // 4)
    assert np.array_equal(got, want)
    assert np.array_equal(unpack_int8(got), q)


# -- quantization_config: compressed-tensors' models, vLLM's rules ------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_is_what_compressed_tensors_models_write(scheme):
    block = quantization_config(scheme, ["lm_head", "model.layers.0.mlp.down_proj"])
    fmt = {"int8": "pack-quantized", "fp8": "float-quantized"}[scheme]
    want = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(
            targets=["Linear"], format=fmt,
            weights=QuantizationArgs(num_bits=8, type="int" if scheme == "int8" else "float",
                                     symmetric=True, strategy="channel", dynamic=False))},
        format=fmt, quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head", "model.layers.0.mlp.down_proj"],
    ).model_dump()
    parsed = QuantizationConfig.model_validate(block).model_dump()
    assert parsed == want
    # nothing compressed-tensors would drop: every key written is one of its models' fields
    assert {k: v for k, v in want.items() if k in block} == json.loads(json.dumps(block))
    assert block["quantization_status"] == "compressed"
    assert not any(k.startswith("shardc") for k in json.dumps(block).split('"'))


def test_vllm_rules_select_the_weight_only_schemes():
    assert vllm_scheme(quantization_config("int8", [])) == "CompressedTensorsWNA16"
    assert vllm_scheme(quantization_config("fp8", [])) == "CompressedTensorsW8A16Fp8"
    old = quantization_config("int8", [])  # the format shardc wrote before: vLLM refuses it
    old["format"] = old["config_groups"]["group_0"]["format"] = "int-quantized"
    with pytest.raises(Rejected):
        vllm_scheme(old)


# -- synthetic builds, loaded by transformers (fast) ----------------------------------------------
@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    out = tmp_path_factory.mktemp("clients")
    src = write_checkpoint(out / "src", llama_config(num_layers=3, vocab_size=100), seed=3)
    x = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    return src, out, x


@pytest.mark.parametrize("pp", [1, 2])
def test_tp1_16bit_build_is_a_hf_checkpoint(synth, pp):
    src, out, x = synth
    res = build(make_plan(src, 1, pp, "bf16"), out / f"bf16-pp{pp}")
    index = json.loads((res.out_dir / INDEX).read_text())
    files = {}
    for shard in res.manifest.shards:
        with safe_open(res.out_dir / shard.file, "pt") as f:
            files.update({n: shard.file for n in f.keys()})  # noqa: SIM118
            sizes = sum(f.get_tensor(n).nbytes for n in f.keys())  # noqa: SIM118
            files.setdefault("__bytes__", 0)
            files["__bytes__"] += sizes
    assert index["metadata"]["total_size"] == files.pop("__bytes__")
    assert index["weight_map"] == files
    assert INDEX in {f.name for f in res.manifest.files}
    assert torch.equal(logits(hf_load(res.out_dir), x), logits(hf_load(src), x))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tp1_quantized_build_loads_in_transformers(synth, scheme):
    """transformers + compressed-tensors decompress the shards to the weights shardc quantized: the
    logits equal those of the source model with every projection replaced by its q * scale (as
    compressed-tensors rounds it), and the tensors are the ones vLLM's scheme loads."""
    src, out, x = synth
    res = build(make_plan(src, 1, 1, scheme, ignore=["lm_head", "layers.1.mlp"]), out / scheme)
    cfg = json.loads((res.out_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    # every quantized projection holds exactly the tensors vLLM's selected scheme registers
    scheme_cls = vllm_scheme(qc)
    with safe_open(res.out_dir / res.manifest.shards[0].file, "pt") as f:
        header = {n: (str(f.get_slice(n).get_dtype()), f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    prefix = "model.layers.0.self_attn.o_proj."
    for suffix, (dtype, shape) in vllm_tensors(scheme_cls, 64, 64).items():
        got_dtype, got_shape = header[prefix + suffix]
        assert list(got_shape) == shape and (dtype is None or got_dtype == dtype), suffix
    shown = CliRunner().invoke(main, ["inspect", str(res.out_dir), "--tensors"])
    assert shown.exit_code == 0 and "hf index" in shown.output
    if scheme == "int8":
        assert "pack-quantized" in shown.output and "o_proj.weight_packed" in shown.output
    ignored = {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    got, want = logits(hf_load(res.out_dir), x), logits(dequantized_source(src, scheme, ignored=ignored), x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def test_verify_checks_the_index(synth):
    src, out, _ = synth
    res = build(make_plan(src, 1, 2, "bf16"), out / "verify-index")
    assert verify_build(load(res.manifest_path), res.out_dir).ok
    idx = res.out_dir / INDEX
    data = json.loads(idx.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "model-tp00-pp01.safetensors" if data["weight_map"][first].endswith(
        "pp00.safetensors") else "model-tp00-pp00.safetensors"
    idx.write_text(json.dumps(data, indent=2) + "\n")
    report = verify_build(load(res.manifest_path), res.out_dir)
    assert not report.ok and any(INDEX in p for p in report.problems)
    idx.unlink()
    report = verify_build(load(res.manifest_path), res.out_dir)
    assert any(f"{INDEX}: missing" in p for p in report.problems)
    tp2 = build(make_plan(src, 2, 1, "bf16"), out / "verify-index-tp2")
    assert not (tp2.out_dir / INDEX).exists()
    assert INDEX not in {f.name for f in tp2.manifest.files}


# -- bad input: one line, exit 2, nothing written ---------------------------------------------------
def _run_build(tmp_path: Path, plan: dict, src: Path):
    import yaml

    pf = tmp_path / "plan.yaml"
    pf.write_text(yaml.safe_dump(plan))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["build", str(pf), "--source", str(src), "--out", str(out),
                                  "--manifests-dir", str(tmp_path / "m"), "--quiet"])
    return r, out


def test_tp_that_cannot_slice_a_packed_weight_is_refused(make_ckpt, tmp_path):
    # o_proj's input is 6 heads x 6 = 36 columns: tp=3 leaves 12 per rank, tp=2 18 and tp=6 6
    src = make_ckpt(hidden_size=48, num_heads=6, num_kv_heads=6, head_dim=6, intermediate_size=96)
    plan = {"replica_group": {"name": "bad", "tp_degree": 6, "pp_degree": 1, "dtype": "int8",
                              "gpus_per_replica": 6}, "model": {"source": str(src)}}
    r, out = _run_build(tmp_path, plan, src)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "self_attn.o_proj.weight" in line and "6 input columns" in line
    assert "tp_degree values that work for this model with int8: 1, 3" in line
    assert not out.exists() or not any(out.iterdir())
    plan["replica_group"]["dtype"] = "bf16"  # 16-bit is not packed: tp=6 builds
    r, _ = _run_build(tmp_path, plan, src)
    assert r.exit_code == 0, r.output


def test_source_config_with_a_quantization_config_is_refused(make_ckpt, tmp_path):
    """A quantization_config shardc does not read (#31 reads block fp8 and compressed-tensors:
    tests/compiler/test_quant_sources.py) is refused by its method, never read as 16-bit weights."""
    src = make_ckpt()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    plan = {"replica_group": {"name": "q", "tp_degree": 1, "pp_degree": 1, "dtype": "int8",
                              "gpus_per_replica": 1}, "model": {"source": str(src)}}
    r, out = _run_build(tmp_path, plan, src)
    assert r.exit_code == 2 and "quant_method 'awq' is not a source format shardc reads" in r.output, r.output
    assert not out.exists() or not any(out.iterdir())


# -- the demo model (SmolLM2-135M), loaded by transformers ------------------------------------------
@pytest.fixture(scope="module")
def demo_builds(demo_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-clients")
    builds = {(pp, d): build(make_plan(demo_model_dir, 1, pp, d), out / f"pp{pp}-{d}")
              for pp, d in ((1, "bf16"), (2, "bf16"), (1, "int8"), (1, "fp8"))}
    return demo_model_dir, builds


@pytest.fixture(scope="module")
def demo_x(demo_builds):
    _, builds = demo_builds
    return golden_windows(builds[(1, "bf16")].out_dir / "tokenizer.json", 2, 64)


@pytest.fixture(scope="module")
def demo_source_logits(demo_builds, demo_x):
    """transformers' logits of the demo source itself, the oracle of both bf16 builds (computed once)."""
    src, _ = demo_builds
    return logits(hf_load(src), demo_x)


@pytest.mark.heavy
@pytest.mark.parametrize("pp", [1, 2])
def test_demo_tp1_bf16_loads_bit_identical(demo_builds, demo_x, demo_source_logits, pp):
    _, builds = demo_builds
    assert torch.equal(logits(hf_load(builds[(pp, "bf16")].out_dir), demo_x), demo_source_logits)


@pytest.mark.heavy
@pytest.mark.parametrize("scheme", SCHEMES)
def test_demo_tp1_quantized_loads_like_shardc_runtime(demo_builds, demo_x, scheme):
    """transformers' logits of the int8 / fp8 build equal shardc's runtime's on the same shards
    within fp32 summation tolerance, and both equal the source model carrying bf16(q * bf16(scale))
    (dequantized_source): the gate scores what a client serves."""
    from shardc.runtime.api import open_build, score

    src, builds = demo_builds
    res = builds[(1, scheme)]
    got = logits(hf_load(res.out_dir), demo_x)
    ours = score(open_build(res.manifest_path), demo_x, return_logits=True, timeout_s=120).logits
    assert torch.isfinite(got).all() and torch.isfinite(ours).all()
    want = logits(dequantized_source(src, scheme), demo_x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-3)
    torch.testing.assert_close(got, ours, rtol=0, atol=2e-3)
    top1 = (got.argmax(-1) == ours.argmax(-1)).float().mean().item()
    print(f"\n{scheme}: transformers vs shardc runtime: max |diff| {(got - ours).abs().max():.4f}, "
          f"top-1 agreement {top1:.3f}")
