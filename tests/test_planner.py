"""The planner's arithmetic against hand-computed cases, its rules, and `shardc plan` end to end.

The worked case is vLLM's own refusal of Llama-3.3-70B bf16 at TP=2 on A100-80GB ("163,840 bytes
per token", "20.0 GiB for one 131,072-token request", "5.63 GiB of KV memory -> maximum model length
36,896"): those figures must come out exactly. Byte counts of tiny models are computed by hand in
the comments, tensor by tensor, so a regression says which rule moved.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardc.build.synthetic import llama_config
from shardc.cli import main
from shardc.errors import PlanError
from shardc.planner.formulas import (
    PRESET_SOURCES,
    Overheads,
    SpeedParams,
    Workload,
    dollars_per_mtok,
    gpipe_bubble,
    kv_blocks,
    kv_bytes_per_token,
    max_model_len,
    param_count,
    plan_dict,
    rank_weights,
    request_kv_bytes,
    ring_allreduce_s,
    round_to_blocks,
    sequences_at,
)
from shardc.planner.gpus import GIB, GPUS, Cluster, get_gpu, get_interconnect, override_gpu
from shardc.planner.search import Candidate, Search, search
from shardc.spec.layout import build_layout
from shardc.spec.model import HUB_PRESETS, load_model, model_from_config
from shardc.spec.plan import load_plan, plan_from_dict

ROOT = Path(__file__).resolve().parents[1]
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
    c = _only(L70, 4, 2, "bf16", Workload(target_tpot_ms=1000))
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


def test_tpot_is_the_roofline_plus_allreduce_for_tp_only():
    c = _only(L70, 4, 1, "bf16")
    v, g, sp = c.speed, A100.gpu, SpeedParams()
    rw = c.weights[0]
    mem = (rw.read_bytes + v.batch * 2048 * 81_920) / (g.hbm_bandwidth * sp.hbm_efficiency)
    ar = 2 * 80 * ring_allreduce_s(4, v.batch * 8192 * 2, g.link.bandwidth * sp.link_efficiency, g.link.latency)
    assert v.memory_s == pytest.approx(mem) and v.allreduce_s == pytest.approx(ar)
    assert v.tpot_s == pytest.approx(max(v.memory_s, v.compute_s) + ar)
    assert v.tokens_per_s == pytest.approx(v.batch / v.tpot_s)
    assert c.meets_target and v.tpot_s <= 0.025
    assert c.cost.dollars_per_mtok == pytest.approx(dollars_per_mtok(4, 2.80, v.tokens_per_s))


def test_pipeline_tpot_includes_the_gpipe_bubble():
    c = _only(L70, 4, 2, "bf16", Workload(target_tpot_ms=1000))
    v = c.speed
    assert v.microbatches == 2 and v.bubble == pytest.approx(1 / 3)
    assert v.tpot_s == pytest.approx((v.microbatches + 2 - 1) * v.slot_s)


def test_demand_sizes_replicas():
    c = _only(L70, 8, 1, "bf16", Workload(demand_tokens_per_s=50_000))
    assert c.cost.replicas_for_demand == -(-50_000 // c.speed.tokens_per_s)
    assert c.cost.gpus_for_demand == 8 * c.cost.replicas_for_demand


# --- search rules and the recommendation -----------------------------------------------------


def test_default_recommendation_is_cheapest_meeting_target_and_cap():
    s = search(L70, A100, model_name="llama-3.3-70b")
    rec = s.recommended
    assert rec is not None and rec.pp == 1 and rec.meets_target and rec.kv.budget == 20 * GIB
    eligible = [c for c in s.candidates if c.fits and not c.skipped and c.meets_target]
    assert all(rec.cost.dollars_per_mtok <= c.cost.dollars_per_mtok for c in eligible)
    reasons = {c.label: c.reasons[0] for c in s.candidates if c.reasons}
    assert "below the 20.00 GiB cap" in reasons["tp=2 pp=1 bf16"]
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

    from shardc.planner.search import _recommend

    s = Search(L70, "m", "m", A100, Workload(), Overheads(), SpeedParams(), ("bf16",), 0,
               [fake(8, 1.0), fake(4, 1.0), fake(2, 1.2)])
    _recommend(s)
    assert s.recommended.tp == 4


def test_more_than_95_percent_of_memory_is_infeasible():
    ok = _only(L70, 2, 1, "bf16", Workload(kv_memory=5.63 * GIB, target_tpot_ms=1000))
    assert ok.fits and 0.92 < ok.memory.used_fraction < 0.95
    full = _only(L70, 2, 1, "bf16", Workload(kv_memory=10 * GIB))
    assert not full.fits and "(> 95%)" in full.reasons[0]


def test_max_model_len_is_a_requirement():
    c = _only(L70, 2, 1, "int8", Workload(max_model_len=131_072, kv_cache_cap=4 * GIB))
    assert "< --max-model-len 131,072" in c.reasons[0]


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
    assert "recommended: tp=" in r.stdout and "[#" in r.stdout and "not feasible:" in r.stdout
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--tp", "2", "--dtype", "bf16",
             "--kv-memory", "5.63GiB", "--target-tpot-ms", "100", "--explain")
    assert r.exit_code == 0, r.output
    for text in ("= 163,840 B", "= 21,474,836,480 B = 20.00 GiB", "= 2,306 -> 36,896 tokens",
                 "= 65.71 GiB", "activations 1.00", "hbm_efficiency 0.8"):
        assert text in r.stdout, text
    r = _run("--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--json")
    data = json.loads(r.stdout)
    rec = data["candidates"][data["recommended"]]
    assert rec["status"] == "ok" and rec["speed"]["tpot_s"] <= 0.025
    assert plan_from_dict(data["plan"]).tp == rec["tp"]


def test_cli_named_parameters_and_sizes():
    from shardc.commands.plan import parse_size

    assert parse_size("20GiB") == parse_size("20") == 20 * GIB
    assert parse_size("5.63 GiB") == 5.63 * GIB and parse_size("80GB") == 80e9
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("0", allow_zero=True) == 0
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--param", "nccl=0", "--param",
             "activations=2GiB", "--param", "hbm_efficiency=0.7", "--explain")
    assert r.exit_code == 0, r.output
    assert "activations 2.00 + cuda_context 0.50 + nccl 0.00" in r.stdout
    assert "x 0.7) =" in r.stdout and "hbm_efficiency 0.7" in r.stdout


def test_cli_out_preset_plan_validates(tmp_path):
    out = tmp_path / "plans" / "l70.yaml"
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.source == "hf://meta-llama/Llama-3.3-70B-Instruct"
    assert plan.dtype == "bf16" and plan.kv_cache_cap_gb == 20
    build_layout(L70, plan)


def test_cli_out_builds(tmp_path, make_ckpt):
    """The plan written by --out validates and compiles with shardc build."""
    build = pytest.importorskip("shardc.build.compile")
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
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--kv-cache-cap", "lots"], "--kv-cache-cap: must be a positive size"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--kv-cache-cap", "90GiB"], "more than the GPU's"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--max-model-len", "1000000"], "exceeds the model's"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "fp4"], "--dtype: must be a dtype"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--param", "bogus=1"], "--param: must be NAME=VALUE"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--avg-context", "200000"], "--avg-context: 200,000 is longer"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--interconnect", "carrier-pigeon"], "unknown interconnect"),
    (["--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--target-tpot-ms", "1"], "meets the TPOT target"),
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
