"""Checkpoint sources other than a plain directory: hf:// through huggingface_hub's real cache; and every
kind of compiler input (checkpoint, build, quantized checkpoint) as the one Source protocol."""

from __future__ import annotations

import shutil
from pathlib import Path

from cli_run import shardc
from plan_helpers import plan as make_plan
from reassemble import load_source, reassemble

from shardc.compiler.compile import build

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
    plan = make_plan(2, name="hub", source="hf://acme/tiny-llama")
    res = build(plan, tmp_path / "o")
    src = res.manifest.source
    assert src.uri == "hf://acme/tiny-llama" and src.revision == REV
    assert {f.name for f in src.files} == {"config.json", "model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    rebuilt, orig = reassemble(res.out_dir), load_source(ckpt)
    assert all(rebuilt[k].equal(v) for k, v in orig.items())


def test_hf_revision_from_the_cli_reads_safetensors_config_and_tokenizer_only(make_ckpt, tmp_path):
    """`shardc build` (a real subprocess) on `hf://org/repo@rev` from huggingface_hub's offline cache,
    laid out as the hub writes it (models--org--repo/snapshots/<commit>/, refs/<branch>), holding
    two commits with different weights:

    * `@<commit>` and `@<branch>` read that commit, a bare repo reads `refs/main`: the shards hold
      exactly the named commit's tensors (reassembled and compared with the checkpoint's own);
    * only safetensors, config.json and tokenizer files are read or copied (README: "safetensors +
      config only"): a `pytorch_model.bin`, a README.md and a training file beside them are FIFOs, so
      opening one would block the build past its timeout, and none of them reaches the output or
      the manifest's source record.
    """
    import json
    import os

    old_rev, new_rev = "a" * 40, "b" * 40
    cfg = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=40)
    old, new = make_ckpt("old", seed=1, **cfg), make_ckpt("new", num_files=2, seed=2, **cfg)
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    for rev, ckpt in ((old_rev, old), (new_rev, new)):
        shutil.copytree(ckpt, repo / "snapshots" / rev)
        (repo / "snapshots" / rev / "tokenizer_config.json").write_text(json.dumps({"rev": rev}))
        for junk in ("pytorch_model.bin", "README.md", "training_args.bin"):
            os.mkfifo(repo / "snapshots" / rev / junk)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new_rev)
    (repo / "refs" / "v1").write_text(old_rev)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def cli_build(source: str, name: str):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(json.dumps({
            "replica_group": {"name": name, "tp_degree": 2, "pp_degree": 1, "dtype": "bf16",
                              "gpus_per_replica": 2},
            "model": {"source": source}}))
        out = tmp_path / "out" / name
        r = shardc("build", plan, "--out", out, "--manifests-dir", tmp_path / "manifests", "--quiet", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return out, json.loads((out / "manifest.json").read_text())

    want = {old_rev: load_source(old), new_rev: load_source(new)}
    for source, rev in (("hf://acme/tiny-llama@" + old_rev, old_rev), ("hf://acme/tiny-llama@v1", old_rev),
                        ("hf://acme/tiny-llama", new_rev)):
        out, manifest = cli_build(source, f"hub-{len(source)}-{rev[0]}")
        assert manifest["source"]["uri"] == source and manifest["source"]["revision"] == rev
        rebuilt, other = reassemble(out), want[new_rev if rev == old_rev else old_rev]
        assert rebuilt.keys() == want[rev].keys()
        assert all(rebuilt[k].equal(v) for k, v in want[rev].items())
        assert not all(rebuilt[k].equal(v) for k, v in other.items())  # the commits do differ
        weights = {"model.safetensors"} if rev == old_rev else {
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
        assert {f["name"] for f in manifest["source"]["files"]} == {"config.json", *weights}
        assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {
            "config.json", "tokenizer_config.json", "manifest.json",
            "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"}
        assert json.loads((out / "tokenizer_config.json").read_text()) == {"rev": rev}


def test_every_kind_of_input_is_a_source(make_ckpt, tmp_path):
    """The compiler's input is declared once (compiler/source.py ``Source``): a checkpoint, a build
    (reshard's and export's input) and a quantized checkpoint each have every member of the
    protocol, without inheriting one another; only a quantized config.json gets the wrapper, whose
    quantized weights read dense by their format and whose other tensors are the checkpoint's own."""
    import json

    import numpy as np
    from quant_sources import fp8_block_source, save_tiny

    from shardc.compiler.build_files import open_local_input
    from shardc.compiler.build_tensors import BuildSource
    from shardc.compiler.checkpoint import CheckpointSource, open_source
    from shardc.compiler.quantized import QuantizedSource, with_quantization
    from shardc.compiler.source import Source
    from shardc.layout.model import model_from_config

    members = set(Source.__annotations__) | {n for n, v in vars(Source).items()
                                             if (callable(v) or isinstance(v, property)) and not n.startswith("_")}
    assert {"tensors", "quantized_shapes", "check", "view", "dense", "confirm", "identity"} <= members
    assert not ({CheckpointSource, QuantizedSource} & set(BuildSource.__mro__))
    assert CheckpointSource not in QuantizedSource.__mro__
    ckpt = make_ckpt(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=40)
    plan = make_plan(2, 1, "bf16", name="p", source=ckpt)
    res = build(plan, tmp_path / "o")
    model = model_from_config(res.manifest.config)
    checkpoint = open_source(str(ckpt))
    assert with_quantization(checkpoint, model) is checkpoint  # a 16-bit checkpoint: no wrapper
    inp = open_local_input(res.out_dir)
    try:
        built = BuildSource(inp, res.manifest.to_layout())
        assert built.as_source() is built and built.source_format is None and not built.quantized_shapes
        name = "model.layers.0.self_attn.q_proj.weight"
        assert np.array_equal(np.asarray(built.dense(name)), checkpoint.view(name))  # reassembled from tp 2
        fp8 = fp8_block_source(save_tiny(tmp_path / "bf16"), tmp_path / "fp8")
        quant = with_quantization(open_source(str(fp8)), model_from_config(json.loads((fp8 / "config.json").read_text())))
        assert isinstance(quant, QuantizedSource) and isinstance(quant.inner, CheckpointSource)
        for src in (checkpoint, built, quant):
            missing = sorted(m for m in members if not hasattr(src, m))
            assert not missing, (type(src).__name__, missing)
        assert name in quant.quantized_shapes and quant.view(name).dtype != np.float32
        dense = quant.dense(name)
        assert dense.dtype == np.float32 and dense.shape == quant.quantized_shapes[name]
        norm = "model.norm.weight"
        assert norm not in quant.quantized_shapes and np.array_equal(quant.dense(norm), quant.inner.view(norm))
    finally:
        inp.close()


def test_a_hub_source_or_temp_name_with_a_trailing_newline_is_not_read_as_a_plain_one():
    """`$` matches before a final newline: `hf://org/repo\\n` passed the hub-source pattern (and a file
    named `.x.<16 hex>.tmp\\n` the temp-name one, which a build clears as its own). Whole-string matches."""
    import pytest

    from shardc.compiler.checkpoint import _resolve_hf
    from shardc.errors import ShardcError
    from shardc.formats.files import is_temp

    with pytest.raises(ShardcError, match="malformed hub source"):
        _resolve_hf("hf://org/repo\n")
    with pytest.raises(ShardcError, match="malformed hub source"):
        _resolve_hf("hf://org/repo@main\n")
    assert is_temp(Path(".model.safetensors.0123456789abcdef.tmp"))
    assert not is_temp(Path(".model.safetensors.0123456789abcdef.tmp\n"))
