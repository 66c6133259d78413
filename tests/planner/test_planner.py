"""The planner's arithmetic against hand-computed cases, its rules, and `shardc plan` end to end.

The worked case is vLLM's own refusal of Llama-3.3-70B bf16 at TP=2 on A100-80GB ("163,840 bytes
per token", "20.0 GiB for one 131,072-token request", "5.63 GiB of KV memory -> maximum model length
36,896"): those figures must come out exactly. Byte counts of tiny models are computed by hand in
the comments, tensor by tensor, so a regression says which rule moved.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from shardc.cli import main
from shardc.compiler.synthetic import llama_config
from shardc.errors import PlanError
from shardc.layout.model import HUB_PRESETS, load_model, model_from_config
from shardc.layout.plan import load_plan, plan_from_dict
from shardc.layout.ranks import build_layout
from shardc.planner.formulas import (
    Overheads,
    SpeedParams,
    Workload,
    dollars_per_mtok,
    gpipe_bubble,
    kv_blocks,
    kv_bytes_per_token,
    lora_bytes_per_layer,
    max_model_len,
    request_kv_bytes,
    ring_allreduce_s,
    round_to_blocks,
    sequences_at,
    speed_for,
    vllm_allreduce_s,
)
from shardc.planner.gpus import GIB, GPUS, Cluster, get_gpu, get_interconnect, override_gpu
from shardc.planner.models import PRESET_SOURCES, param_count, resolve_model
from shardc.planner.report import summary
from shardc.planner.search import Candidate, Search, search
from shardc.planner.weights import plan_dict, rank_weights

ROOT = Path(__file__).resolve().parents[2]
L70 = load_model("llama-3.3-70b")
A100 = Cluster(get_gpu("a100-80gb"))
# hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads, head_dim 16, vocab 96, bf16
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=96)


def _plan(tp: int, pp: int, dtype: str = "bf16"):
    return plan_from_dict(plan_dict("t", "src", tp, pp, dtype))


def _only(model, tp, pp, dtype, workload=None, cluster=A100, **kw) -> Candidate:
    s = search(model, cluster, workload or Workload(), tps=[tp], pps=[pp], dtypes=[dtype], **kw)
    assert len(s.candidates) == 1, [c.label for c in s.candidates]
    return s.candidates[0]


# --- the worked case and the fleet math ------------------------------------------------------


def test_worked_case_llama70b_bf16_tp2_a100():
    assert kv_bytes_per_token(80, 8, 2, 128, 2) == 163_840
    assert request_kv_bytes(163_840, 131_072, 16) == 20 * GIB  # "20.0 GiB for one 131,072-token request"
    assert max_model_len(5.63 * GIB, 163_840, 16, 131_072) == 36_896
    c = _only(L70, 2, 1, "bf16", Workload(kv_memory=5.63 * GIB, target_tpot_ms=1000))
    assert c.kv.bytes_per_token == 163_840
    assert c.kv.request_bytes == 20 * GIB
    assert c.kv.max_model_len == 36_896
    assert round(c.memory.weights / GIB, 1) == 65.7
    # weights: 70,553,706,496 params x 2 B / 2, plus one extra copy of the 81 replicated norm vectors
    # (2 per layer + final) of 8,192 bf16 values on each rank.
    assert c.memory.weights == 70_553_706_496 + 161 * 8192 * 2 // 2


def test_fleet_math_tp4_pp2():
    assert kv_bytes_per_token(40, 8, 4, 128, 2) == 40_960
    blocks = kv_blocks(20 * GIB, 40_960, 16)
    assert blocks * 16 == 524_288
    assert sequences_at(blocks, 2048, 16) == 256
    c = _only(L70, 4, 2, "bf16", Workload(target_tpot_ms=1000, kv_cache_cap=20 * GIB))
    assert (c.kv.bytes_per_token, c.kv.tokens, c.kv.sequences) == (40_960, 524_288, 256)
    assert c.fits and c.kv.budget == 20 * GIB


def test_param_count_llama70b_and_tied_embeddings():
    assert param_count(L70) == 70_553_706_496
    # tiny: per layer q 64x64 + k,v 2 x 32x64 + o 64x64 + gate/up/down 3 x 128x64 + 2 norms x 64 = 36,992
    # x 2 layers = 73,984; embed 96x64 = 6,144; final norm 64; lm_head 6,144 unless tied
    untied = model_from_config(llama_config(**TINY))
    tied = model_from_config(llama_config(**TINY, tie_word_embeddings=True))
    assert param_count(untied) == 73_984 + 6_144 + 64 + 6_144
    assert param_count(tied) == 73_984 + 6_144 + 64


# --- weights per rank from the Layout --------------------------------------------------------


def test_kv_head_replication_when_tp_exceeds_kv_heads():
    model = model_from_config(llama_config(**{**TINY, "num_heads": 8}, head_dim=8))  # 8 heads / 2 KV heads
    ranks = rank_weights(model, _plan(4, 1))
    assert {r.kv_heads for r in ranks} == {1}
    # per rank per layer: q 16x64=1,024; k and v one whole head 8x64=512 each; o 64x16=1,024;
    # gate/up 32x64=2,048 each; down 64x32=2,048; norms 2x64 -> 9,344 elements; x 2 layers = 18,688;
    # embed and lm_head 24 rows x 64 = 1,536 each; final norm 64 -> 21,824 elements x 2 B
    assert {r.nbytes for r in ranks} == {21_824 * 2}
    assert kv_bytes_per_token(2, 2, 4, 8, 2) == 2 * 2 * 1 * 8 * 2  # max(1, 2 // 4) = 1 head, not 0
    assert kv_bytes_per_token(2, 2, 8, 8, 2) == kv_bytes_per_token(2, 2, 2, 8, 2)


def test_tied_embeddings_weights():
    tied = model_from_config(llama_config(**TINY, tie_word_embeddings=True))
    layer = 36_992 * 2  # bytes of one layer (elements above, bf16)
    (one,) = rank_weights(tied, _plan(1, 1))
    assert one.nbytes == 2 * layer + (6_144 + 64) * 2  # embedding stored once, no lm_head
    assert one.read_bytes == one.nbytes  # the embedding doubles as lm_head: streamed every step
    first, last = rank_weights(tied, _plan(1, 2))
    assert first.nbytes == layer + 6_144 * 2  # layer 0 + embed_tokens
    assert last.nbytes == layer + (64 + 6_144) * 2  # layer 1 + final norm + lm_head cut from embed
    assert first.read_bytes == layer  # an embedding lookup reads a few rows, not the table


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_weight_bytes_include_scales(dtype):
    model = model_from_config(llama_config(**TINY))
    ranks = rank_weights(model, _plan(2, 1, dtype))
    # tp=2, per layer: q 32x64 B + 32 f32 scales = 2,176; k, v 16x64 + 16x4 = 1,088 each;
    # o 64x32 + 64x4 (row-parallel: scales whole) = 2,304; gate, up 64x64 + 64x4 = 4,352 each;
    # down 64x64 + 64x4 = 4,352; norms 2 x 64 x 2 B = 256 -> 19,968; x 2 layers = 39,936;
    # embed, lm_head stay bf16: 48 x 64 x 2 = 6,144 each; final norm 128. int8 is stored
    # pack-quantized: the same bytes as int32 words, plus a 16 B int64 weight_shape per projection
    shapes = 2 * 7 * 16 if dtype == "int8" else 0
    assert {r.nbytes for r in ranks} == {39_936 + 6_144 * 2 + 128 + shapes}


@pytest.mark.parametrize("model, tp, pp, dtype", [
    (L70, 8, 1, "bf16"), (L70, 2, 3, "int8"), (L70, 1, 7, "fp8"),
    (model_from_config(llama_config(**TINY, tie_word_embeddings=True)), 2, 2, "int8"),
    (model_from_config(llama_config(**{**TINY, "vocab_size": 97})), 4, 2, "bf16"),  # vocab padding
])
def test_probe_layout_equals_full_layout(model, tp, pp, dtype):
    """rank_weights reads a one-layer-per-stage probe Layout; it must agree with the full Layout."""
    plan = _plan(tp, pp, dtype)
    full = build_layout(model, plan)
    assert [r.nbytes for r in rank_weights(model, plan)] == [r.nbytes for r in full.ranks]


@pytest.mark.parametrize("case", ["glm5", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lora"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_probe_layout_equals_full_layout_with_layers_of_several_kinds(case, tp, pp):
    """Layers that differ by more than routing: GLM-5's shared indexer layers, Qwen3-Next's and
    Qwen3.5's linear and full attention (and dense and routed MLPs), DeepSeek-V3's dense and routed
    layers: the probe's bytes per rank are the full Layout's."""
    from family_models import CASES

    model = model_from_config(CASES[case].config_dict())
    if pp > model.num_layers:
        pytest.skip("more stages than layers")
    plan = _plan(tp, pp, "bf16")
    assert [r.nbytes for r in rank_weights(model, plan)] == [r.nbytes for r in build_layout(model, plan).ranks]


# --- speed and cost formulas -----------------------------------------------------------------


def test_ring_allreduce_bubble_and_cost():
    assert ring_allreduce_s(1, 1e9, 1e9, 1e-3) == 0.0
    # 2(4-1)/4 x 1e6 B / 1e9 B/s = 1.5 ms, + 2(4-1) hops x 1 us = 6 us
    assert ring_allreduce_s(4, 1e6, 1e9, 1e-6) == pytest.approx(1.506e-3)
    assert gpipe_bubble(1, 1) == 0.0
    assert gpipe_bubble(2, 2) == pytest.approx(1 / 3)
    assert gpipe_bubble(4, 12) == pytest.approx(3 / 15)
    assert dollars_per_mtok(8, 2.80, 1000.0) == pytest.approx(8 * 2.80 / 3.6)  # 1e6 tok = 1000 s
    assert round_to_blocks(2049, 16) == 2064 and round_to_blocks(2048, 16) == 2048
    assert sequences_at(100, 33, 16) == 33  # ceil(33/16) = 3 blocks each


def test_vllm_picks_its_all_reduce_kernel_by_size_and_gpus():
    """csrc/custom_all_reduce.cuh: one stage for 2 GPUs, and on a full NVLink mesh below 512 KiB for up
    to 4 GPUs or 256 KiB for up to 8; two stages above (their second barrier: two_stage_us)."""
    bw, lat = 100e9, 2e-6

    def one(n: int, b: int) -> float:  # every GPU reads every peer's buffer
        return (n - 1) * b / bw + lat

    def two(n: int, b: int) -> float:  # reduce-scatter, all-gather
        return 2 * (n - 1) / n * b / bw + 2 * lat + 7e-6

    assert vllm_allreduce_s(1, 1e6, bw, lat, 7.0) == 0.0
    assert vllm_allreduce_s(2, 4 << 20, bw, lat, 7.0) == pytest.approx(one(2, 4 << 20))  # 2 GPUs: always one
    assert vllm_allreduce_s(4, (512 << 10) - 2, bw, lat, 7.0) == pytest.approx(one(4, (512 << 10) - 2))
    assert vllm_allreduce_s(4, 512 << 10, bw, lat, 7.0) == pytest.approx(two(4, 512 << 10))
    assert vllm_allreduce_s(8, (256 << 10) - 2, bw, lat, 7.0) == pytest.approx(one(8, (256 << 10) - 2))
    assert vllm_allreduce_s(8, 256 << 10, bw, lat, 7.0) == pytest.approx(two(8, 256 << 10))
    # 70B's hidden 8,192 in bf16: tp=8 changes kernel between 15 and 16 tokens in the step
    assert 15 * 8192 * 2 < 256 << 10 <= 16 * 8192 * 2


def test_decode_step_is_the_roofline_plus_allreduce_and_fixed_costs():
    c = _only(L70, 4, 1, "bf16")
    v, g, sp = c.speed, A100.gpu, speed_for(A100.gpu)  # A100's own fitted efficiencies (gpus.CALIBRATED)
    rw = c.weights[0]
    mem = rw.read_bytes / (g.hbm_bandwidth * sp.hbm_efficiency) + v.batch * 2048 * 81_920 / (
        g.hbm_bandwidth * sp.kv_hbm_efficiency)  # weights at the GEMMs' rate, the KV at paged attention's
    ar = 2 * 80 * (vllm_allreduce_s(4, v.batch * 8192 * 2, g.link.bandwidth * sp.link_efficiency, g.link.latency,
                                    sp.two_stage_us) + sp.allreduce_overhead_us * 1e-6)  # launch and barrier
    assert v.memory_s == pytest.approx(mem) and v.allreduce_s == pytest.approx(ar)
    assert v.fixed_s == pytest.approx(80 * sp.layer_overhead_us * 1e-6)
    assert v.slot_s == pytest.approx(max(v.memory_s, v.compute_s) + ar + v.fixed_s)
    x = c.serving  # the decode-only step is the slot plus the per-step overhead
    assert x.decode_step_s == pytest.approx(v.slot_s + sp.step_overhead_ms * 1e-3)
    assert c.cost.dollars_per_mtok == pytest.approx(dollars_per_mtok(4, 2.80, v.tokens_per_s))


def test_one_token_fp8_steps_pay_their_kernels_fixed_cost():
    """aiconfigurator 0.12 measures vLLM's fp8 GEMMs of one row slower than of two on Blackwell, by a
    fixed time per layer whatever the model's size and tp (B200 8B fp8: TPOT 4.87 ms at concurrency 1,
    3.18 ms at 2 on tp1; 70B tp8: 9.09 vs 6.76): a step with one token adds fp8_single_token_us per
    layer to the fixed costs, a step with two does not; 16-bit steps pay nothing, Hopper next to nothing."""
    b200 = Cluster(get_gpu("b200"), gpus_per_node=8)
    sp = speed_for(b200.gpu)
    assert sp.fp8_single_token_us > 0

    def speed(dtype: str, conc: int, cluster: Cluster = b200) -> Any:
        return _only(L70, 8, 1, dtype, Workload(concurrency=conc, target_tpot_ms=1e6), cluster).speed

    assert speed("fp8", 1).fixed_s == pytest.approx(80 * (sp.layer_overhead_us + sp.fp8_single_token_us) * 1e-6)
    assert speed("fp8", 2).fixed_s == pytest.approx(80 * sp.layer_overhead_us * 1e-6)
    assert speed("fp8", 1).tpot_s > speed("fp8", 2).tpot_s  # what aiconfigurator measures, and shardc says
    assert speed("bf16", 1).fixed_s == pytest.approx(80 * sp.layer_overhead_us * 1e-6)
    h200 = Cluster(get_gpu("h200"))
    hop = speed_for(h200.gpu)  # Hopper: 1.5 us, a fit's rounding rather than a kernel of its own
    assert hop.fp8_single_token_us < 0.1 * sp.fp8_single_token_us
    assert speed("fp8", 1, h200).fixed_s == pytest.approx(80 * (hop.layer_overhead_us + hop.fp8_single_token_us) * 1e-6)


def test_fp8_steps_pay_the_activation_quantization_per_layer_where_fitted():
    """vLLM's fp8 W8A8 GEMMs quantize their activations first (a per-token kernel before each of a
    layer's linears), a fixed cost per layer that neither the weights' size nor the batch sets. On
    GB300, aiconfigurator 0.12's tables ask for it: without it the fit left Llama-3.1-70B fp8 tp1 at
    1.15x its TPOT and 8B fp8 tp8 at 0.87x (worst cell 17 %); with it, 14 %. Every fp8 step pays it
    (one token: the single-row kernel on top); 16-bit and int8 (weight-only: 16-bit activations)
    steps pay nothing; where the grid does not ask for it (Hopper, B200) it is 0."""
    gb300 = Cluster(get_gpu("gb300"), gpus_per_node=8)
    sp = speed_for(gb300.gpu)
    assert sp.fp8_layer_us > 0

    def fixed(dtype: str, conc: int, cluster: Cluster = gb300) -> float:
        return _only(L70, 8, 1, dtype, Workload(concurrency=conc, target_tpot_ms=1e6), cluster).speed.fixed_s

    assert fixed("fp8", 2) == pytest.approx(80 * (sp.layer_overhead_us + sp.fp8_layer_us) * 1e-6)
    assert fixed("fp8", 16) == pytest.approx(80 * (sp.layer_overhead_us + sp.fp8_layer_us) * 1e-6)
    assert fixed("fp8", 1) == pytest.approx(
        80 * (sp.layer_overhead_us + sp.fp8_layer_us + sp.fp8_single_token_us) * 1e-6)
    assert fixed("bf16", 2) == pytest.approx(80 * sp.layer_overhead_us * 1e-6)
    assert fixed("int8", 2) == pytest.approx(80 * sp.layer_overhead_us * 1e-6)
    for other in ("h200", "b200"):
        assert speed_for(get_gpu(other)).fp8_layer_us == 0, other
    explain = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-70b", "--gpu", "gb300", "--gpus", "8",
                                        "--dtype", "fp8", "--explain"])
    assert explain.exit_code == 0, explain.output
    assert f"fp8_layer_us {sp.fp8_layer_us:g}" in explain.output
    assert "(fp8: activations quantized" in explain.output


def test_pipeline_step_includes_the_gpipe_bubble():
    c = _only(L70, 4, 2, "bf16", Workload(target_tpot_ms=1000))
    v, sp = c.speed, SpeedParams()
    assert v.microbatches == 2 and v.bubble == pytest.approx(1 / 3)
    assert c.serving.decode_step_s == pytest.approx((v.microbatches + 2 - 1) * v.slot_s + sp.step_overhead_ms / 1e3)


def test_demand_sizes_replicas():
    c = _only(L70, 8, 1, "bf16", Workload(demand_tokens_per_s=50_000))
    assert c.cost.replicas_for_demand == -(-50_000 // c.speed.tokens_per_s)
    assert c.cost.gpus_for_demand == 8 * c.cost.replicas_for_demand


# --- search rules and the recommendation -----------------------------------------------------


def test_cost_objective_is_cheapest_meeting_target_and_cap():
    s = search(L70, A100, Workload(kv_cache_cap=20 * GIB), model_name="llama-3.3-70b", objective="cost")
    rec = s.recommended
    assert rec is not None and rec.pp == 1 and rec.meets_target and rec.kv.budget == 20 * GIB
    eligible = [c for c in s.candidates if c.fits and not c.skipped and c.meets_target]
    assert all(rec.cost.dollars_per_mtok <= c.cost.dollars_per_mtok for c in eligible)
    reasons = {c.label: c.reasons[0] for c in s.candidates if c.reasons}
    # tp=2: one 131,072-token request needs 131,072 x 163,840 B = 20 GiB per GPU; the pool is what memory
    # leaves: 76,488,966,144 - 70,555,025,408 - 402,653,184 = 5,531,287,552 B = 5.15 GiB
    assert reasons["tp=2 pp=1 bf16"].startswith(
        "KV demand 20.00 GiB per GPU (one 131,072-token request: 131,072 tokens) > the 5.15 GiB KV pool (what memory leaves")
    assert reasons["tp=1 pp=1 bf16"].startswith("does not fit")
    assert "not divisible by tp=3" in reasons["tp=3 pp=* *"]
    assert all(c.skipped.startswith("TP first") for c in s.candidates if c.pp and c.pp > 1)


def test_pipeline_only_when_no_tp_fits():
    l405 = load_model("llama-3.1-405b")
    cluster = Cluster(get_gpu("a100-80gb"), nodes=2)
    s = search(l405, cluster, Workload(target_tpot_ms=500), dtypes=["bf16"])
    assert not any(c.fits for c in s.candidates if c.pp == 1)
    assert s.recommended is not None and s.recommended.pp > 1 and s.recommended.tp == 8
    assert "crosses the NVLink domain" in next(c for c in s.candidates if c.tp == 16).reasons[0]


def test_ties_go_to_the_smaller_tp_group():
    def fake(tp: int, cost: float) -> Candidate:
        c = _only(L70, 8, 1, "bf16")
        return dataclasses.replace(c, tp=tp, cost=dataclasses.replace(c.cost, dollars_per_mtok=cost))

    from shardc.planner.policy import recommend

    s = Search(L70, "m", "m", A100, Workload(), Overheads(), SpeedParams(), ("bf16",), 0,
               [fake(8, 1.0), fake(4, 1.0), fake(2, 1.2)], objective="cost")
    recommend(s)
    assert s.recommended.tp == 4


def test_more_than_95_percent_of_memory_is_infeasible():
    w = Workload(kv_memory=5.63 * GIB, max_model_len=32_768, target_tpot_ms=1000)
    ok = _only(L70, 2, 1, "bf16", w)
    # weights 70,555,025,408 + every overhead 1,476,395,008 + the measured 5.63 GiB = 91.9%
    assert ok.fits and ok.memory.used_fraction == pytest.approx((70_555_025_408 + 1_476_395_008 + 5.63 * GIB) / 84_987_740_160)
    full = _only(L70, 2, 1, "bf16", dataclasses.replace(w, kv_memory=10 * GIB))
    # 70,555,025,408 + 1,476,395,008 + 10,737,418,240 = 82,768,838,656 B = 97.4% of 84,987,740,160
    assert not full.fits and full.reasons == ["GPU at 97.4% of its memory (> 95%): no headroom"]


def test_max_model_len_is_a_requirement():
    c = _only(L70, 2, 1, "int8", Workload(max_model_len=131_072, kv_cache_cap=4 * GIB))
    # 131,072 tokens x 163,840 B = 20 GiB per GPU > the pool, which the 4 GiB cap limits (memory leaves more)
    assert c.reasons == ["KV demand 20.00 GiB per GPU (one 131,072-token request: 131,072 tokens) > "
                         "the 4.00 GiB KV pool (the 4.00 GiB cap; it holds 26,208)"]  # 16 x floor(4 GiB / (16 x 163,840 B)) = 26,208


def test_gpu_presets_and_overrides():
    assert {"a100-40gb", "a100-80gb", "a100-40gb-pcie", "a100-80gb-pcie", "h100-sxm", "h200", "l40s"} <= set(GPUS)
    assert f"{GPUS['a100-80gb'].memory / GIB:.2f}" == "79.15"  # what CUDA and vLLM report
    assert not GPUS["l40s"].nvlink and GPUS["h100-sxm"].nvlink
    g = override_gpu(GPUS["h100-sxm"], memory=90 * GIB, hbm_bandwidth=1e12, link_bandwidth=1e11)
    assert (g.memory, g.hbm_bandwidth, g.link.bandwidth) == (90 * GIB, 1e12, 1e11)
    assert get_interconnect("infiniband").name == "ib-ndr"
    with pytest.raises(PlanError, match="unknown GPU preset"):
        get_gpu("a100-96gb")


def test_preset_sources_are_known_hub_repos():
    for preset, uri in PRESET_SOURCES.items():
        assert HUB_PRESETS[uri.removeprefix("hf://").lower()] == preset


# --- the command -----------------------------------------------------------------------------


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_cli_table_explain_and_json():
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb")
    assert r.exit_code == 0, r.output
    assert "recommended (fit): tp=4 pp=1" in r.stdout and "[#" in r.stdout and "not feasible:" in r.stdout
    assert "fastest alternative: tp=8 pp=1 bf16" in r.stdout
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--tp", "2", "--dtype", "bf16",
             "--kv-memory", "5.63GiB", "--max-model-len", "32768", "--target-tpot-ms", "100", "--explain")
    assert r.exit_code == 0, r.output
    for text in ("= 163,840 B", "= 5,368,709,120 B = 5.00 GiB", "= 2,306 -> 36,896 tokens",
                 "= 65.71 GiB", "activations 0.25", f"hbm_efficiency {speed_for(get_gpu('a100-80gb')).hbm_efficiency:g}",
                 "KV demand = one 32,768-token request: 32,768 tokens x 163,840 B = 5.00 GiB per GPU -> fits"):
        assert text in r.stdout, text
    r = _run("--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--json")
    data = json.loads(r.stdout)
    rec = data["recommended"]
    assert rec["status"] == "ok" and rec["speed"]["tpot_s"] <= 0.025
    assert plan_from_dict(data["plan"]).tp == rec["tp"]


def test_cli_named_parameters_and_sizes():
    from shardc.units import parse_size

    assert parse_size("20GiB") == parse_size("20Gi") == 20 * GIB
    assert parse_size("5.63 GiB") == int(5.63 * GIB) and parse_size("80GB") == 80e9
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("0", allow_zero=True) == 0
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--param", "nccl=0", "--param",
             "activations=2GiB", "--param", "hbm_efficiency=0.7", "--explain")
    assert r.exit_code == 0, r.output
    assert "overheads in vLLM's budget = activations 2.00 + nccl 0.00 = 2.00 GiB" in r.stdout
    assert "in the headroom = cuda_context 0.50 + cuda_graphs 0.50 = 1.00 GiB" in r.stdout
    assert "x 0.7) + KV" in r.stdout and "hbm_efficiency 0.7" in r.stdout


def test_cli_out_preset_plan_validates(tmp_path):
    out = tmp_path / "plans" / "l70.yaml"
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.source == "hf://meta-llama/Llama-3.3-70B-Instruct"
    # no --kv-cache-cap: the plan records the unit's pool, 40,807,481,344 B = 38.00 GiB at tp=4
    assert plan.dtype == "bf16" and plan.kv_cache_cap_gb == 38.0
    build_layout(L70, plan)


def test_cli_out_builds(tmp_path, make_ckpt):
    """The plan written by --out validates and compiles with shardc build."""
    build = pytest.importorskip("shardc.compiler.compile")
    ckpt = make_ckpt(**TINY)
    out = tmp_path / "plans" / "tiny.yaml"
    r = _run("--model", str(ckpt), "--gpu", "l40s", "--dtype", "int8", "--tp", "2", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert (plan.tp, plan.pp, plan.dtype, Path(plan.source)) == (2, 1, "int8", ckpt.resolve())
    result = build.build(plan.with_source(str(ckpt)), out_dir=tmp_path / "build", progress=False)
    assert (result.out_dir / "manifest.json").is_file()
    assert sorted(p.name for p in result.out_dir.glob("*.safetensors")) == [
        "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"]


@pytest.mark.parametrize("args, text", [
    (["--model", "llama-9b", "--gpu", "a100-80gb"], "no model preset or config.json"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-96gb"], "unknown GPU preset"),
    (["--model", "llama-3.1-405b", "--gpu", "l40s", "--gpus-per-node", "4"], "fits no candidate"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--nodes", "0"], "--nodes: must be a positive integer"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--kv-cache-cap", "lots"], "--kv-cache-cap: must be a size such as"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--kv-cache-cap", "90GiB"], "more than the GPU's"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--max-model-len", "1000000"], "exceeds the model's"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "fp4"], "--dtype: must be a dtype"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--param", "bogus=1"], "--param: must be NAME=VALUE"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--avg-context", "200000"], "--avg-context: 200,000 is longer"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--interconnect", "carrier-pigeon"], "unknown interconnect"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--target-tpot-ms", "1"], "meets the TPOT target"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--lora-adapters", "8"], "--lora-rank: LoRA needs both"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--objective", "cheap"], "--objective: must be a known objective"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--fabric", "smoke"], "--fabric: unknown interconnect"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--draft-model", "nope"], "--draft-model: no model preset"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--block-size", "0"], "--block-size: must be a positive"),
])
def test_bad_input_one_line_exit_2(args, text, tmp_path):
    out = tmp_path / "p.yaml"
    r = _run(*args, "--out", str(out))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], r.stderr
    assert "Traceback" not in r.output and not out.exists()


def test_plan_does_not_import_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from shardc.cli import main\n"
        "import shardc.planner.formulas, shardc.planner.search, shardc.planner.report, shardc.commands.plan\n"
        "r = CliRunner().invoke(main, ['plan', '--model', 'llama-3.3-70b', '--gpu', 'a100-80gb', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'torch' not in sys.modules, 'shardc plan imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- the fit rules (#18, #27), each case's arithmetic worked by hand here ---------------------
# Llama-3.3-70B: per layer q 8192x8192 = 67,108,864; k, v 1024x8192 = 8,388,608 each; o 67,108,864;
# gate, up, down 28672x8192 = 234,881,024 each; 2 norms 8,192 -> 855,654,400 params, 16,384 of them
# norms (replicated). 161 norm vectors in all: 161 x 8,192 x 2 B = 2,637,824 B.
L70_BF16 = 70_553_706_496 * 2  # 141,107,412,992 B = 131.42 GiB
# overheads: activations 256 MiB + nccl 128 MiB inside vLLM's budget; cuda_context + cuda_graphs 512 MiB each outside
IN_BUDGET = 268_435_456 + 134_217_728  # 402,653,184 B
OVER = IN_BUDGET + 2 * 536_870_912  # 1,476,395,008 B = 1.375 GiB
A100_MEM = 84_987_740_160  # A100-80GB as CUDA reports it (79.15 GiB)
USABLE = A100_MEM * 0.9  # 76,488,966,144 B
# KV of one token over all 8 KV heads: 2 x 80 layers x 8 x 128 x 2 B = 327,680 B
L70_KV_TOKEN = 2 * 80 * 8 * 128 * 2


def _l70_tp_bytes(tp: int) -> int:
    """bf16 bytes of one TP rank at pp=1: the split part / tp, plus the norms whole."""
    return (L70_BF16 - 2_637_824) // tp + 2_637_824


def test_fit_a100_sxm_bf16_70b_is_tp4_with_tp8_beside_it():
    # demand: one 131,072-token request (max_position_embeddings) = 131,072 x 327,680 B = 40 GiB, sharded by head
    demand = 131_072 * L70_KV_TOKEN
    assert demand == 40 * GIB
    # room per card: vLLM's budget less what it counts in it, 76,488,966,144 - 402,653,184 = 76,086,312,960
    # (the context and graphs, 1 GiB, sit in the 8.5 GB headroom)
    room = USABLE - IN_BUDGET
    assert room == 76_086_312_960
    assert (L70_BF16 + demand) / room == pytest.approx(2.419, abs=1e-3)  # -> at least 3 GPUs
    s = search(L70, A100, dtypes=["bf16"], model_name="llama-3.3-70b")
    (trail,) = s.trails
    assert (trail.weights, trail.kv_demand, trail.sharded) == (L70_BF16, demand, L70_BF16 + demand)
    assert (trail.replicated, trail.room, trail.minimum) == (OVER, room, 3)
    assert trail.valid_tps == [1, 2, 4, 8]  # divide 64 heads and 8 KV heads; 3 does not
    rec = s.recommended  # the smallest valid TP >= 3
    assert (rec.tp, rec.pp, rec.dtype) == (4, 1, "bf16") and s.objective == "fit"
    assert rec.memory.weights == _l70_tp_bytes(4) == 35_278_831_616
    # tp=4: memory leaves 76,488,966,144 - 35,278,831,616 - 402,653,184 = 40,807,481,344 B, all of it the
    # pool (no default cap, as vLLM); the request needs 131,072 x 81,920 B = 10 GiB of it per GPU
    assert rec.memory.kv_available == pytest.approx(40_807_481_344) == rec.kv.budget
    assert rec.kv.demand_bytes == 10 * GIB
    # in use: weights + overheads + the pool = 35,278,831,616 + 1,476,395,008 + 40,807,481,344 B = 91.3%
    assert rec.memory.used == 35_278_831_616 + OVER + 40_807_481_344 == 77_562_707_968
    assert f"{rec.memory.used_fraction:.1%}" == "91.3%"
    # tp=2: the pool is 76,488,966,144 - 70,555,025,408 - 402,653,184 = 5,531,287,552 B < the 20 GiB demand
    two = next(c for c in s.candidates if c.label == "tp=2 pp=1 bf16")
    assert two.memory.kv_available == pytest.approx(5_531_287_552) and not two.fits
    assert trail.rejected == [("tp=1 pp=1 bf16", next(c for c in s.candidates if c.tp == 1).reasons[0]),
                              ("tp=2 pp=1 bf16", two.reasons[0])]
    alt = s.alternative  # the only single-node TP unit with more than 4 cards
    assert alt.label == "tp=8 pp=1 bf16" and alt.speed.tpot1_s < rec.speed.tpot1_s
    # A100's measured kernels (its fitted efficiencies): tp=4 decodes at 28.1 ms at batch 1, over the
    # default 25 ms, which the pick says; tp=8 beside it is the faster unit
    (warning,) = s.warnings
    assert warning.startswith("tp=4 pp=1 bf16 misses the default 25 ms TPOT target (28.1 ms at concurrency 1")


def test_fit_pcie_tp_limit_gives_tp4_pp2_where_sxm_gives_tp8():
    pcie = Cluster(get_gpu("a100-40gb-pcie"))  # 42,297,786,368 B
    w = Workload(kv_cache_cap=8 * GIB)
    # room per card = 42,297,786,368 x 0.9 - 402,653,184 = 37,665,354,547.2 B;
    # (141.1 GB weights + 42.9 GB demand) / 37.67 GB = 4.89 -> 5 cards
    assert (L70_BF16 + 40 * GIB) / (42_297_786_368 * 0.9 - IN_BUDGET) == pytest.approx(4.887, abs=1e-3)
    s = search(L70, pcie, w, dtypes=["bf16"], model_name="llama-3.3-70b")
    (trail,) = s.trails
    assert trail.minimum == 5 and trail.tp_limit == 4 and trail.valid_tps == [1, 2, 4]
    rec = s.recommended  # no valid TP >= 5 inside PCIe's limit of 4: tp=4, pp = ceil(5 / 4) = 2
    assert rec.label == "tp=4 pp=2 bf16"
    # stage 1 is the fuller: 40 layers x (855,654,400 - 16,384) / 4 + 16,384 params x 2 B = 17,114,071,040
    # + final norm 16,384 + lm_head 32,064 x 8,192 x 2 B = 525,336,576 -> 17,639,424,000 B
    assert rec.memory.stage == 1 and rec.memory.weights == 17_639_424_000
    # pool: the 8 GiB cap (memory leaves 20.0 GB); (17,639,424,000 + 1,476,395,008 + 8 GiB) / 42,297,786,368
    assert f"{rec.memory.used_fraction:.1%}" == "65.5%"
    assert rec.kv.demand_bytes == 131_072 * 2 * 40 * 2 * 128 * 2 == 5 * GIB  # 40 layers, 2 KV heads per rank
    assert rec.speed.bubble == pytest.approx(1 / (rec.speed.microbatches + 1))  # (p-1)/(m+p-1), p = 2
    tp8 = next(c for c in s.candidates if c.tp == 8)
    assert "over the pcie4 TP limit: tp=8 > 4" in tp8.reasons[0]
    # aiconfigurator 0.12 has no measured data for A100 PCIe (nor for the 40 GB SXM card): uncalibrated
    assert not s.cluster.calibrated and "uncalibrated" in summary(s)[0]
    sxm = search(L70, Cluster(get_gpu("a100-40gb")), w, dtypes=["bf16"])
    assert sxm.recommended.label == "tp=8 pp=1 bf16" and sxm.cluster.fabric().startswith("NVLink domain: TP up to 8")
    # the command: 80 GB PCIe cards hold 70B bf16 on 4 (as SXM does), and tp=8 is refused
    p80 = search(L70, Cluster(get_gpu("a100-80gb-pcie")), dtypes=["bf16"])
    assert p80.recommended.label == "tp=4 pp=1 bf16" and p80.alternative is None


def test_fit_one_card_when_everything_fits():
    l8 = load_model("llama-3.1-8b")
    # per layer q 4096^2 = 16,777,216; k, v 1024x4096 = 4,194,304 each; o 16,777,216; mlp 3 x 14336x4096 =
    # 176,160,768; norms 8,192 -> 218,112,000 x 32 = 6,979,584,000; embed + lm_head 2 x 128,256 x 4,096 =
    # 1,050,673,152; final norm 4,096 -> 8,030,261,248 params = 16,060,522,496 B in bf16
    assert param_count(l8) == 8_030_261_248
    h200 = Cluster(get_gpu("h200"))
    s = search(l8, h200, dtypes=["bf16"])
    (trail,) = s.trails
    # demand: one 131,072-token request x (2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B) = 16 GiB;
    # one card (no NCCL): memory x 0.9 - 256 MiB of activations
    mem = h200.gpu.memory
    assert trail.kv_demand == 131_072 * 131_072 == 16 * GIB
    assert trail.one_card_room == mem * 0.9 - 268_435_456
    assert trail.minimum == 1 and 16_060_522_496 + 16 * GIB <= trail.one_card_room
    rec = s.recommended
    assert rec.label == "tp=1 pp=1 bf16" and rec.memory.weights == 16_060_522_496
    assert rec.memory.overheads["nccl"] == 0 and rec.memory.in_budget == 268_435_456
    assert s.alternative is not None and s.alternative.tp > 1 and s.alternative.pp == 1


def test_lora_and_draft_are_sharded_memory():
    l8 = load_model("llama-3.1-8b")
    # LoRA per layer: 7h + 2q + 2kv + 3i = 57,344 + 16,384 + 2,048 + 86,016 = 161,792 (in + out of the 7
    # projections); 64 adapters x rank 64 x 161,792 x 2 B = 1,325,400,064 B per layer, x 80 = 106,032,005,120 B
    assert lora_bytes_per_layer(8192, 8192, 1024, 28672, 64, 64) == 1_325_400_064
    w = Workload(lora_adapters=64, lora_rank=64)
    s = search(L70, A100, w, dtypes=["bf16"], draft=l8)
    (trail,) = s.trails
    assert (trail.lora, trail.draft) == (106_032_005_120, 16_060_522_496)
    # minimum = ceil((141,107,412,992 + 106,032,005,120 + 16,060,522,496 + 40 GiB demand) / 76,086,312,960)
    # = ceil(4.02) = 5
    assert trail.minimum == 5
    rec = s.recommended  # the smallest valid TP >= 5 is 8 (without LoRA and draft: 4)
    assert rec.label == "tp=8 pp=1 bf16"
    assert rec.memory.extra == 106_032_005_120 // 8 + 16_060_522_496 // 8 == 15_261_565_952
    assert rec.memory.kv_available == pytest.approx(USABLE - _l70_tp_bytes(8) - 15_261_565_952 - IN_BUDGET)
    four = next(c for c in s.candidates if c.label == "tp=4 pp=1 bf16")
    # 76,488,966,144 - 35,278,831,616 - (26,508,001,280 + 4,015,130,624) - 402,653,184 = 10,284,349,440 B
    # of pool < the 10 GiB (10,737,418,240 B) one 131,072-token request needs at tp=4
    assert four.memory.kv_available == pytest.approx(10_284_349_440) and not four.fits
    assert search(L70, A100, dtypes=["bf16"]).recommended.tp == 4


# a DeepSeek-V3-family config small enough to lay out whole: 2 dense layers, then 2 of 4 routed experts
MLA_TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None,
    "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def test_mla_is_sized_from_its_family_layout(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MLA_TINY))
    model, name, _ = resolve_model(str(cfg))
    # per layer q 768x1024 = 786,432; kv_a (128+32)x1024 = 163,840 + its norm 128; kv_b 8x(64+64) x 128 =
    # 131,072; o 1024 x 512 = 524,288; 2 norms 2,048 -> 1,607,808 x 4 = 6,431,232; dense MLP 3 x 2048x1024
    # = 6,291,456 x 2 layers; sparse: router 4x1024 + bias 4 + 4 experts x 3 x 256x1024 + shared 3 x 256x1024
    # = 3,936,260 x 2; embed + lm_head 2 x 1000 x 1024 = 2,048,000; final norm 1,024 -> 28,935,688
    assert param_count(model) == 28_935_688
    s = search(model, Cluster(get_gpu("h100-sxm")), Workload(kv_cache_cap=20 * GIB), dtypes=["bf16"],
               tps=[1, 2, 4, 8], pps=[1], objective="cost")
    by_tp = {c.tp: c for c in s.candidates}
    # latent per token per GPU: 4 layers x (128 + 32) x 2 B = 1,280 B at every TP (GQA math would halve it)
    assert {tp: c.kv.bytes_per_token for tp, c in by_tp.items()} == {1: 1280, 2: 1280, 4: 1280, 8: 1280}
    # tp=2 per rank, 16-bit elements: per layer q 393,216 + kv_a 163,840 and norm 128 (replicated) + kv_b
    # 65,536 + o 262,144 + norms 2,048 = 886,912 x 4 = 3,547,648; dense MLP 3,145,728 x 2; sparse: experts
    # 1,572,864 + shared 393,216 = 1,966,080 x 2; embed + lm_head 2 x 500 x 1024 = 1,024,000; norm 1,024
    # -> 14,796,288 x 2 B; + the fp32 router and bias (4,096 + 4) x 4 B x 2 layers = 32,800 B
    assert by_tp[2].memory.weights == 14_796_288 * 2 + 32_800 == 29_625_376
    # 20 GiB / (16 x 1,280 B) = 1,048,576 blocks = 16,777,216 tokens, capped at 4,096
    assert (by_tp[2].kv.blocks, by_tp[2].kv.max_model_len) == (1_048_576, 4096)
    assert s.to_json()["plan"]["replica_group"]["dtype"] == "bf16"  # a plan shardc build compiles
    # stages that mix dense and sparse layers, quantized: the probe agrees with the full Layout
    for tp, pp, dtype in ((1, 3, "bf16"), (2, 2, "fp8"), (1, 1, "int8")):
        plan = plan_from_dict(plan_dict("t", "src", tp, pp, dtype))
        full = {(r.tp_rank, r.pp_stage): sum(t.nbytes for t in r.tensors) for r in build_layout(model, plan).ranks}
        assert {(r.tp_rank, r.pp_stage): r.nbytes for r in rank_weights(model, plan)} == full
    v3 = search(resolve_model("deepseek-v3")[0], Cluster(get_gpu("h200")), dtypes=["fp8"], tps=[8], pps=[1])
    assert v3.candidates[0].kv.bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # DeepSeek-V3 bf16 KV
    assert 670e9 < v3.params < 672e9  # "671B total parameters" (the model card, without the MTP module)


def test_cli_mla_writes_a_plan(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MLA_TINY))
    r = _run("--model", str(cfg), "--gpu", "l40s", "--dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert "advisory" not in data and data["plan"] is not None and data["objective"] == "fit"
    assert data["recommended"]["kv"]["bytes_per_token"] == 1280
    out = tmp_path / "p.yaml"
    r = _run("--model", str(cfg), "--gpu", "l40s", "--dtype", "bf16", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert load_plan(out).dtype == "bf16" and "ADVISORY" not in r.stdout


def test_objectives_pick_differently_and_json_says_which():
    fit = search(L70, A100, dtypes=["bf16"])
    cost = search(L70, A100, dtypes=["bf16"], objective="cost")
    lat = search(L70, A100, dtypes=["bf16"], objective="latency")
    assert fit.recommended.tp == 4
    eligible = [c for c in cost.candidates if c.fits and not c.skipped and c.meets_target]
    assert cost.recommended.cost.dollars_per_mtok == min(c.cost.dollars_per_mtok for c in eligible)
    assert lat.recommended.speed.tpot1_s == min(c.speed.tpot1_s for c in lat.fitting() if not c.skipped)
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--json")
    data = json.loads(r.stdout)
    assert data["objective"] == "fit" and data["recommended"]["tp"] == 4
    assert data["alternative"]["tp"] == 8 and data["fit"][0]["minimum"] == 3
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--explain")
    # (131.42 GiB weights + 40.00 GiB demand) / 70.86 GiB room = 2.42 -> 3
    assert "Choice (objective fit" in r.stdout and "minimum = ceil(171.42 / 70.86) = 3 GPUs" in r.stdout
    assert "fastest alternative (single-node TP unit" in r.stdout


def test_no_default_target_exit_405b_h200_16_per_node():
    """#17: with no --target-tpot-ms, a pick that misses the default 25 ms is shown with a warning."""
    args = ["--model", "llama-3.1-405b", "--gpu", "h200", "--gpus-per-node", "16", "--dtype", "bf16"]
    r = _run(*args)
    assert r.exit_code == 0, r.output
    assert "recommended (fit): tp=8 pp=1 bf16" in r.stdout and "not feasible:" in r.stdout
    assert "warning: tp=8 pp=1 bf16 misses the default 25 ms TPOT target" in r.stdout
    assert "--target-tpot-ms" in r.stdout and "`" not in r.stdout  # fields shown as this command's flags
    r = _run(*args, "--objective", "cost", "--json")  # tp=16 meets 25 ms: the cheapest that does
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and data["recommended"]["tp"] == 16 and not data["warnings"]
    r = _run(*args, "--objective", "cost", "--json", "--param", "layer_overhead_us=100")  # slower kernels
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["recommended"]["tp"] == 16  # the fastest that fits
    assert "recommending the fastest that fits" in data["warnings"][0]
    assert r.stderr.startswith("warning: no candidate meets the default 25 ms")
    r = _run(*args, "--target-tpot-ms", "25", "--param", "layer_overhead_us=100")
    assert r.exit_code == 2 and "--target-tpot-ms: no candidate" in r.stderr


def test_planner_names_fields_not_flags():
    """Library errors carry the field; only shardc/commands/plan.py knows the flags."""
    with pytest.raises(PlanError) as exc:
        search(L70, A100, Workload(avg_context=200_000))
    assert exc.value.key == "avg_context" and "--" not in exc.value.one_line()
    with pytest.raises(PlanError) as exc:
        search(L70, A100, Workload(lora_adapters=4))
    assert exc.value.key == "lora_rank"
    import ast

    for path in sorted((ROOT / "shardc" / "planner").glob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                assert not re.search(r"(^|[\s(])--[a-z]", node.value), f"{path.name}: {node.value!r}"
            if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..x import y
                assert (node.module or "").split(".")[0] in ("layout", "errors"), f"{path.name}: ..{node.module}"


def test_help_examples_run(tmp_path):
    """Every `shardc plan --help` example (but the local-checkpoint one) exits 0 as written; a
    build's directory (`build/...`) is a tiny tp=2 build made here (the demo's is made by `make
    demo`, which the suite does not run first)."""
    import shlex

    from tiny_builds import tiny_build

    from shardc.commands.plan import plan_cmd

    text = plan_cmd.epilog.replace("\\\n", " ")
    examples = [line.split("#")[0].strip() for line in text.splitlines() if line.strip().startswith("shardc plan")]
    assert len(examples) >= 8
    for ex in examples:
        if "/data/" in ex:
            continue
        args = [str(tmp_path / "p.yaml") if a.startswith("plans/") else a for a in shlex.split(ex)[2:]]
        if any(a.startswith("build/") for a in args):
            built = tmp_path / "b" if (tmp_path / "b").exists() else tiny_build(tmp_path, "help-example")
            args = [str(built) if a.startswith("build/") else a for a in args]
        r = _run(*args)
        assert r.exit_code == 0, (ex, r.output)


def test_fabric_override_sets_the_tp_limit_and_json_is_deterministic():
    bridged = Cluster(override_gpu(get_gpu("a100-80gb-pcie"), fabric="nvlink-bridge"))
    assert bridged.tp_limit == 2 and not bridged.calibrated and "nvlink-bridge fabric" in bridged.fabric()
    # minimum 3 cards (as on SXM: same memory), no valid TP >= 3 inside a pair: tp=2, pp = ceil(3 / 2) = 2
    s = search(L70, bridged, dtypes=["bf16"])
    assert s.trails[0].minimum == 3 and s.recommended.label == "tp=2 pp=2 bf16"
    assert Cluster(get_gpu("h200"), gpus_per_node=16).tp_limit == 16  # NVLink: the whole domain
    args = ("--model", "llama-3.3-70b", "--gpu", "a100-80gb-pcie", "--draft-model", "llama-3.1-8b", "--json")
    assert _run(*args).stdout == _run(*args).stdout
