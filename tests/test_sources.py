"""Checkpoint sources other than a plain directory: hf:// through huggingface_hub's real cache."""

from __future__ import annotations

import shutil

from reassemble import load_source, reassemble

from shardc.build.compile import build
from shardc.spec.plan import plan_from_dict

REV = "0123456789abcdef0123456789abcdef01234567"


def test_hf_source_from_offline_cache(make_ckpt, tmp_path, monkeypatch):
    """A hub repo already in the local HF cache builds offline; the manifest records uri + revision."""
    ckpt = make_ckpt(num_files=2, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, vocab_size=40)
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / REV
    shutil.copytree(ckpt, snap)
    (cache / "models--acme--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    plan = plan_from_dict({
        "replica_group": {"name": "hub", "tp_degree": 2, "pp_degree": 1, "dtype": "bf16", "gpus_per_replica": 2},
        "model": {"source": "hf://acme/tiny-llama"}})
    res = build(plan, tmp_path / "o")
    src = res.manifest.source
    assert src.uri == "hf://acme/tiny-llama" and src.revision == REV
    assert {f.name for f in src.files} == {"config.json", "model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    rebuilt, orig = reassemble(res.out_dir), load_source(ckpt)
    assert all(rebuilt[k].equal(v) for k, v in orig.items())
