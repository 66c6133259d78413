"""Property-based fuzzing (#17) of the readers of untrusted files: the plan parser, the config
reader and the safetensors header readers. Any input ends in a result or a ShardcError (the
header reader's contract is ValueError, which verify turns into a mismatch), never another
exception; hypothesis' deadline bounds the time per input and the strategies bound its size."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardc.compiler.checkpoint import open_source
from shardc.errors import ShardcError
from shardc.formats.safetensors import read_header
from shardc.layout.families import BY_ARCHITECTURE
from shardc.layout.families.family import BOUNDS
from shardc.layout.model import PRESETS, load_model, model_from_config
from shardc.layout.plan import load_plan, plan_from_dict

FUZZ = settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.too_slow],
                database=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
PLAN_KEYS = ["replica_group", "model", "quantization", "autoscaling", "name", "tp_degree", "pp_degree",
             "dtype", "gpus_per_replica", "kv_cache_cap_gb", "checkpoint", "shard_prefix", "source",
             "pp_layers", "ignore", "base_dtype", "max_concurrent_sequences", "nvlink_domain"]
plan_like = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats() | st.sampled_from(
        ["bf16", "int8", "x", "model-{tp_rank}-{pp_stage}.safetensors", "{tp_rank:c}{pp_stage}", "s"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(PLAN_KEYS), inner, max_size=6),
    max_leaves=25,
)
CONFIG_KEYS = ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias", "torch_dtype"]
# every family's architecture and every count a family reads (BOUNDS), near and far past the bounds
ARCHITECTURES = sorted(BY_ARCHITECTURE)
FAMILY_KEYS = sorted(set(BOUNDS) - set(CONFIG_KEYS)) + ["model_type", "mlp_only_layers", "layer_types",
                                                          "use_sliding_window", "q_lora_rank"]
counts = st.integers(-5, 2**40) | st.integers(0, 5000) | st.sampled_from([10**6, 10**8, 131073])
config_like = st.fixed_dictionaries(
    {"architectures": st.sampled_from([["LlamaForCausalLM"], ["Qwen2ForCausalLM"], "x", [], [[1]]])
     | st.lists(st.sampled_from(ARCHITECTURES), min_size=1, max_size=2)},
    optional={k: json_values | counts for k in CONFIG_KEYS[1:]}
    | {k: json_values | counts | st.sampled_from(["llama", "mixtral", "kimi_k2", True, [0, 1] * 3000,
                                                  ["sliding_attention"] * 5000])
       for k in FAMILY_KEYS},
)
# a published config (every family's presets) with up to three of those keys replaced
edited_preset = st.builds(lambda name, edits: {**PRESETS[name], **edits}, st.sampled_from(sorted(PRESETS)),
                          st.dictionaries(st.sampled_from(CONFIG_KEYS + FAMILY_KEYS), json_values | counts
                                          | st.sampled_from([["LlamaForCausalLM", "MixtralForCausalLM"], "llama",
                                                             "kimi_k2", [0, 1] * 3000]), max_size=3))


_DIR = tempfile.TemporaryDirectory(prefix="shardc-fuzz-")


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    _DIR.cleanup()


def _tmp_file(data: bytes, name: str) -> Path:
    """One file per name, rewritten for each example (examples run one at a time)."""
    d = Path(_DIR.name) / name.replace(".", "_")
    d.mkdir(exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    p = d / name
    p.write_bytes(data)
    return p


@FUZZ
@given(plan_like)
def test_plan_from_dict(raw):
    try:
        plan_from_dict(raw)
    except ShardcError:
        pass


@FUZZ
@given(st.binary(max_size=2000) | st.text(max_size=2000).map(str.encode)
       | plan_like.map(lambda d: yaml.safe_dump(d).encode()))
def test_load_plan_bytes(data):
    try:
        load_plan(_tmp_file(data, "plan.yaml"))
    except ShardcError:
        pass


@FUZZ
@given(config_like | edited_preset)
def test_model_from_config(cfg):
    try:
        model_from_config(cfg)
    except ShardcError:
        pass


@FUZZ
@given(st.binary(max_size=2000) | config_like.map(lambda c: json.dumps(c).encode()))
def test_load_model_bytes(data):
    try:
        load_model(_tmp_file(data, "config.json"))
    except ShardcError:
        pass


def _header_file(header: bytes, declared: int | None, tail: bytes) -> bytes:
    n = len(header) if declared is None else declared
    return struct.pack("<Q", n) + header + tail


headers = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=8), st.fixed_dictionaries(
        {"dtype": st.sampled_from(["BF16", "F32", "I8", "X", 1]),
         "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
         "data_offsets": st.lists(st.integers(-2, 2**62), max_size=3) | json_values}), max_size=3,
    ).map(lambda d: json.dumps(d).encode()),
)


@FUZZ
@given(headers, st.none() | st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_read_header(header, declared, tail):
    try:
        read_header(_tmp_file(_header_file(header, declared, tail), "x.safetensors"))
    except ShardcError:
        pass


@FUZZ
@given(headers, st.none() | st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_source_index(header, declared, tail):
    from shardc.compiler.synthetic import llama_config

    p = _tmp_file(_header_file(header, declared, tail), "model.safetensors")
    (p.parent / "config.json").write_text(json.dumps(llama_config()))
    try:
        open_source(str(p.parent))
    except ShardcError:
        pass
