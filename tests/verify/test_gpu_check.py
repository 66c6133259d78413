"""scripts/gpu_check.sh, the one-call GPU check of issue 16, runs end to end on CPU with a tiny model
(DEVICE=cpu), so the script the GPU machine runs cannot rot: every step must pass, none skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert r["figures"]["decode_tokens_identical"] == 16
    assert (tmp_path / "out" / "gpu_check.log").is_file()
