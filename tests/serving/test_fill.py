"""The load format's pure rules (shardc/serving/fill.py), without vLLM: which shard tensors fill
which engine parameters, and every way a build and an engine can disagree refused with one line
naming the parameter (the end-to-end proofs against vLLM itself are test_vllm_*.py)."""

from __future__ import annotations

import pytest

from shardc.errors import ServeError
from shardc.serving.fill import (
    Engine,
    ModelFacts,
    Param,
    Tensor,
    check_engine,
    check_experts,
    fill_plan,
)

P = "model.layers.0."
LLAMA = ModelFacts(packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
MIXTRAL_EXPERTS = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                   "block_sparse_moe.experts.{e}.w2.weight")


def _t(name: str, *shape: int, dtype: str = "bfloat16", rows: tuple[int, int] | None = None) -> Tensor:
    return Tensor(name, shape, dtype, rows)


def _attention_shard() -> list[Tensor]:  # tp=2 of 4 q heads, 2 kv heads, head_dim 32, hidden 128
    return [_t(P + "self_attn.q_proj.weight", 64, 128), _t(P + "self_attn.k_proj.weight", 32, 128),
            _t(P + "self_attn.v_proj.weight", 32, 128), _t(P + "self_attn.o_proj.weight", 128, 64)]


def _fill(shard: list[Tensor], params: list[Param], facts: ModelFacts = LLAMA, must: list[str] | None = None):
    return fill_plan(shard, params, [p.name for p in params] if must is None else must, facts)


def test_packed_modules_are_their_members_cuts_end_to_end():
    qkv = Param(P + "self_attn.qkv_proj.weight", (128, 128), "bfloat16")
    o = Param(P + "self_attn.o_proj.weight", (128, 64), "bfloat16")
    plan = _fill(_attention_shard(), [qkv, o])
    assert [(pc.tensor.rsplit(".", 2)[1], pc.offset, pc.rows) for pc in plan[qkv.name]] == [
        ("k_proj", 64, 32), ("q_proj", 0, 64), ("v_proj", 96, 32)]
    assert [(pc.tensor, pc.offset, pc.rows) for pc in plan[o.name]] == [(o.name, 0, 128)]


def test_a_member_the_engine_keeps_apart_is_loaded_as_itself():
    # DeepSeek without q_lora_rank: the packed mapping names fused_qkv_a_proj, the model has none
    facts = ModelFacts(packed={"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")})
    kv_a = Param(P + "self_attn.kv_a_proj_with_mqa.weight", (96, 128), "bfloat16")
    plan = _fill([_t(kv_a.name, 96, 128)], [kv_a], facts)
    assert plan[kv_a.name][0].offset == 0


def test_experts_fill_fused_moe_stacks_by_the_engines_local_index():
    facts = ModelFacts(expert_templates=MIXTRAL_EXPERTS, local_experts={2: 0, 3: 1})
    pre = P + "block_sparse_moe.experts."
    shard = [_t(f"{pre}{e}.{w}.weight", *((64, 128) if w != "w2" else (128, 64))) for e in (2, 3)
             for w in ("w1", "w2", "w3")]
    w13 = Param(pre + "routed_experts.w13_weight", (2, 128, 128), "bfloat16")
    w2 = Param(pre + "routed_experts.w2_weight", (2, 128, 64), "bfloat16")
    plan = _fill(shard, [w13, w2], facts)
    assert sorted((pc.tensor.split(".")[-3:-1][0], pc.tensor.split(".")[-2], pc.expert, pc.offset)
                  for pc in plan[w13.name]) == [("2", "w1", 0, 0), ("2", "w3", 0, 64), ("3", "w1", 1, 0),
                                                ("3", "w3", 1, 64)]
    assert sorted((pc.expert, pc.offset, pc.rows) for pc in plan[w2.name]) == [(0, 0, 128), (1, 0, 128)]
    # an expert the engine places elsewhere: refused, naming the tensor
    with pytest.raises(ServeError) as err:
        _fill(shard, [w13, w2], ModelFacts(expert_templates=MIXTRAL_EXPERTS, local_experts={0: 0, 1: 1}))
    assert err.value.one_line().startswith(pre + "2.w1.weight: the shard holds expert 2, which the engine places "
                                                 "on another rank")


def test_vocabulary_rows_must_be_the_ones_the_engine_gives_the_rank():
    emb = Param("model.embed_tokens.weight", (128, 128), "bfloat16", vocab=(128, 256))
    plan = _fill([_t(emb.name, 128, 128, rows=(128, 256))], [emb])
    assert plan[emb.name][0].rows == 128
    # vocabulary 1000 at tp=2: shardc cuts 500 rows a rank, vLLM pads to 1024 and gives rank 1 512..999
    emb = Param("model.embed_tokens.weight", (512, 128), "bfloat16", vocab=(512, 1000))
    with pytest.raises(ServeError) as err:
        _fill([_t(emb.name, 500, 128, rows=(500, 1000))], [emb])
    assert err.value.one_line().startswith("model.embed_tokens.weight: the engine gives this rank vocabulary "
                                           "rows [512, 1000], the build's shard holds [500, 1000]")


@pytest.mark.parametrize("case, message", [
    ("missing", "self_attn.qkv_proj.bias: no tensor of the rank's shard fills this parameter"),
    ("extra", "self_attn.o_proj.bias: the shard's tensor fills no parameter of the engine's model"),
    ("short", "self_attn.qkv_proj.weight: the shard fills 96 of its 128 rows"),
    ("shape", "self_attn.o_proj.weight: shape [128, 64] cannot hold the shard's model.layers.0.self_attn."
              "o_proj.weight [128, 32]"),
    ("narrowing", "self_attn.o_proj.weight: the shard's model.layers.0.self_attn.o_proj.weight is float32, "
                  "the parameter bfloat16"),
    ("fp16", "self_attn.qkv_proj.weight: the shard's model.layers.0.self_attn.k_proj.weight is bfloat16, "
             "the parameter float16"),
])
def test_every_disagreement_is_one_line_naming_the_parameter(case, message):
    shard = _attention_shard()
    qkv = Param(P + "self_attn.qkv_proj.weight", (128, 128), "float16" if case == "fp16" else "bfloat16")
    o = Param(P + "self_attn.o_proj.weight", (128, 64), "bfloat16")
    params = [qkv, o]
    if case == "missing":
        params.append(Param(P + "self_attn.qkv_proj.bias", (128,), "bfloat16"))
    elif case == "extra":
        shard.append(_t(P + "self_attn.o_proj.bias", 128))
    elif case == "short":
        shard = [t for t in shard if "v_proj" not in t.name]
    elif case == "shape":
        shard[-1] = _t(o.name, 128, 32)
    elif case == "narrowing":
        shard[-1] = _t(o.name, 128, 64, dtype="float32")
    with pytest.raises(ServeError) as err:
        _fill(shard, params)
    assert err.value.one_line().startswith(P + message), err.value.one_line()
    assert "\n" not in err.value.one_line()


def test_widening_to_float32_is_exact_and_allowed():
    gate = Param(P + "mlp.gate.weight", (4, 128), "float32")  # a router vLLM keeps in fp32
    assert _fill([_t(gate.name, 4, 128)], [gate])[gate.name][0].rows == 4


def test_rows_filled_twice_are_refused():
    qkv = Param(P + "self_attn.qkv_proj.weight", (128, 128), "bfloat16")
    facts = ModelFacts(packed={"qkv_proj": ("q_proj", "k_proj", "k_proj", "v_proj")})
    with pytest.raises(ServeError, match="not filled \\(or filled twice\\)|fills 160 of its 128 rows"):
        _fill(_attention_shard()[:3], [qkv], facts)


def test_parameters_outside_must_fill_may_stay_empty_but_shard_tensors_may_not():
    qkv = Param(P + "self_attn.qkv_proj.weight", (128, 128), "bfloat16")
    scale = Param(P + "self_attn.attn.k_scale", (), "float32")  # a KV-cache scale vLLM defaults
    plan = _fill(_attention_shard()[:3], [qkv, scale], must=[qkv.name])
    assert set(plan) == {qkv.name}


ENGINE = Engine(tp=2, pp=2, dp=1, expert_parallel=False, stages=((0, 2), (2, 4)))


@pytest.mark.parametrize("change, message", [
    (dict(tp=4), "tensor_parallel_size: the engine runs tensor_parallel_size=4, the build b was made for 2 "
                 "(hint: start vLLM with --tensor-parallel-size 2, or build a plan with tp: 4)"),
    (dict(pp=1, stages=((0, 4),)), "pipeline_parallel_size: the engine runs pipeline_parallel_size=1, the build b "
                                   "was made for 2"),
    (dict(expert_parallel=True), "enable_expert_parallel: the engine runs enable_expert_parallel=True, the build "
                                 "b was made for False (hint: drop --enable-expert-parallel)"),
    (dict(stages=((0, 3), (3, 4))), "pipeline_parallel_size: the engine's pipeline stages hold layers 0-2, 3-3, "
                                    "the build's 0-1, 2-3 (hint: set VLLM_PP_LAYER_PARTITION=2,2)"),
])
def test_an_engine_of_other_degrees_is_refused_naming_both(change, message):
    check_engine("b", 2, 2, 1, False, ((0, 2), (2, 4)), ENGINE)  # the build's own shape passes
    engine = Engine(**{**ENGINE.__dict__, **change})
    with pytest.raises(ServeError) as err:
        check_engine("b", 2, 2, 1, False, ((0, 2), (2, 4)), engine)
    assert err.value.one_line().startswith(message), err.value.one_line()


def test_data_parallel_counts_only_for_expert_parallel_builds():
    replicas = Engine(tp=2, pp=1, dp=4, expert_parallel=False, stages=((0, 4),))
    check_engine("b", 2, 1, 1, False, ((0, 4),), replicas)  # four whole copies of a tp=2 build
    with pytest.raises(ServeError, match="data_parallel_size=4, the build e was made for 2"):
        check_engine("e", 2, 1, 2, True, ((0, 4),), Engine(tp=2, pp=1, dp=4, expert_parallel=True,
                                                          stages=((0, 4),)))


def test_expert_placement_is_compared_as_sets_of_ids():
    check_experts("e", (0, 1, 2), [2, 0, 1])
    with pytest.raises(ServeError) as err:
        check_experts("e", (0, 1, 2), [0, 2, 4])
    assert err.value.one_line() == (
        "expert_placement_strategy: the engine places experts 0-0, 2-2, 4-4 on this rank, the build e put 0-2 in "
        "its shard (hint: start vLLM with the build's placement (--expert-placement-strategy linear))")


def test_int8_companions_follow_their_weight_into_the_packed_parameter():
    """pack-quantized int8: weight_packed and weight_scale rows of q, k, v end to end, as the
    16-bit weights; a parameter the pieces cannot tile (a fused weight_shape of [2]) is refused,
    never loaded wrong."""
    shard = []
    for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        shard += [_t(f"{P}self_attn.{proj}.weight_packed", rows, 32, dtype="int32"),
                  _t(f"{P}self_attn.{proj}.weight_scale", rows, 1, dtype="float32")]
    packed = Param(P + "self_attn.qkv_proj.weight_packed", (128, 32), "int32")
    scale = Param(P + "self_attn.qkv_proj.weight_scale", (128, 1), "float32")
    plan = _fill(shard, [packed, scale])
    assert sorted((pc.offset, pc.rows) for pc in plan[packed.name]) == [(0, 64), (64, 32), (96, 32)]
    assert sorted((pc.offset, pc.rows) for pc in plan[scale.name]) == [(0, 64), (64, 32), (96, 32)]
    shape = Param(P + "self_attn.qkv_proj.weight_shape", (2,), "int64")
    shard += [_t(f"{P}self_attn.{p}.weight_shape", 2, dtype="int64") for p in ("q_proj", "k_proj", "v_proj")]
    with pytest.raises(ServeError) as err:
        _fill(shard, [packed, scale, shape])
    assert err.value.one_line().startswith(shape.name + ": the shard fills 6 of its 2 rows")


def test_gpt_oss_mxfp4_experts_cut_by_tp_never_fill_vllms_parameters():
    """A tp 2 rank of a ``dtype: source`` gpt-oss (MXFP4 experts; 4 experts, hidden 64, intermediate
    64: 32 a rank) never reaches the fill in vLLM: vllm_plugin.py refuses every stacked-expert build
    first. Were it to, the shard's blocks [E, out, in/32, 16] fit none of the parameters vLLM makes
    for them under its own names (GptOssForCausalLM.hf_to_vllm_mapper: ``*_proj_blocks`` ->
    ``w13_weight`` / ``w2_weight``; Mxfp4MoEMethod.create_weights flattens each expert's blocks to
    [out, in/2] bytes and pads the intermediate size to its kernel's multiple): one line naming
    the parameter, never a silent fill."""
    pre = P + "mlp.experts."
    suffix = {"gate_up_proj_blocks": "w13_weight", "gate_up_proj_scales": "w13_weight_scale",
              "gate_up_proj_bias": "w13_bias", "down_proj_blocks": "w2_weight", "down_proj_scales": "w2_weight_scale",
              "down_proj_bias": "w2_bias"}
    facts = ModelFacts(rename=lambda n: pre + suffix[n.removeprefix(pre)] if n.startswith(pre) else n)
    shard = [_t(pre + "gate_up_proj_blocks", 4, 64, 2, 16, dtype="uint8"), _t(pre + "gate_up_proj_scales", 4, 64, 2, dtype="uint8"),
             _t(pre + "gate_up_proj_bias", 4, 64), _t(pre + "down_proj_blocks", 4, 64, 1, 16, dtype="uint8"),
             _t(pre + "down_proj_scales", 4, 64, 1, dtype="uint8"), _t(pre + "down_proj_bias", 4, 64)]
    params = [Param(pre + "w13_weight", (4, 64, 32), "uint8"), Param(pre + "w13_weight_scale", (4, 64, 2), "uint8"),
              Param(pre + "w13_bias", (4, 64), "bfloat16"), Param(pre + "w2_weight", (4, 64, 16), "uint8"),
              Param(pre + "w2_weight_scale", (4, 64, 1), "uint8"), Param(pre + "w2_bias", (4, 64), "bfloat16")]
    with pytest.raises(ServeError) as err:
        _fill(shard, params, facts)
    assert err.value.one_line().startswith(
        f"{pre}w2_weight: shape [4, 64, 16] cannot hold the shard's {pre}down_proj_blocks [4, 64, 1, 16]")


def test_every_architecture_has_a_tiny_model_for_vllm():
    """tests/serving/vllm_models.py sizes one model per family for vLLM's CPU kernels; a family
    registered without one would never be loaded by vLLM in the serving tests (docs/architecture.md §8)."""
    from vllm_models import FAMILIES as VLLM_FAMILIES

    from shardc.layout.families import BY_ARCHITECTURE

    assert {arch for _, arch, _ in VLLM_FAMILIES.values()} == set(BY_ARCHITECTURE)


@pytest.mark.parametrize(("names", "scalar"), [
    (("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"), (1,)),  # compressed-tensors
    (("weight", "weight_scale", "weight_scale_2", "input_scale"), ()),  # ModelOpt: 0-d scalars
])
def test_nvfp4_per_tensor_scales_fill_the_fused_layers_slots_in_member_order(names, scalar):
    """NVFP4 at tp=2: q, k and v each keep their own global (and input) scale on every rank; vLLM's
    fused qkv_proj holds one slot per member (``PerTensorScaleParameter`` of
    ``len(output_partition_sizes)``) and its ``process_weights_after_loading`` takes the largest.
    The fill puts each member's scale in its slot (q 0, k 1, v 2), so that rule sees exactly the
    source's scales; packed values and block scales go end to end as the 16-bit weights."""
    values, block, per_tensor, inputs = names
    shard = []
    for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        shard += [_t(f"{P}self_attn.{proj}.{values}", rows, 64, dtype="uint8"),
                  _t(f"{P}self_attn.{proj}.{block}", rows, 8, dtype="float8_e4m3fn"),
                  _t(f"{P}self_attn.{proj}.{per_tensor}", *scalar, dtype="float32"),
                  _t(f"{P}self_attn.{proj}.{inputs}", *scalar, dtype="float32")]
    params = [Param(P + f"self_attn.qkv_proj.{values}", (128, 64), "uint8"),
              Param(P + f"self_attn.qkv_proj.{block}", (128, 8), "float8_e4m3fn"),
              Param(P + f"self_attn.qkv_proj.{per_tensor}", (3,), "float32"),
              Param(P + f"self_attn.qkv_proj.{inputs}", (3,), "float32")]
    plan = _fill(shard, params)
    for p in params[2:]:
        assert sorted((pc.offset, pc.rows, pc.tensor.rsplit(".", 2)[1]) for pc in plan[p.name]) == [
            (0, 1, "q_proj"), (1, 1, "k_proj"), (2, 1, "v_proj")]
    assert sorted((pc.offset, pc.rows) for pc in plan[params[0].name]) == [(0, 64), (64, 32), (96, 32)]
    with pytest.raises(ServeError, match="cannot hold"):  # a slot per member, never one scale for all
        _fill(shard, [*params[:2], Param(P + f"self_attn.qkv_proj.{per_tensor}", (3, 2), "float32"), params[3]])
