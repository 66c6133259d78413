"""The demo model (SmolLM2-135M) resharded and exported: transformers loads the export, bit for bit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shardc.compiler.build_files import open_local_input
from shardc.compiler.compile import build
from shardc.compiler.export import export
from shardc.compiler.reshard import reshard
from shardc.layout.plan import load_plan

PLANS = Path(__file__).resolve().parents[2] / "plans"
pytestmark = pytest.mark.heavy


def test_demo_reshard_export_and_transformers_logits(demo_model_dir, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build(load_plan(PLANS / "demo-tp3pp2-bf16.yaml"), tmp_path / "a")
    # tp3pp2 -> tp1pp1 through reshard equals the shipped tp1pp1 build of the source
    plan = load_plan(PLANS / "demo-tp1pp1-bf16.yaml")
    got = reshard(open_local_input(a.manifest_path), plan, tmp_path / "r")
    want = build(plan, tmp_path / "b")
    for s in want.manifest.shards:
        assert hashlib.sha256((got.out_dir / s.file).read_bytes()).hexdigest() == s.sha256
    # the same side files (config, index, the tokenizer the input lists), from the input's copies
    assert got.manifest.files == want.manifest.files

    out = tmp_path / "hf"
    info = export(open_local_input(a.manifest_path), out, max_shard_size=100 * 10**6)
    assert len(info.files) == 3  # 269 MB of bf16 in files of at most 100 MB
    assert (out / "tokenizer.json").read_bytes() == (demo_model_dir / "tokenizer.json").read_bytes()

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    logits = {}
    for name, path in (("source", demo_model_dir), ("export", out)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        model.eval()
        with torch.no_grad():
            logits[name] = model(ids).logits
        del model
    assert logits["export"].dtype == torch.bfloat16
    assert torch.equal(logits["export"].view(torch.int16), logits["source"].view(torch.int16))
