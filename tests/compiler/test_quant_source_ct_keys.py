"""A source quantization config read key by key (#41 items 3, 4 and 11): every key of
compressed-tensors' models classified by shardc (a release adding one fails here), a key refused
only at a value that would change the math, every size bounded before any work proportional to
it, and a config that quantizes none of the family's weights refused.

The configs are the one compressed-tensors' ``ModelCompressor.update_config`` writes (a tiny
module tree compressed for real, ``written`` below), edited one key at a time.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from cli_run import one_line, shardc, shardc_in  # noqa: E402
from plan_helpers import write_plan  # noqa: E402
from quant_sources import ct_model_compressor_source, ct_scheme, save_tiny  # noqa: E402

from shardc.errors import QuantizationError  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.layout.quant_formats import ct_keys, detect_source  # noqa: E402
from shardc.layout.quant_formats.compressed import CompressedTensors  # noqa: E402

G = "config_groups.group_0"
W = f"{G}.weights"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("ckeys") / "llama")


@pytest.fixture(scope="module")
def written(llama) -> dict:
    """config.json of a W4A16 (group 32) checkpoint as ModelCompressor writes it."""
    src = ct_model_compressor_source(llama, llama.parent / "w4a16", "w4a16-group")
    return json.loads((src / "config.json").read_text())


def _edit(config: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(config))
    node = out["quantization_config"]
    *head, last = path.split(".")
    for k in head:
        node = node[k]
    node[last] = value
    return out


def _read(config: dict):
    """The format read from config.json, and applied to the model it describes (every refusal
    the build makes before reading a tensor)."""
    from shardc.compiler.quantized import quantization_of

    return quantization_of(config, model_from_config(config))


def test_every_compressed_tensors_field_is_classified(tmp_path):
    """Every field of the installed compressed-tensors' QuantizationConfig, QuantizationScheme and
    QuantizationArgs, and every key ModelCompressor.update_config writes beside them, is in
    shardc's tables: a release that adds a key fails here until shardc says what it does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    for model, table in ((QuantizationConfig, ct_keys.CONFIG), (QuantizationScheme, ct_keys.SCHEME),
                         (QuantizationArgs, ct_keys.ARGS)):
        assert set(model.model_fields) <= set(table), (model.__name__, set(model.model_fields) - set(table))
    (tmp_path / "config.json").write_text("{}")
    config = QuantizationConfig(config_groups={"group_0": ct_scheme("w4a16-group")})
    ModelCompressor(quantization_config=config).update_config(str(tmp_path))
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert set(block) <= set(ct_keys.CONFIG), set(block) - set(ct_keys.CONFIG)
    assert set(ct_keys.CONFIG) - set(block) == set()  # no stale entry: each key is one the library writes
    assert set(ct_keys.SCHEME) == set(QuantizationScheme.model_fields)
    assert set(ct_keys.ARGS) == set(QuantizationArgs.model_fields)


def test_the_written_config_is_read(written):
    """What compressed-tensors 0.20 writes (moe_sparsity_config null, sparsity_config and
    transform_config {}, version) is read: the issue's refusal of every such checkpoint."""
    block = written["quantization_config"]
    assert block["moe_sparsity_config"] is None and block["sparsity_config"] == {} and block["transform_config"] == {}
    sq, shapes = _read(written)
    assert sq.label == "compressed-tensors int4 packed per group 32" and len(shapes) == 14


@pytest.mark.parametrize(("path", "value"), [
    ("moe_sparsity_config", None), ("kv_cache_scheme", None), ("sparsity_config", None), ("transform_config", None),
    ("transform_config", {"config_groups": {}}),
    ("sparsity_config", {"format": "dense", "global_sparsity": 0.0, "sparsity_structure": "unstructured",
                         "targets": [], "ignore": [], "registry_requires_subclass": False}),
    (f"{G}.output_activations", None), (f"{W}.block_structure", None),
    # inert: no value changes the stored weights' math
    ("global_compression_ratio", 1.73), ("version", "9.9.9"), (f"{W}.observer", "mse"),
    (f"{W}.observer_kwargs", {"maxshrink": 0.2}), (f"{W}.zp_dtype", None),
    # read, at values it implements
    (f"{W}.actorder", "weight"), (f"{W}.actorder", False), (f"{W}.symmetric", True),
])
def test_a_value_that_cannot_change_the_math_is_accepted(written, path, value):
    sq, _ = _read(_edit(written, path, value))
    assert sq.label == "compressed-tensors int4 packed per group 32"


@pytest.mark.parametrize(("path", "value", "line"), [
    ("moe_sparsity_config", {"method": "prune", "num_experts": [None, 3]},
     "quantization_config.moe_sparsity_config: is set: pruned or merged experts change the model and are not read "
     "(hint: use a checkpoint with every expert)"),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
     "quantization_config.kv_cache_scheme: is set: it quantizes the KV cache, which changes the model's math and "
     "is not read (hint: use a checkpoint without KV-cache quantization)"),
    ("sparsity_config", {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"},
     "quantization_config.sparsity_config: is set: sparse compressed weights are not read "
     "(hint: use a dense checkpoint)"),
    (f"{G}.output_activations", {"num_bits": 8, "type": "int", "dynamic": True},
     f"quantization_config.{G}.output_activations: is set: output quantization is not read "
     "(hint: use a weight-only or W8A8 scheme)"),
    (f"{W}.block_structure", [128, 128],
     f"quantization_config.{W}.block_structure: is set: block-scaled compressed-tensors weights are not read "
     "(hint: use a channel or group strategy)"),
    ("zero_bias", True, "quantization_config.zero_bias: is a compressed-tensors key shardc does not implement "
     "(hint: start from a checkpoint without it, or from the unquantized checkpoint)"),
    (f"{G}.rotation", "hadamard", f"quantization_config.{G}.rotation: is a compressed-tensors key shardc does not "
     "implement"),
    (f"{W}.scale_offset", 1, f"quantization_config.{W}.scale_offset: is a compressed-tensors key shardc does not "
     "implement"),
    (f"{W}.symmetric", "false", f"quantization_config.{W}.symmetric: is 'false': zero points are not read"),
    (f"{W}.group_size", 2**34, f"quantization_config.{W}.group_size: is 17179869184; a group strategy needs a "
     "positive size no larger than the weights' input dimension (hint: group_size: 128)"),
    (f"{W}.group_size", 512, f"quantization_config.{W}.group_size: is 512, longer than a row of weight "
     "model.layers.0.mlp.down_proj.weight [128, 256] (hint: a group_size that divides 256 (128, 64, 32))"),
    ("ignore", ["lm_head", "re:("], "quantization_config.ignore: entry 're:(' is not a regular expression "
     "(missing ), unterminated subpattern at position 0) (hint: fix the pattern after re:)"),
    ("ignore", ["lm_head", "re:.*proj"], "quantization_config.quant_method: is 'compressed-tensors', but "
     "compressed-tensors int4 packed per group 32 quantizes none of LlamaForCausalLM's weights (it applies to the "
     "decoder's linear projections not in its ignore list) (hint: a checkpoint whose weights are 16-bit has no "
     "quantization_config: remove it from config.json, or start from the checkpoint it describes)"),
])
def test_a_value_that_would_change_the_math_is_refused(written, path, value, line):
    """Refused by name before any tensor is read: the exact line the CLI prints."""
    with pytest.raises(QuantizationError) as e:
        _read(_edit(written, path, value))
    assert f"{e.value.key}: {e.value.message} (hint: {e.value.hint})".startswith(line)


def test_huge_group_size_is_one_line_at_once(llama, tmp_path):
    """The issue's ``group_size: 2**34`` (scales [out, 1] pass the shape check): one line, exit 2,
    nothing written; the check itself is immediate (the process's time is its imports)."""
    src = ct_model_compressor_source(llama, tmp_path / "src", "w4a16-channel")
    config = json.loads((src / "config.json").read_text())
    config = _edit(config, f"{W}.strategy", "group")
    config = _edit(config, f"{W}.group_size", 2**34)
    (src / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    with pytest.raises(QuantizationError):
        _read(config)
    assert time.perf_counter() - t0 < 1
    r = shardc("build", write_plan(tmp_path / "p.yaml", 1, 1, "bf16", name="g", source=src), "--out",
               tmp_path / "out", "--quiet")
    one_line(r, f"quantization_config.{W}.group_size: is 17179869184")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))


def test_group_dequantization_allocates_only_the_output():
    """A group as long as the whole row (or longer: the format's own bound is the config check)
    multiplies in place: the peak is the float32 output plus a bounded chunk, never a repeat of
    the scales to the weight's size; and the values are q x scale rounded to the scale's dtype."""
    rows, cols = 512, 4096
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    for group, n in ((1 << 34, 1), (cols, 1), (128, cols // 128)):
        w = {"num_bits": 8, "type": "int", "strategy": "group", "group_size": group}
        sq = CompressedTensors({"ignore": []}, "int-quantized", w, "BF16")
        s = (rng.random((rows, n), dtype=np.float32) + 0.5).astype(ml_dtypes.bfloat16)
        tensors = {"x.weight": q, "x.weight_scale": s}
        tracemalloc.start()
        got = sq.dequantize("x.weight", (rows, cols), tensors.__getitem__)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < rows * cols * 4 * 2, (group, peak)  # the output (8 MiB) and chunk temporaries
        want = torch.from_numpy(q).to(torch.bfloat16) * torch.from_numpy(s.view(np.int16)).view(torch.bfloat16) \
            .repeat_interleave(min(group, cols), dim=1)[:, :cols]
        assert got.dtype == np.float32 and np.array_equal(got.astype(ml_dtypes.bfloat16).view(np.int16),
                                                           want.view(torch.int16).numpy()), group


@pytest.mark.parametrize(("qconfig", "arch"), [
    ({"quant_method": "mxfp4"}, "LlamaForCausalLM"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "LlamaForCausalLM"),
    ({"quant_method": "fp8", "weight_block_size": [32, 32], "modules_to_not_convert": ["model.layers"]},
     "LlamaForCausalLM"),
])
@pytest.mark.parametrize("dtype", ["source", "bf16"])
def test_a_config_that_quantizes_nothing_is_refused(llama, tmp_path, qconfig, arch, dtype):
    """The issue's Llama whose config.json says mxfp4 over bf16 tensors built with exit 0 and
    kept claiming mxfp4; now one line naming quant_method and the architecture, whatever the plan's
    dtype, nothing written. (An fp8 config whose modules_to_not_convert keeps every projection
    is the same lie.)"""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"quantization_config": qconfig}))
    # in this process (the six cases are one code path; the real process's line: the test above)
    r = shardc_in("build", write_plan(tmp_path / "p.yaml", 1, 1, dtype, name="m", source=src), "--out",
                  tmp_path / "out", "--quiet")
    line = one_line(r, f"quantization_config.quant_method: is {qconfig['quant_method']!r}, but ")
    assert f"quantizes none of {arch}'s weights (it applies to " in line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))


def test_detect_source_alone_still_reads_the_block():
    """``detect_source`` reads the block without a model (the planner's and the manifest's use);
    the family check is ``applied``, which the build and the Layout call."""
    sq = detect_source({"quantization_config": {"quant_method": "mxfp4"}})
    assert sq is not None and sq.label.startswith("mxfp4")
