"""What a new user trips over in the first hour (#26), each run as a user types it: a real
``shardc`` subprocess, the exact line checked.

- ``--json`` errors are a JSON object on stdout as well as the one line on stderr;
- an offline ``hf://`` source is one line; a missing ``--source`` names ``--source``;
- ``verify`` prints the failing check and its reason on the FAIL line;
- ``run`` with several prompts says where each output starts;
- ``build --upload`` says what it pushed; ``build --dry-run`` counts the whole file;
- ``scripts/rollout.sh`` runs from a clean shell and takes the gate's size.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_run import shardc as run_shardc
from plan_helpers import write_plan

ROOT = Path(__file__).resolve().parents[2]


def shardc(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return run_shardc(*args, env=env, cwd=cwd, timeout=300)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def _plan(root: Path, name: str, src: Path, tp: int = 1, pp: int = 1) -> Path:
    return write_plan(root / f"{name}.yaml", tp, pp, name=name, source=src)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny checkpoint and its tp=2 pp=2 build."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("new-user")
    src = write_checkpoint(root / "src", llama_config(num_layers=2), seed=3)
    plan = _plan(root, "small", src, tp=2, pp=2)
    r = shardc("build", plan, "--out", root / "b", "--manifests-dir", root / "m", "-q")
    assert r.returncode == 0, r.stderr
    return root, src, plan


# -- item 3: --json errors ---------------------------------------------------------------------
def test_json_error_is_an_object_on_stdout_and_one_line_on_stderr(tmp_path):
    r = shardc("verify", "--manifest", tmp_path / "missing.json", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"error": f"cannot read manifest {tmp_path / 'missing.json'}: No such file or directory",
                                    "key": None, "hint": "check the path", "exit": 2}
    assert one_line(r) == (f"error: cannot read manifest {tmp_path / 'missing.json'}: No such file or directory "
                           "(hint: check the path)")
    r = shardc("plan", "--model", "llama-3.3-70b", "--gpu", "nope", "--json")
    assert r.returncode == 2
    err = json.loads(r.stdout)
    assert (err["key"], err["error"], err["exit"]) == ("--gpu", "unknown GPU preset 'nope'", 2)
    assert one_line(r).startswith("error: --gpu: unknown GPU preset 'nope' (hint: presets: ")
    # without --json stdout stays empty: the line is on stderr only
    r = shardc("verify", "--manifest", tmp_path / "missing.json")
    assert r.returncode == 2 and r.stdout == ""


def test_json_error_names_the_flag(small):
    root, _, _ = small
    r = shardc("verify", "--manifest", root / "b" / "manifest.json", "--rank", "9", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["key"] == "--rank"


# -- items 3 and 4: sources ----------------------------------------------------------------------
def test_offline_hub_source_is_one_line(tmp_path):
    plan = tmp_path / "hub.yaml"
    plan.write_text(yaml.safe_dump({
        "replica_group": {"name": "hub", "tp_degree": 1, "pp_degree": 1, "dtype": "bf16", "gpus_per_replica": 1},
        "model": {"source": "hf://nobody/nothing"}}))
    r = shardc("build", plan, "--out", tmp_path / "o", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2
    assert one_line(r) == (
        "error: cannot fetch hf://nobody/nothing: the hub is not reachable from here and no snapshot of it "
        "is in the local Hugging Face cache (hint: download it where the hub is reachable (hf download "
        "REPO --local-dir DIR) and build from that directory (--source))")
    assert not (tmp_path / "o").exists()


def test_a_missing_source_directory_names_the_flag_or_the_plan_key(small, tmp_path):
    root, _, plan = small
    r = shardc("build", plan, "--source", tmp_path / "nowhere", "--out", tmp_path / "o")
    assert r.returncode == 2
    assert one_line(r) == (f"error: --source: source directory {tmp_path / 'nowhere'} does not exist "
                           "(hint: give a checkpoint directory that exists)")
    gone = _plan(tmp_path, "gone", tmp_path / "gone-src")
    r = shardc("build", gone, "--out", tmp_path / "o")
    assert one_line(r) == (f"error: model.source: source directory {tmp_path / 'gone-src'} does not exist "
                           "(hint: give a checkpoint directory that exists)")
    assert not (tmp_path / "o").exists()


# -- item 6: output ------------------------------------------------------------------------------
def test_verify_fail_line_names_the_failing_check_and_why(small, tmp_path):
    import shutil

    root, _, _ = small
    bad = tmp_path / "bad"
    shutil.copytree(root / "b", bad)
    shard = bad / "model-tp01-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1  # a tensor byte: the header still parses
    shard.write_bytes(bytes(data))
    r = shardc("verify", "--manifest", bad / "manifest.json")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    # the manifest's chunk digests (format 3) name the damaged chunk, its bytes and its tensors
    assert f"FAIL {shard.name} (rank 1: tp 1, pp 0)  sha256 of 1 of 1 chunk(s) differs from the manifest: " \
           f"chunk 0 (bytes 0..{len(data)}: <header>, model.embed_tokens.weight, " \
           "model.layers.0.input_layernorm.weight and 8 more) (corrupted bytes)" in lines, r.stdout
    assert "ok   model-tp00-pp00.safetensors (rank 0: tp 0, pp 0)  present size sha256 header metadata " \
           "tensor-set dtype-shape extent" in lines, r.stdout
    assert lines[-1] == "small: 1 problem(s)"
    # with --json a mismatch is the report alone: exactly one JSON document on stdout
    r = shardc("verify", "--manifest", bad / "manifest.json", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False


def test_dry_run_reports_the_size_of_the_file_build_writes(small):
    root, _, plan = small
    r = shardc("build", plan, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    for rank in json.loads(r.stdout)["ranks"]:
        assert rank["file_bytes"] == (root / "b" / rank["file"]).stat().st_size  # header included
        assert rank["bytes"] < rank["file_bytes"]
    r = shardc("build", plan, "--dry-run")
    from shardc.formats.files import human_size

    size = human_size((root / "b" / "model-tp00-pp00.safetensors").stat().st_size)
    assert any(line.startswith("  model-tp00-pp00.safetensors") and line.endswith(f"{size} file")
               for line in r.stdout.splitlines()), r.stdout


def test_build_upload_says_what_it_pushed(small, tmp_path):
    root, _, plan = small
    dest = tmp_path / "store"
    r = shardc("build", plan, "--out", root / "b", "--manifests-dir", tmp_path / "m", "--upload",
               "--to", f"file://{dest}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == f"manifest: {dest / 'manifest.json'} (uploaded)", r.stdout
    # 4 shards and config.json (the manifest is the line below)
    assert re.fullmatch(r"pushed 5 file\(s\), [\d.]+ [KMG]iB \(0 already present\) in [\d.]+s", lines[-2]), lines
    assert (dest / "manifest.json").read_bytes() == (root / "b" / "manifest.json").read_bytes()


@pytest.mark.heavy
def test_run_with_several_prompts_marks_where_each_output_starts(small):
    root, _, _ = small
    r = shardc("run", "--manifest", root / "b", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
               "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "--- output 1 of 2 ---" and lines[1].startswith("[1,2,3] -> ")
    assert lines[2:4] == ["", "--- output 2 of 2 ---"] and lines[4].startswith("[4,5] -> ")
    r = shardc("run", "--manifest", root / "b", "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.stdout.splitlines()[0].startswith("[1,2,3] -> ")  # one prompt: no marker


@pytest.mark.heavy
def test_gate_max_tokens_below_one_window_names_the_users_number(demo_model_dir, tmp_path):
    """#26 item 4: the limit is the user's --max-tokens, not the golden text (113,108 tokens)."""
    plan = _plan(tmp_path, "demo1", demo_model_dir)
    assert shardc("build", plan, "--out", tmp_path / "b", "--manifests-dir", tmp_path / "m", "-q").returncode == 0
    r = shardc("gate", "--baseline", tmp_path / "b", "--candidate", tmp_path / "b", "--max-tokens", "64")
    assert r.returncode == 2
    line = one_line(r)
    assert re.fullmatch(r"error: --max-tokens: 64 is smaller than one --window of 512 tokens \(the golden text "
                        r"has \d+\) \(hint: give --max-tokens 512 or more, or a smaller --window\)", line), line


def test_verify_deep_names_the_damaged_tensor(small, tmp_path):
    """#26 item 6: a flipped byte under a sound header; --deep says which tensor holds it (found
    here from the file's own header, parsed by hand)."""
    import shutil
    import struct

    root, src, _ = small
    bad = tmp_path / "bad"
    shutil.copytree(root / "b", bad)
    shard = bad / "model-tp00-pp01.safetensors"
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    pos = 8 + n + 100  # the 100th data byte
    name = next(k for k, v in header.items() if k != "__metadata__"
                and v["data_offsets"][0] <= pos - 8 - n < v["data_offsets"][1])
    data[pos] ^= 0x40
    shard.write_bytes(bytes(data))
    r = shardc("verify", "--manifest", bad / "manifest.json", "--deep", src)
    assert r.returncode == 1
    assert f"     also: tensor {name} differs from source {name} (deep check)" in r.stdout.splitlines(), r.stdout


def test_build_upload_over_another_plan_needs_replace(small, tmp_path):
    """push refuses to replace another plan's build (#25 item 12); build --upload takes --replace too."""
    root, src, plan = small
    dest = tmp_path / "store"
    assert shardc("build", plan, "--out", root / "b", "--manifests-dir", tmp_path / "m", "--upload",
                  "--to", f"file://{dest}", "-q").returncode == 0
    other = _plan(tmp_path, "other", src)  # tp=1: another plan
    r = shardc("build", other, "--out", tmp_path / "o", "--manifests-dir", tmp_path / "m", "--upload",
               "--to", f"file://{dest}")
    assert r.returncode == 2 and "--replace" in one_line(r)
    assert json.loads((dest / "manifest.json").read_text())["plan"]["replica_group"]["name"] == "small"
    r = shardc("build", other, "--out", tmp_path / "o", "--manifests-dir", tmp_path / "m", "--upload",
               "--to", f"file://{dest}", "--replace")
    assert r.returncode == 0, r.stderr
    # the old tp2pp2 shards the tp1 build does not name (model-tp00-pp00 is overwritten, not removed)
    assert r.stdout.splitlines()[-1] == "removed 3 object(s) of the replaced build", r.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "manifest.json", "model-tp00-pp00.safetensors",
                                                      "model.safetensors.index.json"]


def test_export_quiet_prints_nothing(small, tmp_path):
    """#26 item 6: export has -q like every other writing command."""
    root, _, _ = small
    r = shardc("export", "--manifest", root / "b", "--out", tmp_path / "hf", "-q")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    r = shardc("export", "--manifest", root / "b", "--out", tmp_path / "hf2")
    assert r.stdout.startswith("exported 1 file(s), "), r.stdout


def test_gate_report_and_cache_paths_get_their_directories(tmp_path):
    """The README's gate examples write under reports/, which a fresh clone lacks: the gate makes
    the directory before it scores (here the gate then stops at its first check, a missing build)."""
    r = shardc("gate", "--baseline", tmp_path / "nope", "--candidate", tmp_path / "nope",
               "--report", tmp_path / "reports" / "gate.json",
               "--baseline-cache", tmp_path / "cache" / "b.safetensors")
    assert r.returncode == 2 and (tmp_path / "reports").is_dir() and (tmp_path / "cache").is_dir()
    (tmp_path / "file").write_text("")
    r = shardc("gate", "--baseline", tmp_path / "nope", "--candidate", tmp_path / "nope",
               "--report", tmp_path / "file" / "gate.json")
    assert r.returncode == 1
    assert one_line(r).startswith(f"error: --report {tmp_path / 'file' / 'gate.json'}: cannot create its directory")
