"""#41 item 8: build, reshard and export never replace a different build, or write beside files
that are not a build, without being asked; records never replace a different build's record.

The CLI as typed, on real builds of a tiny seeded checkpoint: in this process (``cli_run.shardc_in``,
what the command does), and as real processes (``cli_run.shardc``) where a refusal's exit code and
one line on stderr are the subject. Oracles: the directory's bytes read before the refused run
(every file, byte for byte, and no new one), and ``shardc verify`` of what ``--replace`` left.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_run import one_line, shardc, shardc_in
from plan_helpers import write_plan

from shardc.formats.manifest import loads

TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
REPLACE_HINT = "use --replace to replace it"
NOT_A_BUILD = "never deletes files shardc did not write"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints of one model (other weights), plans 'alpha' (tp 2) and 'beta' (tp 1) of
    checkpoint a, 'alpha' of checkpoint b (same name, other source), 'gamma' (int8 of a), and
    built directories: alpha and beta (records in their own dirs) and alpha's export."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    d = tmp_path_factory.mktemp("guard")
    cfg = llama_config(**TINY)
    a = write_checkpoint(d / "src-a", cfg, seed=1)
    b = write_checkpoint(d / "src-b", cfg, seed=2)
    w = {"d": d, "src-a": a, "src-b": b,
         "alpha": write_plan(d / "alpha.yaml", 2, name="alpha", source=a),
         "alpha-b": write_plan(d / "alpha-b.yaml", 2, name="alpha", source=b),
         "beta": write_plan(d / "beta.yaml", 1, name="beta", source=a),
         "gamma": write_plan(d / "gamma.yaml", 1, dtype="int8", name="gamma", source=a)}
    for name in ("alpha", "beta"):
        r = shardc_in("build", w[name], "--out", d / f"built-{name}", "--manifests-dir", d / f"m-{name}", "-q")
        assert r.returncode == 0, r.stderr
        w[f"built-{name}"] = d / f"built-{name}"
    r = shardc_in("export", "--manifest", w["built-alpha"], "--out", d / "hf-alpha", "-q")
    assert r.returncode == 0, r.stderr
    w["hf-alpha"] = d / "hf-alpha"
    return w


def snapshot(d: Path) -> dict[str, bytes]:
    """Every entry of the directory and its bytes, recursively (the lock file included: a refused
    run makes none); a directory as None."""
    return {str(p.relative_to(d)): None if p.is_dir() else p.read_bytes() for p in sorted(d.rglob("*"))}


def copy_of(src: Path, tmp_path: Path, name: str = "out") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    (out / ".shardc-build.lock").unlink(missing_ok=True)
    return out


def user_dir(tmp_path: Path) -> Path:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "model.safetensors").write_bytes(b"not yours")
    (out / "zz-data").mkdir()
    (out / "zz-data" / "keep").write_text("keep\n")
    (out / "results.csv").write_text("a,b\n")
    return out


def build(world, plan: str, out: Path, *extra: object, m: Path | None = None, run=shardc_in):
    return run("build", world[plan], "--out", out, "--manifests-dir", m or out.parent / "m", "-q", *extra)


def reshard(world, plan: str, out: Path, *extra: object, m: Path | None = None, run=shardc_in):
    return run("reshard", "--manifest", world["built-alpha"], "--plan", world[plan], "--out", out,
               "--manifests-dir", m or out.parent / "m", "-q", *extra)


def export(world, build_dir: Path, out: Path, *extra: object, run=shardc_in):
    return run("export", "--manifest", build_dir, "--out", out, "-q", *extra)


def plan_sha(d: Path) -> str:
    return json.loads((d / "manifest.json").read_bytes())["plan_sha256"]


# -- build and reshard into a directory holding another plan's build --------------------------

@pytest.mark.parametrize("cmd", ["build", "reshard"])
def test_another_plans_build_is_refused_untouched(world, tmp_path, cmd):
    """A real process: exit code 2, the one line on stderr."""
    out = copy_of(world["built-beta"], tmp_path)
    before = snapshot(out)
    r = (build if cmd == "build" else reshard)(world, "alpha", out, run=shardc)
    line = one_line(r, code=2)
    assert line == (f"error: {out} holds build 'beta' (plan sha256 {plan_sha(out)[:12]}), not plan 'alpha' "
                    f"(hint: {REPLACE_HINT} (the journaled switch: the old build stays whole until the new "
                    f"one is), or build into another directory (--out))")
    assert snapshot(out) == before
    assert not (tmp_path / "m").exists()  # no record either


@pytest.mark.parametrize("cmd", ["build", "reshard"])
def test_replace_switches_the_other_build_out(world, tmp_path, cmd):
    out = copy_of(world["built-beta"], tmp_path)
    r = (build if cmd == "build" else reshard)(world, "alpha", out, "--replace")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_bytes())
    assert m["plan"]["replica_group"]["name"] == "alpha"
    # beta's files are gone (tp 1: its index and model-tp00-pp00 of another size), only alpha's remain
    listed = {*m["shards"], *(f["name"] for f in m["files"])}
    assert {p.name for p in out.iterdir()} == listed | {"manifest.json", ".shardc-build.lock"}
    assert "model.safetensors.index.json" not in listed
    assert shardc_in("verify", "--manifest", out).returncode == 0
    assert (tmp_path / "m" / "alpha.json").read_bytes() == (out / "manifest.json").read_bytes()


def test_a_manifest_that_does_not_parse_is_not_replaced_without_asking(world, tmp_path):
    out = copy_of(world["built-beta"], tmp_path)
    (out / "manifest.json").write_text("{not json")
    before = snapshot(out)
    one_line(build(world, "alpha", out), f"{out} holds a manifest.json shardc cannot read; refusing to "
                                         f"replace it with plan 'alpha'")
    assert snapshot(out) == before


# -- files that are not a build ---------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["build", "reshard", "export"])
@pytest.mark.parametrize("flag", [(), ("--replace",)])
def test_a_directory_of_user_files_is_refused_even_with_replace(world, tmp_path, cmd, flag):
    out = user_dir(tmp_path)
    before = snapshot(out)
    r = {"build": lambda: build(world, "alpha", out, *flag), "reshard": lambda: reshard(world, "alpha", out, *flag),
         "export": lambda: export(world, world["built-alpha"], out, *flag, run=shardc if not flag else shardc_in),
         }[cmd]()  # export's refusal without a flag in a real process (build's and reshard's: above)
    what = "an export" if cmd == "export" else "a build"
    line = one_line(r, code=2)
    assert line == (f"error: {out} holds 4 file(s) that are not {what}: model.safetensors, notes.txt, "
                    f"results.csv, … (1 more) (hint: move them away or write into an empty directory "
                    f"(--out); --replace {NOT_A_BUILD})")
    assert snapshot(out) == before and (out / "zz-data" / "keep").read_text() == "keep\n"
    assert not (tmp_path / "m").exists()


def test_one_user_file_beside_a_build_of_the_same_plan_is_refused(world, tmp_path):
    out = copy_of(world["built-alpha"], tmp_path)
    (out / "README.md").write_text("my notes\n")
    before = snapshot(out)
    line = one_line(build(world, "alpha", out, "--force"))
    assert line.endswith(f"{out} holds 1 file(s) that are not a build: README.md (hint: move them away or write "
                         f"into an empty directory (--out); --replace {NOT_A_BUILD})")
    assert snapshot(out) == before


# -- what still works without a flag -----------------------------------------------------------

def test_the_same_plan_rebuilds_resumes_and_switches_without_a_flag(world, tmp_path):
    out = copy_of(world["built-alpha"], tmp_path)
    m = tmp_path / "m"
    # up to date, then forced (the switch over a complete build of the same plan)
    r = shardc_in("build", world["alpha"], "--out", out, "--manifests-dir", m, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["up_to_date"], r.stderr
    r = shardc_in("build", world["alpha"], "--out", out, "--manifests-dir", m, "--force", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["built"], r.stderr
    # the same plan name from another source: the ordinary rebuild, its own record replaced
    r = build(world, "alpha-b", out, m=m)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_bytes())["source"]["uri"] == str(world["src-b"])
    # resume: what a killed build leaves (shards, a resume record, a temp file, no manifest)
    fresh = tmp_path / "fresh"
    assert shardc_in("build", world["beta"], "--out", fresh, "--manifests-dir", tmp_path / "m2", "-q").returncode == 0
    (fresh / "manifest.json").unlink()
    shard = next(fresh.glob("model-*.safetensors"))
    (fresh / f".{shard.name}.done.json").write_text("{}")  # a stale record: rebuilt, not refused
    (fresh / f".config.json.{'0' * 16}.tmp").write_bytes(b"x")
    r = shardc_in("build", world["beta"], "--out", fresh, "--manifests-dir", tmp_path / "m2", "--json")
    assert r.returncode == 0, r.stderr
    assert shardc_in("verify", "--manifest", fresh).returncode == 0


def test_an_empty_or_missing_directory_is_fine(world, tmp_path):
    (tmp_path / "empty").mkdir()
    assert build(world, "beta", tmp_path / "empty").returncode == 0
    assert export(world, world["built-alpha"], tmp_path / "new" / "hf").returncode == 0


# -- export ---------------------------------------------------------------------------------------

def test_export_of_another_dtype_is_refused_then_replaced(world, tmp_path):
    gamma = tmp_path / "gamma"
    assert build(world, "gamma", gamma).returncode == 0
    out = copy_of(world["hf-alpha"], tmp_path, "hf")
    before = snapshot(out)
    line = one_line(export(world, gamma, out))
    assert line == (f"error: {out} holds an export of another model or dtype (its config.json differs from "
                    f"this export's) (hint: use --replace to replace it, or export into another directory "
                    f"(--out))")
    assert snapshot(out) == before
    r = export(world, gamma, out, "--replace", "--json")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_bytes())
    assert {p.name for p in out.iterdir()} == {*index["weight_map"].values(), "model.safetensors.index.json",
                                               "config.json", ".shardc-build.lock"}
    assert json.loads((out / "config.json").read_bytes())["quantization_config"]


def test_export_of_the_same_model_and_dtype_replaces_as_before(world, tmp_path):
    """A re-export (here of another build of the same model at the same dtype) is the same
    checkpoint: no flag needed, the old export switched out as before."""
    out = copy_of(world["hf-alpha"], tmp_path, "hf")
    assert export(world, world["built-beta"], out).returncode == 0


def test_export_over_a_checkpoint_shardc_did_not_write_is_refused(world, tmp_path):
    """HF-named files without shardc's export metadata (a user's download) are not an export:
    refused even with --replace, where the switch would have deleted them."""
    out = copy_of(world["hf-alpha"], tmp_path, "hf")
    theirs = out / "model-00001-of-00009.safetensors"
    shutil.copy(world["src-a"] / "model.safetensors", theirs)
    before = snapshot(out)
    line = one_line(export(world, world["built-alpha"], out, "--replace"))
    assert f"{out} holds 1 file(s) that are not an export: model-00001-of-00009.safetensors " in line
    assert snapshot(out) == before


# -- records ----------------------------------------------------------------------------------------

def test_a_record_of_another_build_of_the_plan_is_not_replaced(world, tmp_path):
    """Two --out builds of one plan from two sources would share manifests/alpha.json."""
    m = tmp_path / "m"
    first = tmp_path / "first"
    assert build(world, "alpha", first, m=m).returncode == 0
    record = (m / "alpha.json").read_bytes()
    second = tmp_path / "second"
    line = one_line(build(world, "alpha-b", second, m=m))
    sha = loads(record).effective_sha256
    assert line == (f"error: the record {m / 'alpha.json'} is of another build of plan 'alpha' (effective plan "
                    f"sha256 {sha[:12]}, source {world['src-a']}), not the one in {second} (hint: use "
                    f"--replace to replace the record, or keep this build's record elsewhere (--manifests-dir))")
    assert not second.exists() and (m / "alpha.json").read_bytes() == record
    one_line(reshard(world, "alpha-b", second, m=m), f"the record {m / 'alpha.json'} is of another build")
    assert not second.exists()
    # the same build in a second directory writes the same record: allowed
    assert build(world, "alpha", tmp_path / "again", m=m).returncode == 0
    assert (m / "alpha.json").read_bytes() == record
    # --replace: the record is the second build's
    assert build(world, "alpha-b", second, "--replace", m=m).returncode == 0
    assert (m / "alpha.json").read_bytes() == (second / "manifest.json").read_bytes()


def test_a_record_that_does_not_parse_is_not_replaced(world, tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "beta.json").write_text("mine")
    line = one_line(build(world, "beta", tmp_path / "o", m=m))
    assert f"the record {m / 'beta.json'} is not a manifest shardc can read" in line
    assert (m / "beta.json").read_text() == "mine" and not (tmp_path / "o").exists()
