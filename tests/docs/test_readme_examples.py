"""The README's shell examples, run as a user types them (#26 item 2 and its "done when").

Every command line of every ```bash block in README.md is either run here, in the order the README
gives, from the repository root, by bash, with this checkout's ``shardc`` first on PATH, or listed
in ``SKIPPED`` with the reason it cannot run here (a GPU, the network, a 70B checkpoint, a path the
reader substitutes). A new example that is neither fails the test, so the README cannot grow
untested examples. Afterwards ``git status`` must be what it was: the examples write only ignored
paths (build/, manifests/, reports/, .cache/, /tmp), and the build directories and records they
made are removed again, but the demo's build (build/demo-tp3pp2-bf16).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_70B = "needs a Llama-3.3-70B checkpoint on disk (or hf:// with network): not on this machine"
PLACEHOLDER = "a path the reader substitutes (build/x, m.json, /models/x, /nvme): shown with the demo's names above"
# The start of an example line -> why it does not run here.
SKIPPED: dict[str, str] = {
    "make demo": "this test's own set-up (CI runs it as `make test`)",
    "make test": "the command that runs this test",
    "shardc build plans/tp2pp1-int8.yaml --source /data/": NEEDS_70B,
    "shardc build plans/tp4pp2-fp16.yaml": "the plan's source is hf://meta-llama/Llama-3.3-70B-Instruct: network and 140 GB",
    "shardc plan --model /data/DeepSeek-V3 ": "needs DeepSeek-V3's FP8 checkpoint's config.json on disk: planning a "
                                             "quantized checkpoint is tested in planner/test_serving.py",
    "shardc plan --model /data/": NEEDS_70B,
    "shardc build plans/deepseek-v3-fp8-tp8.yaml --source /data/": "needs DeepSeek-V3's FP8 checkpoint (690 GB): "
                                                                  "its shapes are tested in compiler/test_quant_sources.py",
    "shardc push --manifest build/x/": PLACEHOLDER,
    "shardc pull --manifest s3://models/x/": PLACEHOLDER,
    "shardc reshard --manifest s3://models/x/": PLACEHOLDER,
    "shardc reshard --manifest build/x-int8/": PLACEHOLDER,
    "shardc verify --manifest /models/x/": "--device cuda: needs a GPU (scripts/gpu_check.sh runs it where one is lent)",
    "shardc verify --manifest m.json --deep /data/": NEEDS_70B,
    "shardc verify --manifest build/r/": PLACEHOLDER,
    "shardc verify --manifest /nvme/": NEEDS_70B,
    "torchrun --nproc-per-node 8 -m shardc.cli verify": "--device cuda on 8 GPUs",
    "shardc gate ": "the README's gate figures are these commands, run and pinned by tests/docs/test_readme_gate_figures.py",
    "torchrun --nproc-per-node 6 -m shardc.cli run": "six ranks on two cores (minutes); the torchrun environment is tested in runtime/test_runtime.py",
    'python -c "from vllm ': "vLLM lives in its own venv (.venv-vllm), and the demo at tp=3 needs three cores; "
                             "tests/serving/ load builds with load_format='shardc'",
}


def examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line.strip())
    return lines


def _skip_reason(line: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if line.startswith(start)), None)


def test_every_example_runs_here_or_says_why_not():
    lines = examples()
    assert len(lines) > 20, "the README's examples were not found: the pattern is stale"
    used = {start for start in SKIPPED if any(line.startswith(start) for line in lines)}
    assert used == set(SKIPPED), f"SKIPPED names examples the README no longer has: {set(SKIPPED) - used}"


def _git_status() -> str | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                       capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


@pytest.mark.heavy
def test_readme_examples_run_and_leave_git_status_clean(demo_model_dir):
    before = _git_status()
    builds = set(os.listdir(ROOT / "build")) if (ROOT / "build").is_dir() else set()
    records = set(os.listdir(ROOT / "manifests")) if (ROOT / "manifests").is_dir() else None
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SHARDC_MANIFESTS_DIR")  # as a user types them: records in manifests/ (push reads one)
    ran = []
    try:
        for line in examples():
            if _skip_reason(line) is not None:
                continue
            r = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True,
                               timeout=600, env=env)
            assert r.returncode == 0, f"README example failed ({r.returncode}): {line}\n{r.stdout}\n{r.stderr}"
            ran.append(line)
    finally:
        shutil.rmtree("/tmp/smollm2-hf", ignore_errors=True)  # the export example's --out
        # the examples' other build directories go too (the checkout as it was, .ci/run checks;
        # records went to the suite's SHARDC_MANIFESTS_DIR); the demo's own build stays
        made = set(os.listdir(ROOT / "build")) if (ROOT / "build").is_dir() else set()
        for name in made - builds - {"demo-tp3pp2-bf16"}:
            shutil.rmtree(ROOT / "build" / name, ignore_errors=True)
        if records is None:
            shutil.rmtree(ROOT / "manifests", ignore_errors=True)
        else:
            for name in set(os.listdir(ROOT / "manifests")) - records:
                (ROOT / "manifests" / name).unlink()
    assert any(line.startswith("shardc reshard") for line in ran) and len(ran) >= 12, ran
    if before is not None:
        assert _git_status() == before, "a README example changed tracked or unignored files"


@pytest.mark.parametrize("line", [line for line in examples() if _skip_reason(line) is not None])
def test_readme_example_not_run_here(line):
    """Each README example that cannot run here is reported as a skip, with its reason (``-rs``)."""
    pytest.skip(f"README example `{line[:60]}`: {_skip_reason(line)}")
