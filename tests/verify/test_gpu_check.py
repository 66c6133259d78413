"""scripts/gpu_check.sh, the one-call GPU check of issue 16, runs end to end on CPU with a tiny model
(DEVICE=cpu), so the script the GPU machine runs cannot rot: every step must pass, none skipped.
Its decode check (scripts/decode_score.py, issue #41 item 10) is scored by teacher forcing; the
scoring is fed synthetic logits here, so it is seen to pass exact tokens and bf16 near-ties and to
fail a real mismatch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from decode_score import NEAR_TIE_ULPS, bf16_ulp, score_tokens

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
def test_gpu_check_script_on_cpu(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "BUDGET_S": "900", "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r["ok"] and r["device"] == "cpu" and r["size"] == "tiny"
    assert {v["status"] for v in r["steps"].values()} == {"ok"}, r["steps"]
    assert len(r["steps"]) == 15
    tf = r["figures"]["decode_teacher_forced"]
    assert (tf["tokens"], tf["mismatch"], tf["exact"] + tf["near_tie"]) == (16, 0, 16), tf
    assert tf["margin_bf16_ulps"] == NEAR_TIE_ULPS and 0 < tf["margins"][0] <= tf["margins"][1]
    assert "16 greedy tokens scored by teacher forcing: " in p.stdout and "0 real mismatch(es)" in p.stdout
    assert (tmp_path / "out" / "gpu_check.log").is_file()


# -- the decode check's scoring (scripts/decode_score.py) ---------------------------------------------
def _next_bf16(x: float) -> float:
    """The bf16 value after ``x`` (an exact bf16 value), from ml_dtypes' bit pattern: the oracle."""
    bits = np.array([x], dtype=ml_dtypes.bfloat16).view(np.uint16) + np.uint16(1)
    return float(bits.view(ml_dtypes.bfloat16)[0])


@pytest.mark.parametrize("x", [1.0, 1.5, 3.96875, 4.0, 12.25, 0.046875, 100.0, -7.5, 2.0 ** -120])
def test_bf16_ulp_is_the_spacing_of_bf16(x):
    assert float(np.array([x], dtype=ml_dtypes.bfloat16)[0]) == x  # an exact bf16 value
    assert bf16_ulp(x) == _next_bf16(abs(x)) - abs(x)


def test_bf16_ulp_between_bf16_values():
    assert bf16_ulp(4.0) == 2.0 ** -5 and bf16_ulp(3.99) == 2.0 ** -6 and bf16_ulp(0.0) == 2.0 ** -133


def _rows(tokens: list[int], vocab: int = 8) -> np.ndarray:
    """Logits whose argmax at row i is tokens[i], by a clear 2.0, at a magnitude of about 4."""
    rows = np.tile(np.linspace(-3.0, 1.0, vocab), (len(tokens), 1))
    for i, t in enumerate(tokens):
        rows[i, t] = 4.0
    return rows


def test_exact_tokens_pass():
    s = score_tokens([3, 1, 7, 0], _rows([3, 1, 7, 0]))
    assert s.ok and (s.tokens, s.exact, s.near_tie, s.mismatches) == (4, 4, 0, ())
    assert s.margins == (4 * 2.0 ** -5, 4 * 2.0 ** -5) and s.worst_near_tie_ulps == 0.0
    assert s.line() == ("4 greedy tokens scored by teacher forcing: 4 transformers' argmax, 0 near-ties within 4 "
                        "bf16 ulps of the top logit (margin 0.125-0.125 in logits; largest gap 0.00 ulps), "
                        "0 real mismatch(es)")


def test_a_tie_at_the_top_is_exact():
    rows = _rows([2, 2])
    rows[1, 5] = 4.0  # 2 and 5 tie; numpy's argmax says 2, ours says 5: both are the reference's argmax
    s = score_tokens([2, 5], rows)
    assert s.ok and s.exact == 2


def test_a_near_tie_within_the_margin_passes():
    # at magnitude 4 one bf16 ulp is 2^-5; ours is 3 ulps (0.09375) under transformers' top logit
    rows = _rows([3, 1, 6])
    rows[1, 4] = 4.0 + 3 * 2.0 ** -5  # transformers' argmax at position 1 is 4, ours 1
    s = score_tokens([3, 1, 6], rows)
    assert s.ok and (s.exact, s.near_tie) == (2, 1)
    assert s.worst_near_tie_ulps == pytest.approx(3.0)
    rows[1, 4] = 4.0 + 4 * 2.0 ** -5  # exactly the margin: still a near-tie
    assert score_tokens([3, 1, 6], rows).near_tie == 1


def test_a_gap_past_the_margin_fails():
    rows = _rows([3, 1])
    rows[1, 4] = 4.0 + 5 * 2.0 ** -5  # 5 ulps: beyond the stated 4
    s = score_tokens([3, 1], rows)
    assert not s.ok and s.exact == 1 and s.near_tie == 0
    (m,) = s.mismatches
    assert (m.position, m.ours, m.theirs) == (1, 1, 4)
    assert m.gap == pytest.approx(5 * 2.0 ** -5) and m.margin == 4 * 2.0 ** -5
    assert s.failure() == ("1 of 2 tokens are not transformers' choice: token 1: shardc 1, transformers 4, "
                           "logit gap 0.1562 > margin 0.125")
    assert score_tokens([3, 1], rows, ulps=5).ok  # the margin is the stated one, not a constant elsewhere


def test_a_clear_mismatch_fails():
    rows = _rows([0, 0, 0, 0])
    s = score_tokens([0, 6, 0, 2], rows)  # two tokens far from transformers' choice (gap 2.0 and beyond)
    assert not s.ok and [m.position for m in s.mismatches] == [1, 3]
    assert all(m.theirs == 0 and m.gap >= 2.0 for m in s.mismatches)
    assert s.as_dict()["mismatch"] == 2 and s.exact == 2


def test_a_row_that_is_not_finite_is_a_mismatch():
    rows = _rows([1, 1])
    rows[0, 3] = math.nan
    rows[1, 2] = math.inf
    s = score_tokens([1, 1], rows)
    assert not s.ok and len(s.mismatches) == 2 and all(math.isnan(m.gap) for m in s.mismatches)


def test_the_scoring_refuses_misaligned_input():
    with pytest.raises(ValueError, match="one row of logits per token: 3 tokens"):
        score_tokens([1, 2, 3], _rows([1, 2]))
    with pytest.raises(ValueError, match="token 0 is 9, outside the vocabulary of 8"):
        score_tokens([9], _rows([1]))


def test_bf16_logits_from_torch_are_scored():
    torch = pytest.importorskip("torch")
    logits = torch.tensor(_rows([3, 1]), dtype=torch.bfloat16)
    logits[1, 4] = 4.0 + 2 * 2.0 ** -5  # an exact bf16 value: 2 ulps above ours
    s = score_tokens([3, 1], logits.float())
    assert s.ok and (s.exact, s.near_tie) == (1, 1) and s.worst_near_tie_ulps == pytest.approx(2.0)


# -- scripts/bench_loader.py: the device every peer gets, and InstantTensor (CUDA only) ----------------
def test_bench_loader_gives_every_loader_an_indexed_device(monkeypatch):
    import bench_loader

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert bench_loader.indexed("cuda") == "cuda:0"  # fastsafetensors fails on a bare "cuda"
    assert (bench_loader.indexed("cuda:3"), bench_loader.indexed("cpu")) == ("cuda:3", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert bench_loader.indexed("cuda") == "cuda:2"  # what shardc's own "cuda" means under torchrun


def test_bench_loader_skips_instanttensor_on_cpu_with_a_line(capsys):
    import importlib.util

    import bench_loader

    assert "instanttensor" in bench_loader.LOADERS and "instanttensor" in bench_loader.UNCHECKED
    assert bench_loader.available(["safetensors", "instanttensor"], "cpu") == ["safetensors"]
    assert capsys.readouterr().out == "  (instanttensor skipped: it loads to CUDA only; run with --device cuda)\n"
    on_cuda = bench_loader.available(["instanttensor"], "cuda:0")
    if importlib.util.find_spec("instanttensor") is None:
        assert on_cuda == []
        assert capsys.readouterr().out == "  (instanttensor not installed: pip install -e '.[bench]')\n"
    else:
        assert on_cuda == ["instanttensor"]


def test_bench_loader_help_and_a_bad_device():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_loader.py"), "--help"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and "instanttensor" in p.stdout and "cuda:0 outside torchrun" in p.stdout
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_loader.py"), "--device", "gpu"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "bench_loader.py: error: --device 'gpu' is not cpu, cuda or cuda:N")
