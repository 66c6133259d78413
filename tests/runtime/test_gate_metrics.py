"""The gate's numbers recomputed in the test with plain torch, from two logit arrays.

Pure part: ``summarize`` gets per-position arrays made here from random logits; perplexity, delta,
KL mean / p99 and top-1 are recomputed with torch, the paired bootstrap's interval is derived from
its definition. End to end: the ``shardc gate`` CLI scores two builds of different (peaked) models;
the test loads the *source* checkpoints into transformers, scores the same windows itself and
compares every figure of the JSON report, including the direction of the KL divergence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_run import shardc_in
from plan_helpers import plan as make_plan

from shardc.runtime.api_results import PositionScores
from shardc.runtime.gate import Thresholds, paired_bootstrap_ci, summarize

ROOT = Path(__file__).resolve().parents[2]


def metrics(lb_logits: torch.Tensor, lc_logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Everything the gate reports, from [windows, positions, vocab] logits and next-token targets."""
    lb = torch.log_softmax(lb_logits.double(), -1)
    lc = torch.log_softmax(lc_logits.double(), -1)
    nb = -lb.gather(-1, targets[..., None])[..., 0]
    nc = -lc.gather(-1, targets[..., None])[..., 0]
    kl = (lb.exp() * (lb - lc)).sum(-1)  # KL(baseline || candidate)
    ppl_b, ppl_c = math.exp(nb.mean().item()), math.exp(nc.mean().item())
    return {
        "nll_base": nb, "nll_cand": nc, "kl": kl, "top1": lb.argmax(-1) == lc.argmax(-1),
        "baseline_ppl": ppl_b, "candidate_ppl": ppl_c, "ppl_delta_pct": (ppl_c / ppl_b - 1) * 100,
        "kl_mean": kl.mean().item(), "kl_p99": torch.quantile(kl.flatten(), 0.99).item(),
        "kl_reverse": (lc.exp() * (lc - lb)).sum(-1).mean().item(),
        "top1_agreement": (lb.argmax(-1) == lc.argmax(-1)).double().mean().item(),
    }


def _logits(seed: int, w: int = 4, t: int = 50, v: int = 40, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(w, t, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_summarize_equals_torch_recomputation():
    base, targets = _logits(0), torch.randint(0, 40, (4, 50), generator=torch.Generator().manual_seed(9))
    cand = base + _logits(1, scale=1.0)
    want = metrics(base, cand, targets)
    assert abs(want["kl_mean"] - want["kl_reverse"]) > 0.05 * want["kl_mean"]  # direction matters here
    res = PositionScores(*(want[k].numpy() for k in ("nll_base", "nll_cand", "kl", "top1")))
    got = summarize(res, 4, Thresholds())
    for k in ("baseline_ppl", "candidate_ppl", "ppl_delta_pct", "kl_mean", "kl_p99", "top1_agreement"):
        assert getattr(got, k) == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    assert got.positions == 200


def test_bootstrap_interval_is_the_extreme_window_deltas():
    """With 3 windows, each single-window draw (i, i, i) has probability 1/27 > 2.5%, so the 2.5th and
    97.5th percentiles of the paired block bootstrap are exactly the smallest and largest delta a
    single window gives: exp(mean(nc_i - nb_i)) - 1."""
    g = torch.Generator().manual_seed(3)
    nb = torch.rand(3, 20, generator=g, dtype=torch.float64) * 4
    nc = nb + torch.tensor([[0.01], [-0.02], [0.05]], dtype=torch.float64) + torch.rand(3, 20, generator=g, dtype=torch.float64) * 1e-3
    per_window = ((nc - nb).mean(1).exp() - 1) * 100
    lo, hi = paired_bootstrap_ci(nb.numpy(), nc.numpy(), 2000, 0)
    assert lo == pytest.approx(per_window.min().item(), rel=1e-9)
    assert hi == pytest.approx(per_window.max().item(), rel=1e-9)


def test_bootstrap_is_paired():
    """Candidate = baseline + the same shift at every position: whatever windows are drawn, the delta
    is exp(shift) - 1, so a paired bootstrap has a zero-width interval however much the windows'
    perplexities differ. An unpaired draw would spread it by the windows' own variation."""
    nb = np.repeat(np.array([[0.5], [3.0], [6.0], [1.0]]), 30, axis=1)
    lo, hi = paired_bootstrap_ci(nb, nb + 0.004, 2000, 0)
    assert lo == pytest.approx((math.exp(0.004) - 1) * 100, rel=1e-9)
    assert hi == pytest.approx(lo, rel=1e-9)


@pytest.mark.parametrize("pct, ok", [(-5.0, False), (-0.6, False), (-0.4, True), (0.4, True), (0.6, False)])
def test_the_limit_applies_to_the_absolute_delta(pct, ok):
    """A candidate far *better* than the baseline is as suspect as one far worse (README: 0.5% delta)."""
    nb = np.full((2, 10), 2.0)
    nc = nb + math.log(1 + pct / 100)
    r = summarize(PositionScores(nll_base=nb, nll_cand=nc, kl=np.zeros(20), top1=np.ones(20, bool)), 2, Thresholds())
    assert r.ppl_delta_pct == pytest.approx(pct, rel=1e-9)
    assert r.passed is ok


def test_max_kl_and_min_top1_are_inclusive_limits():
    nb = np.full((1, 8), 2.0)
    res = PositionScores(nll_base=nb, nll_cand=nb, kl=np.full(8, 0.25), top1=np.arange(8) < 6)
    assert summarize(res, 1, Thresholds(max_kl=0.25, min_top1=0.75)).passed
    r = summarize(res, 1, Thresholds(max_kl=0.2499))
    assert not r.passed and [c.ok for c in r.checks] == [True, False]
    r = summarize(res, 1, Thresholds(min_top1=0.7501))
    assert not r.passed and [c.name for c in r.checks if not c.ok] == ["top1_agreement"]


# -- end to end: the CLI's report against transformers on the source checkpoints ------------------------------
WINDOW, MAX_TOKENS = 32, 128


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """Two different tiny models whose lm_head is scaled up, so the next-token distributions are
    peaked and KL(a||b) differs clearly from KL(b||a); a word-level tokenizer; a .txt golden file."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("gate-oracle")
    words = ("the a of to in is it and for on with as by at from that this be are was not or "
             "an if can has but when all one may use which will new each any its more").split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rng = np.random.default_rng(7)
    golden = root / "golden.txt"
    golden.write_text(" ".join(rng.choice(words, size=400)))
    srcs, manifests = {}, {}
    cfg = llama_config(num_layers=2, vocab_size=len(vocab))
    other = load_file(write_checkpoint(root / "other", cfg, seed=11) / "model.safetensors")["lm_head.weight"]
    for name, tp in (("base", 1), ("cand", 2)):
        src = write_checkpoint(root / name, cfg, seed=0)
        st = load_file(src / "model.safetensors")
        w = st["lm_head.weight"].float()
        # baseline: sharp; candidate: softer and partly another model's head (asymmetric KL, top-1 < 1)
        w = w * 40 if name == "base" else w * 12 + other.float() * 8
        st["lm_head.weight"] = w.to(torch.bfloat16)
        save_file(st, str(src / "model.safetensors"))
        tok.save(str(src / "tokenizer.json"))
        plan = make_plan(tp, name=name, source=src)
        srcs[name], manifests[name] = src, build(plan, root / f"b-{name}").manifest_path
    return {"src": srcs, "manifest": manifests, "golden": golden, "tokenizer": srcs["base"] / "tokenizer.json"}


def _oracle(peaked) -> dict:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    ids = Tokenizer.from_file(str(peaked["tokenizer"])).encode(peaked["golden"].read_text()).ids
    n = min(len(ids), MAX_TOKENS) // WINDOW
    x = torch.tensor(ids[: n * WINDOW]).reshape(n, WINDOW)
    logits = {}
    for side in ("base", "cand"):
        m = LlamaForCausalLM.from_pretrained(peaked["src"][side], dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[side] = m(x).logits[:, :-1].float()
    return metrics(logits["base"], logits["cand"], x[:, 1:])


def test_cli_report_matches_transformers(peaked, tmp_path):
    want = _oracle(peaked)
    assert want["kl_mean"] > 0.5 and abs(want["kl_mean"] - want["kl_reverse"]) > 0.2 * want["kl_mean"]
    report = tmp_path / "r.json"
    args = ["gate", "--baseline", str(peaked["manifest"]["base"]),
            "--candidate", str(peaked["manifest"]["cand"]), "--golden", str(peaked["golden"]),
            "--tokenizer", str(peaked["tokenizer"]), "--window", str(WINDOW), "--max-tokens", str(MAX_TOKENS),
            "--max-ppl-delta-pct", "1000", "--timeout", "60", "--report", str(report)]
    p = shardc_in(*args, "--max-kl", str(want["kl_mean"] * 1.1))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(report.read_text())
    assert r["golden"]["source"] == str(peaked["golden"]) and r["golden"]["windows"] == MAX_TOKENS // WINDOW
    assert r["positions"] == want["nll_base"].numel()
    # bf16 GEMMs blocked differently (tp=2 vs one matrix) move the last bits: a few percent at most
    for k in ("baseline_ppl", "candidate_ppl", "kl_mean", "kl_p99"):
        assert r[k] == pytest.approx(want[k], rel=0.03), (k, r[k], want[k])
    assert r["ppl_delta_pct"] == pytest.approx(want["ppl_delta_pct"], abs=0.03 * abs(want["ppl_delta_pct"]) + 0.5)
    assert r["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=3 / r["positions"])
    assert [c["name"] for c in r["checks"]] == ["ppl_delta_pct", "kl_mean"]
    # --max-kl below the measured mean KL fails the gate with exit 1
    p = shardc_in(*args, "--max-kl", str(want["kl_mean"] * 0.9))
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(report.read_text())
    assert not r["pass"] and [c["ok"] for c in r["checks"]] == [True, False]


# -- what the gate refuses and reads ------------------------------------------------------------------------
GATE_KEYS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "vocab_size", "rope_theta", "rope_scaling")


def _manifest(tok: str | None = "t" * 64, **model):
    """A typed Manifest carrying only what the gate compares (model record, side-file hashes)."""
    from shardc.formats.manifest import FileEntry, LayoutRecord, Manifest, SourceRecord

    base = {"architecture": "LlamaForCausalLM", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 96, "rope_theta": 1e4,
            "rope_scaling": None}
    files = [FileEntry("config.json", 10, "c" * 64)]
    if tok:
        files.append(FileEntry("tokenizer.json", 10, tok))
    return Manifest(plan={}, plan_sha256="p" * 64, model={**base, **model},
                    layout=LayoutRecord(1, 1, [(0, 2)], "bf16", "bf16"),
                    source=SourceRecord("synthetic", None, []), files=files, shards=[])


@pytest.mark.parametrize("key", GATE_KEYS)
def test_every_model_key_must_agree(key):
    from shardc.errors import ManifestError
    from shardc.runtime.gate import check_compatible

    check_compatible(_manifest(), _manifest())  # the same network: accepted
    other = {"architecture": "Qwen2ForCausalLM", "rope_scaling": {"rope_type": "linear", "factor": 2.0},
             "rope_theta": 5e5}.get(key, 7)
    with pytest.raises(ManifestError, match=f"different models: {key} is ") as err:
        check_compatible(_manifest(), _manifest(**{key: other}))
    assert repr(other) in str(err.value) and err.value.hint


def test_tokenizers_must_agree_when_both_are_known():
    from shardc.errors import ManifestError
    from shardc.runtime.gate import check_compatible

    check_compatible(_manifest(tok="a" * 64), _manifest(tok="a" * 64))
    check_compatible(_manifest(tok="a" * 64), _manifest(tok=None))  # one side has none: nothing to compare
    check_compatible(_manifest(tok=None), _manifest(tok="b" * 64))
    with pytest.raises(ManifestError, match="different tokenizer.json") as err:
        check_compatible(_manifest(tok="a" * 64), _manifest(tok="b" * 64))
    assert err.value.hint


def test_golden_text_sources_and_labels(tmp_path):
    from pydoc_data.topics import topics

    from shardc.runtime.gate import GoldenError, golden_text, make_windows

    text, label = golden_text("pydoc")
    assert label == "pydoc" and text == "\n\n".join(topics[k] for k in sorted(topics))
    f = tmp_path / "g.txt"
    f.write_bytes("naïve café\n".encode())
    assert golden_text(str(f)) == ("naïve café\n", str(f))
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(GoldenError, match="cannot read golden text") as err:
        golden_text(str(f))
    assert err.value.hint
    assert make_windows(list(range(7)), 2, 100) == [[0, 1], [2, 3], [4, 5]]  # 2 is the smallest window
    with pytest.raises(GoldenError, match="must be at least 2, got 1"):
        make_windows(list(range(7)), 1, 100)
    with pytest.raises(GoldenError, match="3 is smaller than one `window` of 4") as err:
        make_windows(list(range(7)), 4, 3)
    assert err.value.hint
