"""The golden-set gate: metrics, verdicts and exit codes, on synthetic and on the demo model."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_run import shardc_in
from manifest_edits import reseal
from plan_helpers import plan as make_plan

from shardc.errors import ManifestError
from shardc.results import to_json
from shardc.runtime.api_results import PositionScores
from shardc.runtime.gate import (
    GoldenError,
    Thresholds,
    check_compatible,
    golden_text,
    make_windows,
    paired_bootstrap_ci,
    run_gate,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]


# -- pure parts ------------------------------------------------------------------------------------------
def test_pydoc_golden_text_is_bundled_and_stable():
    text, label = golden_text("pydoc")
    assert label == "pydoc" and len(text) > 100_000
    assert golden_text("pydoc")[0] == text  # sorted topics: the same bytes every run


def test_text_and_jsonl_golden_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    assert golden_text(str(tmp_path / "a.txt"))[0] == "hello world"
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n"two"\n')
    assert golden_text(str(tmp_path / "b.jsonl"))[0] == "one\n\ntwo"
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(GoldenError, match="c.jsonl:1 has no string 'text'"):
        golden_text(str(tmp_path / "c.jsonl"))
    with pytest.raises(GoldenError, match="cannot read"):
        golden_text(str(tmp_path / "missing.txt"))


def test_windows_are_identical_non_overlapping_slices():
    ids = list(range(1000))
    w = make_windows(ids, 128, 700)
    assert len(w) == 5 and all(len(x) == 128 for x in w)
    assert w[1][0] == 128 and w[-1][-1] == 639
    with pytest.raises(GoldenError, match="fewer than one window"):
        make_windows(ids[:10], 128, 700)


def _res(nb: np.ndarray, nc: np.ndarray, kl: float = 0.0, agree: float = 1.0) -> PositionScores:
    n = nb.size
    top1 = np.zeros(n, dtype=bool)
    top1[: int(round(agree * n))] = True
    return PositionScores(nll_base=nb, nll_cand=nc, kl=np.full(n, kl), top1=top1)


def test_identical_plans_pass_with_zero_delta():
    nb = np.random.default_rng(0).gamma(2.0, 1.5, size=(8, 63))
    r = summarize(_res(nb, nb.copy()), 8, Thresholds())
    assert r.passed and r.ppl_delta_pct == 0.0 and r.ppl_delta_ci95_pct == (0.0, 0.0)
    assert r.baseline_ppl == pytest.approx(math.exp(nb.mean()))
    assert r.kl_mean == 0.0 and r.top1_agreement == 1.0


def test_drift_fails_and_thresholds_apply():
    nb = np.random.default_rng(1).gamma(2.0, 1.5, size=(8, 63))
    r = summarize(_res(nb, nb + 0.01, kl=0.02, agree=0.9), 8, Thresholds())
    assert r.ppl_delta_pct == pytest.approx((math.exp(0.01) - 1) * 100)  # +1.005%
    assert not r.passed and [c.name for c in r.checks] == ["ppl_delta_pct"]
    lo, hi = r.ppl_delta_ci95_pct
    assert lo == pytest.approx(hi) == pytest.approx(r.ppl_delta_pct)  # a constant shift
    r = summarize(_res(nb, nb, kl=0.02, agree=0.9), 8, Thresholds(0.5, max_kl=0.01, min_top1=0.95))
    assert not r.passed
    assert {c.name: c.ok for c in r.checks} == {
        "ppl_delta_pct": True, "kl_mean": False, "top1_agreement": False}


def test_paired_bootstrap_brackets_the_estimate():
    rng = np.random.default_rng(2)
    nb = rng.gamma(2.0, 1.5, size=(16, 127))
    nc = nb + rng.normal(0.0, 0.05, size=nb.shape)
    lo, hi = paired_bootstrap_ci(nb, nc, 2000, 0)
    delta = (math.exp((nc.sum() - nb.sum()) / nb.size) - 1) * 100
    assert lo < delta < hi and hi - lo < 1.0
    assert paired_bootstrap_ci(nb, nc, 2000, 0) == (lo, hi)  # seeded: reproducible reports


def test_different_models_are_refused():
    from shardc.formats.manifest import LayoutRecord, Manifest, SourceRecord

    def manifest(vocab: int) -> Manifest:
        return Manifest({}, "0" * 64, {"hidden_size": 64, "vocab_size": vocab},
                        LayoutRecord(1, 1, [(0, 1)], "BF16", "bf16"), SourceRecord("x", None, []), [], [])

    with pytest.raises(ManifestError, match="vocab_size"):
        check_compatible(manifest(96), manifest(128))


# -- end to end on synthetic models (tiny word-level tokenizer shipped with the checkpoint) --------------
def _gate(*args: str) -> subprocess.CompletedProcess:
    return shardc_in("gate", *args)


def _build(src: Path, out: Path, tp: int, pp: int, dtype: str = "bf16") -> Path:
    from shardc.compiler.compile import build

    name = f"{src.name}-tp{tp}pp{pp}-{dtype}"
    plan = make_plan(tp, pp, dtype, name=name, source=src)
    return build(plan, out_dir=out / name).manifest_path


@pytest.fixture(scope="module")
def synth_builds(tmp_path_factory):
    pytest.importorskip("torch")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("gate-synth")
    words = golden_text("pydoc")[0].split()[:5000]
    vocab = {"[UNK]": 0}
    for w in words:
        if len(vocab) < 96:
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = {}
    for name, seed in (("model", 0), ("other", 5)):
        src = write_checkpoint(root / name, llama_config(num_layers=2), seed=seed)
        tok.save(str(src / "tokenizer.json"))
        out[name] = src
    return {
        "tp1pp1": _build(out["model"], root / "b", 1, 1),
        "tp2pp2": _build(out["model"], root / "b", 2, 2),
        "other": _build(out["other"], root / "b", 1, 1),
    }


def test_gate_cli_pass_fail_and_bad_input(synth_builds, tmp_path):
    common = ["--max-tokens", "256", "--window", "64", "--timeout", "60"]
    report = tmp_path / "gate.json"
    p = _gate("--baseline", str(synth_builds["tp1pp1"]), "--candidate", str(synth_builds["tp2pp2"]),
              "--min-top1", "0.9", "--report", str(report), *common)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout
    r = json.loads(report.read_text())
    assert r["pass"] and abs(r["ppl_delta_pct"]) < 0.05 and r["golden"]["windows"] == 4
    assert r["positions"] == 4 * 63 and r["candidate"]["tp"] == 2

    # Same shapes, different weights: perplexity of two near-uniform random models may match, but
    # their top-1 predictions do not.
    p = _gate("--baseline", str(synth_builds["tp1pp1"]), "--candidate", str(synth_builds["other"]),
              "--min-top1", "0.9", "--json", *common)
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert not r["pass"] and r["top1_agreement"] < 0.5

    p = _gate("--baseline", str(synth_builds["tp1pp1"]), "--candidate", str(synth_builds["tp2pp2"]),
              "--golden", str(tmp_path / "nope.jsonl"), *common)
    assert p.returncode == 2 and "cannot read golden text" in p.stderr


def _numbers(r: dict) -> dict:
    """The report without what may differ between equal runs (timings, the cache's own status)."""
    return {k: v for k, v in to_json(r).items() if k not in ("seconds", "baseline_cache")}


@pytest.mark.heavy
def test_baseline_cache_is_identical_and_keyed(synth_builds, tmp_path):
    """Fresh, cache-written and cache-read gates give the same numbers; a cache of another baseline
    is recomputed with a line saying so; and the sequential passes equal the side-by-side formulas
    applied to each build's own fp32 logits (the oracle: two independent score jobs)."""
    import torch

    from shardc.runtime.api import open_build, score
    from shardc.runtime.gate import run_gate

    kw = {"max_tokens": 256, "window": 64, "timeout_s": 60.0}
    base, cand = synth_builds["tp1pp1"], synth_builds["tp2pp2"]
    fresh = run_gate(base, cand, **kw)
    assert fresh.baseline_cache.status == "none"
    cache = tmp_path / "base.safetensors"
    notes: list[str] = []
    written = run_gate(base, cand, baseline_cache=cache, note=notes.append, **kw)
    assert written.baseline_cache.status == "new" and cache.is_file() and not notes
    hit = run_gate(base, cand, baseline_cache=cache, note=notes.append, **kw)
    assert hit.baseline_cache.status == "hit" and hit.seconds.baseline_compute is None
    assert _numbers(fresh) == _numbers(written) == _numbers(hit)

    other = run_gate(synth_builds["other"], cand, baseline_cache=cache, note=notes.append, **kw)
    assert other.baseline_cache.status == "stale"
    assert len(notes) == 1 and "another baseline" in notes[0] and "recomputing" in notes[0]
    assert _numbers(other) == _numbers(run_gate(synth_builds["other"], cand, **kw))
    assert other.baseline_ppl != fresh.baseline_ppl

    windows = torch.tensor(make_windows(_ids(base), 64, 256))
    lb, lc = (torch.log_softmax(score(open_build(m), windows, return_logits=True).logits[:, :-1]
                                .float(), -1) for m in (base, cand))
    t = windows[:, 1:, None]
    want = PositionScores(nll_base=-lb.gather(-1, t)[..., 0].double(), nll_cand=-lc.gather(-1, t)[..., 0].double(),
                          kl=(lb.exp() * (lb - lc)).double().sum(-1).clamp_min(0), top1=lb.argmax(-1) == lc.argmax(-1))
    ref = summarize(want, len(windows), Thresholds())
    for k in ("baseline_ppl", "candidate_ppl", "kl_mean", "kl_p99", "top1_agreement", "ppl_delta_ci95_pct"):
        assert getattr(ref, k) == getattr(fresh, k), k


def _ids(manifest: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(manifest.parent / "tokenizer.json")).encode(golden_text("pydoc")[0]).ids


def test_gate_cli_baseline_cache_line(synth_builds, tmp_path):
    common = ["--max-tokens", "128", "--window", "64", "--timeout", "60"]
    cache = tmp_path / "c.safetensors"
    cache.write_text("not a cache")
    p = _gate("--baseline", str(synth_builds["tp1pp1"]), "--candidate", str(synth_builds["tp2pp2"]),
              "--baseline-cache", str(cache), *common)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"baseline cache {cache} is of another baseline" in p.stderr and "recomputing" in p.stderr


def test_gate_on_cuda_without_gpus_is_one_line(synth_builds):
    p = _gate("--baseline", str(synth_builds["tp1pp1"]), "--candidate", str(synth_builds["tp2pp2"]),
              "--device", "cuda", "--max-tokens", "128", "--window", "64")
    assert p.returncode == 2, p.stdout + p.stderr
    name = synth_builds["tp2pp2"].parent.name
    assert p.stderr.strip().splitlines() == [
        f"error: plan {name} needs 4 GPUs on this node; 0 are visible (hint: run on a node with more "
        "GPUs, widen CUDA_VISIBLE_DEVICES, or use --device cpu)"]


# -- the demo model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_builds(demo_model_dir, tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("gate-demo")
    return {
        "tp1pp1": _build(demo_model_dir, out, 1, 1),
        "tp3pp2": _build(demo_model_dir, out, 3, 2),
        "out": out,
    }


# The demo's bf16 tp3pp2, int8 and fp8 gates, measured rather than assumed (pass exactly when the
# threshold says, quantization visible in KL and top-1), are tests/docs/test_readme_gate_figures.py:
# the README's figures at the gate's defaults, with these checks on each report.


def _swap_row_parallel(build_dir: Path, layer: int) -> None:
    """Corrupt a tp3pp2 build the way a buggy resharder would: layer ``layer``'s row-parallel
    shards (o_proj, down_proj) swapped between TP ranks 0 and 1. Manifest hashes are updated so
    every file still verifies; only the model is wrong. (Swapping *all* of a layer's tensors would
    be harmless: heads and MLP columns are permutation-invariant.)"""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardc.formats.manifest import load

    m = load(build_dir / "manifest.json")
    stage = next(s for s in m.shards if s.layers[0] <= layer < s.layers[1]).pp_stage
    entries = {s.tp_rank: s for s in m.shards if s.pp_stage == stage}
    data, meta = {}, {}
    for r in (0, 1):
        with safe_open(build_dir / entries[r].file, "pt") as f:
            meta[r] = f.metadata()
            data[r] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for name in (f"model.layers.{layer}.self_attn.o_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight"):
        data[0][name], data[1][name] = data[1][name], data[0][name]
    for r in (0, 1):
        path = build_dir / entries[r].file
        save_file(data[r], str(path), metadata=meta[r])
        reseal(entries[r], path.read_bytes())
    (build_dir / "manifest.json").write_bytes(m.dumps())


@pytest.mark.heavy
def test_demo_broken_candidate_fails_loudly(demo_builds):
    import shutil

    broken = demo_builds["out"] / "broken"
    shutil.copytree(demo_builds["tp3pp2"].parent, broken)
    _swap_row_parallel(broken, layer=20)
    # one 256-token window is plenty: the swap costs > 5 % of perplexity (the same window as the
    # transformers-referenced gate of the same damage below)
    p = _gate("--baseline", str(demo_builds["tp1pp1"]), "--candidate", str(broken / "manifest.json"),
              "--min-top1", "0.9", "--max-tokens", "256", "--window", "256", "--timeout", "120", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert not r["pass"] and r["ppl_delta_pct"] > 5 and r["top1_agreement"] < 0.9
    assert all(not c["ok"] for c in r["checks"])


# -- --reference transformers: the baseline scored by transformers itself ----------------------------------
def test_reference_transformers_refuses_a_split_baseline(synth_builds):
    """transformers reads a tp=1 build only: a tp>1 baseline is one line naming --reference and what
    would work, exit 2, before anything is scored."""
    p = _gate("--baseline", str(synth_builds["tp2pp2"]), "--candidate", str(synth_builds["tp1pp1"]),
              "--reference", "transformers", "--max-tokens", "128", "--window", "64")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --reference: transformers cannot load the baseline")
    assert "tp=2" in lines[0] and "reshard the baseline (" in lines[0] and "--reference shardc" in lines[0]


def test_cache_key_and_cache_differ_by_reference(synth_builds, tmp_path):
    """A baseline cache scored by one reference is never read for the other (either way), with a
    line naming the reference; shardc's own key has no reference entry (its caches stay valid)."""
    from shardc.formats.safetensors import ShardWriter
    from shardc.runtime.api import open_build
    from shardc.runtime.gate import cache_key, check_cache, seal_cache
    from shardc.runtime.reference import reference_record

    base = open_build(synth_builds["tp1pp1"])
    windows = [[1, 2, 3, 4]]
    ours = cache_key(base, "text", 4, 4, windows, 1)
    by = reference_record("transformers")
    theirs = cache_key(base, "text", 4, 4, windows, 1, by)
    assert "reference" not in ours and reference_record("shardc") is None
    assert theirs == {**ours, "reference": by} and by["name"] == "transformers" and by["attn_implementation"] == "default"
    for written, read, why in ((ours, theirs, "reference shardc != transformers"),
                               (theirs, ours, "reference transformers != shardc")):
        scratch, cache = tmp_path / "scratch.safetensors", tmp_path / "cache.safetensors"
        w = ShardWriter(scratch, [("logits", "BF16", (1, 3, 4))], {})
        w.write(np.zeros(1 * 3 * 4 * 2, dtype=np.uint8))
        w.commit()
        seal_cache(scratch, cache, written)
        assert check_cache(cache, written) == ("hit", "")
        assert check_cache(cache, read) == ("stale", why)


def _hf_baseline_ppl(build: Path, windows: list[list[int]]) -> float:
    """The oracle: transformers' forward of the build directory, written here (one thread, as
    the gate's CPU passes run), through summarize's sums."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(build, dtype=torch.bfloat16).eval()
        rows = torch.tensor(windows)
        with torch.inference_mode():
            lp = torch.cat([torch.log_softmax(model(rows[i : i + 1]).logits[:, :-1].float(), -1)
                            for i in range(len(windows))])
    finally:
        torch.set_num_threads(threads)
    nll = -lp.gather(-1, rows[:, 1:, None])[..., 0].double()
    res = PositionScores(nll_base=nll, nll_cand=nll, kl=torch.zeros_like(nll), top1=torch.ones_like(nll, dtype=torch.bool))
    return summarize(res, len(windows), Thresholds()).baseline_ppl


REF = {"max_tokens": 512, "window": 256, "timeout_s": 120.0}


@pytest.mark.heavy
def test_demo_reference_transformers_agrees_with_shardc(demo_builds, tmp_path):
    """tp1 vs tp1 on the demo model, the baseline scored by shardc's runtime and then by
    transformers (its default attention: SDPA for Llama). The candidate side is shardc's either
    way, so its perplexity is the shardc-scored baseline's exactly; the transformers-scored
    baseline's perplexity is exactly what transformers' forward gives in the test; and since
    shardc's tp = 1 forward equals transformers' bit for bit on the CPU, the gate's delta and KL are
    exactly 0. (With eager attention, which rounds scores and probabilities to bf16, the same pair
    measured delta -0.023%, KL 1.9e-3, top-1 97.5%.) A shardc-scored cache is recomputed, with a line."""
    base = demo_builds["tp1pp1"]
    cache = tmp_path / "baseline.safetensors"
    ours = run_gate(base, base, baseline_cache=cache, **REF)
    assert ours.baseline_cache.status == "new" and ours.baseline.scored_by is None
    assert ours.passed and ours.baseline_ppl == ours.candidate_ppl and ours.kl_mean == 0.0
    notes: list[str] = []
    theirs = run_gate(base, base, baseline_cache=cache, note=notes.append, reference="transformers", **REF)
    assert theirs.baseline_cache.status == "stale"
    assert notes == [f"baseline cache {cache} is of another baseline (reference shardc != transformers); recomputing it"]
    assert theirs.baseline.scored_by["name"] == "transformers" and theirs.passed
    assert theirs.candidate_ppl == ours.baseline_ppl
    windows = make_windows(_ids(base), REF["window"], REF["max_tokens"])
    assert theirs.baseline_ppl == _hf_baseline_ppl(base.parent, windows)
    assert theirs.ppl_delta_pct == 0.0 and theirs.kl_mean == 0.0 and theirs.top1_agreement == 1.0


@pytest.mark.heavy
def test_demo_reference_transformers_fails_a_broken_candidate(demo_builds):
    import shutil

    broken = demo_builds["out"] / "broken-ref"
    shutil.copytree(demo_builds["tp3pp2"].parent, broken)
    _swap_row_parallel(broken, layer=20)
    p = _gate("--baseline", str(demo_builds["tp1pp1"]), "--candidate", str(broken / "manifest.json"),
              "--reference", "transformers", "--min-top1", "0.9", "--max-tokens", "256", "--window", "256",
              "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert r["baseline"]["scored_by"]["name"] == "transformers"
    assert not r["pass"] and r["ppl_delta_pct"] > 5 and r["top1_agreement"] < 0.9
