"""The family conformance suite (#44 item 6): every family in ``shardc.layout.families.FAMILIES``,
through one tiny transformers-made model each (tests/family_models.py ``SUITE``: each family's
first case, and DeepSeek's second attention form), is built, verified ``--deep`` against its
source, resharded, exported, run and gated against transformers at tp = 1 and tp = 2, and with
expert parallelism for the mixture-of-experts families. A family's own test file keeps only what
is peculiar to it (its other cases and layouts, its features shown to matter, its refusals).

transformers is the oracle. At tp = 1 the runtime follows each family's reference operation for
operation (eager experts or attention where the family's file measured it): the logits are equal bit
for bit, and so is the tp = 1 build loaded by transformers. At tp = 2 and with expert parallelism
the partial sums are reduced in another order: each family's measured bound (``Tiny.agree``).
One build per plan serves the whole session (the ``tiny_families`` fixture).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cli_run import shardc_in
from family_models import (
    CASES,
    FAMILY_OF,
    MODELS,
    SUITE,
    char_tokenizer,
    hf_logits,
    ids,
    model_of,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_plans import moe_plan  # noqa: E402

from shardc.layout.families import FAMILIES  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402

# tp = 1 stays in the fast loop (make test-fast) for the families whose file ran it there before
FAST = {"phi3", "gemma2", "gemma3", "mixtral", "deepseek_v3", "gpt_oss"}
# the stacked experts have no int8/fp8 form (tests/families/test_gpt_oss.py refuses those plans)
QUANTIZED = {c: () if FAMILY_OF[c] == "gpt_oss" else ("int8", "fp8") for c in SUITE}


def _params(cases: tuple[str, ...], fast: bool = False) -> list:
    return [pytest.param(c, id=c, marks=() if fast and FAMILY_OF[c] in FAST else pytest.mark.heavy)
            for c in cases]


def _run(manifest: Path, x: torch.Tensor) -> torch.Tensor:
    return score(open_build(manifest), x, return_logits=True, timeout_s=120).logits


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.safetensors"))}


def _layout(case: str) -> dict:
    """The tp = 2 layout the suite runs beside tp = 1: experts placed whole by expert parallelism
    for a mixture-of-experts family, cut by TP otherwise."""
    return {"tp": 2, "ep": CASES[case].moe}


def test_every_family_has_a_tiny_model():
    """A family added to FAMILIES without a tiny model fails here, and each case's config is read
    as the family it is filed under."""
    assert set(MODELS) == {f.name for f in FAMILIES}
    assert set(SUITE) >= {next(iter(cases)) for cases in MODELS.values()}
    for case, m in CASES.items():
        assert model_from_config(m.config_dict()).family == FAMILY_OF[case], case


@pytest.mark.parametrize("case", _params(SUITE, fast=True))
def test_tp1_equals_transformers_and_loads_in_it(tiny_families, case):
    """tp = 1: the runtime's logits equal transformers' bit for bit, and the tp = 1 build is a
    checkpoint transformers loads, to the source's logits."""
    m, src = CASES[case], tiny_families.source(case)
    x = ids(m.seed_of(1, False, 1), m.T, m.vocab)
    manifest = tiny_families.built(case, 1)
    got, want = _run(manifest, x), hf_logits(src, x, **m.ref)
    assert torch.equal(got, hf_logits(src, x, **m.tp1_ref) if m.tp1_ref else want)
    if m.tp1_near_ref is not None:  # Gemma 3: against transformers' eager attention too
        torch.testing.assert_close(got, want, rtol=0.0, atol=m.tp1_near_ref)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(hf_logits(manifest.parent, x, **m.ref), want)


@pytest.mark.heavy
@pytest.mark.parametrize("case", _params(SUITE))
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_tp2_agrees_with_transformers(tiny_families, case, ep):
    """tp = 2, and tp = 2 with expert parallelism: within the family's measured bound."""
    m = CASES[case]
    if ep and not m.moe:
        pytest.skip("no routed experts to place")
    x = ids(m.seed_of(2, ep, 1), m.T, m.vocab)
    want = hf_logits(tiny_families.source(case), x, **m.ref)
    m.agree(_run(tiny_families.built(case, 2, ep), x), want, 2)


@pytest.mark.heavy
@pytest.mark.parametrize("case", _params(SUITE))
def test_builds_verify_deep_against_the_source(tiny_families, case):
    """int8 and fp8 tp = 2 builds (the stacked experts have neither: gpt-oss's bf16) and, for a
    mixture-of-experts family, the bf16 expert-parallel build pass ``verify --deep`` against the
    source: every rank checked."""
    m, src = CASES[case], tiny_families.source(case)
    wanted = [(dtype, False) for dtype in QUANTIZED[case]] + ([("bf16", True)] if m.moe else [])
    assert wanted
    for dtype, ep in wanted:
        r = shardc_in("verify", "--manifest", tiny_families.built(case, 2, ep, dtype), "--deep", src)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("ok   ") == 2 and "all good" in r.stdout, (dtype, r.stdout)


@pytest.mark.heavy
@pytest.mark.parametrize("case", _params(SUITE))
def test_reshard_tp2_to_tp1_is_the_direct_tp1_build(tiny_families, case, tmp_path):
    """Reshard of the tp = 2 build (expert-parallel for a mixture-of-experts family) to a tp = 1
    plan gives a direct tp = 1 build's shard bytes."""
    src = tiny_families.source(case)
    plan = tmp_path / "tp1.yaml"
    plan.write_text(json.dumps(moe_plan(src, 1).data))
    out = tmp_path / "resharded"
    r = shardc_in("reshard", "--manifest", tiny_families.built(case, **_layout(case)), "--plan", plan,
                  "--out", out, "-q")
    assert r.returncode == 0, r.stderr
    direct = _digests(tiny_families.built(case, 1).parent)
    assert _digests(out) == direct and len(direct) == 1


@pytest.mark.heavy
@pytest.mark.parametrize("case", _params(SUITE))
def test_export_of_a_tp2_build_is_the_source(tiny_families, case, tmp_path):
    """Export reassembles a tp = 2 build (replicated tensors taken once, tied embeddings kept tied)
    into a checkpoint whose transformers logits are bit-identical to the source's."""
    m, src = CASES[case], tiny_families.source(case)
    out = tmp_path / "export"
    r = shardc_in("export", "--manifest", tiny_families.built(case, 2), "--out", out, "-q")
    assert r.returncode == 0, r.stderr
    x = ids(9, m.T, m.vocab)
    assert torch.equal(hf_logits(out, x, **m.ref), hf_logits(src, x, **m.ref))
    assert model_of(out).forward == model_of(src).forward


@pytest.mark.heavy
@pytest.mark.parametrize("case", _params(tuple(next(iter(cases)) for cases in MODELS.values())))
def test_gate_passes_tp2_against_the_tp1_baseline_scored_by_transformers(tiny_families, case, tmp_path):
    """The gate scores the tp = 2 build (expert-parallel for a mixture-of-experts family) against
    the tp = 1 baseline scored by transformers itself, over the golden text in a one-character-per-
    token tokenizer that fits the tiny vocabulary: it passes, the delta the rounding of tp = 2's sums
    (and for routed experts the tokens a last-bit change routes to another expert: ``Tiny.gate_ppl``)."""
    from shardc.runtime.gate import run_gate
    from shardc.runtime.gate_report import Thresholds

    m = CASES[case]
    tok = char_tokenizer(tmp_path / "tokenizer.json", m.vocab)
    report = run_gate(tiny_families.built(case, 1), tiny_families.built(case, **_layout(case)), max_tokens=128,
                      window=64, tokenizer=tok, timeout_s=120, reference="transformers",
                      thresholds=Thresholds(max_ppl_delta_pct=m.gate_ppl))
    assert report.passed and report.baseline.scored_by["name"] == "transformers", report
    assert abs(report.ppl_delta_pct) <= m.gate_ppl and report.top1_agreement > m.gate_top1, report
