"""Running vLLM's venv on this folder's scripts, for the serving tests. Import by name
(``from vllm_run import ENV, run_workers``): a helper module, not the conftest, so that the name
cannot resolve to tests/conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
# two ranks on these two cores; a small KV cache (vLLM CPU's own advice for tests)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


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
