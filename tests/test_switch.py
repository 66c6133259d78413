"""#17 item 2: a rebuild killed while switching its files in is finished by the next build.

Real subprocess builds, really killed (SIGKILL from the fault hook ``SHARDC_FAULT=switch:N`` in
``build/switch.py``: after the N-th rename), real files. The oracle is an uninterrupted rebuild
into another directory, compared byte for byte, and ``shardc verify``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
JOURNAL = ".shardc-switch.json"
INTERRUPTED = "a rebuild was interrupted while switching its files in"


def shardc(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SHARDC_FAULT", None)
    if fault:
        env["SHARDC_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "shardc.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def one_line(r: subprocess.CompletedProcess, needle: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """A: tp 1 x pp 2 of checkpoint a (writes the HF index); B: tp 2 x pp 1 of checkpoint b (same
    model, other weights: every shard changes, and the index of A has to go)."""
    from shardc.build.synthetic import llama_config, write_checkpoint

    d = tmp_path_factory.mktemp("switch")
    cfg = llama_config(**TINY)
    out = {}
    for name, seed, tp, pp in [("A", 1, 1, 2), ("B", 2, 2, 1)]:
        src = write_checkpoint(d / name.lower(), cfg, seed=seed)
        plan = {"replica_group": {"name": "h", "tp_degree": tp, "pp_degree": pp, "dtype": "bf16",
                                  "gpus_per_replica": tp * pp}, "model": {"source": str(src)}}
        (d / f"{name}.yaml").write_text(yaml.safe_dump(plan))
        out[name] = d / f"{name}.yaml"
    return out


def build(plan: Path, out: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    return shardc("build", str(plan), "--out", str(out), "--manifests-dir", str(out.parent / "m"), *extra,
                  fault=fault)


def built(plan: Path, out: Path, *extra: str) -> dict:
    r = build(plan, out, "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".shardc-build.lock"}


@pytest.fixture(scope="module")
def reference(plans, tmp_path_factory) -> dict[str, bytes]:
    """A, then B over it, uninterrupted: what every finished switch must end as."""
    out = tmp_path_factory.mktemp("ref") / "out"
    built(plans["A"], out)
    assert built(plans["B"], out)["built"]
    return files(out)


def test_a_rebuild_leaves_exactly_the_new_build(plans, reference):
    """A (tp 1 x pp 2, with the HF index) rebuilt as B (tp 2 x pp 1): the directory holds B's
    listed files and its manifest, nothing of A (model-tp00-pp01, the index) is left behind."""
    m = json.loads(reference["manifest.json"])
    listed = {*m["shards"], *(f["name"] for f in m["files"])}
    assert set(reference) == listed | {"manifest.json"}
    assert "model-tp00-pp01.safetensors" not in reference and "model.safetensors.index.json" not in reference


def interrupted(plans, tmp_path: Path, n: int) -> Path:
    """A complete build A, and a rebuild to B killed after the n-th rename of its switch."""
    out = tmp_path / "out"
    built(plans["A"], out)
    r = build(plans["B"], out, "-q", fault=f"switch:{n}")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert (out / JOURNAL).is_file()
    return out


def renames_in_b(reference: dict[str, bytes]) -> int:
    """How many files B's switch renames before its manifest: its shards and listed side files."""
    m = json.loads(reference["manifest.json"])
    return len(m["shards"]) + len(m["files"])


@pytest.mark.parametrize("point", ["0", "1", "last"])
def test_kill_during_the_switch_is_finished_by_the_rerun(plans, reference, tmp_path, point):
    n = renames_in_b(reference) if point == "last" else int(point)
    out = interrupted(plans, tmp_path, n)
    assert not (out / "manifest.json").exists()
    for cmd in (["verify", "--manifest", str(out / "manifest.json")], ["verify", "--manifest", str(out)],
                ["pull", "--manifest", str(out), "--all", "--dest", str(tmp_path / "pulled")]):
        one_line(shardc(*cmd), INTERRUPTED)
    from shardc.errors import ManifestError
    from shardc.verify.loader import load_shard

    with pytest.raises(ManifestError, match=INTERRUPTED):
        load_shard(out, 0, 0, device="cpu")
    journal = json.loads((out / JOURNAL).read_text())
    inodes = {name: (out / name).stat().st_ino for pair in journal["renames"] for name in pair
              if (out / name).exists()}
    assert sum(1 for tmp, _ in journal["renames"] if not (out / tmp).exists()) == n  # n renamed

    res = built(plans["B"], out)  # the same build again: finished, nothing rewritten
    assert res["finished_switch"] and res["up_to_date"] and res["built"] == []
    for tmp, final in journal["renames"]:  # each file is the one written before the kill
        assert (out / final).stat().st_ino == inodes.get(tmp, inodes.get(final)), final
    assert files(out) == reference  # no temp file, no journal, no index of A: byte-identical
    assert shardc("verify", "--manifest", str(out / "manifest.json")).returncode == 0


def test_kill_after_the_manifest_rename_leaves_a_build_the_rerun_tidies(plans, reference, tmp_path):
    out = interrupted(plans, tmp_path, renames_in_b(reference) + 1)  # all renamed, journal not removed
    assert shardc("verify", "--manifest", str(out)).returncode == 0
    res = built(plans["B"], out)
    assert res["finished_switch"] and res["up_to_date"] and res["built"] == []
    assert files(out) == reference


def test_another_plan_after_an_interrupted_switch_finishes_it_then_rebuilds(plans, reference, tmp_path):
    out = interrupted(plans, tmp_path, 1)
    a_alone = tmp_path / "a"
    built(plans["A"], a_alone)
    res = built(plans["A"], out)  # B's switch first (so this is a rebuild over B), then A
    assert res["finished_switch"] and not res["up_to_date"]
    assert sorted(res["built"]) == ["model-tp00-pp00.safetensors", "model-tp00-pp01.safetensors"]
    for name in ("manifest.json", "config.json", "model.safetensors.index.json", *res["built"]):
        assert (out / name).read_bytes() == (a_alone / name).read_bytes(), name
    assert not (out / JOURNAL).exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert shardc("verify", "--manifest", str(out)).returncode == 0


def test_reshard_into_a_directory_with_an_interrupted_switch_finishes_it_first(plans, reference, tmp_path):
    out = interrupted(plans, tmp_path, 1)
    a_alone = tmp_path / "a"
    built(plans["A"], a_alone)
    r = shardc("reshard", "--manifest", str(a_alone), "--plan", str(plans["B"]), "--out", str(out),
               "--manifests-dir", str(tmp_path / "m"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["finished_switch"]
    assert not (out / JOURNAL).exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert shardc("verify", "--manifest", str(out)).returncode == 0


def _snapshot(out: Path) -> dict[str, tuple]:
    return {p.name: (p.is_symlink(), os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(out.iterdir())}


def _edit(journal: dict, out: Path, case: str, victim: Path) -> bytes | None:
    """The journal as the case spoils it (bytes), or None when the case spoils the directory."""
    renames = journal["renames"]
    if case == "not-json":
        return b'{"format": "shardc-switch", "renames": ['
    if case == "slash":
        renames[0][1] = "sub/" + renames[0][1]
    elif case == "dotdot":
        renames[0] = [f".{renames[0][1]}.0123456789abcdef.tmp".replace(renames[0][1], ".."), ".."]
    elif case == "parent-path":
        renames[0][1] = "../" + victim.name
    elif case == "absolute":
        journal["remove"] = [str(victim)]
    elif case == "foreign-temp":
        renames[0][0] = ".passwd.0123456789abcdef.tmp"
    elif case == "symlink-temp":  # the manifest's temp name now links to a file outside
        tmp = out / renames[-1][0]
        tmp.unlink()
        tmp.symlink_to(victim)
        return None
    elif case == "symlink-journal":
        real = out.parent / "journal.json"
        real.write_bytes((out / JOURNAL).read_bytes())
        (out / JOURNAL).unlink()
        (out / JOURNAL).symlink_to(real)
        return None
    return json.dumps(journal).encode()


@pytest.mark.parametrize("case,needle", [
    ("not-json", "is not JSON"),
    ("slash", "which is not a plain file name of its directory"),
    ("dotdot", "which is not a plain file name of its directory"),
    ("parent-path", "which is not a plain file name of its directory"),
    ("absolute", "which is not a plain file name of its directory"),
    ("foreign-temp", "which is not a temp name of"),
    ("symlink-temp", "which is not a regular file"),
    ("symlink-journal", "is not a regular file (a link?)"),
])
def test_malformed_journal_is_one_line_and_touches_nothing(plans, reference, tmp_path, case, needle):
    out = interrupted(plans, tmp_path, 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    data = _edit(json.loads((out / JOURNAL).read_text()), out, case, victim)
    if data is not None:
        (out / JOURNAL).write_bytes(data)
    before = _snapshot(out)
    r = build(plans["B"], out, "-q")
    one_line(r, needle)
    assert "switch journal" in r.stderr and "delete it and rebuild" in r.stderr
    assert _snapshot(out) == before  # no rename, no removal, no temp cleanup
    assert victim.read_text() == "precious"


def test_rebuild_whose_manifest_cannot_be_written_keeps_the_old_build(tmp_path):
    """The new manifest is the last file staged: failing to write it (EFBIG from a file size limit
    between the largest shard and the manifest, as a full disk fails it) leaves the old build
    byte for byte, no journal and no temp file."""
    from shardc.build.synthetic import llama_config, write_checkpoint

    cfg = llama_config(hidden_size=8, intermediate_size=16, num_layers=24, num_heads=2, num_kv_heads=1, vocab_size=16)
    plans = {}
    for name, seed in [("a", 1), ("b", 2)]:
        src = write_checkpoint(tmp_path / name, cfg, seed=seed)
        plans[name] = tmp_path / f"{name}.yaml"
        plans[name].write_text(yaml.safe_dump({"replica_group": {"name": "h", "tp_degree": 1, "pp_degree": 6,
                                                                 "dtype": "bf16", "gpus_per_replica": 6},
                                               "model": {"source": str(src)}}))
    out = tmp_path / "out"
    built(plans["a"], out)
    before = files(out)
    shard = max(len(v) for k, v in before.items() if k.endswith(".safetensors"))
    assert shard < len(before["manifest.json"])

    def limit() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        lim = (shard + len(before["manifest.json"])) // 2
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim, lim))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SHARDC_FAULT", None)
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "build", str(plans["b"]), "--out", str(out),
                        "--manifests-dir", str(tmp_path / "m"), "-q"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120, preexec_fn=limit)
    one_line(r, "cannot write manifest.json", code=1)
    assert "the build already there is untouched" in r.stderr
    assert files(out) == before  # no journal, no temp file, every old file as it was
    assert shardc("verify", "--manifest", str(out)).returncode == 0


_NAMES = ["manifest.json", "config.json", "model-tp00-pp00.safetensors", ".manifest.json.0123456789abcdef.tmp",
          ".config.json.0123456789abcdef.tmp", ".model-tp00-pp00.safetensors.0123456789abcdef.tmp",
          "../victim.txt", "/tmp/x", "..", ".", "", "a/b", ".shardc-build.lock", ".shardc-switch.json"]


def test_journal_reader_fuzz(tmp_path):
    """Any journal ends in a finished switch or a ShardcError, never another exception, and
    nothing outside the directory changes (the victim beside it)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardc.build.switch import finish_switch
    from shardc.errors import ShardcError

    names = st.sampled_from(_NAMES) | st.text(max_size=12)
    value = st.recursive(st.none() | st.integers(-2, 3) | names,
                         lambda inner: st.lists(inner, max_size=4), max_leaves=12)
    journal = st.fixed_dictionaries({}, optional={
        "format": st.sampled_from(["shardc-switch", "x"]), "version": st.sampled_from([1, 2, True]),
        "renames": st.lists(st.lists(names, min_size=2, max_size=2), max_size=4) | value,
        "remove": st.lists(names, max_size=3) | value, "extra": value})
    pairs = st.sampled_from([[f".{n}.0123456789abcdef.tmp", n] for n in _NAMES[:3]] + [["..", ".."], ["a/b", "b"]])
    journal |= st.fixed_dictionaries({"format": st.just("shardc-switch"), "version": st.just(1),
                                      "renames": st.lists(pairs, min_size=1, max_size=4),
                                      "remove": st.lists(names, max_size=3)})
    outcomes = []
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    counter = iter(range(10**6))

    @settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow,
              HealthCheck.function_scoped_fixture], database=None, derandomize=True)
    @given(journal, st.sets(st.sampled_from(_NAMES[:6])))
    def check(j, present):
        out = tmp_path / f"d{next(counter)}"
        out.mkdir()
        for name in present:
            (out / name).write_text(name)
        (out / JOURNAL).write_text(json.dumps(j))
        try:
            finished = finish_switch(out)
        except ShardcError:
            outcomes.append(False)
            return
        outcomes.append(True)
        assert finished and not (out / JOURNAL).exists()
        assert victim.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir() if
                                                            not p.name.startswith("d")) == ["victim.txt"]

    check()
    assert True in outcomes and False in outcomes  # both ends were reached
