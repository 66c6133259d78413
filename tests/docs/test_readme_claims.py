"""README claims that had no test: inspect, the planner's KV cap and hardware overrides from the CLI,
SHARDC_FSYNC_DOWNLOADS, and scripts/rollout.sh (build -> verify -> gate -> push, stopping at red)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from plan_helpers import plan_data

from shardc.cli import main
from shardc.compiler.compile import build
from shardc.layout.plan import plan_from_dict

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=10)


def _cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def _plan(tp: int, pp: int, name: str = "c", **rg) -> dict:
    return plan_data(tp, pp, name=name, group=rg)


# -- inspect ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("claims")
    src = write_checkpoint(root / "src", llama_config(**MODEL))
    return build(plan_from_dict(_plan(4, 2, name="insp")).with_source(str(src)), root / "b")


def test_inspect_manifest_build_dir_and_shard(small_build):
    d = small_build.out_dir
    for target in (d / "manifest.json", d):
        r = _cli("inspect", str(target))
        assert r.exit_code == 0, r.output
        assert "plan       insp" in r.stdout
        assert "tp=4 pp=2 dtype=bf16" in r.stdout and "vocab=10 (padded 12)" in r.stdout
        assert "shards     8 files" in r.stdout
        assert "model-tp03-pp01.safetensors  rank 7 (tp 3, pp 1)  layers 1:2" in r.stdout
    r = _cli("inspect", str(d / "manifest.json"), "--json")
    info = json.loads(r.stdout)
    assert info["kind"] == "manifest"
    rows = {(t["file"], t["name"]): t for t in info["tensors"]}
    assert rows["model-tp03-pp01.safetensors", "lm_head.weight"]["shape"] == [3, 32]
    assert rows["model-tp03-pp01.safetensors", "lm_head.weight"]["pad_rows"] == 2

    shard = d / "model-tp02-pp00.safetensors"
    r = _cli("inspect", str(shard), "--tensors")
    assert r.exit_code == 0
    assert "rank       2 (tp 2/4, pp 0/2)  layers 0:1" in r.stdout
    assert "model.layers.0.self_attn.k_proj.weight" in r.stdout and "[8, 32]" in r.stdout
    assert "model.layers.1." not in r.stdout  # stage 0 holds layer 0 only


def test_inspect_foreign_and_broken_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    r = _cli("inspect", str(tmp_path / "plain.safetensors"))
    assert r.exit_code == 0 and "not a shardc shard" in r.stdout
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    r = _cli("inspect", str(tmp_path / "junk.safetensors"))
    assert r.exit_code == 2 and "junk.safetensors" in r.stderr and "not a safetensors file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, naming the file
    assert "Traceback" not in r.output


# -- the planner from the CLI -------------------------------------------------------------------------
# Llama-3.3-70B bf16 at tp=2 on A100-80GB: bytes/token/GPU = 2 x 80 layers x (8 // 2) KV heads x 128 x 2.
BYTES_PER_TOKEN = 2 * 80 * 4 * 128 * 2


def _plan_json(*args: str) -> dict:
    r = _cli("plan", "--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--tp", "2", "--pp", "1",
             "--dtype", "bf16", "--target-tpot-ms", "1000", "--json", *args)
    assert r.exit_code in (0, 2), r.output
    return json.loads(r.stdout)


def test_planner_max_model_length_follows_the_kv_cap():
    c = _plan_json("--kv-cache-cap", "1GiB")["candidates"][0]
    assert c["kv"]["bytes_per_token"] == BYTES_PER_TOKEN == 163_840
    assert c["kv"]["budget"] == GIB  # the cap, below what memory leaves
    assert c["kv"]["max_model_len"] == 16 * (GIB // (16 * BYTES_PER_TOKEN)) == 6544
    # 6,545 tokens are paged as 6,560 = 410 blocks of 16; the 1 GiB pool holds 409
    c = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "6545")["candidates"][0]
    assert c["status"] == "infeasible" and c["kv_demand_bytes"] == 6560 * BYTES_PER_TOKEN
    assert c["reasons"] == ["KV demand 1.00 GiB per GPU (one 6,545-token request: 6,560 tokens) > "
                            "the 1.00 GiB KV pool (the 1.00 GiB cap; it holds 6,544)"]
    c = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "6544")["candidates"][0]
    assert c["status"] == "ok" and c["kv_demand_bytes"] == 6544 * BYTES_PER_TOKEN


def test_planner_hardware_overrides_from_the_cli():
    base = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "4096")
    b = base["candidates"][0]
    assert base["hardware"]["gpu"]["hbm_bandwidth"] == 2039e9
    hbm = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "4096", "--hbm-bandwidth", "1000")
    h = hbm["candidates"][0]
    assert hbm["hardware"]["gpu"]["hbm_bandwidth"] == 1000e9
    assert h["speed"]["batch"] == b["speed"]["batch"]
    assert h["speed"]["memory_s"] == pytest.approx(b["speed"]["memory_s"] * 2.039, rel=1e-9)
    mem = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "4096", "--gpu-memory", "100GiB")
    m = mem["candidates"][0]
    assert mem["hardware"]["gpu"]["memory"] == m["memory"]["total"] == 100 * GIB
    assert m["memory"]["kv_available"] == pytest.approx(b["memory"]["kv_available"] + 0.9 * (100 * GIB - b["memory"]["total"]))
    nv = _plan_json("--kv-cache-cap", "1GiB", "--max-model-len", "4096", "--nvlink-bandwidth", "100")
    assert nv["hardware"]["gpu"]["link"]["bandwidth"] == 100e9
    assert nv["candidates"][0]["speed"]["allreduce_s"] > b["speed"]["allreduce_s"]


# -- SHARDC_FSYNC_DOWNLOADS ------------------------------------------------------------------------------
@pytest.mark.parametrize("value, synced", [(None, False), ("1", True), ("0", False)])
def test_fsync_downloads_switch(small_build, tmp_path, monkeypatch, value, synced):
    """Pull syncs the downloaded files only with SHARDC_FSYNC_DOWNLOADS=1 (a real pull from a local
    store; os.fsync is observed, not replaced)."""
    from shardc.store import pull_build, push_build

    push_build(small_build.manifest_path, str(tmp_path / "store"))
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", spy)
    if value is None:
        monkeypatch.delenv("SHARDC_FSYNC_DOWNLOADS", raising=False)
    else:
        monkeypatch.setenv("SHARDC_FSYNC_DOWNLOADS", value)
    pull_build(str(tmp_path / "store" / "manifest.json"), tmp_path / "dest", ranks=[(1, 1)])
    shard_syncs = [p for p in seen if "model-tp01-pp01.safetensors" in p]
    assert (tmp_path / "dest" / "model-tp01-pp01.safetensors").is_file()
    assert bool(shard_syncs) is synced, seen


# -- scripts/rollout.sh ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout_env(tmp_path_factory):
    """A working directory with a baseline plan, a good candidate and a drifting one."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.runtime.gate import golden_text

    root = tmp_path_factory.mktemp("rollout")
    vocab = {"[UNK]": 0}
    for w in golden_text("pydoc")[0].split()[:5000]:
        if len(vocab) < 96:
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cfg = llama_config(num_layers=2)
    src = write_checkpoint(root / "src", cfg)
    tok.save(str(src / "tokenizer.json"))
    drift = write_checkpoint(root / "drift", cfg)
    sd = load_file(drift / "model.safetensors")
    sd["lm_head.weight"] = (sd["lm_head.weight"].float() * 30).to(torch.bfloat16)  # a different model
    save_file(sd, str(drift / "model.safetensors"))
    tok.save(str(drift / "tokenizer.json"))
    plans = {}
    for name, tp, s in (("base", 1, src), ("good", 2, src), ("bad", 2, drift)):
        d = _plan(tp, 1, name=name, checkpoint={"manifest_uri": str(root / "store" / name / "manifest.json")})
        d["model"]["source"] = str(s)
        plans[name] = root / f"{name}.yaml"
        plans[name].write_text(yaml.safe_dump(d))
    shim = root / "shardc"  # the script runs $SHARDC: this checkout's CLI
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m shardc.cli \"$@\"\n")
    shim.chmod(0o755)
    return root, plans, shim


def _rollout(root: Path, shim: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "rollout.sh"), *args], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "SHARDC": str(shim)})


@pytest.mark.heavy
def test_rollout_pushes_a_good_candidate(rollout_env):
    root, plans, shim = rollout_env
    p = _rollout(root, shim, str(plans["good"]), str(plans["base"]))
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads((root / "reports" / "verify.json").read_text())["ok"]
    assert json.loads((root / "reports" / "gate.json").read_text())["pass"]
    pushed = root / "store" / "good" / "manifest.json"
    assert pushed.read_bytes() == (root / "build" / "good" / "manifest.json").read_bytes()
    dest = root / "elsewhere"
    p = _rollout(root, shim, str(plans["good"]), str(plans["base"]), str(dest))
    assert p.returncode == 0 and (dest / "manifest.json").is_file(), p.stderr


@pytest.mark.heavy
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "shardc").is_file(), reason="needs `make setup`'s .venv")
def test_rollout_runs_from_a_clean_shell_and_takes_the_gate_size(rollout_env):
    """#26 item 1: no venv activated, no $SHARDC, nothing but the system PATH (the shell a CI
    runner starts): the script finds this checkout's .venv/bin/shardc; --max-tokens reaches the gate."""
    root, plans, _ = rollout_env
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "rollout.sh"), "--max-tokens", "600",
                        str(plans["good"]), str(plans["base"]), str(root / "clean-dest")],
                       cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    gate = json.loads((root / "reports" / "gate.json").read_text())
    assert gate["golden"]["tokens"] <= 600 < 8192 and gate["pass"], gate
    assert (root / "clean-dest" / "manifest.json").is_file()
    p = subprocess.run(["bash", str(ROOT / "scripts" / "rollout.sh"), "--gate-tokens", "5", "a", "b"],
                       cwd=root, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: unknown option --gate-tokens"), p.stderr


@pytest.mark.heavy
def test_rollout_stops_at_a_red_gate(rollout_env):
    root, plans, shim = rollout_env
    p = _rollout(root, shim, str(plans["bad"]), str(plans["base"]))
    assert p.returncode == 1, p.stdout + p.stderr
    assert not json.loads((root / "reports" / "gate.json").read_text())["pass"]
    assert not (root / "store" / "bad").exists()  # never pushed
    p = _rollout(root, shim, str(root / "missing.yaml"), str(plans["base"]))
    assert p.returncode == 2
