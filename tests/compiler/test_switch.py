"""#17 item 2: a rebuild killed while switching its files in is finished by the next build.

Real subprocess builds, really killed (SIGKILL from the fault hook ``SHARDC_FAULT=switch:N`` in
``compiler/switch.py``: after the N-th rename), real files. The oracle is an uninterrupted rebuild
into another directory, compared byte for byte, and ``shardc verify``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_run import one_line, shardc

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
JOURNAL = ".shardc-switch.json"
INTERRUPTED = "a rebuild was interrupted while switching its files in"


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """A: tp 1 x pp 2 of checkpoint a (writes the HF index); B: tp 2 x pp 1 of checkpoint b (same
    model, other weights: every shard changes, and the index of A has to go)."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

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
    from shardc.loader.local import load_shard

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


@pytest.fixture(scope="module")
def switching(plans, tmp_path_factory) -> tuple[Path, bytes]:
    """One rebuild A -> B killed after its first rename (the rest of B at temp names, the journal,
    no manifest), and A's manifest: each journal case edits a copy of this directory."""
    out = tmp_path_factory.mktemp("switching") / "out"
    built(plans["A"], out)
    a_manifest = (out / "manifest.json").read_bytes()
    r = build(plans["B"], out, "-q", fault="switch:1")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    return out, a_manifest


def copy_of(switching: tuple[Path, bytes], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(switching[0], out, symlinks=True)
    return out


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``, by relative path: its kind and its bytes (regular files), its
    target (links); a directory's entries are listed under it. A FIFO is never opened."""
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(p.relative_to(root))] = ("file", p.read_bytes(), st.st_ino)
        else:
            out[str(p.relative_to(root))] = ("dir" if p.is_dir() else "other", st.st_mode)
    return out


A_ONLY = "model-tp00-pp01.safetensors"  # listed in the journal's remove (B has no pp stage 1)


def _edit(journal: dict, out: Path, case: str, victim: Path) -> bytes | None:
    """The journal as the case spoils it (bytes), or None when the case spoils the directory."""
    renames, remove = journal["renames"], journal["remove"]
    outside = victim.parent
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
    elif case in ("absolute-temp", "parent-temp"):
        # #25 item 1: a temp-looking file outside the directory, named by an absolute or ../ path
        # whose last component is the right temp name: it used to be moved into the build.
        name = f".{renames[1][1]}.0123456789abcdef.tmp"
        (outside / name).write_bytes(b"from outside")
        renames[1][0] = str(outside / name) if case == "absolute-temp" else f"../{name}"
    elif case == "other-final-temp":  # the temp name of another file of the build
        renames[1][0] = renames[2][0]
    elif case == "trailing-newline":
        remove.append(A_ONLY + "\n")
    elif case == "nul":
        remove.append("config.json\x00x")
    elif case == "too-long":
        remove.append("a" * 300)
    elif case == "version-true":
        journal["version"] = True
    elif case == "remove-twice":
        remove.append(A_ONLY)
    elif case == "renamed-and-removed":
        remove.append(renames[0][1])
    elif case in ("remove-dir", "remove-link", "remove-fifo"):
        # #25 item 1: a removed name that is not a regular file. The old manifest is back (a kill
        # right after the journal was written): it used to be deleted before the removal failed,
        # and every rerun failed the same way.
        (out / A_ONLY).unlink()
        if case == "remove-dir":
            (out / A_ONLY).mkdir()
            (out / A_ONLY / "kept").write_text("kept")
        elif case == "remove-link":
            (out / A_ONLY).symlink_to(victim)
        else:
            os.mkfifo(out / A_ONLY)
        return None
    elif case == "final-dir":  # a pending rename's final name is a directory
        (out / renames[1][1]).unlink(missing_ok=True)
        (out / renames[1][1]).mkdir()
        return None
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


PLAIN = "which is not a plain file name of its directory"
NOT_TEMP = "which is not a temp name of"


@pytest.mark.parametrize("case,needle", [
    ("not-json", "is not JSON"),
    ("slash", PLAIN),
    ("dotdot", PLAIN),
    ("parent-path", PLAIN),
    ("absolute", PLAIN),
    ("foreign-temp", NOT_TEMP),
    ("absolute-temp", NOT_TEMP),
    ("parent-temp", NOT_TEMP),
    ("other-final-temp", NOT_TEMP),
    ("trailing-newline", PLAIN),
    ("nul", PLAIN),
    ("too-long", "longer than 255 bytes"),
    ("version-true", "is not a shardc-switch version 1 journal"),
    ("remove-twice", f"removes {A_ONLY} twice"),
    ("renamed-and-removed", "both renames to and removes model-tp0"),
    ("remove-dir", f"removes {A_ONLY}, which is not a regular file"),
    ("remove-link", f"removes {A_ONLY}, which is not a regular file"),
    ("remove-fifo", f"removes {A_ONLY}, which is not a regular file"),
    ("final-dir", "which is not a regular file"),
    ("symlink-temp", "which is not a regular file"),
    ("symlink-journal", "is not a regular file (a link?)"),
])
def test_malformed_journal_is_one_line_and_touches_nothing(plans, switching, tmp_path, case, needle):
    """Each hostile journal or directory: the rerun build is one line, exit 2, and nothing under
    tmp_path changed (the build directory, the journal, the files outside it), byte for byte."""
    out = copy_of(switching, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    journal = json.loads((out / JOURNAL).read_text())
    assert A_ONLY in journal["remove"] and not (out / "manifest.json").exists()
    data = _edit(journal, out, case, victim)
    if data is not None:
        (out / JOURNAL).write_bytes(data)
    if case.startswith("remove-"):
        (out / "manifest.json").write_bytes(switching[1])
    before = tree(tmp_path)
    r = build(plans["B"], out, "-q")
    one_line(r, needle)
    assert "switch journal" in r.stderr and "delete it and rebuild" in r.stderr
    assert tree(tmp_path) == before  # no rename, no removal, no temp cleanup, nothing outside


@pytest.mark.heavy  # three builds (~5 s here); compiler/test_switch_journal.py covers the refusal in-process
def test_rebuild_refuses_a_directory_in_the_way_before_its_switch(plans, tmp_path):
    """A directory squats on a name the switch would rename to (a shard only B has) or remove (a
    shard only A has): the rebuild is refused before its journal, one line, exit 1, and the old
    build is as it was (the switch used to start, remove the old manifest and stop there)."""
    out = tmp_path / "out"
    built(plans["A"], out)
    for squatted in ("model-tp01-pp00.safetensors", A_ONLY):
        kept = None
        if (out / squatted).exists():
            kept = (out / squatted).read_bytes()
            (out / squatted).unlink()
        (out / squatted).mkdir()
        before = tree(tmp_path)
        r = build(plans["B"], out, "-q")
        one_line(r, f"its switch {'removes' if kept else 'names'} {squatted}, which is not a regular file", code=1)
        assert "the build already there is untouched" in r.stderr
        assert tree(tmp_path) == before  # no journal, no temp file
        (out / squatted).rmdir()
        if kept is not None:
            (out / squatted).write_bytes(kept)


def test_rebuild_whose_manifest_cannot_be_written_keeps_the_old_build(tmp_path):
    """The new manifest is the last file staged: failing to write it (EFBIG from a file size limit
    between the largest shard and the manifest, as a full disk fails it) leaves the old build
    byte for byte, no journal and no temp file."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

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

    r = shardc("build", plans["b"], "--out", out, "--manifests-dir", tmp_path / "m", "-q", preexec_fn=limit)
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

    from shardc.compiler.switch import finish_switch
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


def temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def test_killed_force_rebuild_leaves_temps_the_up_to_date_rerun_removes(plans, tmp_path):
    """#25 item 10c: ``build --force`` over a complete build, SIGKILLed once every new file is
    staged at its temp name (SHARDC_FAULT=switch:-1, before the journal). The old build is
    complete, so the plain rerun is up to date; it used to keep the staged shards (0.47 GB on the
    demo) for good. Now it removes them and leaves the build byte for byte as before."""
    out = tmp_path / "out"
    built(plans["A"], out)
    before = files(out)
    r = build(plans["A"], out, "-q", "--force", fault="switch:-1")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    left = temps(out)
    shards = [n for n in left if n.startswith(".model-tp00-pp0") and ".safetensors." in n]
    assert len(shards) == 2 and any(n.startswith(".manifest.json.") for n in left), left
    assert not (out / JOURNAL).exists()
    res = built(plans["A"], out)
    assert res["up_to_date"] and res["built"] == [] and not res["finished_switch"]
    assert temps(out) == [] and files(out) == before


def test_a_running_builds_temps_are_never_removed(plans, tmp_path):
    """The cleanup runs under the build lock: while another process holds it (here this test,
    with flock on the lock file), a build into the directory is refused at once, exit 2, and a
    temp file there (the other build's shard being written) is not touched."""
    import fcntl

    out = tmp_path / "out"
    built(plans["A"], out)
    writing = out / ".model-tp00-pp00.safetensors.0123456789abcdef.tmp"
    writing.write_bytes(b"being written")
    fd = os.open(out / ".shardc-build.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        one_line(build(plans["A"], out, "-q"), "another shardc build is writing to")
        assert writing.read_bytes() == b"being written"
    finally:
        os.close(fd)
    assert built(plans["A"], out)["up_to_date"] and not writing.exists()  # lock free: a leftover


def test_the_committer_is_chosen_once_by_the_manifest_file(tmp_path):
    """compiler/commit.py: a directory without a complete build (no manifest.json file) gets the
    fresh commit (final names, resume records keyed by the run's key); one with a manifest gets the
    switch, which stages everything and counts the old build in the space check."""
    from shardc.compiler.commit import FreshCommit, SwitchCommit, choose_committer

    fresh = choose_committer(tmp_path, {"plan_sha256": "x"})
    assert isinstance(fresh, FreshCommit) and fresh.replacing is False and fresh.key == {"plan_sha256": "x"}
    (tmp_path / "manifest.json").mkdir()  # not a file: no complete build
    assert isinstance(choose_committer(tmp_path, {}), FreshCommit)
    (tmp_path / "manifest.json").rmdir()
    (tmp_path / "manifest.json").write_text("{}")
    switch = choose_committer(tmp_path, {})
    assert isinstance(switch, SwitchCommit) and switch.replacing is True and switch.staged == {}
    assert switch.in_the_way([]) == [] and "untouched" in switch.disk_hint and "kept" in fresh.disk_hint
