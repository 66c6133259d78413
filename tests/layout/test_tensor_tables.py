"""layout/tensors.py and layout/quantization.py pinned by hand-written tables: the split kind of every
Llama-family name, the full source tensor list (names, order, shapes) of small configs with and
without biases, each TP precondition's refusal and the TP degrees that work, which weights a plan
quantizes, the 16-bit base dtype, and the int8 packing refusal. Every expectation is a literal
written here, never derived by calling the code under test (docs/mutation-testing.md).
"""

from __future__ import annotations

import pytest
from plan_helpers import plan

from shardc.compiler.synthetic import llama_config
from shardc.errors import LayoutError, QuantizationError
from shardc.layout.model import model_from_config
from shardc.layout.quantization import _ignore_matches, base_dtype, check_packing, quantized_names
from shardc.layout.ranks import build_layout, check_degrees
from shardc.layout.tensors import layer_of, source_tensors, split_kind, valid_tp_degrees


def _model(arch="LlamaForCausalLM", **over):
    extra = over.pop("extra", {})
    cfg = llama_config(architecture=arch, **over)
    cfg.update(extra)
    return model_from_config(cfg)


def _plan(tp, dtype="bf16", quant=None, pp=1):
    return plan(tp, pp, dtype, name="m", source="/nonexistent", **({} if quant is None else {"quantization": quant}))


# ---- split kinds -----------------------------------------------------------------------------

SPLIT_TABLE = {
    "model.embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
    "model.layers.0.self_attn.q_proj.weight": "column",
    "model.layers.17.self_attn.q_proj.bias": "column",
    "model.layers.3.self_attn.k_proj.weight": "kv_column",
    "model.layers.3.self_attn.k_proj.bias": "kv_column",
    "model.layers.3.self_attn.v_proj.weight": "kv_column",
    "model.layers.120.self_attn.v_proj.bias": "kv_column",
    "model.layers.1.mlp.gate_proj.weight": "column",
    "model.layers.1.mlp.gate_proj.bias": "column",
    "model.layers.1.mlp.up_proj.weight": "column",
    "model.layers.1.mlp.up_proj.bias": "column",
    "model.layers.2.self_attn.o_proj.weight": "row",
    "model.layers.2.mlp.down_proj.weight": "row",
    "model.layers.2.self_attn.o_proj.bias": "replicated",
    "model.layers.2.mlp.down_proj.bias": "replicated",
    "model.layers.9.input_layernorm.weight": "replicated",
    "model.layers.9.post_attention_layernorm.weight": "replicated",
    "model.norm.weight": "replicated",
}


@pytest.mark.parametrize("name,kind", sorted(SPLIT_TABLE.items()))
def test_split_kind_of_every_llama_name(name, kind):
    model = _model(num_layers=121, extra={"attention_bias": True, "mlp_bias": True})
    assert split_kind(name, model) == kind


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.rotary_emb.inv_freq",
    "model.layers.x.self_attn.q_proj.weight",
    "model.layers.0.self_attn.w_proj.weight",
    "model.layers.0.mlp.gate_proj.weight_scale",
    "xmodel.norm.weight",
    "model.embed_tokens",
    "lm_head.bias",
])
def test_split_kind_refuses_other_names(name):
    with pytest.raises(LayoutError) as e:
        split_kind(name, _model())
    assert (e.value.message, e.value.hint) == (
        f"no split rule for tensor {name!r}", "only names in the model's family table are known")


@pytest.mark.parametrize("name,layer", [
    ("model.layers.0.input_layernorm.weight", 0),
    ("model.layers.12.mlp.up_proj.weight", 12),
    ("model.layers.305.self_attn.o_proj.bias", 305),
    ("model.norm.weight", None),
    ("model.embed_tokens.weight", None),
    ("lm_head.weight", None),
])
def test_layer_of(name, layer):
    assert layer_of(name) == layer


# ---- source tensors --------------------------------------------------------------------------

# hidden 12, 2 heads of head_dim 4 (q out 8, not hidden), 1 KV head (kv out 4), intermediate 20,
# vocab 7, 2 layers. Per layer, in name order: (suffix, shape, present when).
_LAYER = [
    ("input_layernorm.weight", (12,), "always"),
    ("mlp.down_proj.bias", (12,), "mlp"),
    ("mlp.down_proj.weight", (12, 20), "always"),
    ("mlp.gate_proj.bias", (20,), "mlp"),
    ("mlp.gate_proj.weight", (20, 12), "always"),
    ("mlp.up_proj.bias", (20,), "mlp"),
    ("mlp.up_proj.weight", (20, 12), "always"),
    ("post_attention_layernorm.weight", (12,), "always"),
    ("self_attn.k_proj.bias", (4,), "qkv"),
    ("self_attn.k_proj.weight", (4, 12), "always"),
    ("self_attn.o_proj.bias", (12,), "o"),
    ("self_attn.o_proj.weight", (12, 8), "always"),
    ("self_attn.q_proj.bias", (8,), "qkv"),
    ("self_attn.q_proj.weight", (8, 12), "always"),
    ("self_attn.v_proj.bias", (4,), "qkv"),
    ("self_attn.v_proj.weight", (4, 12), "always"),
]
SMALL = dict(hidden_size=12, num_heads=2, head_dim=4, num_kv_heads=1, intermediate_size=20,
             vocab_size=7, num_layers=2)


def _expected(biases: set[str], tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    out = [] if tied else [("lm_head.weight", (7, 12))]
    out.append(("model.embed_tokens.weight", (7, 12)))
    for i in (0, 1):
        out += [(f"model.layers.{i}.{s}", shape) for s, shape, when in _LAYER
                if when == "always" or when in biases]
    out.append(("model.norm.weight", (12,)))
    return out


@pytest.mark.parametrize("arch,extra,biases,tied", [
    ("LlamaForCausalLM", {}, set(), False),
    ("LlamaForCausalLM", {}, set(), True),
    ("Qwen2ForCausalLM", {}, {"qkv"}, False),
    ("LlamaForCausalLM", {"attention_bias": True}, {"qkv", "o"}, False),
    ("LlamaForCausalLM", {"mlp_bias": True}, {"mlp"}, True),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, {"qkv", "o", "mlp"}, False),
])
def test_source_tensors_names_order_and_shapes(arch, extra, biases, tied):
    model = _model(arch, tie_word_embeddings=tied, extra=extra, **SMALL)
    got = [(t.name, t.shape) for t in source_tensors(model)]
    assert got == _expected(biases, tied)


def test_source_tensors_sorted_by_name_past_ten_layers():
    """Name order, not layer order: layers.10 and layers.11 sort before layers.2."""
    model = _model(**{**SMALL, "num_layers": 12})
    layers = []
    for t in source_tensors(model):
        if t.name.endswith("input_layernorm.weight"):
            layers.append(t.name.split(".")[2])
    assert layers == ["0", "1", "10", "11", "2", "3", "4", "5", "6", "7", "8", "9"]


# ---- TP preconditions ------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,tp,message,good", [
    (dict(num_heads=4, num_kv_heads=2, hidden_size=16, intermediate_size=32), 3,
     "num_attention_heads=4 is not divisible by tp=3", "1, 2, 4"),
    (dict(num_heads=12, num_kv_heads=6, hidden_size=48, intermediate_size=48), 4,
     "num_key_value_heads=6 is not divisible by tp=4", "1, 2, 3, 6, 12"),
    (dict(num_heads=12, num_kv_heads=4, hidden_size=48, intermediate_size=48), 6,
     "tp=6 is not a multiple of num_key_value_heads=4", "1, 2, 4, 12"),
    (dict(num_heads=4, num_kv_heads=4, hidden_size=16, intermediate_size=30), 4,
     "intermediate_size=30 is not divisible by tp=4", "1, 2"),
    (dict(num_heads=4, num_kv_heads=4, head_dim=4, hidden_size=18, intermediate_size=32), 4,
     "hidden_size=18 is not divisible by tp=4", "1, 2"),
    # the hint lists TP degrees up to 64: 64 is in it, 65 (which 65 heads would allow) is not
    (dict(num_heads=64, num_kv_heads=64, hidden_size=64, intermediate_size=64), 3,
     "num_attention_heads=64 is not divisible by tp=3", "1, 2, 4, 8, 16, 32, 64"),
    (dict(num_heads=65, num_kv_heads=65, hidden_size=65, intermediate_size=65), 3,
     "num_attention_heads=65 is not divisible by tp=3", "1, 5, 13"),
    (dict(num_heads=8, num_kv_heads=1, hidden_size=32, intermediate_size=24), 16,
     "num_attention_heads=8 is not divisible by tp=16", "1, 2, 4, 8"),
])
def test_tp_refusals_and_degrees_that_work(cfg, tp, message, good):
    model = _model(**cfg)
    with pytest.raises(LayoutError) as e:
        check_degrees(model, _plan(tp))
    assert (e.value.message, e.value.key, e.value.hint) == (
        message, "replica_group.tp_degree", f"tp_degree values that work for this model: {good}")
    assert valid_tp_degrees(model) == [int(x) for x in good.split(", ")]


@pytest.mark.parametrize("cfg,tps", [
    (dict(num_heads=4, num_kv_heads=4, hidden_size=16, intermediate_size=32), [1, 2, 4]),  # kv == tp
    (dict(num_heads=8, num_kv_heads=2, hidden_size=32, intermediate_size=32), [1, 2, 4, 8]),  # kv < tp
    (dict(num_heads=8, num_kv_heads=1, hidden_size=32, intermediate_size=32), [1, 2, 4, 8]),
])
def test_tp_degrees_accepted(cfg, tps):
    model = _model(**cfg)
    for tp in tps:
        check_degrees(model, _plan(tp))
    assert valid_tp_degrees(model) == tps
    assert valid_tp_degrees(model, limit=4) == [t for t in tps if t <= 4]


# ---- quantization: which weights, ignore entries ---------------------------------------------

_PROJ = ["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.weight",
         "self_attn.v_proj.weight"]


def _proj(*layers, skip=()):
    return {f"model.layers.{i}.{p}" for i in layers for p in _PROJ if p not in skip}


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_names_default_ignore_takes_the_projections_only(dtype):
    # biases, norms, embeddings and lm_head stay 16-bit even with an empty ignore list
    model = _model(extra={"attention_bias": True, "mlp_bias": True}, **SMALL)
    assert quantized_names(model, _plan(1, dtype)) == _proj(0, 1)
    assert quantized_names(model, _plan(1, dtype, quant={"ignore": []})) == _proj(0, 1)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_quantized_names_empty_for_16_bit(dtype):
    assert quantized_names(_model(**SMALL), _plan(1, dtype, quant={"ignore": ["nothing.here"]})) == set()


@pytest.mark.parametrize("ignore,want", [
    (["layers.1"], _proj(0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)),  # not layers.10 / layers.11
    (["layers.10.mlp"], _proj(*range(12)) - {f"model.layers.10.{p}" for p in _PROJ[:3]}),
    (["q_proj", "self_attn.o_proj"], _proj(*range(12), skip=("self_attn.q_proj.weight",
                                                             "self_attn.o_proj.weight"))),
    (["model.layers.0.self_attn.q_proj.weight"], _proj(*range(12)) - {"model.layers.0.self_attn.q_proj.weight"}),
    (["weight"], set()),
    (["embed_tokens", "norm", "lm_head"], _proj(*range(12))),
])
def test_quantized_names_ignore_entries(ignore, want):
    model = _model(**{**SMALL, "num_layers": 12})
    assert quantized_names(model, _plan(1, "int8", quant={"ignore": ignore})) == want


def test_ignore_lm_head_accepted_when_tied():
    """A tied model has no lm_head tensor, but the default ignore list names it: not an error."""
    model = _model(tie_word_embeddings=True, **SMALL)
    assert quantized_names(model, _plan(1, "fp8", quant={"ignore": ["lm_head"]})) == _proj(0, 1)


@pytest.mark.parametrize("entry", ["layers.2", "lm_hea", "k_proj.bias", "model.layers.0.mlp.up_proj.weight.x"])
def test_ignore_entry_matching_nothing_refused(entry):
    with pytest.raises(QuantizationError) as e:
        quantized_names(_model(**SMALL), _plan(1, "int8", quant={"ignore": ["q_proj", entry]}))
    assert (e.value.message, e.value.key, e.value.hint) == (
        f"ignore entry {entry!r} matches no tensor of this model", "quantization.ignore",
        "use name parts such as lm_head, embed_tokens, layers.0, layers.79.mlp, q_proj")


@pytest.mark.parametrize("entry,name,want", [
    ("layers.1", "model.layers.1.mlp.up_proj.weight", True),
    ("layers.1", "model.layers.10.mlp.up_proj.weight", False),
    ("weight", "model.norm.weight", True),
    ("model", "model.norm.weight", True),
    ("model.norm.weight", "model.norm.weight", True),
    ("model.norm.weight.x", "model.norm.weight", False),
    ("norm.bias", "model.norm.weight", False),
])
def test_ignore_matches_whole_segments(entry, name, want):
    assert _ignore_matches(entry, name) is want


# ---- base dtype ------------------------------------------------------------------------------

@pytest.mark.parametrize("torch_dtype,dtype,quant,want", [
    ("bfloat16", "fp16", None, "F16"),
    ("float16", "bf16", None, "BF16"),
    ("float32", "fp16", {"base_dtype": "bf16"}, "F16"),  # base_dtype only applies when quantized
    ("float16", "int8", None, "F16"),
    ("bfloat16", "fp8", None, "BF16"),
    ("float32", "int8", None, "BF16"),
    ("float16", "int8", {"base_dtype": "bf16"}, "BF16"),
    ("bfloat16", "fp8", {"base_dtype": "fp16"}, "F16"),
])
def test_base_dtype(torch_dtype, dtype, quant, want):
    model = _model(torch_dtype=torch_dtype, **SMALL)
    assert base_dtype(model, _plan(1, dtype, quant=quant)) == want


# ---- int8 packing ----------------------------------------------------------------------------

def _packing_error(model, plan):
    with pytest.raises(LayoutError) as e:
        build_layout(model, plan)
    assert e.value.key == "replica_group.tp_degree"
    return e.value.message, e.value.hint


def test_packing_refusal_names_the_row_parallel_slice():
    # hidden 24, 4 heads of 8 (q out 32), 2 KV heads, intermediate 40: at tp=4 down_proj gets
    # 40/4 = 10 input columns (not a multiple of 4); o_proj 32/4 = 8 and the column-parallel
    # ones the whole 24 would be fine. tp 1 and 2 work (40, 20); tp 8 is invalid (4 heads).
    model = _model(hidden_size=24, num_heads=4, head_dim=8, num_kv_heads=2, intermediate_size=40)
    assert _packing_error(model, _plan(4, "int8")) == (
        "tensor model.layers.0.mlp.down_proj.weight gets 10 input columns per rank at tp=4; int8 is "
        "stored pack-quantized (4 values per int32), which needs a multiple of 4",
        "tp_degree values that work for this model with int8: 1, 2")
    build_layout(model, _plan(2, "int8"))
    build_layout(model, _plan(4, "fp8"))  # fp8 is stored unpacked: no constraint
    build_layout(model, _plan(4, "int8", quant={"ignore": ["mlp.down_proj"]}))


def test_packing_refusal_o_proj_when_mlp_ignored():
    # hidden 16, 4 heads of 6 (q out 24): o_proj gets 24/4 = 6 columns at tp=4; 12 at tp=2 works
    model = _model(hidden_size=16, num_heads=4, head_dim=6, num_kv_heads=4, intermediate_size=32)
    assert _packing_error(model, _plan(4, "int8", quant={"ignore": ["mlp"]})) == (
        "tensor model.layers.0.self_attn.o_proj.weight gets 6 input columns per rank at tp=4; int8 "
        "is stored pack-quantized (4 values per int32), which needs a multiple of 4",
        "tp_degree values that work for this model with int8: 1, 2")
    build_layout(model, _plan(4, "int8", quant={"ignore": ["mlp", "o_proj"]}))


def test_packing_refusal_column_parallel_input_width():
    # hidden 18: every column-parallel projection reads all 18 inputs at any tp, so none works.
    # The first quantized tensor by name is layer 0's down_proj: 36/2 = 18 columns.
    model = _model(hidden_size=18, num_heads=2, head_dim=9, num_kv_heads=2, intermediate_size=36)
    assert _packing_error(model, _plan(2, "int8")) == (
        "tensor model.layers.0.mlp.down_proj.weight gets 18 input columns per rank at tp=2; int8 is "
        "stored pack-quantized (4 values per int32), which needs a multiple of 4",
        "tp_degree values that work for this model with int8: none")
    # with the MLP kept 16-bit, k_proj (input 18, not sliced) is the first by name: at tp=1 too
    assert _packing_error(model, _plan(1, "int8", quant={"ignore": ["mlp"]})) == (
        "tensor model.layers.0.self_attn.k_proj.weight gets 18 input columns per rank at tp=1; int8 "
        "is stored pack-quantized (4 values per int32), which needs a multiple of 4",
        "tp_degree values that work for this model with int8: none")


def test_check_packing_direct():
    model = _model(hidden_size=24, num_heads=4, head_dim=8, num_kv_heads=2, intermediate_size=40)
    check_packing(model, _plan(4, "fp8"), {"model.layers.0.mlp.down_proj.weight"})
    check_packing(model, _plan(4, "int8"), set())  # nothing quantized: nothing packed
    with pytest.raises(LayoutError, match="down_proj.weight gets 10 input columns"):
        check_packing(model, _plan(4, "int8"), {"model.layers.1.mlp.down_proj.weight"})
