"""runtime/gate.py behaviours that mutation testing found unchecked, or reached only through the CLI
in a subprocess (which mutmut's per-test coverage does not see): the human report's exact text, the
baseline cache's verdicts and key, which torchrun rank holds the result, and run_gate's report
beyond the figures (golden, thresholds, cache, the scratch file removed).

Oracles: report lines written out by hand; cache files written here with the safetensors library;
hashes taken with hashlib over bytes the test holds; token counts from the tokenizers library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")

from shardc.results import to_json  # noqa: E402
from shardc.runtime.api_results import PositionScores  # noqa: E402
from shardc.runtime.gate import (  # noqa: E402
    GATE_CPU_THREADS,
    GoldenError,
    Thresholds,
    cache_key,
    check_cache,
    golden_text,
    make_windows,
    paired_bootstrap_ci,
    res_holder,
    run_gate,
    summarize,
)
from shardc.runtime.gate_report import (  # noqa: E402
    CacheRecord,
    CacheStatus,
    GateCheck,
    GateReport,
    GateSeconds,
    GateSide,
    GoldenRecord,
    Metric,
    format_report,
)


# -- format_report ----------------------------------------------------------------------------------------
def _report(passed: bool) -> GateReport:
    """A report with the figures the text shows (the rest: placeholders the text does not read)."""
    return GateReport(
        passed=passed,
        baseline=GateSide("b-plan", "b/manifest.json", "0" * 64, 1, 2, "bf16"),
        candidate=GateSide("c-plan", "c/manifest.json", "1" * 64, 4, 1, "int8"),
        golden=GoldenRecord("pydoc", "2" * 64, 200, 3, 64, 192),
        positions=189,
        baseline_ppl=12.345678, candidate_ppl=12.5,
        ppl_delta_pct=1.2500049, ppl_delta_ci95_pct=(-0.25, 2.75),
        kl_mean=0.00123456, kl_p99=0.0456, top1_agreement=0.98765,
        checks=(
            GateCheck(Metric.PPL_DELTA_PCT, 1.2500049, 0.5, "abs(value) <= limit", False),
            GateCheck(Metric.KL_MEAN, 0.00123456, 0.01, "value <= limit", True),
        ),
        thresholds=Thresholds(0.5, max_kl=0.01), baseline_cache=CacheRecord(None, CacheStatus.NONE),
        seconds=GateSeconds(1.0, 0.5, 0.1, 0.5, 0.1),
    )


def test_format_report_text_is_exact():
    want = [
        "gate: c-plan (tp4 pp1 int8) vs baseline b-plan (tp1 pp2 bf16)",
        "golden: pydoc, 3 windows x 64 tokens, 189 scored positions",
        "perplexity: baseline 12.3457  candidate 12.5000  delta +1.2500% (95% CI -0.2500% .. +2.7500%)",
        "KL(baseline||candidate): mean 1.235e-03  p99 4.560e-02 nats/token",
        "top-1 agreement: 98.77%",
        "FAIL ppl_delta_pct = 1.25 (abs(value) <= limit, limit 0.5)",
        "ok   kl_mean = 0.00123456 (value <= limit, limit 0.01)",
        "FAIL: the candidate does not match the baseline",
    ]
    assert format_report(_report(False)).split("\n") == want
    assert format_report(_report(True)).split("\n")[-1] == "PASS"


# -- the baseline cache ---------------------------------------------------------------------------------------
KEY = {"cpu_threads": 1, "baseline_manifest_sha256": "a" * 64, "golden_sha256": "b" * 64,
       "window": 64, "max_tokens": 256, "windows_sha256": "c" * 64}


def _cache(path: Path, meta: dict | None) -> Path:
    from safetensors.torch import save_file

    save_file({"logits": torch.zeros(2, 3)}, str(path), metadata=meta)
    return path


def test_check_cache_verdicts(tmp_path):
    assert check_cache(tmp_path / "none.safetensors", KEY) == ("new", "")
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a cache")
    n = int.from_bytes(b"not a ca", "little")  # its first 8 bytes read as the header length
    assert check_cache(junk, KEY) == ("stale", f"unreadable: header length {n} does not fit the file")
    assert check_cache(_cache(tmp_path / "m.safetensors", None), KEY) == ("stale", "not a shardc baseline cache")
    assert check_cache(_cache(tmp_path / "o.safetensors", {"other": "x"}), KEY) == (
        "stale", "not a shardc baseline cache")
    assert check_cache(_cache(tmp_path / "l.safetensors", {"shardc.baseline_cache": "[1, 2]"}), KEY) == (
        "stale", "not a shardc baseline cache")
    hit = _cache(tmp_path / "h.safetensors", {"shardc.baseline_cache": json.dumps(KEY)})
    # the right key but no digest (#25 item 6: hits are tested in runtime/test_gate_cache.py)
    assert check_cache(hit, KEY) == ("stale", "it carries no digest (an older shardc's cache)")
    # the first differing key, both values cut to 12 characters
    other = {**KEY, "golden_sha256": "d" * 64, "windows_sha256": "e" * 64}
    assert check_cache(hit, other) == ("stale", f"golden_sha256 {'b' * 12} != {'d' * 12}")
    assert check_cache(hit, {**KEY, "cpu_threads": None}) == ("stale", "cpu_threads 1 != None")
    partial = _cache(tmp_path / "p.safetensors", {"shardc.baseline_cache": json.dumps({"window": 64})})
    assert check_cache(partial, KEY) == ("stale", "cpu_threads None != 1")


# -- on real builds -------------------------------------------------------------------------------------------
def _build(src: Path, out: Path, tp: int, pp: int) -> Path:
    from shardc.compiler.compile import build

    name = f"mg-tp{tp}pp{pp}"
    plan = make_plan(tp, pp, name=name, source=src)
    return build(plan, out_dir=out / name).manifest_path


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("mgate")
    words = "the a of to in is it and for on with as by at from that this be are was".split()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    src = write_checkpoint(root / "src", llama_config(hidden_size=32, intermediate_size=64, num_layers=2,
                                                      vocab_size=len(words) + 1))
    tok.save(str(src / "tokenizer.json"))
    golden = root / "golden.txt"
    golden.write_text(" ".join(np.random.default_rng(3).choice(words, size=150)) + " zzz")
    return {"tp1pp1": _build(src, root, 1, 1), "tp2pp2": _build(src, root, 2, 2),
            "tp1pp2": _build(src, root, 1, 2), "golden": golden,
            "tokenizer": src / "tokenizer.json"}


def test_cache_key_pins_manifest_text_windows_and_threads(builds):
    from shardc.runtime.api import open_build

    ref = open_build(builds["tp1pp1"])
    windows = [[1, 2, 3], [4, 5, 6]]
    got = cache_key(ref, "héllo", 3, 7, windows, 1)
    assert got == {
        "cpu_threads": 1,
        "baseline_manifest_sha256": hashlib.sha256(builds["tp1pp1"].read_bytes()).hexdigest(),
        "golden_sha256": hashlib.sha256("héllo".encode()).hexdigest(),
        "window": 3, "max_tokens": 7,
        "windows_sha256": hashlib.sha256(b"[[1, 2, 3], [4, 5, 6]]").hexdigest(),
    }
    assert type(got["window"]) is int and type(got["max_tokens"]) is int
    assert cache_key(ref, "héllo", np.int64(3), np.int64(7), windows)["cpu_threads"] is None
    assert json.dumps(cache_key(ref, "x", np.int64(3), np.int64(7), windows))  # numpy ints made JSON-able


def test_res_holder_is_the_last_stage_first_rank(builds, monkeypatch):
    """Under torchrun the rank that reads the baseline logits is tp_rank 0 of the last stage:
    (pp - 1) * tp = 2 for tp=2 pp=2; without RANK, rank 0."""
    from shardc.runtime.api import open_build

    big, one = open_build(builds["tp2pp2"]), open_build(builds["tp1pp1"])
    monkeypatch.delenv("RANK", raising=False)
    assert res_holder(one) and not res_holder(big)
    for rank, want in ((0, False), (1, False), (2, True), (3, False)):
        monkeypatch.setenv("RANK", str(rank))
        assert res_holder(big) is want


def _tmp_gate_files() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("shardc-gate-*")}


def test_run_gate_report_and_cache(builds, tmp_path):
    """Three gates of tp1pp2 against tp1pp1: a cache that is not one (recomputed, a note says so),
    the same cache again (a hit: the baseline is not scored), and no cache (the scratch logits file
    is removed). Same numbers each time; the report carries what was asked."""
    from tokenizers import Tokenizer

    text = builds["golden"].read_text()
    ids = Tokenizer.from_file(str(builds["tokenizer"])).encode(text).ids
    kw = {"golden": str(builds["golden"]), "max_tokens": 96, "window": 32, "timeout_s": 60.0,
          "tokenizer": str(builds["tokenizer"]), "thresholds": Thresholds(0.75, max_kl=0.5, min_top1=0.25)}
    cache = tmp_path / "base.safetensors"
    cache.write_text("junk")
    notes: list[str] = []
    before = _tmp_gate_files()
    t0 = time.perf_counter()
    first = run_gate(builds["tp1pp1"], builds["tp1pp2"], baseline_cache=cache, note=notes.append, **kw)
    elapsed = time.perf_counter() - t0
    assert to_json(first.baseline_cache) == {"path": str(cache), "status": "stale"}
    assert len(notes) == 1 and notes[0].startswith(f"baseline cache {cache} is of another baseline (unreadable")
    assert notes[0].endswith("; recomputing it")
    windows = make_windows(ids, 32, 96)
    from safetensors import safe_open

    with safe_open(str(cache), framework="pt") as f:
        stored = json.loads(f.metadata()["shardc.baseline_cache"])
    assert stored == {
        "cpu_threads": GATE_CPU_THREADS,
        "baseline_manifest_sha256": hashlib.sha256(builds["tp1pp1"].read_bytes()).hexdigest(),
        "golden_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": 32, "max_tokens": 96,
        "windows_sha256": hashlib.sha256(json.dumps(windows).encode()).hexdigest()}
    assert GATE_CPU_THREADS == 1
    assert to_json(first.golden) == {"source": str(builds["golden"]), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                               "text_tokens": len(ids), "windows": 3, "window": 32, "tokens": 96}
    assert len(ids) == 151 and ids[-1] == 0  # "zzz" is unknown to the word-level vocabulary
    assert to_json(first.thresholds) == {"max_ppl_delta_pct": 0.75, "max_kl": 0.5, "min_top1": 0.25}
    assert [c.name for c in first.checks] == ["ppl_delta_pct", "kl_mean", "top1_agreement"]
    assert first.positions == 3 * 31 and first.passed
    for side, name, tp, pp in (("baseline", "mg-tp1pp1", 1, 1), ("candidate", "mg-tp1pp2", 1, 2)):
        m = json.loads(builds[f"tp{tp}pp{pp}"].read_text())
        assert to_json(getattr(first, side)) == {"plan": name, "manifest": str(builds[f"tp{tp}pp{pp}"].resolve()),
                               "plan_sha256": m["plan_sha256"], "tp": tp, "pp": pp, "dtype": "bf16"}
    s = to_json(first.seconds)
    assert set(s) == {"wall", "compute", "load", "baseline_compute", "baseline_load"}
    assert all(isinstance(s[k], float) and s[k] > 0 for k in s)
    assert s["compute"] < s["wall"] <= elapsed and s["baseline_compute"] < s["wall"]

    hit = run_gate(builds["tp1pp1"], builds["tp1pp2"], baseline_cache=cache, note=notes.append, **kw)
    assert to_json(hit.baseline_cache) == {"path": str(cache), "status": "hit"} and len(notes) == 1
    assert hit.seconds.baseline_compute is None and hit.seconds.baseline_load is None
    plain = run_gate(builds["tp1pp1"], builds["tp1pp2"], **kw)
    assert to_json(plain.baseline_cache) == {"path": None, "status": "none"}
    assert _tmp_gate_files() == before  # the scratch logits are gone (outside torchrun, whatever the plan)
    assert cache.is_file()  # a named cache is kept
    drop = ("seconds", "baseline_cache")
    assert {k: v for k, v in to_json(first).items() if k not in drop} \
        == {k: v for k, v in to_json(hit).items() if k not in drop} \
        == {k: v for k, v in to_json(plain).items() if k not in drop}
    # a default-threshold report has the delta check alone
    assert summarize(PositionScores(nll_base=np.ones((1, 4)), nll_cand=np.ones((1, 4)), kl=np.zeros(4),
                                    top1=np.ones(4, bool)), 1, Thresholds()).checks[0].limit == 0.5


# -- pure parts the earlier tests left loose -------------------------------------------------------------------
def test_summarize_p99_and_positions_from_hand_arrays():
    """kl p99 of 0..99 is 98.01 (linear interpolation); a single window's bootstrap resamples positions."""
    nb = np.zeros((1, 100))
    nc = np.full((1, 100), math.log(1.01))
    r = summarize(PositionScores(nll_base=nb, nll_cand=nc, kl=np.arange(100.0), top1=np.arange(100) < 37), 1,
                  Thresholds(1.5))
    assert r.kl_p99 == pytest.approx(98.01, rel=1e-12) and r.kl_mean == pytest.approx(49.5)
    assert r.top1_agreement == pytest.approx(0.37) and r.positions == 100
    assert r.ppl_delta_pct == pytest.approx(1.0, rel=1e-9) and r.passed
    assert r.baseline_ppl == 1.0 and r.candidate_ppl == pytest.approx(1.01)
    assert r.ppl_delta_ci95_pct == pytest.approx((1.0, 1.0), rel=1e-9)


def test_single_window_bootstrap_resamples_positions():
    """One window: positions are resampled. Per-position deltas of 0 and log(1.1) half and half give an
    interval strictly inside (0%, 10%) that holds the point estimate."""
    nb = np.zeros((1, 200))
    nc = np.concatenate([np.zeros(100), np.full(100, math.log(1.1))])[None]
    lo, hi = paired_bootstrap_ci(nb, nc, 2000, 0)
    est = (math.exp(math.log(1.1) / 2) - 1) * 100
    assert 0 < lo < est < hi < 10
    assert paired_bootstrap_ci(nb, nc, 2000, 1) != (lo, hi)  # the seed is used


def test_golden_jsonl_errors_name_the_line(tmp_path):
    f = tmp_path / "g.jsonl"
    f.write_text('{"text": "a"}\n\nnot json\n')
    with pytest.raises(GoldenError) as e:
        golden_text(str(f))
    assert e.value.message == f"{f}:3 is not JSON" and e.value.hint == "one JSON object per line"
    f.write_text('{"text": "a"}\n[1]\n')
    with pytest.raises(GoldenError) as e:
        golden_text(str(f))
    assert e.value.message == f"{f}:2 has no string 'text' field" and e.value.hint == 'lines like {"text": "..."}'
    f.write_text('{"text": 5}\n')
    with pytest.raises(GoldenError, match="1 has no string"):
        golden_text(str(f))
    f.write_text('"x"\n  \n{"text": "y"}\n')
    assert golden_text(str(f)) == ("x\n\ny", str(f))
    with pytest.raises(GoldenError) as e:
        golden_text(str(tmp_path / "nope.txt"))
    assert e.value.hint == "use `golden` pydoc, a UTF-8 text file or a JSONL file"
    assert e.value.message.startswith(f"cannot read golden text {str(tmp_path / 'nope.txt')!r}: ")


def test_make_windows_messages_and_bounds():
    with pytest.raises(GoldenError) as e:  # the limit is the user's number, not the text (#26 item 4)
        make_windows(list(range(10)), 4, 3)
    assert (e.value.key, e.value.message) == ("max_tokens", "3 is smaller than one `window` of 4 tokens (the golden text has 10)")
    assert e.value.hint == "give `max_tokens` 4 or more, or a smaller `window`"
    with pytest.raises(GoldenError) as e:
        make_windows(list(range(3)), 4, 100)
    assert e.value.message == "the golden text has 3 tokens, fewer than one window of 4"
    assert e.value.hint == "use a longer text or a smaller `window`"
    assert make_windows(list(range(8)), 4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # exactly two windows
    assert make_windows(list(range(8)), 4, 7) == [[0, 1, 2, 3]]
    assert make_windows(list(range(4)), 4, 100) == [[0, 1, 2, 3]]


# -- run_gate's refusals, before anything is scored (no process started) ---------------------------------------
def _pydoc_tokens(tokenizer: Path) -> int:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer)).encode("\n\n".join(topics[k] for k in sorted(topics))).ids)


def _too_short(n: int) -> str:
    return f"1 is smaller than one `window` of 2 tokens (the golden text has {n})"


def test_run_gate_defaults_to_pydoc_and_the_build_tokenizer(builds):
    """No --golden, no --tokenizer: pydoc's topics through the baseline build's tokenizer.json (the
    token count in the refusal says which text and which tokenizer were used)."""
    with pytest.raises(GoldenError) as e:
        run_gate(builds["tp1pp1"], builds["tp1pp2"], max_tokens=1, window=2)
    assert e.value.message == _too_short(_pydoc_tokens(builds["tokenizer"]))


def test_run_gate_uses_the_tokenizer_override(builds, tmp_path):
    """--tokenizer: a tokenizer that also splits punctuation counts more pydoc tokens than the build's."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_file(str(builds["tokenizer"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    other = tmp_path / "tokenizer.json"
    tok.save(str(other))
    n = _pydoc_tokens(other)
    assert n > _pydoc_tokens(builds["tokenizer"])
    with pytest.raises(GoldenError) as e:
        run_gate(builds["tp1pp1"], builds["tp1pp2"], max_tokens=1, window=2, tokenizer=str(other))
    assert e.value.message == _too_short(n)


def test_run_gate_takes_shards_from_the_given_directories(builds, tmp_path):
    """Manifests copied away from their shards: --baseline-dir / --candidate-dir name where the shards
    are (tokenizer.json included); without them the build is refused."""
    import shutil

    from shardc.errors import ManifestError

    copies = {}
    for key in ("tp1pp1", "tp1pp2"):
        d = tmp_path / key
        d.mkdir()
        shutil.copy(builds[key], d / "manifest.json")
        copies[key] = d / "manifest.json"
    with pytest.raises(GoldenError) as e:
        run_gate(copies["tp1pp1"], copies["tp1pp2"], baseline_dir=builds["tp1pp1"].parent,
                 candidate_dir=builds["tp1pp2"].parent, max_tokens=1, window=2)
    assert e.value.message == _too_short(_pydoc_tokens(builds["tokenizer"]))
    for kw in ({"baseline_dir": builds["tp1pp1"].parent}, {"candidate_dir": builds["tp1pp2"].parent}):
        with pytest.raises(ManifestError, match="shard file"):
            run_gate(copies["tp1pp1"], copies["tp1pp2"], max_tokens=1, window=2, **kw)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the refusal on a node without GPUs")
def test_run_gate_device_check_names_the_larger_plan(builds, monkeypatch):
    """--device cuda without GPUs: the refusal names the plan needing the most GPUs (whichever side it
    is on); under torchrun, this node's share (LOCAL_WORLD_SIZE) of it."""
    from shardc.errors import DeviceError

    for env in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(env, raising=False)
    for base, cand in (("tp1pp1", "tp2pp2"), ("tp2pp2", "tp1pp1")):
        with pytest.raises(DeviceError) as e:
            run_gate(builds[base], builds[cand], device="cuda", max_tokens=1, window=2)
        assert e.value.message == "plan mg-tp2pp2 needs 4 GPUs on this node; 0 are visible"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(DeviceError) as e:
        run_gate(builds["tp1pp1"], builds["tp2pp2"], device="cuda", max_tokens=1, window=2)
    assert e.value.message == "plan mg-tp2pp2 needs 3 GPUs on this node; 0 are visible"


def test_summarize_sums_float32_inputs_in_float64():
    """Per-position NLLs handed over as float32 are summed in float64 (the module's promise): a
    million 0.1f values sum to 100000.0015 in float64, to 100000.0078 in float32."""
    a = np.full(10**6, 0.1, dtype=np.float32)
    exact = math.fsum(a.astype(np.float64).tolist()) / a.size
    r = summarize(PositionScores(nll_base=a, nll_cand=a * np.float32(2), kl=a,
                                 top1=np.ones(a.size, bool)), 4, Thresholds())
    assert r.kl_mean == pytest.approx(exact, rel=1e-12)
    assert r.baseline_ppl == pytest.approx(math.exp(exact), rel=1e-12)
    assert r.candidate_ppl == pytest.approx(math.exp(2 * exact), rel=1e-12)


def test_different_models_message_is_exact(builds):
    import copy

    from shardc.errors import ManifestError
    from shardc.formats.manifest import Manifest
    from shardc.runtime.gate import check_compatible

    d = json.loads(builds["tp1pp1"].read_text())
    other = copy.deepcopy(d)
    other["model"]["hidden_size"] = 7
    with pytest.raises(ManifestError) as e:
        check_compatible(Manifest.from_dict(d), Manifest.from_dict(other))
    assert e.value.message == f"baseline and candidate are different models: hidden_size is {d['model']['hidden_size']} vs 7"
    assert e.value.hint == "gate two plans built from the same checkpoint"
    other = copy.deepcopy(d)
    next(f for f in other["files"] if f["name"] == "tokenizer.json")["sha256"] = "f" * 64
    with pytest.raises(ManifestError) as e:
        check_compatible(Manifest.from_dict(d), Manifest.from_dict(other))
    assert e.value.message == "baseline and candidate ship different tokenizer.json files"
    assert e.value.hint == "gate two plans built from the same checkpoint"


def test_summarize_checks_are_exact_records_and_reproducible():
    """Every check is {name, value, limit, rule, ok} (format_report and the JSON report read them), and
    the bootstrap interval is seeded: the same arrays give the same interval."""
    rng = np.random.default_rng(5)
    nb = rng.gamma(2.0, 1.5, size=(6, 20))
    nc = nb + rng.normal(0.0, 0.05, size=nb.shape)
    res = PositionScores(nll_base=nb, nll_cand=nc, kl=np.full(120, 0.25), top1=np.arange(120) < 90)
    r = summarize(res, 6, Thresholds(2.0, max_kl=0.3, min_top1=0.8))
    delta = (math.exp((nc.sum() - nb.sum()) / nb.size) - 1) * 100
    assert to_json(r.checks) == [
        {"name": "ppl_delta_pct", "value": pytest.approx(delta, rel=1e-9), "limit": 2.0,
         "rule": "abs(value) <= limit", "ok": abs(delta) <= 2.0},
        {"name": "kl_mean", "value": 0.25, "limit": 0.3, "rule": "value <= limit", "ok": True},
        {"name": "top1_agreement", "value": 0.75, "limit": 0.8, "rule": "value >= limit", "ok": False},
    ]
    assert r.passed is False
    again = summarize(PositionScores(*(getattr(res, f.name).copy() for f in dataclasses.fields(res))), 6, Thresholds())
    assert again.ppl_delta_ci95_pct == r.ppl_delta_ci95_pct
    assert again.ppl_delta_ci95_pct[0] < delta < again.ppl_delta_ci95_pct[1]
    # identical plans: delta exactly 0, and a 0% limit is met (the limit is inclusive)
    assert summarize(dataclasses.replace(res, nll_cand=nb.copy()), 6, Thresholds(0.0)).passed is True


def test_two_windows_are_resampled_as_blocks():
    """Two windows, each shifted by its own constant: the block bootstrap draws (0,0), (0,1), (1,0),
    (1,1), a quarter each, so its 2.5th / 97.5th percentiles are exactly the two windows' deltas
    exp(0.01) - 1 and exp(0.05) - 1. Resampling positions instead would give a far narrower interval,
    and a draw that never picks window 0 would lose the lower end."""
    nb = np.random.default_rng(8).gamma(2.0, 1.5, size=(2, 50))
    nc = nb + np.array([[0.01], [0.05]])
    lo, hi = paired_bootstrap_ci(nb, nc, 2000, 0)
    assert lo == pytest.approx((math.exp(0.01) - 1) * 100, rel=1e-9)
    assert hi == pytest.approx((math.exp(0.05) - 1) * 100, rel=1e-9)


def test_bootstrap_percentiles_match_the_definition():
    """20 windows of different shifts: the interval is the 2.5th and 97.5th percentile (linear
    interpolation) of exp(mean over the drawn windows' positions of nc - nb) - 1 over 2000 draws of
    20 windows with replacement, drawn by numpy's default_rng(seed).integers(0, 20, (2000, 20))."""
    g = torch.Generator().manual_seed(4)
    nb = torch.rand(20, 30, generator=g, dtype=torch.float64) * 3
    nc = nb + torch.randn(20, 1, generator=g, dtype=torch.float64) * 0.02
    idx = torch.from_numpy(np.random.default_rng(0).integers(0, 20, size=(2000, 20)))
    diff = (nc - nb).sum(1)[idx].sum(1) / (20 * 30)
    d = (diff.exp() - 1) * 100
    want = torch.quantile(d, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    got = paired_bootstrap_ci(nb.numpy(), nc.numpy(), 2000, 0)
    assert got == pytest.approx(want, rel=1e-9)
    assert got != pytest.approx(torch.quantile(d, torch.tensor([0.035, 0.985], dtype=torch.float64)).tolist(), rel=1e-6)


def test_a_failed_baseline_pass_reports_its_own_error(builds, tmp_path):
    """A baseline shard whose bytes no longer match its manifest: the baseline pass fails before it
    writes the scratch logits file, and the gate raises that failure (a ShardcError naming the sha256
    mismatch), not a FileNotFoundError from cleaning up a file that was never written."""
    import shutil

    from shardc.errors import ShardcError

    d = tmp_path / "b"
    shutil.copytree(builds["tp1pp1"].parent, d)
    shard = next(d.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = _tmp_gate_files()
    with pytest.raises(ShardcError) as e:
        run_gate(d / "manifest.json", builds["tp1pp2"], golden=str(builds["golden"]), max_tokens=96, window=32,
                 timeout_s=60.0)
    assert "sha256" in str(e.value), str(e.value)
    assert _tmp_gate_files() == before
