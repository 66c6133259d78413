"""The gate figures the README states for the demo model, pinned (not just pass / fail).

README: "Measured on the demo model (8,192 tokens, tp1pp1 bf16 baseline): tp3pp2 bf16 +0.11% pass,
tp3pp1 int8 +0.33% pass, tp3pp1 fp8 +2.6% fail." The builds come from the shipped demo plans, the
gate runs with its defaults (pydoc golden text, 8,192 tokens, 512-token windows).

Tolerance: the README rounds to the digits it prints, and bf16 GEMMs on another CPU may block the
sums differently, which moves the perplexities in the 4th-5th digit. Allowed: half a unit in the
last printed digit plus 0.02 percentage points (bf16 ±0.025, int8 ±0.025, fp8 ±0.07). A change of the
split rules, the quantizers or the scoring moves these figures by far more (a swapped row-parallel
pair: > +5%; int8 without per-channel scales: several %).

The thread count matters too: a bf16 GEMM blocked for 2 threads rounds differently from one for 1
thread (the tp1pp1 baseline's perplexity moves from 14.9327 to 14.9545, every delta by about -0.14
points), so the gate runs every CPU rank of both passes on one thread; this test checks that too by
giving the gate both cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc

# The first test scores the baseline too (one single-threaded pass over 8,192 tokens, then its
# candidate's), and under `make test` this file starts first (tests/conftest.py LONG_FILES), beside
# the other worker's files: the suite's 600 s per test is too short for it on a loaded CI runner.
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]

# plan -> (README delta %, tolerance in percentage points, README verdict)
FIGURES = {
    "demo-tp3pp2-bf16": (0.11, 0.025, True),
    "demo-tp3pp1-int8": (0.33, 0.025, True),
    "demo-tp3pp1-fp8": (2.6, 0.07, False),
}
# The README's figures for a CPU whose torch kernels are AVX2 ones (no AVX-512): torch blocks bf16
# GEMMs by its CPU capability, which moves every delta by 0.13-0.18 points (measured on an AMD EPYC
# without AVX-512, on the commit before and after #41's changes alike: bf16 -0.0189, int8 +0.1539).
AVX2_FIGURES = {
    "demo-tp3pp2-bf16": (-0.02, 0.025, True),
    "demo-tp3pp1-int8": (0.15, 0.025, True),
    "demo-tp3pp1-fp8": (2.6, 0.07, False),
}


def figures() -> dict[str, tuple[float, float, bool]]:
    """The README's figures for this CPU's torch kernels."""
    import torch

    return AVX2_FIGURES if torch.backends.cpu.get_cpu_capability() == "AVX2" else FIGURES


@pytest.fixture(scope="module")
def demo_builds(demo_model_dir, tmp_path_factory):
    from shardc.compiler.compile import build
    from shardc.layout.plan import load_plan

    out = tmp_path_factory.mktemp("readme-gate")
    builds = {name: build(load_plan(ROOT / "plans" / f"{name}.yaml").with_source(str(demo_model_dir)),
                          out / name).manifest_path
              for name in ("demo-tp1pp1-bf16", *FIGURES)}
    # one baseline pass for the three gates: the first writes the baseline's logits, the others
    # read them back (checked against the baseline's manifest and the golden set: runtime/gate.py)
    return builds, out / "baseline-pydoc.safetensors"


@pytest.mark.parametrize("plan", list(FIGURES))
def test_readme_gate_figure(demo_builds, plan, tmp_path):
    builds, cache = demo_builds
    want, tol, verdict = figures()[plan]
    report = tmp_path / "gate.json"
    # a real process, as the README's user runs it (minutes of scoring: nothing to save in-process)
    p = shardc("gate", "--baseline", builds["demo-tp1pp1-bf16"], "--candidate", builds[plan], "--report", report,
               "--timeout", "600", "--baseline-cache", cache, timeout=1800)
    assert p.returncode == (0 if verdict else 1), p.stdout + p.stderr
    r = json.loads(report.read_text())
    assert r["golden"]["source"] == "pydoc" and r["golden"]["tokens"] == 8192 and r["golden"]["window"] == 512
    assert r["pass"] is verdict
    assert r["ppl_delta_pct"] == pytest.approx(want, abs=tol), (plan, r["ppl_delta_pct"])
    # measured, not assumed: the verdict is the threshold's (0.5 %) on the figure, and the exit code says it
    assert r["pass"] == (abs(r["ppl_delta_pct"]) <= 0.5) == (p.returncode == 0)
    if plan.endswith("bf16"):  # only bf16 rounding of the row-parallel partial sums differs
        assert r["kl_mean"] < 5e-3 and r["top1_agreement"] > 0.95
    else:  # quantization is visible, and a small drift for int8, a larger one for fp8
        assert r["kl_mean"] > 0 and r["top1_agreement"] < 1.0
