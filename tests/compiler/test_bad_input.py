"""Bad input ends with one clear line naming the problem, exit code 2, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from cli_run import shardc
from click.testing import CliRunner

from shardc.cli import main

GOOD = {
    "replica_group": {"name": "bad", "tp_degree": 2, "pp_degree": 2, "dtype": "bf16",
                      "gpus_per_replica": 4},
    "model": {"source": "SRC"},
}
MODEL = dict(hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6, num_kv_heads=2,
             vocab_size=50)


def _with(path: str, value, base=GOOD) -> dict:
    d = json.loads(json.dumps(base))
    keys = path.split(".")
    cur = d
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    if value is KeyError:
        del cur[keys[-1]]
    else:
        cur[keys[-1]] = value
    return d


# (plan change, text that must appear in the one line)
CASES = {
    "unknown-top-key": (lambda: {**GOOD, "extra": 1}, "extra: unknown key"),
    "unknown-nested-key": (lambda: _with("replica_group.tp", 2), "replica_group.tp: unknown key"),
    "wrong-type": (lambda: _with("replica_group.tp_degree", "two"), "replica_group.tp_degree: must be a positive integer"),
    "gpus-mismatch": (lambda: _with("replica_group.gpus_per_replica", 8), "set gpus_per_replica: 4"),
    "tp-heads": (lambda: _with("replica_group.gpus_per_replica", 8, _with("replica_group.tp_degree", 4)),
                 "num_attention_heads=6 is not divisible by tp=4"),
    "kv-rule": (lambda: _with("replica_group.gpus_per_replica", 6, _with("replica_group.tp_degree", 3)),
                "tp=3 is not a multiple of num_key_value_heads=2 (hint: tp_degree values that work for this model: 1, 2, 6)"),
    "pp-too-deep": (lambda: _with("replica_group.gpus_per_replica", 8, _with("replica_group.pp_degree", 4)),
                    "pp_degree=4 exceeds num_hidden_layers=3"),
    "pp-layers-sum": (lambda: _with("model.pp_layers", [1, 1]), "sums to 2 but the model has 3 layers"),
    "pp-layers-len": (lambda: _with("model.pp_layers", [3]), "has 1 entries but pp_degree is 2"),
    "pp-layers-zero": (lambda: _with("model.pp_layers", [0, 3]), "model.pp_layers: must be a list of positive integers"),
    "dtype": (lambda: _with("replica_group.dtype", "fp4"), "must be one of fp16, bf16, int8, fp8, source"),
    "missing-name": (lambda: _with("replica_group.name", KeyError), "replica_group.name: missing required key"),
    "unsafe-name": (lambda: _with("replica_group.name", "../evil"), "replica_group.name: must be"),
    "shard-prefix": (lambda: _with("replica_group.checkpoint", {"shard_prefix": "../x{tp_rank}{pp_stage}.safetensors"}),
                     "plain file name"),
    "ignore-nothing": (lambda: _with("quantization", {"ignore": ["layers.99"]},
                                     _with("replica_group.dtype", "int8")), "matches no tensor"),
    "bad-scheme": (lambda: _with("model.source", "gs://bucket/x"), "unsupported source scheme"),
    "missing-source": (lambda: _with("model.source", "/nonexistent/dir"), "does not exist"),
}


def run_build(tmp_path: Path, plan: dict | str, src: Path | None, extra: list[str] = ()):
    plan_file = tmp_path / "plan.yaml"
    if isinstance(plan, str):
        plan_file.write_text(plan)
    else:
        text = yaml.safe_dump(plan).replace("SRC", str(src))
        plan_file.write_text(text)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["build", str(plan_file), "--out", str(out), "--manifests-dir",
                                  str(tmp_path / "m"), "--quiet", *extra])
    return r, out


def assert_one_line(r, needle: str, out: Path) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.output
    shards = list(out.glob("*.safetensors")) if out.exists() else []
    assert not shards and not (out / "manifest.json").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_plan(make_ckpt, tmp_path, case):
    src = make_ckpt(**MODEL)
    change, needle = CASES[case]
    r, out = run_build(tmp_path, change(), src)
    assert_one_line(r, needle, out)


def test_malformed_yaml(tmp_path):
    r, out = run_build(tmp_path, "replica_group: [1, 2\n", None)
    assert_one_line(r, "is not valid YAML at line", out)


def test_plan_file_missing(tmp_path):
    r = CliRunner().invoke(main, ["build", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2 and "cannot read plan file" in r.stderr


def _break_ckpt(src: Path, what: str) -> None:
    from safetensors.torch import load_file, save_file

    f = src / "model.safetensors"
    sd = load_file(f)
    if what == "missing":
        del sd["model.layers.1.mlp.up_proj.weight"]
    elif what == "shape":
        sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(10, 48, dtype=torch.bfloat16)
    elif what == "extra":
        sd["model.layers.7.mlp.up_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(sd, str(f))


@pytest.mark.parametrize(("what", "needle"), [
    ("missing", "'model.layers.1.mlp.up_proj.weight' is missing"),
    ("shape", "has shape [10, 48] but config.json implies [48, 48]"),
    ("extra", "unexpected tensor 'model.layers.7.mlp.up_proj.weight'"),
])
def test_bad_source_tensors(make_ckpt, tmp_path, what, needle):
    src = make_ckpt(**MODEL)
    _break_ckpt(src, what)
    r, out = run_build(tmp_path, GOOD, src)
    assert_one_line(r, needle, out)


def test_unknown_architecture(make_ckpt, tmp_path):
    src = make_ckpt(**MODEL)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    r, out = run_build(tmp_path, GOOD, src)
    assert_one_line(r, "unsupported architecture 'GPT2LMHeadModel'", out)


def test_pickle_refused_unless_allowed(make_ckpt, tmp_path):
    from safetensors.torch import load_file

    src = make_ckpt(**MODEL)
    sd = load_file(src / "model.safetensors")
    torch.save(sd, src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    r, out = run_build(tmp_path, GOOD, src)
    assert_one_line(r, "only pickled .bin weights", out)
    r = CliRunner().invoke(main, ["build", str(tmp_path / "plan.yaml"), "--out", str(out),
                                  "--manifests-dir", str(tmp_path / "m"), "--allow-pickle", "--quiet"])
    assert r.exit_code == 0, r.output
    assert (out / "manifest.json").exists()


def test_pickle_from_the_hub_refused_even_when_allowed(make_ckpt, tmp_path, monkeypatch):
    """README: from hf:// only safetensors, JSON configs and tokenizer files are read. A cached
    snapshot that holds only pytorch_model.bin (downloaded by another tool) is one line, exit 2,
    with --allow-pickle too: the pickle is never loaded (it is a FIFO here, so opening it would
    block the test)."""
    import os

    import huggingface_hub.constants as c

    src = make_ckpt(**MODEL)
    rev = "c" * 40
    repo = tmp_path / "hub" / "models--acme--bins"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    shutil.copy(src / "config.json", snap / "config.json")
    os.mkfifo(snap / "pytorch_model.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    plan = _with("model.source", "hf://acme/bins")
    for extra in ([], ["--allow-pickle"]):
        r, out = run_build(tmp_path, plan, None, extra)
        assert_one_line(r, "hf://acme/bins holds only pickled .bin weights; shardc reads only "
                           "safetensors from the hub, even with --allow-pickle", out)  # the CLI's flag for `allow_pickle`


def test_unsafe_index_name(make_ckpt, tmp_path):
    src = make_ckpt(num_files=2, **MODEL)
    idx = src / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../../etc/passwd"
    idx.write_text(json.dumps(data))
    r, out = run_build(tmp_path, GOOD, src)
    assert_one_line(r, "unsafe weight file name '../../etc/passwd'", out)


def test_no_traceback_without_debug_but_with_debug(tmp_path):
    """A real subprocess: the user sees one line; --debug shows the traceback."""
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(yaml.safe_dump(_with("replica_group.dtype", "fp4")))
    r = shardc("build", plan_file)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = shardc("--debug", "build", plan_file)
    assert r.returncode != 0 and "Traceback" in r.stderr
