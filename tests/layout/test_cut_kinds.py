"""layout/cuts.py's STACKED and FUSED kinds pinned by hand-written cuts, for several tp (and EP) ranks.

Every expected dim, start, stop, piece and shape below is a literal worked out by hand for two small
models, never computed by layout code (docs/mutation-testing.md). The conventions they encode are
the readers' of these checkpoints, not shardc's:

- gpt-oss (transformers' ``GptOssExperts``): ``gate_up_proj`` [E, hidden, 2·inter] with gate and up
  interleaved along the last dimension (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``),
  ``down_proj`` [E, inter, hidden]. vLLM's ``gpt_oss.py`` loader cuts TP rank r's gate_up at
  ``[2·r·inter/tp, 2·(r+1)·inter/tp)`` of that dimension (whole gate/up pairs, the pairs of the
  inter rows the rank's down slice holds), its bias the same, down at ``[r·inter/tp, (r+1)·inter/tp)``
  of dim 1, and loads down's bias whole (added once); with expert parallelism each rank takes its
  experts' contiguous block of dim 0 (``FusedMoE``'s linear map: the remainder to the first ranks).
- Phi-3 (transformers' ``Phi3Attention`` / ``Phi3MLP``): ``qkv_proj`` [q + 2·kv, hidden] holds q,
  then k, then v along dim 0; ``gate_up_proj`` [2·inter, hidden] gate then up (``chunk(2)``). A TP
  rank holds its q heads, its KV head (whole and replicated when tp > kv heads, as vLLM's
  ``QKVParallelLinear`` does) and its gate and up rows, end to end in that order.
"""

from __future__ import annotations

import pytest
from plan_helpers import plan

from shardc.errors import LayoutError
from shardc.layout.cuts import Cut, slice_for_rank
from shardc.layout.model import model_from_config
from shardc.layout.ranks import build_layout
from shardc.layout.tensors import COLUMN, FUSED, KV_COLUMN, STACKED, tensor_table

# gpt-oss: hidden 8, 4 heads of 2, 2 KV heads, 3 experts, inter 12 (gate_up's last dimension 24).
GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=8, intermediate_size=12,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=2, vocab_size=16,
               num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5)
# Phi-3: hidden 8, 4 heads of 2 (q: 8 rows), 2 KV heads (k, v: 4 rows each), inter 12.
PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=8, intermediate_size=12,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
            max_position_embeddings=64, rms_norm_eps=1e-5)

E = "model.layers.0.mlp.experts."
GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS = (E + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                          "down_proj_bias"))
QKV, FUSED_GATE_UP = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"


def _model(cfg, **over):
    return model_from_config({**cfg, **over})


def _same(got: Cut, want: Cut) -> None:
    """Equal field by field and in every number's type: a float 6.0 equals 6 but is written to the
    manifest as 6.0 (and cannot index), so the reprs are compared too."""
    assert got == want
    assert repr(got) == repr(want)


# ---- STACKED (gpt-oss experts) -----------------------------------------------------------------

# (shape, tp_dim) as the gpt-oss table declares them for 3 experts, hidden 8, inter 12
STACKED_ROWS = {GATE_UP: ((3, 8, 24), 2), GATE_UP_BIAS: ((3, 24), 1), DOWN: ((3, 12, 8), 1),
                DOWN_BIAS: ((3, 8), None)}

# Each TP rank's cut, by hand. tp 2: gate_up columns [0, 12) | [12, 24) hold the gate/up pairs of
# inter rows [0, 6) | [6, 12), which are down's rows of the same rank. tp 4: 6 columns (3 pairs) and
# 3 down rows per rank. down's bias is whole on every rank.
STACKED_CUTS = {
    2: {GATE_UP: [Cut((3, 8, 12), 2, 0, 12), Cut((3, 8, 12), 2, 12, 24)],
        GATE_UP_BIAS: [Cut((3, 12), 1, 0, 12), Cut((3, 12), 1, 12, 24)],
        DOWN: [Cut((3, 6, 8), 1, 0, 6), Cut((3, 6, 8), 1, 6, 12)],
        DOWN_BIAS: [Cut((3, 8)), Cut((3, 8))]},
    4: {GATE_UP: [Cut((3, 8, 6), 2, 0, 6), Cut((3, 8, 6), 2, 6, 12), Cut((3, 8, 6), 2, 12, 18),
                  Cut((3, 8, 6), 2, 18, 24)],
        GATE_UP_BIAS: [Cut((3, 6), 1, 0, 6), Cut((3, 6), 1, 6, 12), Cut((3, 6), 1, 12, 18), Cut((3, 6), 1, 18, 24)],
        DOWN: [Cut((3, 3, 8), 1, 0, 3), Cut((3, 3, 8), 1, 3, 6), Cut((3, 3, 8), 1, 6, 9), Cut((3, 3, 8), 1, 9, 12)],
        DOWN_BIAS: [Cut((3, 8))] * 4},
}


def test_the_gpt_oss_table_declares_the_stacked_rows():
    """The rows the cuts below are asked about: shapes [E, hidden, 2·inter], [E, 2·inter],
    [E, inter, hidden], [E, hidden] and the dimension TP cuts in each."""
    table = tensor_table(_model(GPT_OSS))
    assert {n: (table[n].shape, table[n].tp_dim) for n in STACKED_ROWS} == STACKED_ROWS
    assert {table[n].split for n in STACKED_ROWS} == {STACKED}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(STACKED_ROWS))
def test_stacked_cuts_by_tp_rank(tp, name):
    model = _model(GPT_OSS)
    shape, tp_dim = STACKED_ROWS[name]
    for r, want in enumerate(STACKED_CUTS[tp][name]):
        _same(slice_for_rank(STACKED, shape, r, model, tp, tp_dim=tp_dim), want)


@pytest.mark.parametrize("name", sorted(STACKED_ROWS))
def test_stacked_at_tp1_is_whole(name):
    shape, tp_dim = STACKED_ROWS[name]
    _same(slice_for_rank(STACKED, shape, 0, _model(GPT_OSS), 1, tp_dim=tp_dim), Cut(shape))


def test_stacked_cuts_in_the_layout_without_and_with_expert_parallelism():
    """The Layout's records for the same tensors: TP 2 cuts as above; expert parallelism over
    2 ranks gives rank 0 experts 0 and 1 (rows [0, 2) of dim 0) and rank 1 expert 2 ([2, 3)), each
    tensor otherwise whole (down's bias too: an expert's bias goes with its expert)."""
    model = _model(GPT_OSS)
    for ep, want in [
        (False, [{GATE_UP: (2, 0, 12, (3, 8, 12)), GATE_UP_BIAS: (1, 0, 12, (3, 12)), DOWN: (1, 0, 6, (3, 6, 8)),
                  DOWN_BIAS: (None, None, None, (3, 8))},
                 {GATE_UP: (2, 12, 24, (3, 8, 12)), GATE_UP_BIAS: (1, 12, 24, (3, 12)), DOWN: (1, 6, 12, (3, 6, 8)),
                  DOWN_BIAS: (None, None, None, (3, 8))}]),
        (True, [{GATE_UP: (0, 0, 2, (2, 8, 24)), GATE_UP_BIAS: (0, 0, 2, (2, 24)), DOWN: (0, 0, 2, (2, 12, 8)),
                 DOWN_BIAS: (0, 0, 2, (2, 8))},
                {GATE_UP: (0, 2, 3, (1, 8, 24)), GATE_UP_BIAS: (0, 2, 3, (1, 24)), DOWN: (0, 2, 3, (1, 12, 8)),
                 DOWN_BIAS: (0, 2, 3, (1, 8))}]),
    ]:
        layout = build_layout(model, plan(2, name="g", source="/nonexistent",
                                          group={"expert_parallel": True} if ep else None))
        assert [rl.experts for rl in layout.ranks] == ([(0, 1), (2,)] if ep else [(), ()])
        for rl, cuts in zip(layout.ranks, want, strict=True):
            got = {n: (t.dim, t.start, t.stop, t.shape) for n in cuts for t in [rl.tensor(n)]}
            assert got == cuts, (ep, rl.tp_rank)
            assert {rl.tensor(n).split for n in cuts} == {STACKED}


# ---- STACKED MXFP4 kept as stored (#46): gpt-oss-120b's widths -----------------------------------

# hidden and intermediate 2,880 (90 32-value blocks), 64 heads, 8 KV heads, 4 experts, the experts
# MXFP4 as published (blocks [E, out, in/32, 16], scales [E, out, in/32])
GPT_OSS_MXFP4 = dict(GPT_OSS, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                     head_dim=64, num_local_experts=4, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                         "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def test_mxfp4_experts_at_tp2_are_cut_where_vllm_cuts_them():
    """vLLM's MXFP4 loader (gpt_oss.py ``_load_weights_mxfp4``) at tp 2: 90 blocks, ceil(90 / 2)·32
    = 1,440 intermediate values a rank, rank r [1440·r, 1440·(r+1)). gate_up's blocks and scales:
    rows 2·start:2·end = [0, 2880) | [2880, 5760) of dim 1 (the weight's dim 2: stored transposed);
    down's: block columns start/32:end/32 = [0, 45) | [45, 90) of dim 2 (the weight's dim 1)."""
    layout = build_layout(_model(GPT_OSS_MXFP4), plan(2, dtype="source", name="g", source="/nonexistent"))
    want = [{GATE_UP + "_blocks": (1, 0, 2880, (4, 2880, 90, 16)), GATE_UP + "_scales": (1, 0, 2880, (4, 2880, 90)),
             DOWN + "_blocks": (2, 0, 45, (4, 2880, 45, 16)), DOWN + "_scales": (2, 0, 45, (4, 2880, 45))},
            {GATE_UP + "_blocks": (1, 2880, 5760, (4, 2880, 90, 16)), GATE_UP + "_scales": (1, 2880, 5760, (4, 2880, 90)),
             DOWN + "_blocks": (2, 45, 90, (4, 2880, 45, 16)), DOWN + "_scales": (2, 45, 90, (4, 2880, 45))}]
    for rl, cuts in zip(layout.ranks, want, strict=True):
        assert {n: (t.dim, t.start, t.stop, t.shape) for n in cuts for t in [rl.tensor(n)]} == cuts
        assert {rl.tensor(n).dtype for n in cuts} == {"U8"}
        assert not any(t.name in (GATE_UP, DOWN) for t in rl.tensors)  # stored only as blocks + scales


@pytest.mark.parametrize(("tp", "per", "blocks"), [(4, 720, "22.5"), (8, 360, "11.25")])
def test_mxfp4_experts_cut_inside_a_block_are_refused_in_words(tp, per, blocks):
    """2,880 / tp not whole blocks (vLLM pads such ranks with zeros; shardc's are equal): one line
    naming the tensor, the intermediate size, its 90 blocks, each rank's share, the tp degrees that
    keep whole blocks (1, 2) and bf16."""
    with pytest.raises(LayoutError) as e:
        build_layout(_model(GPT_OSS_MXFP4), plan(tp, dtype="source", name="g", source="/nonexistent"))
    assert e.value.one_line() == (
        f"replica_group.tp_degree: tensor {DOWN} [4, 2880, 2880]: each expert's intermediate size 2880 is 90 "
        "32-value mxfp4 blocks (down_proj_blocks, down_proj_scales), cut only between blocks (vLLM pads a cut "
        f"inside one with zeros into ranks of unequal size, which shardc does not make), and each rank would hold "
        f"{per} values, {blocks} blocks at tp={tp} (hint: tp_degree values that keep every mxfp4 (e2m1, 32-value "
        "blocks) cell whole: 1, 2 (or dtype: bf16, which dequantizes))")


# ---- FUSED (Phi-3's qkv_proj and gate_up_proj) -------------------------------------------------

QKV_PARTS = ((8, COLUMN), (4, KV_COLUMN), (4, KV_COLUMN))  # q [0, 8), k [8, 12), v [12, 16)
GATE_UP_PARTS = ((12, COLUMN), (12, COLUMN))  # gate [0, 12), up [12, 24)

# Each TP rank's pieces, by hand. tp 2 (2 KV heads: one each): q heads 0-1 | 2-3, KV head 0 | 1.
# tp 4 > 2 KV heads: one q head each; ranks 0-1 hold KV head 0 (k [8, 10), v [12, 14)) whole,
# ranks 2-3 KV head 1 (k [10, 12), v [14, 16)).
FUSED_CUTS = {
    2: {QKV: [Cut((8, 8), 0, pieces=((0, 4), (8, 10), (12, 14))),
              Cut((8, 8), 0, pieces=((4, 8), (10, 12), (14, 16)))],
        FUSED_GATE_UP: [Cut((12, 8), 0, pieces=((0, 6), (12, 18))), Cut((12, 8), 0, pieces=((6, 12), (18, 24)))]},
    4: {QKV: [Cut((6, 8), 0, pieces=((0, 2), (8, 10), (12, 14)), kv_head=0),
              Cut((6, 8), 0, pieces=((2, 4), (8, 10), (12, 14)), kv_head=0),
              Cut((6, 8), 0, pieces=((4, 6), (10, 12), (14, 16)), kv_head=1),
              Cut((6, 8), 0, pieces=((6, 8), (10, 12), (14, 16)), kv_head=1)],
        FUSED_GATE_UP: [Cut((6, 8), 0, pieces=((0, 3), (12, 15))), Cut((6, 8), 0, pieces=((3, 6), (15, 18))),
                        Cut((6, 8), 0, pieces=((6, 9), (18, 21))), Cut((6, 8), 0, pieces=((9, 12), (21, 24)))]},
}
FUSED_ROWS = {QKV: ((16, 8), QKV_PARTS), FUSED_GATE_UP: ((24, 8), GATE_UP_PARTS)}


def test_the_phi3_table_declares_the_fused_rows():
    table = tensor_table(_model(PHI3))
    assert {n: (table[n].shape, table[n].parts) for n in FUSED_ROWS} == FUSED_ROWS
    assert {table[n].split for n in FUSED_ROWS} == {FUSED}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(FUSED_ROWS))
def test_fused_pieces_by_tp_rank(tp, name):
    model = _model(PHI3)
    shape, parts = FUSED_ROWS[name]
    for r, want in enumerate(FUSED_CUTS[tp][name]):
        _same(slice_for_rank(FUSED, shape, r, model, tp, parts), want)


@pytest.mark.parametrize("name", sorted(FUSED_ROWS))
def test_fused_at_tp1_is_whole(name):
    shape, parts = FUSED_ROWS[name]
    _same(slice_for_rank(FUSED, shape, 0, _model(PHI3), 1, parts), Cut(shape))


def test_fused_with_one_kv_head_replicates_it_on_every_rank():
    """1 KV head at tp 2 (qkv [8 + 2 + 2, 8]): each rank holds half of q and the one head whole;
    kv_head 0 is recorded (0, not None: the rank replicates head 0)."""
    model = _model(PHI3, num_key_value_heads=1)
    parts = ((8, COLUMN), (2, KV_COLUMN), (2, KV_COLUMN))
    want = [Cut((8, 8), 0, pieces=((0, 4), (8, 10), (10, 12)), kv_head=0),
            Cut((8, 8), 0, pieces=((4, 8), (8, 10), (10, 12)), kv_head=0)]
    for r in range(2):
        _same(slice_for_rank(FUSED, (12, 8), r, model, 2, parts), want[r])


def test_a_kv_part_before_a_column_part_keeps_its_head():
    """The pieces follow the parts' order whatever it is, and the replicated KV head is the one a
    KV part names even when a column part comes after it: k [0, 4), v [4, 8), then 8 column rows
    [8, 16) at tp 4 (2 KV heads of 2 rows): rank 2 holds k's head 1 [2, 4), v's [6, 8), rows
    [12, 14)."""
    parts = ((4, KV_COLUMN), (4, KV_COLUMN), (8, COLUMN))
    want = [Cut((6, 8), 0, pieces=((0, 2), (4, 6), (8, 10)), kv_head=0),
            Cut((6, 8), 0, pieces=((0, 2), (4, 6), (10, 12)), kv_head=0),
            Cut((6, 8), 0, pieces=((2, 4), (6, 8), (12, 14)), kv_head=1),
            Cut((6, 8), 0, pieces=((2, 4), (6, 8), (14, 16)), kv_head=1)]
    model = _model(PHI3)
    for r in range(4):
        _same(slice_for_rank(FUSED, (16, 8), r, model, 4, parts), want[r])


@pytest.mark.parametrize("parts,line", [
    (((8, COLUMN), (4, KV_COLUMN)), "fused parts cover 12 of 16 rows"),
    (((8, COLUMN), (4, KV_COLUMN), (4, KV_COLUMN), (4, COLUMN)), "fused parts cover 20 of 16 rows"),
])
def test_fused_parts_that_do_not_cover_the_tensor_are_a_bug(parts, line):
    """The family's table is wrong, not the input: an AssertionError, never a silent wrong cut."""
    with pytest.raises(AssertionError) as err:
        slice_for_rank(FUSED, (16, 8), 0, _model(PHI3), 2, parts)
    assert str(err.value) == line


def test_fused_cuts_in_the_layout():
    """The Layout's records of rank 3 at tp 4 (and of rank 1 at tp 2): the pieces, dim 0, no
    start/stop, the local shape, the replicated KV head; the manifest record lists the pieces."""
    model = _model(PHI3)
    rl = build_layout(model, plan(4, name="p", source="/nonexistent")).ranks[3]
    qkv, gate_up = rl.tensor(QKV), rl.tensor(FUSED_GATE_UP)
    assert (qkv.split, qkv.dim, qkv.start, qkv.stop, qkv.shape, qkv.pieces, qkv.kv_head) == (
        FUSED, 0, None, None, (6, 8), ((6, 8), (10, 12), (14, 16)), 1)
    assert (gate_up.dim, gate_up.shape, gate_up.pieces, gate_up.kv_head) == (0, (6, 8), ((9, 12), (21, 24)), None)
    assert qkv.record() == {"dtype": "BF16", "shape": [6, 8], "source": QKV, "split": "fused", "dim": 0,
                            "kv_head": 1, "pieces": [[6, 8], [10, 12], [14, 16]]}
    rl = build_layout(model, plan(2, name="p", source="/nonexistent")).ranks[1]
    assert (rl.tensor(QKV).pieces, rl.tensor(QKV).kv_head, rl.tensor(QKV).shape) == (
        ((4, 8), (10, 12), (14, 16)), None, (8, 8))
    assert rl.tensor(FUSED_GATE_UP).pieces == ((6, 12), (18, 24))
