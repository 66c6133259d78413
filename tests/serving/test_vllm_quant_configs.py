"""vLLM's own parser reads the quantization_config shardc writes for a ModelOpt NVFP4 build (vLLM
CPU has no NVFP4 kernel, so no engine runs it here): a kept build of a checkpoint with an FP8 KV
cache, whose config.json drops the KV-cache key because the build holds no KV scales, resolves
``--kv-cache-dtype auto`` to the model's dtype where the source's block resolves it to FP8; an
older export's ``hf_quant_config.json``, read as the quantization_config, parses as vLLM's flat
form; and vLLM excludes exactly the modules shardc keeps in 16 bits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plan_helpers import plan

pytest.importorskip("torch")
pytestmark = pytest.mark.heavy

from quant_sources import modelopt_source, save_tiny  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.layout.model import load_model  # noqa: E402
from shardc.layout.quant_formats import detect_source  # noqa: E402
from shardc.layout.quantization import quantizable  # noqa: E402

HERE = Path(__file__).resolve().parent
IGNORE = ("lm_head", "model.layers.0.self_attn*")


def test_vllm_reads_the_kept_builds_quantization_config(vllm_python, tmp_path):
    bf16 = save_tiny(tmp_path / "bf16")
    kv = modelopt_source(bf16, tmp_path / "kv", IGNORE, kv_fp8=True)
    build(plan(1, 1, "source", name="mo", source=kv), tmp_path / "kept")
    legacy = modelopt_source(bf16, tmp_path / "legacy", IGNORE)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg.pop("quantization_config")
    (legacy / "config.json").write_text(json.dumps(cfg))
    (legacy / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": list(IGNORE)}}))
    build(plan(1, 1, "source", name="mo", source=legacy), tmp_path / "kept-legacy")

    model = load_model(kv / "config.json")
    modules = sorted(n.removesuffix(".weight") for n in quantizable(model)) + ["lm_head"]
    cases = {name: {"config": str(path / "config.json"), "modules": modules}
             for name, path in (("source", kv), ("kept", tmp_path / "kept"), ("kept-legacy", tmp_path / "kept-legacy"))}
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"cases": cases}))
    run = subprocess.run([str(vllm_python), str(HERE / "vllm_quant_config.py"), str(job), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["source"]["kv"] == "fp8_e4m3"  # what the checkpoint asks vLLM for
    assert got["kept"]["kv"] is None and got["kept-legacy"]["kv"] is None  # auto: the model's dtype
    ours = detect_source(model.config)
    want = [ours.excluded(m) for m in modules]
    assert want.count(True) == 5  # layer 0's q, k, v, o and lm_head
    for name in cases:
        assert got[name]["group_size"] == 16 and got[name]["exclude"] == list(IGNORE), name
        assert got[name]["excluded"] == want, name
