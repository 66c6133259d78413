"""Hostile configs (#41 items 2 and 5): every count a family reads is bounded before anything is
sized by it, and a config that names two models at once is refused naming both fields.

The bounds are one table (``families/family.py`` ``BOUNDS``). For every family, each bounded key it
reads (found by recording what the reader looks up, so a family that starts reading another count
is tested here without a new line) is refused one above its bound with one line naming the key,
the value and the bound, refused below its lowest, and accepted at its bound (or, where the other
keys forbid that, a value as large as they allow). The issue's configs, a published Mixtral and
Qwen3-MoE with 10**8 experts, go through the real CLI: one line, exit 2, in well under a second of
the process's CPU.
"""

from __future__ import annotations

import copy
import json
import resource
import time
from typing import Any

import pytest
import yaml
from cli_run import one_line, shardc

from shardc.errors import ModelError
from shardc.layout.families import BY_ARCHITECTURE, FAMILIES
from shardc.layout.families.family import BOUNDS, EXPERT_MLPS
from shardc.layout.model import LIMITS, PRESETS, model_from_config

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=256)
WINDOWS = dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)
# One small config per architecture (and per spelling of the experts key) with every count live.
BASES: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **WINDOWS),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **WINDOWS),
    "granite": dict(architectures=["GraniteForCausalLM"], model_type="granite"),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=8),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=8),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8,
                   sliding_window_pattern=2),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=8,
                    num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", **WINDOWS, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[3], moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", use_sliding_window=True,
                      sliding_window=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[3], moe_intermediate_size=32),
    # transformers 5 writes num_local_experts for every MoE family
    "qwen3_moe_t5": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_local_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
                        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, num_nextn_predict_layers=1,
                        num_mtp_layers=1),
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", sliding_window=8,
                    num_local_experts=4, num_experts_per_tok=2),
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_local_experts=4,
                       num_experts_per_tok=2, rotary_dim=8, num_mtp_modules=1),
    "deepseek_v32": dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_key_value_heads=4,
                         n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, num_nextn_predict_layers=1,
                         index_n_heads=2, index_head_dim=16, index_topk=8),
    # GLM-5.3's indexer pattern: index_topk_freq and index_skip_topk_offset
    "glm_moe_dsa": dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        moe_intermediate_size=16, index_n_heads=2, index_head_dim=16, index_topk=8,
                        index_topk_freq=2, index_skip_topk_offset=1),
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=16,
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       full_attention_interval=2),
    # Qwen3.5: the published configs' keys (mlp_only_layers empty, the attention gate declared, mrope)
    "qwen3_5": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", head_dim=16,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    full_attention_interval=2, attn_output_gate=True, mlp_only_layers=[],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", head_dim=16,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, full_attention_interval=2),
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", rms_norm_eps=1e-5,
                     n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, moe_intermediate_size=16, num_nextn_predict_layers=1,
                     num_mtp_layers=1),
}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class Recorded(dict):
    """A config that records the keys its readers look up."""

    looked_up: set[str]

    def get(self, key: str, default: Any = None) -> Any:
        self.__dict__.setdefault("looked_up", set()).add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.__dict__.setdefault("looked_up", set()).add(key)
        return super().__getitem__(key)


def _base(label: str) -> dict[str, Any]:
    return {**SHAPE, **copy.deepcopy(BASES[label])}


def _bounded_reads(label: str) -> set[str]:
    cfg = Recorded(_base(label))
    model_from_config(cfg)
    return cfg.__dict__["looked_up"] & set(BOUNDS)


CASES = [(label, key) for label in BASES for key in sorted(_bounded_reads(label))]


def _experts_key(cfg: dict[str, Any]) -> str:
    return next(k for k in EXPERT_KEYS if k in cfg)


def _large(label: str, key: str) -> dict[str, Any]:
    """The base config with ``key`` at its bound, or as large as the other keys let it be, and
    those keys moved with it."""
    cfg = _base(label)
    high = BOUNDS[key][1]
    if key in ("num_attention_heads", "num_key_value_heads"):  # kv divides the heads (MLA: equal)
        cfg.update(num_attention_heads=high, num_key_value_heads=high)
    elif key == "num_experts_per_tok":  # at most the experts, and within the chosen groups
        cfg.update({_experts_key(cfg): high, "n_group": 1, "topk_group": 1})
    elif key in ("n_group", "topk_group"):  # groups of at least 2 experts, topk_group <= n_group
        cfg.update(n_routed_experts=BOUNDS["n_routed_experts"][1], n_group=high // 2, topk_group=high // 2)
        return cfg
    elif key in ("num_nextn_predict_layers", "num_mtp_layers"):  # two spellings that must agree
        cfg.update(num_nextn_predict_layers=high, num_mtp_layers=high)
    elif key == "linear_num_key_heads":  # the value heads are a multiple of the key heads
        cfg.update(linear_num_value_heads=high)
    elif key == "qk_rope_head_dim" and "index_head_dim" in cfg:  # DSA's indexer rotates as many
        cfg.update(index_head_dim=high)
    elif key in EXPERT_KEYS:  # the one spelling (transformers 4 and 5 spellings must agree)
        for k in EXPERT_KEYS:
            cfg.pop(k, None)
    cfg[key] = high
    return cfg


@pytest.mark.parametrize("label,key", CASES)
def test_each_count_at_its_bound_is_read_and_one_above_is_one_line(label, key):
    low, high = BOUNDS[key]
    large = _large(label, key)
    m = model_from_config(large)  # accepted, the value carried through
    assert m.config[key] == large[key] >= high // 2
    if key in EXPERT_KEYS:
        assert m.options["experts"] == high
    cfg = {**large, key: high + 1}
    with pytest.raises(ModelError) as e:
        model_from_config(cfg)
    assert (e.value.key, e.value.message) == (key, f"config.json {key} is {high + 1}, above the limit of {high}")
    assert e.value.hint.startswith(f"{key} at most {high}, far above any published model's")
    cfg = {**_base(label), key: low - 1}
    with pytest.raises(ModelError) as e:
        model_from_config(cfg)
    assert e.value.key == key and f"config.json {key} must be a " in e.value.message
    assert repr(low - 1) in e.value.message


def test_every_bound_is_read_by_some_family_and_limits_are_its_rows():
    read = set().union(*(_bounded_reads(label) for label in BASES))
    assert read == set(BOUNDS)
    assert LIMITS == {k: BOUNDS[k][1] for k in LIMITS} and len(LIMITS) == 8
    # far above every published model: the presets are all inside their bounds by 8x or more
    for name, cfg in PRESETS.items():
        for key, (_, high) in BOUNDS.items():
            if isinstance(cfg.get(key), int):
                assert cfg[key] * 8 <= high, (name, key)


@pytest.mark.parametrize("label", [label for label in BASES if any(k in BASES[label] for k in EXPERT_KEYS)])
def test_routed_experts_in_all_layers_are_bounded(label):
    key = _experts_key(BASES[label])
    experts = BOUNDS[key][1]
    layers = EXPERT_MLPS // experts
    cfg = {**_base(label), key: experts, "num_hidden_layers": layers, "mlp_only_layers": []}
    assert model_from_config(cfg).options["experts"] == experts
    cfg["num_hidden_layers"] = layers + 1
    with pytest.raises(ModelError) as e:
        model_from_config(cfg)
    assert e.value.key == key
    assert e.value.message == (f"config.json {key}={experts} in each of num_hidden_layers={layers + 1} is "
                               f"{experts * (layers + 1)} routed experts, above the limit of {EXPERT_MLPS}")


@pytest.mark.parametrize("label,key,value,needle", [
    ("qwen3_moe", "mlp_only_layers", [0] * 2_000_000, "lists 2000000 entries; there are 4 layers"),
    ("gemma2", "layer_types", ["sliding_attention"] * 2_000_000, "must list full_attention or sliding_attention"),
    ("gpt_oss", "layer_types", ["full_attention"] * 2_000_000, "for each of the 4 layers"),
])
def test_long_lists_are_refused_by_their_length(label, key, value, needle):
    cfg = {**_base(label), key: value}
    start = time.process_time()
    with pytest.raises(ModelError) as e:
        model_from_config(cfg)
    assert time.process_time() - start < 0.5  # the length first: neither the entries nor their repr
    assert e.value.key == key and needle in e.value.message and len(e.value.message) < 250


# -- the configs, through the real CLI ----------------------------------------------------

def _cli_cpu(*args: object) -> tuple[Any, float]:
    """A real shardc process and the CPU seconds it used (robust on a loaded machine, where the
    unbounded read took minutes of CPU)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    r = shardc(*args, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert time.monotonic() - start < 30
    return r, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


@pytest.mark.parametrize("preset,key,experts", [("mixtral-8x7b", "num_local_experts", 10**8),
                                                ("qwen3-30b-a3b", "num_experts", 10**8),
                                                ("qwen3-30b-a3b", "num_experts", 10**6)])
def test_a_published_moe_with_too_many_experts_is_one_line_at_once(tmp_path, preset, key, experts):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**PRESETS[preset], key: experts}))
    assert (src / "config.json").stat().st_size < 2048  # a 1 KB file
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"replica_group": {"name": "h", "tp_degree": 1, "pp_degree": 1, "dtype": "bf16",
                                                      "gpus_per_replica": 1}, "model": {"source": str(src)}}))
    line = f"error: {key}: config.json {key} is {experts}, above the limit of 4096 (hint: {key} at most 4096"
    for args in (("plan", "--model", src, "--gpu", "h100-sxm"),
                 ("build", plan, "--out", tmp_path / "out", "--manifests-dir", tmp_path / "m", "--dry-run")):
        r, cpu = _cli_cpu(*args)
        assert one_line(r, line).startswith(line)
        assert cpu < 5, cpu
    assert not (tmp_path / "out").exists() and not (tmp_path / "m").exists()


# -- ambiguous architecture -----------------------------------------------------------------------

def test_each_architecture_declares_transformers_model_type():
    transformers = pytest.importorskip("transformers")
    for arch, family in BY_ARCHITECTURE.items():
        assert family.model_types[arch] == getattr(transformers, arch).config_class.model_type, arch
    assert sorted(BY_ARCHITECTURE) == sorted(a for f in FAMILIES for a in f.model_types)
    for name, cfg in PRESETS.items():  # the published configs agree with themselves
        assert model_from_config(cfg).architecture == cfg["architectures"][0], name


def _refused(cfg: dict[str, Any]) -> ModelError:
    with pytest.raises(ModelError) as e:
        model_from_config(cfg)
    return e.value


def test_two_architectures_are_refused_naming_both():
    e = _refused({**PRESETS["llama-3.1-8b"], "architectures": ["LlamaForCausalLM", "MixtralForCausalLM"]})
    assert (e.key, e.message) == ("architectures", "config.json architectures names 2 architectures, "
                                  "['LlamaForCausalLM', 'MixtralForCausalLM']; transformers and vLLM may each "
                                  "build a different one")
    assert e.hint == "list the one architecture whose tensors the checkpoint holds"
    e = _refused({**PRESETS["llama-3.1-8b"], "architectures": ["LlamaForCausalLM", "GPT2LMHeadModel"]})
    assert e.key == "architectures" and "GPT2LMHeadModel" in e.message
    assert model_from_config({**PRESETS["llama-3.1-8b"], "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("preset,model_type,other", [
    ("llama-3.1-8b", "mixtral", "MixtralForCausalLM"),  # another family
    ("llama-3.1-8b", "qwen2", "Qwen2ForCausalLM"),  # the same shardc family, another model: q/k/v biases
    ("mixtral-8x7b", "mistral", "MistralForCausalLM"),
    ("deepseek-v3", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ("gemma-3-1b", "gemma2", "Gemma2ForCausalLM"),
])
def test_a_model_type_of_another_known_architecture_is_refused_naming_both(preset, model_type, other):
    cfg = {**PRESETS[preset], "model_type": model_type}
    arch, own = cfg["architectures"][0], PRESETS[preset]["model_type"]
    e = _refused(cfg)
    assert (e.key, e.message) == ("model_type", f"config.json model_type={model_type!r} is {other}'s, but "
                                  f"architectures names {arch} (transformers builds by model_type, vLLM by "
                                  "architectures)")
    assert e.hint == f"model_type {own!r} for {arch}, or architectures [{other!r}]: whichever the checkpoint's tensors are"


@pytest.mark.parametrize("preset,model_type", [("deepseek-v3", "kimi_k2"), ("llama-3.1-8b", "exaone"),
                                               ("gemma-3-27b", "gemma3"), ("qwen3-8b", None)])
def test_a_model_type_shardc_does_not_know_leaves_the_architecture_to_decide(preset, model_type):
    cfg = {**PRESETS[preset], "model_type": model_type}
    if model_type is None:
        del cfg["model_type"]
    assert model_from_config(cfg).spec is model_from_config(PRESETS[preset]).spec


def test_a_model_type_that_is_not_a_string_is_refused():
    e = _refused({**PRESETS["llama-3.1-8b"], "model_type": ["llama"]})
    assert (e.key, e.message) == ("model_type", "config.json model_type must be a string, found ['llama']")
    assert e.hint == "'llama', transformers' model_type of LlamaForCausalLM"


def test_ambiguous_configs_through_the_cli(tmp_path):
    for name, edit, needle in [
        ("two", {"architectures": ["LlamaForCausalLM", "MixtralForCausalLM"]},
         "error: architectures: config.json architectures names 2 architectures"),
        ("type", {"model_type": "mixtral"}, "error: model_type: config.json model_type='mixtral' is "
                                            "MixtralForCausalLM's, but architectures names LlamaForCausalLM"),
    ]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**PRESETS["llama-3.1-8b"], **edit}))
        one_line(shardc("plan", "--model", path, "--gpu", "h100-sxm", timeout=60), needle)


def test_a_manifest_whose_config_has_too_many_experts_is_one_line_before_its_layout(tmp_path):
    """The manifest reader bounds the numbers every decoder has (``LIMITS``); a family's counts
    are bounded by model_from_config as the manifest's Layout is made, before it is sized."""
    from tiny_builds import tiny_build

    built = tiny_build(tmp_path, "t")
    m = json.loads((built / "manifest.json").read_text())
    m["model"]["config"].update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=10**8)
    (built / "manifest.json").write_text(json.dumps(m))
    r, cpu = _cli_cpu("verify", "--manifest", built / "manifest.json")
    one_line(r, "error: num_local_experts: config.json num_local_experts is 100000000, above the limit of 4096")
    assert cpu < 5, cpu


def test_every_architecture_has_a_base_config_here():
    """A family registered without a base config here would have none of its counts bounded by
    these tests (docs/architecture.md §8): every architecture is listed."""
    assert {cfg["architectures"][0] for cfg in BASES.values()} == set(BY_ARCHITECTURE)
