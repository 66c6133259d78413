"""layout/ranks.py pinned by hand-written tables: stage layer ranges, every tensor record of a
rank (owner, slice, local shape, vocabulary padding, replicated KV head, quantized companions),
the LayoutError messages, and rank selection. Every expectation is a literal written here for a
small concrete model, never derived by calling layout code (docs/mutation-testing.md).
"""

from __future__ import annotations

import json

import pytest
from plan_helpers import plan

from shardc.compiler.synthetic import llama_config
from shardc.errors import LayoutError, QuantizationError
from shardc.layout.model import model_from_config
from shardc.layout.ranks import (
    RankLayout,
    Split,
    TensorSpec,
    build_layout,
    check_degrees,
    padded_vocab,
    stage_ranges,
)

# hidden 16, 4 heads of 4, 2 KV heads, intermediate 32, vocab 10, 3 layers (bf16 source).
CFG = dict(hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
           vocab_size=10)


def _model(**over):
    cfg = llama_config(**{**CFG, **{k: v for k, v in over.items() if k != "extra"}})
    cfg.update(over.get("extra", {}))
    return model_from_config(cfg)


def _plan(tp, pp, dtype="bf16", pp_layers=None, quant=None):
    return plan(tp, pp, dtype, name="m", source="/nonexistent",
                model=None if pp_layers is None else {"pp_layers": pp_layers},
                **({} if quant is None else {"quantization": quant}))


def _records(rl: RankLayout) -> dict[str, dict]:
    return {t.name: t.record() for t in rl.tensors}


# ---- stage ranges --------------------------------------------------------------------------

@pytest.mark.parametrize("layers,pp,want", [
    (3, 1, [(0, 3)]),
    (3, 2, [(0, 2), (2, 3)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
])
def test_stage_ranges_even_with_remainder_first(layers, pp, want):
    assert stage_ranges(_model(num_layers=layers), _plan(1, pp)) == want


def test_stage_ranges_explicit_pp_layers():
    assert stage_ranges(_model(num_layers=5), _plan(1, 2, pp_layers=[1, 4])) == [(0, 1), (1, 5)]
    assert stage_ranges(_model(num_layers=5), _plan(1, 3, pp_layers=[3, 1, 1])) == [(0, 3), (3, 4), (4, 5)]


def test_stage_ranges_errors():
    with pytest.raises(LayoutError) as e:
        stage_ranges(_model(num_layers=3), _plan(1, 4))
    assert (e.value.message, e.value.key, e.value.hint) == (
        "pp_degree=4 exceeds num_hidden_layers=3", "replica_group.pp_degree", "use pp_degree <= 3")
    with pytest.raises(LayoutError) as e:
        stage_ranges(_model(num_layers=5), _plan(1, 2, pp_layers=[1, 3]))
    assert (e.value.message, e.value.key, e.value.hint) == (
        "[1, 3] sums to 4 but the model has 5 layers", "model.pp_layers",
        "layer counts must cover every layer exactly once")
    with pytest.raises(LayoutError, match="sums to 6"):
        stage_ranges(_model(num_layers=5), _plan(1, 2, pp_layers=[3, 3]))


def test_check_degrees():
    with pytest.raises(LayoutError) as e:
        check_degrees(_model(), _plan(3, 1))
    assert (e.value.message, e.value.key, e.value.hint) == (
        "num_attention_heads=4 is not divisible by tp=3", "replica_group.tp_degree",
        "tp_degree values that work for this model: 1, 2, 4")
    with pytest.raises(LayoutError, match="exceeds num_hidden_layers"):
        check_degrees(_model(), _plan(2, 4))
    assert check_degrees(_model(), _plan(4, 3)) is None


@pytest.mark.parametrize("vocab,tp,want", [(10, 1, 10), (10, 2, 10), (10, 4, 12), (10, 3, 12),
                                           (10, 5, 10), (10, 6, 12), (9, 4, 12)])
def test_padded_vocab(vocab, tp, want):
    assert padded_vocab(_model(vocab_size=vocab), tp) == want


# ---- every record of a rank ----------------------------------------------------------------

def _layer(i, q, kv, o, mlp, down, kv_head=None, q_dtype="BF16"):
    """Hand-written records of layer i's tensors on one rank (bf16, no quantization)."""
    p = f"model.layers.{i}."
    norm = {"dtype": "BF16", "shape": [16], "split": "replicated"}
    kvrec = {"dtype": "BF16", "shape": [kv[1] - kv[0], 16], "split": "kv_column", "dim": 0,
             "start": kv[0], "stop": kv[1]}
    if kv_head is not None:
        kvrec["kv_head"] = kv_head
    return {
        p + "input_layernorm.weight": {**norm, "source": p + "input_layernorm.weight"},
        p + "post_attention_layernorm.weight": {**norm, "source": p + "post_attention_layernorm.weight"},
        p + "self_attn.q_proj.weight": {"dtype": "BF16", "shape": [q[1] - q[0], 16], "split": "column",
                                        "dim": 0, "start": q[0], "stop": q[1],
                                        "source": p + "self_attn.q_proj.weight"},
        p + "self_attn.k_proj.weight": {**kvrec, "source": p + "self_attn.k_proj.weight"},
        p + "self_attn.v_proj.weight": {**kvrec, "source": p + "self_attn.v_proj.weight"},
        p + "self_attn.o_proj.weight": {"dtype": "BF16", "shape": [16, o[1] - o[0]], "split": "row",
                                        "dim": 1, "start": o[0], "stop": o[1],
                                        "source": p + "self_attn.o_proj.weight"},
        p + "mlp.gate_proj.weight": {"dtype": "BF16", "shape": [mlp[1] - mlp[0], 16], "split": "column",
                                     "dim": 0, "start": mlp[0], "stop": mlp[1],
                                     "source": p + "mlp.gate_proj.weight"},
        p + "mlp.up_proj.weight": {"dtype": "BF16", "shape": [mlp[1] - mlp[0], 16], "split": "column",
                                   "dim": 0, "start": mlp[0], "stop": mlp[1],
                                   "source": p + "mlp.up_proj.weight"},
        p + "mlp.down_proj.weight": {"dtype": "BF16", "shape": [16, down[1] - down[0]], "split": "row",
                                     "dim": 1, "start": down[0], "stop": down[1],
                                     "source": p + "mlp.down_proj.weight"},
    }


def _vocab(name, start, stop, pad, source=None):
    rec = {"dtype": "BF16", "shape": [3, 16], "split": "vocab", "dim": 0, "start": start,
           "stop": stop, "source": source or name}
    if pad:
        rec["pad_rows"] = pad
    return rec


# tp=4 > 2 KV heads: KV head 0 on tp ranks 0,1, head 1 on ranks 2,3; vocab 10 padded to 12.
Q = {0: (0, 4), 1: (4, 8), 2: (8, 12), 3: (12, 16)}
KV = {0: (0, 4), 1: (0, 4), 2: (4, 8), 3: (4, 8)}
KV_HEAD = {0: 0, 1: 0, 2: 1, 3: 1}
MLP = {0: (0, 8), 1: (8, 16), 2: (16, 24), 3: (24, 32)}
VOCAB = {0: (0, 3, 0), 1: (3, 6, 0), 2: (6, 9, 0), 3: (9, 10, 2)}


@pytest.mark.parametrize("tied", [False, True])
def test_tp4_pp2_every_record(tied):
    lay = build_layout(_model(tie_word_embeddings=tied), _plan(4, 2))
    assert lay.stages == ((0, 2), (2, 3))
    assert lay.padded_vocab == 12
    assert [(r.rank, r.tp_rank, r.pp_stage, r.layers, r.file) for r in lay.ranks] == [
        (0, 0, 0, (0, 2), "model-tp00-pp00.safetensors"),
        (1, 1, 0, (0, 2), "model-tp01-pp00.safetensors"),
        (2, 2, 0, (0, 2), "model-tp02-pp00.safetensors"),
        (3, 3, 0, (0, 2), "model-tp03-pp00.safetensors"),
        (4, 0, 1, (2, 3), "model-tp00-pp01.safetensors"),
        (5, 1, 1, (2, 3), "model-tp01-pp01.safetensors"),
        (6, 2, 1, (2, 3), "model-tp02-pp01.safetensors"),
        (7, 3, 1, (2, 3), "model-tp03-pp01.safetensors"),
    ]
    for t in range(4):
        a, b, pad = VOCAB[t]
        want0 = {"model.embed_tokens.weight": _vocab("model.embed_tokens.weight", a, b, pad)}
        for i in (0, 1):
            want0.update(_layer(i, Q[t], KV[t], Q[t], MLP[t], MLP[t], kv_head=KV_HEAD[t]))
        want1 = _layer(2, Q[t], KV[t], Q[t], MLP[t], MLP[t], kv_head=KV_HEAD[t])
        want1["model.norm.weight"] = {"dtype": "BF16", "shape": [16], "split": "replicated",
                                      "source": "model.norm.weight"}
        want1["lm_head.weight"] = _vocab(
            "lm_head.weight", a, b, pad, source="model.embed_tokens.weight" if tied else None)
        for s, want in ((0, want0), (1, want1)):
            rl = lay.rank(t, s)
            assert [x.name for x in rl.tensors] == sorted(want)
            assert _records(rl) == want, (t, s)
    # nbytes: rank 3 stage 1 = layer 2 (2 norms 16, q 4x16, k,v 4x16, o 16x4, gate/up 8x16,
    # down 16x8) + norm 16 + lm_head 3x16, all bf16
    assert lay.rank(3, 1).nbytes == 2 * (16 + 16 + 64 + 64 + 64 + 64 + 128 + 128 + 128 + 16 + 48)
    assert lay.rank(3, 1).tensor("lm_head.weight").nbytes == 96
    with pytest.raises(KeyError) as e:
        lay.rank(3, 1).tensor("model.embed_tokens.weight")
    assert e.value.args == ("model.embed_tokens.weight",)


def test_tp2_kv_divides_and_tp1_vocab():
    lay = build_layout(_model(), _plan(2, 1))
    r1 = _records(lay.rank(1, 0))
    assert r1["model.layers.0.self_attn.k_proj.weight"] == {
        "dtype": "BF16", "shape": [4, 16], "split": "kv_column", "dim": 0, "start": 4, "stop": 8,
        "source": "model.layers.0.self_attn.k_proj.weight"}
    assert r1["model.layers.2.self_attn.q_proj.weight"]["start"] == 8
    assert r1["lm_head.weight"] == {"dtype": "BF16", "shape": [5, 16], "split": "vocab", "dim": 0,
                                    "start": 5, "stop": 10, "source": "lm_head.weight"}
    lay = build_layout(_model(), _plan(1, 1))
    r0 = _records(lay.rank(0, 0))
    # tp=1: every split is the whole tensor, except vocab which still records its (full) slice
    assert r0["model.layers.0.self_attn.k_proj.weight"] == {
        "dtype": "BF16", "shape": [8, 16], "split": "kv_column",
        "source": "model.layers.0.self_attn.k_proj.weight"}
    assert r0["model.layers.0.mlp.down_proj.weight"] == {
        "dtype": "BF16", "shape": [16, 32], "split": "row",
        "source": "model.layers.0.mlp.down_proj.weight"}
    assert r0["model.embed_tokens.weight"] == {"dtype": "BF16", "shape": [10, 16], "split": "vocab",
                                               "dim": 0, "start": 0, "stop": 10,
                                               "source": "model.embed_tokens.weight"}
    assert len(r0) == 1 + 9 * 3 + 2


def test_tied_single_stage_has_no_lm_head():
    # pp=1: the one stage holds the embedding, which serves as the head; no lm_head.weight at all
    lay = build_layout(_model(tie_word_embeddings=True), _plan(2, 1))
    for t in range(2):
        names = [x.name for x in lay.rank(t, 0).tensors]
        assert "lm_head.weight" not in names
        assert len(names) == 1 + 9 * 3 + 1


def test_tp4_kv1_every_rank_holds_head_0():
    lay = build_layout(_model(num_kv_heads=1), _plan(4, 1))
    for t in range(4):
        assert _records(lay.rank(t, 0))["model.layers.1.self_attn.v_proj.weight"] == {
            "dtype": "BF16", "shape": [4, 16], "split": "kv_column", "dim": 0, "start": 0,
            "stop": 4, "kv_head": 0, "source": "model.layers.1.self_attn.v_proj.weight"}


def test_vocab_smaller_than_tp_padding():
    # vocab 10 at tp=8 would fail on heads; use 8 heads of 2, 8 KV heads, vocab 10 -> 16 rows
    lay = build_layout(_model(num_heads=8, num_kv_heads=8, vocab_size=10), _plan(8, 1))
    got = [(lay.rank(t, 0).tensor("lm_head.weight").start, lay.rank(t, 0).tensor("lm_head.weight").stop,
            lay.rank(t, 0).tensor("lm_head.weight").pad_rows) for t in range(8)]
    assert got == [(0, 2, 0), (2, 4, 0), (4, 6, 0), (6, 8, 0), (8, 10, 0), (10, 10, 2), (10, 10, 2),
                   (10, 10, 2)]
    assert lay.rank(7, 0).tensor("lm_head.weight").shape == (2, 16)


def test_biases_sliced():
    lay = build_layout(_model(extra={"attention_bias": True}), _plan(4, 1))
    r = _records(lay.rank(3, 0))
    assert r["model.layers.0.self_attn.q_proj.bias"] == {
        "dtype": "BF16", "shape": [4], "split": "column", "dim": 0, "start": 12, "stop": 16,
        "source": "model.layers.0.self_attn.q_proj.bias"}
    assert r["model.layers.0.self_attn.k_proj.bias"] == {
        "dtype": "BF16", "shape": [4], "split": "kv_column", "dim": 0, "start": 4, "stop": 8,
        "kv_head": 1, "source": "model.layers.0.self_attn.k_proj.bias"}


# ---- quantized weights -----------------------------------------------------------------------

def test_fp8_records_tp4():
    lay = build_layout(_model(), _plan(4, 1, dtype="fp8"))
    r = _records(lay.rank(2, 0))
    k = "model.layers.1.self_attn.k_proj.weight"
    assert r[k] == {"dtype": "F8_E4M3", "shape": [4, 16], "split": "kv_column", "dim": 0,
                    "start": 4, "stop": 8, "kv_head": 1, "quant": "fp8", "source": k}
    assert r[k + "_scale"] == {"dtype": "F32", "shape": [4, 1], "split": "kv_column", "dim": 0,
                               "start": 4, "stop": 8, "kv_head": 1, "quant": "fp8", "source": k,
                               "scale_of": k}
    g = "model.layers.0.mlp.gate_proj.weight"
    assert r[g + "_scale"] == {"dtype": "F32", "shape": [8, 1], "split": "column", "dim": 0,
                               "start": 16, "stop": 24, "quant": "fp8", "source": g, "scale_of": g}
    o = "model.layers.0.self_attn.o_proj.weight"
    assert r[o] == {"dtype": "F8_E4M3", "shape": [16, 4], "split": "row", "dim": 1, "start": 8,
                    "stop": 12, "quant": "fp8", "source": o}
    assert r[o + "_scale"] == {"dtype": "F32", "shape": [16, 1], "split": "replicated",
                               "quant": "fp8", "source": o, "scale_of": o}
    # not quantized: norms, embeddings, lm_head stay in the source's 16-bit dtype
    assert r["model.layers.0.input_layernorm.weight"]["dtype"] == "BF16"
    assert r["lm_head.weight"]["dtype"] == "BF16" and "quant" not in r["lm_head.weight"]
    assert "lm_head.weight_scale" not in r
    assert len(r) == 1 + 3 * (9 + 7) + 2


def test_int8_packed_records_tp2():
    lay = build_layout(_model(), _plan(2, 1, dtype="int8", quant={"base_dtype": "fp16"}))
    r = _records(lay.rank(1, 0))
    d = "model.layers.2.mlp.down_proj.weight"
    assert d not in r
    assert r[d + "_packed"] == {"dtype": "I32", "shape": [16, 4], "split": "row", "dim": 1,
                                "start": 16, "stop": 32, "quant": "int8", "pack": 4, "source": d}
    assert r[d + "_shape"] == {"dtype": "I64", "shape": [2], "split": "row", "quant": "int8",
                               "value": [16, 16], "source": d}
    assert r[d + "_scale"] == {"dtype": "F32", "shape": [16, 1], "split": "replicated",
                               "quant": "int8", "source": d, "scale_of": d}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert r[q + "_packed"] == {"dtype": "I32", "shape": [8, 4], "split": "column", "dim": 0,
                                "start": 8, "stop": 16, "quant": "int8", "pack": 4, "source": q}
    assert r[q + "_shape"]["value"] == [8, 16]
    assert lay.rank(1, 0).tensor(q + "_shape").value == (8, 16)
    assert lay.rank(1, 0).tensor(q + "_shape").nbytes == 16
    assert r[q + "_scale"] == {"dtype": "F32", "shape": [8, 1], "split": "column", "dim": 0,
                               "start": 8, "stop": 16, "quant": "int8", "source": q, "scale_of": q}
    assert r["model.norm.weight"]["dtype"] == "F16"
    # shapes are ints (the manifest and the safetensors header write them as JSON integers)
    assert json.dumps(r[d + "_packed"]["shape"]) == "[16, 4]"
    assert json.dumps(r[q + "_packed"]["shape"]) == "[8, 4]"


def test_quant_ignore_keeps_16_bit():
    lay = build_layout(_model(), _plan(2, 1, dtype="fp8", quant={"ignore": ["layers.1"]}))
    r = _records(lay.rank(0, 0))
    assert r["model.layers.1.mlp.up_proj.weight"]["dtype"] == "BF16"
    assert "model.layers.1.mlp.up_proj.weight_scale" not in r
    assert r["model.layers.2.mlp.up_proj.weight"]["dtype"] == "F8_E4M3"


def test_tensorspec_record_drops_empty_fields():
    t = TensorSpec(name="x", dtype="F32", shape=(2, 3), source="x", split=Split.REPLICATED)
    assert t.record() == {"dtype": "F32", "shape": [2, 3], "source": "x", "split": "replicated"}
    assert t.nbytes == 24
    t = TensorSpec(name="x", dtype="I64", shape=(2,), source="y", split=Split.ROW, dim=0, start=0,
                   stop=0, pad_rows=3, kv_head=0, value=(4, 5))
    assert t.record() == {"dtype": "I64", "shape": [2], "source": "y", "split": "row", "dim": 0,
                          "start": 0, "stop": 0, "pad_rows": 3, "kv_head": 0, "value": [4, 5]}


# ---- refusals and selection ----------------------------------------------------------------

@pytest.mark.parametrize("block,key,message", [
    ({"quant_method": "fp8"}, "quantization_config.weight_block_size",
     "is missing: per-tensor fp8 is not read, only block-scaled"),
    ({}, "quantization_config.quant_method", "quant_method None is not a source format shardc reads (it reads fp8, compressed-tensors, mxfp4, modelopt)"),
    ({"quant_method": "gptq"}, "quantization_config.quant_method",
     "quant_method 'gptq' is not a source format shardc reads (it reads fp8, compressed-tensors, mxfp4, modelopt)"),
    ("x", "quantization_config", "must be a mapping"),
])
def test_source_quantization_config_not_read_is_refused(block, key, message):
    """A quantized source is read only in a format shardc implements (layout/quant_formats/, #31):
    any other quantization_config is refused by name, never read as 16-bit weights."""
    with pytest.raises(QuantizationError) as e:
        build_layout(_model(extra={"quantization_config": block}), _plan(1, 1))
    assert (e.value.message, e.value.key) == (message, key)


def test_build_layout_checks_degrees_first():
    with pytest.raises(LayoutError, match="num_attention_heads=4 is not divisible by tp=3"):
        build_layout(_model(), _plan(3, 1))


def test_rank_and_select():
    lay = build_layout(_model(), _plan(2, 3))
    assert lay.rank(1, 2).rank == 5 and lay.rank(0, 1).rank == 2
    for t, p in ((2, 0), (-1, 0), (0, 3), (0, -1)):
        with pytest.raises(LayoutError) as e:
            lay.rank(t, p)
        assert (e.value.message, e.value.key, e.value.hint) == (
            f"rank tp={t} pp={p} is outside tp_degree=2 pp_degree=3", "tp_rank",
            "tp ranks 0..1, pp stages 0..2")
    assert [r.rank for r in lay.select()] == [0, 1, 2, 3, 4, 5]
    assert [r.rank for r in lay.select(ranks=[4, 1, 4], pairs=[(1, 0), (0, 2)])] == [1, 4]
    assert [r.rank for r in lay.select(pairs=[(1, 1)])] == [3]
    assert [r.rank for r in lay.select(ranks=[0, 5])] == [0, 5]
    for bad in (6, -1):
        with pytest.raises(LayoutError) as e:
            lay.select(ranks=[bad])
        assert (e.value.message, e.value.key, e.value.hint) == (
            f"{bad} is outside 0..5 for this plan", "rank", "this plan has 6 ranks")
    with pytest.raises(LayoutError) as e:
        lay.select(ranks=[0], pairs=[(0, 3)])
    assert e.value.key == "tp_rank"
