"""`build --source` and `verify --plan` (#17 item 3): the manifest records the effective plan.

A build made with ``--source /elsewhere`` keeps the plan file's sha256 (shard metadata, byte for
byte the same shards), but its manifest records the override and the effective plan's hash, and
``verify --plan P`` accepts it only together with that ``--source``. Real checkpoints, the CLI as
typed (in this process; real processes for the bad input's exit code and one line); the expected
hashes are computed here from the manifest's JSON, not by shardc.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_run import shardc, shardc_in

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
PLAN_YAML = """\
replica_group: {name: eff, tp_degree: 1, pp_degree: 2, dtype: bf16, gpus_per_replica: 2}
model: {source: weights}
"""


def sha_of(obj) -> str:
    """The oracle: sha256 of sorted-key JSON, indent 1, UTF-8, newline (docs/architecture.md §3.3)."""
    return hashlib.sha256((json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()).hexdigest()


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("model-*.safetensors"))}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The plan (its source `weights`, relative to the plan file), a copy of the same checkpoint
    elsewhere, a build without override and one with ``--source <copy>``."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("eff")
    write_checkpoint(root / "weights", llama_config(**TINY), seed=3)
    elsewhere = root / "mirror" / "weights"
    shutil.copytree(root / "weights", elsewhere)
    plan = root / "plan.yaml"
    plan.write_text(PLAN_YAML)
    for out, extra in (("plain", ()), ("over", ("--source", elsewhere))):
        # each build its own records: the two are builds of one plan from different sources, and
        # a record is never replaced by a different build's
        r = shardc_in("build", plan, "--out", root / out, "--manifests-dir", root / "m" / out, "-q", *extra)
        assert r.returncode == 0, r.stderr
    return {"root": root, "plan": plan, "elsewhere": str(elsewhere), "plain": root / "plain", "over": root / "over"}


def verify(build_dir: Path, *extra, run=shardc_in) -> subprocess.CompletedProcess:
    return run("verify", "--manifest", build_dir / "manifest.json", *extra)


def test_the_manifest_records_the_override_and_the_effective_plan(world):
    plain = json.loads((world["plain"] / "manifest.json").read_text())
    over = json.loads((world["over"] / "manifest.json").read_text())
    # the plan file's hash and the shards are the same wherever the weights were read from
    assert over["plan"] == plain["plan"] and over["plan_sha256"] == plain["plan_sha256"] == sha_of(plain["plan"])
    assert digests(world["over"]) == digests(world["plain"]) and len(digests(world["plain"])) == 2
    # ... but the manifest says which source, and hashes the plan as applied
    assert over["overrides"] == {"model.source": world["elsewhere"]}
    effective = json.loads(json.dumps(plain["plan"]))
    effective["model"]["source"] = world["elsewhere"]
    assert over["effective_plan_sha256"] == sha_of(effective) != over["plan_sha256"]
    assert over["source"]["uri"] == world["elsewhere"]
    from shardc.verify.inspect import describe

    assert f"source     {world['elsewhere']}  (build --source; the plan's own is weights, effective plan " \
           f"sha256 {over['effective_plan_sha256'][:12]})" in describe(world["over"]).lines
    # a build without override records neither key: its bytes are what they always were
    assert "overrides" not in plain and "effective_plan_sha256" not in plain
    assert plain["source"]["uri"] == "weights"


def test_verify_plan_of_an_override_build_needs_its_source(world):
    plan, src = world["plan"], world["elsewhere"]
    r = verify(world["over"], "--plan", plan)
    assert r.returncode == 1, r.stderr
    line = f"built from `--source {src}` instead of the plan's `weights`; " \
           f"`shardc verify --plan {plan} --source {src}` accepts that source"
    assert r.stderr.strip().splitlines() == [f"error: {line}"]
    r = verify(world["over"], "--plan", plan, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["ok"] is False and report["problems"] == [line]
    assert all(rank["ok"] for rank in report["ranks"])  # the shards themselves are sound
    check = report["plan_check"]
    assert check["ok"] is False and check["overrides"] == {"model.source": src} and check["expected_overrides"] == {}
    assert check["expected_effective_plan_sha256"] == json.loads((world["over"] / "manifest.json").read_text())["plan_sha256"]
    # with the source it was built from, it is exactly the plan this node expects
    r = verify(world["over"], "--plan", plan, "--source", src, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["plan_check"]["ok"] is True


def test_verify_plan_with_another_source_fails(world):
    plan, src, other = world["plan"], world["elsewhere"], str(world["root"] / "other")
    r = verify(world["over"], "--plan", plan, "--source", other)
    assert r.returncode == 1, r.stderr
    assert f"built from `--source {src}`, not `--source {other}` (the plan's own is `weights`)" in r.stderr
    # the plan's own words as --source mean no override: the build read another source
    r = verify(world["over"], "--plan", plan, "--source", "weights")
    assert r.returncode == 1 and f"built from `--source {src}` instead of the plan's `weights`" in r.stderr
    # a build of the plan's own source is not one of another source either
    r = verify(world["plain"], "--plan", plan, "--source", other, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["problems"][0].startswith(
        f"built from the plan's own source `weights`, not from `--source {other}`; "
        f"`shardc verify --plan {plan}` (without --source) accepts it")


def test_a_build_without_override_still_passes_verify_plan(world):
    r = verify(world["plain"], "--plan", world["plan"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = verify(world["plain"], "--plan", world["plan"], "--source", "weights")  # the plan's own words
    assert r.returncode == 0, r.stdout + r.stderr


def test_old_manifests_without_the_field_still_verify(world, tmp_path):
    """A version 1 manifest (and any written before overrides were recorded) has no such keys:
    its effective plan is its plan."""
    from shardc.formats.manifest import load

    old = tmp_path / "old"
    shutil.copytree(world["plain"], old)
    m = json.loads((old / "manifest.json").read_text())
    m["format_version"] = 1
    m["shards"] = [{"file": f, **e} for f, e in sorted(m["shards"].items())]
    (old / "manifest.json").write_text(json.dumps(m))
    assert verify(old, "--plan", world["plan"]).returncode == 0
    r = verify(old, "--plan", world["plan"], "--source", world["elsewhere"])
    assert r.returncode == 1 and "built from the plan's own source `weights`" in r.stderr
    fixture = load(ROOT / "tests" / "data" / "manifest-v1-demo-tp3pp2-bf16.json")
    assert fixture.overrides == {} and fixture.effective_sha256 == fixture.plan_sha256


def test_effective_hash_is_deterministic_and_part_of_up_to_date(world, tmp_path):
    again = tmp_path / "again"
    r = shardc_in("build", world["plan"], "--out", again, "--manifests-dir", tmp_path / "m", "-q",
               "--source", world["elsewhere"])
    assert r.returncode == 0, r.stderr
    want = (world["over"] / "manifest.json").read_bytes()
    assert (again / "manifest.json").read_bytes() == want
    # a manifest of this build without the override record (as a shardc that did not record it
    # wrote) is not up to date: the rerun writes the record
    m = json.loads(want)
    del m["overrides"], m["effective_plan_sha256"]
    (again / "manifest.json").write_text(json.dumps(m))
    r = shardc_in("build", world["plan"], "--out", again, "--manifests-dir", tmp_path / "m", "--json",
               "--source", world["elsewhere"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["up_to_date"] is False and summary["overrides"] == {"model.source": world["elsewhere"]}
    assert (again / "manifest.json").read_bytes() == want


def test_reshard_output_verifies_against_its_own_plan(world, tmp_path):
    """A reshard reads an input build, not a checkpoint: its provenance is source.reshard_of (the
    input manifest's sha256, which covers the input's own overrides), and its effective plan is
    its plan, so `verify --plan` of that plan accepts it."""
    target = tmp_path / "target.yaml"
    target.write_text(PLAN_YAML.replace("name: eff", "name: eff1").replace("pp_degree: 2", "pp_degree: 1")
                      .replace("gpus_per_replica: 2", "gpus_per_replica: 1"))
    out = tmp_path / "r"
    r = shardc_in("reshard", "--manifest", world["over"] / "manifest.json", "--plan", target, "--out", out,
               "--manifests-dir", tmp_path / "m", "-q")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert "overrides" not in m
    assert m["source"]["reshard_of"]["manifest_sha256"] == hashlib.sha256(
        (world["over"] / "manifest.json").read_bytes()).hexdigest()
    assert verify(out, "--plan", target).returncode == 0
    r = verify(out, "--plan", target, "--source", world["elsewhere"])
    assert r.returncode == 1
    assert f"resharded from {world['over'] / 'manifest.json'} under the plan's own source `weights`" in r.stderr


@pytest.mark.parametrize(("edit", "code", "needle"), [
    (lambda m: m.pop("effective_plan_sha256"), 2, "effective_plan_sha256: "),
    (lambda m: m["overrides"].update({"replica_group.name": "x"}), 2, "only model.source can be overridden"),
    (lambda m: m.update(overrides={}), 2, "overrides: "),
    (lambda m: m.update(effective_plan_sha256=m["plan_sha256"]), 1,
     "manifest effective_plan_sha256 does not match the hash of its plan with its overrides"),
    (lambda m: m["source"].update(uri="/somewhere/else"), 1,
     "manifest overrides model.source with"),
])
def test_an_inconsistent_override_record_is_refused(world, tmp_path, edit, code, needle):
    d = tmp_path / "b"
    shutil.copytree(world["over"], d)
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    r = verify(d)
    assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_source_flags_that_mean_nothing_or_two_things_are_bad_input(world, tmp_path):
    r = verify(world["plain"], "--source", world["elsewhere"], run=shardc)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --source goes with --plan (it names the source of the plan this node expects) "
        "(hint: shardc verify --manifest M --plan PLAN.yaml --source SRC)"]
    # the plan's own words, relative to another directory (here: the repository, the cwd):
    # recorded as the plan's source they would lie, so the build is refused before anything
    r = shardc("build", world["plan"], "--out", tmp_path / "o", "--source", "weights", "-q")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--source 'weights' is the plan's own model.source, which the plan resolves to {world['root'] / 'weights'}" \
        in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_the_override_record_survives_push_and_pull(world, tmp_path, compress):
    """A node checks a pulled build: the pulled manifest.json is the build's, override included."""
    from shardc.store import pull_build, push_build

    push_build(world["over"] / "manifest.json", str(tmp_path / "store"), compress=compress)
    pull_build(str(tmp_path / "store" / "manifest.json"), tmp_path / "node")
    assert (tmp_path / "node" / "manifest.json").read_bytes() == (world["over"] / "manifest.json").read_bytes()
    assert verify(tmp_path / "node", "--plan", world["plan"], "--source", world["elsewhere"]).returncode == 0
    assert verify(tmp_path / "node", "--plan", world["plan"]).returncode == 1


def test_an_override_of_a_plan_without_a_source_is_refused_on_read(world):
    from shardc.errors import ManifestError
    from shardc.formats.manifest import loads

    m = json.loads((world["over"] / "manifest.json").read_text())
    m["plan"]["model"] = ["not", "a", "section"]
    with pytest.raises(ManifestError, match="expected dict") as err:
        loads(json.dumps(m))
    assert err.value.key == "plan.model"
