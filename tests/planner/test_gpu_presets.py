"""GPU presets beyond Hopper (#43 item 7): Blackwell (B200, B300, GB200/GB300 NVL72, RTX PRO 6000),
which of them the speed model is calibrated for, and the NVL72 rack as one NVLink domain.

The figures are aiconfigurator 0.12's system files (`aiconfigurator_core/systems/<system>.yaml`:
mem_capacity, mem_bw, bfloat16_tc_flops, fp8_tc_flops, intra_node_bw, num_gpus_per_rack), the data
the calibration (scripts/bench_plan.py --peer) measures against; the hand-worked sizes below follow
from them.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from shardc.cli import main
from shardc.planner.formulas import SpeedParams, Workload, speed_for
from shardc.planner.gpus import (
    CALIBRATED,
    FP8_TFLOPS,
    GIB,
    GPUS,
    WORST_CELL,
    Cluster,
    get_gpu,
    override_gpu,
)
from shardc.planner.models import resolve_model
from shardc.planner.search import search

# preset -> (memory bytes, HBM GB/s, 16-bit TFLOP/s, fp8 TFLOP/s, aiconfigurator system)
BLACKWELL = {
    "b200": (193_273_528_320, 7700, 2250, 4500, "b200_sxm"),
    "b300": (288_400_343_040, 7750, 2250, 4500, "b300_sxm"),
    "gb200": (198_674_743_296, 8000, 2500, 5000, "gb200"),
    "gb300": (298_013_687_808, 8000, 2500, 5000, "gb300"),
    "rtx-pro-6000": (102_641_958_912, 1792, 467.8, 935.6, "rtx_pro_6000_server"),
}


@pytest.mark.parametrize("name", list(BLACKWELL))
def test_blackwell_presets_carry_aiconfigurators_figures(name):
    memory, hbm, tflops, fp8, peer = BLACKWELL[name]
    g = get_gpu(name)
    assert (g.memory, g.hbm_bandwidth, g.flops, FP8_TFLOPS[name], g.peer) == (memory, hbm * 1e9, tflops * 1e12, fp8,
                                                                             peer)
    assert g.link.name == ("pcie5" if name == "rtx-pro-6000" else "nvlink5")


def test_calibration_is_measured_data_on_the_presets_own_fabric():
    measured = {n for n, g in GPUS.items() if g.peer is not None}
    assert measured == {"a100-80gb", "h100-sxm", "h200", "l40s", *BLACKWELL}
    for name in ("a100-40gb", "a100-40gb-pcie", "a100-80gb-pcie"):  # aiconfigurator 0.12 has no data for these
        c = Cluster(get_gpu(name))
        assert c.calibration == "uncalibrated" and c.worst_cell is None
        assert c.fabric().endswith("(uncalibrated: no measured data for this card and fabric)")
    for name in measured:  # every card with data was fitted and its worst cell recorded
        c = Cluster(get_gpu(name))
        worst = WORST_CELL[GPUS[name].peer]
        assert c.worst_cell == worst and c.calibrated == (worst <= 0.15)
        if worst <= 0.15:
            assert c.calibration == "calibrated" and "(" not in c.fabric()
        else:  # measured but not within the tolerance: the figures say how far they may be
            assert c.calibration == "approximate" and f"speed up to {worst:.0%} from aiconfigurator" in c.fabric()
    # Hopper is calibrated (the grid, within 15 %)
    assert Cluster(get_gpu("h100-sxm")).calibrated and Cluster(get_gpu("h200")).calibrated
    # a preset given another fabric is not the system that was measured; the same fabric still is
    bridged = override_gpu(get_gpu("l40s"), fabric="nvlink-bridge")
    assert Cluster(bridged).calibration == "uncalibrated"
    assert speed_for(bridged) == speed_for(get_gpu("l40s"))  # the card's kernels are still the card's
    assert Cluster(override_gpu(get_gpu("h200"), fabric="nvlink4")).calibrated


def test_speed_knobs_are_the_cards_generation_then_the_command_line():
    for name, g in GPUS.items():
        want = {**SpeedParams().__dict__, **CALIBRATED.get(g.peer or "", {})}
        assert speed_for(g).__dict__ == want, name
    assert speed_for(get_gpu("b200"), hbm_efficiency=0.5).hbm_efficiency == 0.5
    assert speed_for(get_gpu("a100-40gb")) == SpeedParams()  # no data: the Hopper-fitted defaults


def test_nvl72_is_one_nvlink_domain_of_72():
    r = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-8b", "--gpu", "gb200"])
    assert r.exit_code == 0, r.output
    assert "gpus    72 x gb200 (1 node x 72): 185.03 GiB as nvidia-smi reports it" in r.output
    assert "fabric  NVLink domain: TP up to 72" in r.output
    # --gpus still wins: four GPUs of one compute tray
    r = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-8b", "--gpu", "gb200", "--gpus", "4"])
    assert "gpus    4 x gb200 (1 node x 4)" in r.output


def test_llama_70b_bf16_fits_one_b200_and_405b_fp8_one_b300():
    # Llama-3.1-70B bf16: 141.1 GB of weights < 180 GiB x 0.9 = 162 GiB less activations: one card
    l70 = resolve_model("llama-3.1-70b")[0]
    s = search(l70, Cluster(get_gpu("b200")), Workload(max_model_len=8192), dtypes=["bf16"])
    assert s.recommended.label == "tp=1 pp=1 bf16"
    assert s.recommended.memory.weights > 131 * GIB  # 70.55 B parameters x 2 B
    # Llama-3.1-405B fp8: about 405 GB of weights; 8 x 288 GB of B300 holds it at tp=2 (2 x 241 GiB budget)
    l405 = resolve_model("llama-3.1-405b")[0]
    s = search(l405, Cluster(get_gpu("b300")), Workload(max_model_len=8192), dtypes=["fp8"])
    assert s.recommended.label == "tp=2 pp=1 fp8"


def test_l40s_all_reduces_as_measured_where_no_ring_does():
    """L40S's TP all-reduce is aiconfigurator 0.12's measured vLLM table (allreduce_tables.MEASURED), read
    at its points, linear between them, proportional beyond; a tp=4 step pays what the table says."""
    g = get_gpu("l40s")
    # measured points (message bytes -> s): 4 MiB on 2 GPUs 0.2294 ms, on 4 1.649 ms (7.2x; a ring: 1.5x)
    assert g.allreduce_s(2, 4 << 20) == pytest.approx(0.2294e-3)
    assert g.allreduce_s(4, 4 << 20) == pytest.approx(1.649e-3)
    # halfway between 2 MiB (0.8408 ms) and 4 MiB on 4 GPUs: the mean; below the smallest: the smallest
    assert g.allreduce_s(4, 3 << 20) == pytest.approx((0.8408e-3 + 1.649e-3) / 2)
    assert g.allreduce_s(4, 8) == g.allreduce_s(4, 256) == pytest.approx(1.329e-5)
    assert g.allreduce_s(2, 2 << 30) == pytest.approx(2 * 0.05595)  # beyond 1 GiB: proportional
    assert g.allreduce_s(3, 4 << 20) is None  # not measured: the link's formula (a ring)
    assert g.measures_allreduce(4) and not g.measures_allreduce(3)
    assert get_gpu("h200").allreduce_s(2, 4 << 20) is None  # Hopper: vLLM's kernel formula fits
    # another fabric (or bandwidth) is not the system measured: the formula again
    assert override_gpu(g, fabric="nvlink-bridge").allreduce_s(2, 4 << 20) is None
    assert override_gpu(g, link_bandwidth=64e9).allreduce_s(2, 4 << 20) is None
    # Llama-3.1-8B bf16 tp=4 at batch 1 on L40S: 2 x 32 layers x the 8 KiB row's measured 14.32 us
    # (between 4 KiB 14.09 and 8 KiB 14.32), no link efficiency, no extra launch cost
    model = resolve_model("llama-3.1-8b")[0]
    c = search(model, Cluster(g), Workload(concurrency=1), dtypes=["bf16"], tps=[4], pps=[1]).candidates[0]
    assert c.speed is not None
    assert c.speed.allreduce_s == pytest.approx(2 * 32 * g.allreduce_s(4, 4096 * 2))
    assert g.allreduce_s(4, 4096 * 2) == pytest.approx(1.432e-5)
    # --explain names the measurement instead of a formula, and no launch cost on top
    r = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--tp", "4", "--dtype", "bf16",
                                  "--explain"])
    assert r.exit_code == 0, r.output
    (words,) = [ln for ln in r.output.splitlines() if ln.strip().startswith("all-reduce:")]
    assert "as measured on 4 l40s GPUs, aiconfigurator 0.12" in words and "launch" not in words
