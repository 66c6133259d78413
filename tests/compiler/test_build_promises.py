"""Build behaviours the README promises, each checked against bytes the test knows independently:
resume re-hashes what it keeps, pickled sources give the checkpoint's values (and never run code),
quantization.base_dtype, autoscaling in the manifest, and the CLI's --force, --dry-run --model and
--upload without --to."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from plan_helpers import plan_data as shared_plan_data
from safetensors import safe_open
from safetensors.torch import load_file

from shardc.cli import main
from shardc.compiler.compile import build
from shardc.layout.plan import plan_from_dict

MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


def plan_data(tp: int, pp: int, dtype: str = "bf16", name: str = "b", source: str = "synthetic", **extra) -> dict:
    return shared_plan_data(tp, pp, dtype, name=name, source=source, **extra)


def shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_resume_rehashes_the_shards_it_keeps(make_ckpt, tmp_path):
    """A kept shard whose bytes rotted (same size, done-record intact) is rewritten, not trusted."""
    from shardc.errors import ShardcError

    src = make_ckpt(**MODEL)
    plan = plan_from_dict(plan_data(2, 2)).with_source(str(src))
    clean = build(plan, tmp_path / "clean")
    want = {s.file: s.sha256 for s in clean.manifest.shards}
    out = tmp_path / "o"
    squat = out / "model-tp01-pp01.safetensors"
    squat.mkdir(parents=True)  # stage 1 cannot be renamed into place: stage 0 stays, finished
    with pytest.raises(ShardcError):
        build(plan, out)
    squat.rmdir()
    assert (out / ".model-tp01-pp00.safetensors.done.json").is_file()
    victim = out / "model-tp01-pp00.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x40
    victim.write_bytes(bytes(data))
    res = build(plan, out)
    assert "model-tp00-pp00.safetensors" in res.skipped  # intact, re-hashed, kept
    assert "model-tp01-pp00.safetensors" in res.built
    assert {f: sha(out / f) for f in want} == want


def _pickled_build(src: Path, sd: dict, tmp_path: Path):
    """Replace the checkpoint by a pickled ``pytorch_model.bin`` holding ``sd``; build it from the
    CLI with --allow-pickle."""
    torch.save(sd, src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    pf = tmp_path / "p.yaml"
    pf.write_text(yaml.safe_dump(plan_data(1, 1, source=str(src))))
    return CliRunner().invoke(main, ["build", str(pf), "--out", str(tmp_path / "o"), "--manifests-dir",
                                     str(tmp_path / "m"), "--allow-pickle", "--quiet"])


def test_pickled_source_gives_the_checkpoint_values(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    sd = load_file(src / "model.safetensors")
    r = _pickled_build(src, sd, tmp_path)
    assert r.exit_code == 0, r.output
    got = shard_tensors(tmp_path / "o" / "model-tp00-pp00.safetensors")
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


class _Payload:
    """Unpickling this runs ``Path(marker).touch()``: what weights_only=True must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_with_code_is_refused_even_when_allowed(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    sd = dict(load_file(src / "model.safetensors"))
    marker = tmp_path / "code-ran"
    sd["payload"] = _Payload(marker)
    r = _pickled_build(src, sd, tmp_path)
    assert not marker.exists()
    assert r.exit_code != 0
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_base_dtype_is_the_dtype_of_what_is_not_quantized(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)  # bf16 source
    sd = load_file(src / "model.safetensors")
    data = plan_data(1, 1, "int8", quantization={"base_dtype": "fp16", "ignore": ["layers.1.mlp"]})
    res = build(plan_from_dict(data).with_source(str(src)), tmp_path / "o")
    got = shard_tensors(res.out_dir / "model-tp00-pp00.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight"):
        assert got[name].dtype == torch.float16, name
        assert torch.equal(got[name], sd[name].to(torch.float16)), name
    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"):  # quantized:
        assert f"{name}.weight" not in got, name  # int8 is pack-quantized (compressed-tensors)
        assert got[f"{name}.weight_packed"].dtype == torch.int32, name
    cfg = json.loads((res.out_dir / "config.json").read_text())
    assert cfg["torch_dtype"] == "float16"


def test_autoscaling_is_carried_into_the_manifest(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    scaling = {"min_replicas": 2, "max_replicas": 9, "target": {"tokens_per_s": 1500.5}, "note": "x"}
    res = build(plan_from_dict(plan_data(1, 1, autoscaling=scaling)).with_source(str(src)), tmp_path / "o")
    m = json.loads((res.out_dir / "manifest.json").read_text())
    assert m["plan"]["autoscaling"] == scaling


# -- the CLI ------------------------------------------------------------------------------------------
def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_cli_force_rebuilds_and_default_reuses(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    pf = tmp_path / "p.yaml"
    pf.write_text(yaml.safe_dump(plan_data(2, 1, source=str(src))))
    common = ["--out", str(tmp_path / "o"), "--manifests-dir", str(tmp_path / "m"), "--json"]
    first = json.loads(_cli("build", str(pf), *common).output)
    shard = tmp_path / "o" / "model-tp00-pp00.safetensors"
    os.utime(shard, ns=(10**18, 10**18))  # a mark that only a rewrite removes
    again = _cli("build", str(pf), *common)
    assert again.exit_code == 0 and json.loads(again.output)["shards"] == first["shards"]
    assert shard.stat().st_mtime_ns == 10**18  # up to date: not rewritten
    forced = _cli("build", str(pf), *common, "--force")
    assert forced.exit_code == 0 and json.loads(forced.output)["shards"] == first["shards"]
    assert shard.stat().st_mtime_ns != 10**18  # rewritten


def test_cli_dry_run_against_a_model_config(tmp_path):
    """--dry-run --model checks a plan against a config.json without reading weights."""
    from shardc.compiler.synthetic import llama_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama_config(**{**MODEL, "vocab_size": 10})))
    pf = tmp_path / "p.yaml"
    pf.write_text(yaml.safe_dump(plan_data(4, 2, source="hf://org/not-there")))
    r = _cli("build", str(pf), "--dry-run", "--model", str(cfg), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["valid"] and [x["rank"] for x in out["ranks"]] == list(range(8))
    # rank 3 = tp 3 stage 0: embedding 3 padded rows x 32 + layer 0 (two norms 32 each, q 8x32,
    # k, v 8x32 each (replicated KV head), o 32x8, gate/up 16x32 each, down 32x16), all bf16
    r3 = out["ranks"][3]
    assert (r3["tp_rank"], r3["pp_stage"], r3["layers"]) == (3, 0, [0, 1])
    elems = 3 * 32 + 2 * 32 + 8 * 32 * 3 + 32 * 8 + 16 * 32 * 2 + 32 * 16
    assert r3["bytes"] == 2 * elems and r3["tensors"] == 10
    bad = _cli("build", str(pf), "--dry-run", "--model", str(cfg).replace("config", "nope"))
    assert bad.exit_code == 2
    pf.write_text(yaml.safe_dump(plan_data(3, 1, source="hf://org/not-there")))
    bad = _cli("build", str(pf), "--dry-run", "--model", str(cfg))
    assert bad.exit_code == 2 and "tp_degree" in bad.stderr


def test_cli_upload_without_to_uses_the_plan_manifest_uri(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    dest = tmp_path / "store" / "v1"
    pf = tmp_path / "p.yaml"
    data = plan_data(2, 1, source=str(src))
    data["replica_group"]["checkpoint"] = {"manifest_uri": str(dest / "manifest.json")}
    pf.write_text(yaml.safe_dump(data))
    r = _cli("build", str(pf), "--out", str(tmp_path / "o"), "--manifests-dir", str(tmp_path / "m"),
             "--upload", "--quiet")
    assert r.exit_code == 0, r.output
    built = tmp_path / "o"
    for f in ("manifest.json", "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors", "config.json"):
        assert sha(dest / f) == sha(built / f), f


@pytest.mark.parametrize("src_dtype, want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             ("float32", torch.bfloat16)])
def test_default_base_dtype_follows_a_16_bit_source(make_ckpt, tmp_path, src_dtype, want):
    """Without quantization.base_dtype, what is not quantized keeps a 16-bit source's dtype; an fp32
    source becomes bf16."""
    src = make_ckpt(torch_dtype=src_dtype, **MODEL)
    res = build(plan_from_dict(plan_data(2, 1, "fp8")).with_source(str(src)), tmp_path / "o")
    got = shard_tensors(res.out_dir / "model-tp01-pp00.safetensors")
    sd = load_file(src / "model.safetensors")
    assert got["model.norm.weight"].dtype == want
    assert torch.equal(got["model.norm.weight"], sd["model.norm.weight"].to(want))
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
