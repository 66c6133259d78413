"""compiler/switch.py pinned in-process, for mutation testing (the kill-and-rerun tests of
compiler/test_switch.py run shardc in subprocesses, which mutmut's per-test coverage does not see): the
journal's exact bytes, every refusal's exact line and hint, the name and size limits at their
edges, the order of the switch, and the fault hook (real SIGKILLs of forked children).

Oracles are written by hand: the journal's canonical JSON as a literal, the messages as literals,
the directory's contents as the bytes the test wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from shardc.compiler.switch import _fault, apply_switch, finish_switch, write_journal
from shardc.errors import ManifestError, OutputError

JOURNAL = ".shardc-switch.json"
H1, H2, H3 = "0123456789abcdef", "00000000000000aa", "fedcba9876543210"
HINT = ("it records a rebuild interrupted while switching its files in; "
        "delete it and rebuild (`force`)")  # the library's field; shardc build says --force


def staged_build(out: Path) -> dict[str, bytes]:
    """An old build (manifest, config, shard a; shard b only in the old build) and the new one
    staged at temp names (shard a, config, manifest). Returns what the directory holds."""
    out.mkdir()
    content = {"manifest.json": b"old manifest", "config.json": b"old config", "a.safetensors": b"old a",
               "b.safetensors": b"old b", f".a.safetensors.{H1}.tmp": b"new a",
               f".config.json.{H2}.tmp": b"new config", f".manifest.json.{H3}.tmp": b"new manifest"}
    for name, data in content.items():
        (out / name).write_bytes(data)
    return content


def write(out: Path) -> tuple[list[list[str]], list[str]]:
    return write_journal(out, {out / "a.safetensors": out / f".a.safetensors.{H1}.tmp",
                               out / "config.json": out / f".config.json.{H2}.tmp"},
                         out / f".manifest.json.{H3}.tmp", ["b.safetensors"])


def listing(out: Path) -> dict[str, bytes | str]:
    """Each entry's bytes; a link, directory or FIFO by its kind (never opened)."""
    return {p.name: "link" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir" if p.is_dir() else "other"
            for p in sorted(out.iterdir())}


NEW = {"a.safetensors": b"new a", "config.json": b"new config", "manifest.json": b"new manifest"}


def test_write_journal_bytes_and_the_switch(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    renames, remove = write(out)
    want_renames = [[f".a.safetensors.{H1}.tmp", "a.safetensors"], [f".config.json.{H2}.tmp", "config.json"],
                    [f".manifest.json.{H3}.tmp", "manifest.json"]]
    assert (renames, remove) == (want_renames, ["b.safetensors"])
    assert (out / JOURNAL).read_text() == (
        '{\n "format": "shardc-switch",\n "remove": [\n  "b.safetensors"\n ],\n "renames": [\n  [\n'
        f'   ".a.safetensors.{H1}.tmp",\n   "a.safetensors"\n  ],\n  [\n   ".config.json.{H2}.tmp",\n'
        f'   "config.json"\n  ],\n  [\n   ".manifest.json.{H3}.tmp",\n   "manifest.json"\n  ]\n ],\n'
        ' "version": 1\n}\n')
    assert finish_switch(out) is True
    assert listing(out) == NEW
    assert finish_switch(out) is False  # no journal: nothing to do


def test_write_journal_sorts_the_removals(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    (out / "c.bin").write_bytes(b"c")
    _, remove = write_journal(out, {}, out / f".manifest.json.{H3}.tmp", ["c.bin", "b.safetensors"])
    assert remove == ["b.safetensors", "c.bin"] == json.loads((out / JOURNAL).read_bytes())["remove"]


@pytest.mark.parametrize("squat,word", [("b.safetensors", "removes"), ("config.json", "names"),
                                        (f".config.json.{H2}.tmp", "names")])
def test_write_journal_refuses_a_directory_in_the_way(tmp_path, squat, word):
    out = tmp_path / "o"
    staged_build(out)
    (out / squat).unlink()
    (out / squat).mkdir()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(OutputError) as e:
        write(out)
    assert e.value.message == f"cannot switch the new build into {out}: its switch {word} {squat}, which is not a regular file"
    assert e.value.hint == "remove or rename it, then rerun; the build already there is untouched"
    assert sorted(p.name for p in out.iterdir()) == before  # no journal


def journal(out: Path, renames: list, remove: list, **extra) -> None:
    j = {"format": "shardc-switch", "version": 1, "renames": renames, "remove": remove, **extra}
    (out / JOURNAL).write_text(json.dumps(j))


def refused(out: Path, what: str) -> None:
    before = listing(out)
    with pytest.raises(ManifestError) as e:
        finish_switch(out)
    assert e.value.message == f"switch journal {out / JOURNAL} {what}; nothing was changed"
    assert e.value.hint == HINT and e.value.exit_code == 2
    assert listing(out) == before


GOOD = [[f".a.safetensors.{H1}.tmp", "a.safetensors"], [f".manifest.json.{H3}.tmp", "manifest.json"]]


@pytest.mark.parametrize("j,what", [
    ({"format": "shardc-switch", "version": 1, "renames": GOOD}, "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-switch", "version": 1, "renames": GOOD, "remove": [], "x": 1},
     "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-swich", "version": 1, "renames": GOOD, "remove": []}, "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-switch", "version": 2, "renames": GOOD, "remove": []}, "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-switch", "version": True, "renames": GOOD, "remove": []},
     "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-switch", "version": 1.0, "renames": GOOD, "remove": []},
     "is not a shardc-switch version 1 journal"),
    ([1], "is not a shardc-switch version 1 journal"),
    ({"format": "shardc-switch", "version": 1, "renames": [], "remove": []},
     "needs a non-empty list 'renames' and a list 'remove'"),
    ({"format": "shardc-switch", "version": 1, "renames": {"a": 1}, "remove": []},
     "needs a non-empty list 'renames' and a list 'remove'"),
    ({"format": "shardc-switch", "version": 1, "renames": GOOD, "remove": "b.safetensors"},
     "needs a non-empty list 'renames' and a list 'remove'"),
])
def test_journal_shape_refusals(tmp_path, j, what):
    out = tmp_path / "o"
    staged_build(out)
    (out / JOURNAL).write_text(json.dumps(j))
    refused(out, what)


LONG = "x" * 100  # _short: repr cut to 77 characters and "..."


@pytest.mark.parametrize("renames,remove,what", [
    ([["a"]], [], "has a rename that is not [temp name, final name]: ['a']"),
    ([["a", "b", "c"]], [], "has a rename that is not [temp name, final name]: ['a', 'b', 'c']"),
    ([[1, "a.safetensors"]], [], "has a rename that is not [temp name, final name]: [1, 'a.safetensors']"),
    (["ab"], [], "has a rename that is not [temp name, final name]: 'ab'"),
    ([[LONG, LONG]], [], "has " + repr(LONG)[:77] + "..., which is not a temp name of " + LONG + " in its directory"),
    ([["x" * 78, "y"]], [], "has " + repr("x" * 78) + ", which is not a temp name of y in its directory"),  # 80: whole
    ([[f".a.safetensors.{H1}.tmp", "a/safetensors"]], [],
     "names 'a/safetensors', which is not a plain file name of its directory"),
    ([[f".a.safetensors.{H1}.tmp", "a.safetensors"]], [], "must rename each file once, manifest.json last"),
    ([GOOD[1], GOOD[0]], [], "must rename each file once, manifest.json last"),
    ([GOOD[0], GOOD[0], GOOD[1]], [], "must rename each file once, manifest.json last"),
    ([GOOD[1], GOOD[1]], [], "must rename each file once, manifest.json last"),
    ([[f".a.safetensors.{H1}.tmp", "a.safetensors"], [f".a.safetensors.{H2}.tmp", "a.safetensors"], GOOD[1]], [],
     "must rename each file once, manifest.json last"),
    ([[f"/x/.a.safetensors.{H1}.tmp", "a.safetensors"], GOOD[1]], [],
     f"has '/x/.a.safetensors.{H1}.tmp', which is not a temp name of a.safetensors in its directory"),
    ([[f".a.safetensors.{H1}.tmpx", "a.safetensors"], GOOD[1]], [],
     f"has '.a.safetensors.{H1}.tmpx', which is not a temp name of a.safetensors in its directory"),
    ([[f"x.a.safetensors.{H1}.tmp", "a.safetensors"], GOOD[1]], [],
     f"has 'x.a.safetensors.{H1}.tmp', which is not a temp name of a.safetensors in its directory"),
    ([[f".aXsafetensors.{H1}.tmp", "a.safetensors"], GOOD[1]], [],  # "." of the final matched as itself
     f"has '.aXsafetensors.{H1}.tmp', which is not a temp name of a.safetensors in its directory"),
    ([[f".a.safetensors.{H1[:15]}g.tmp", "a.safetensors"], GOOD[1]], [],
     f"has '.a.safetensors.{H1[:15]}g.tmp', which is not a temp name of a.safetensors in its directory"),
    ([GOOD[0], GOOD[1]], ["a.safetensors"], "both renames to and removes a.safetensors"),
    ([GOOD[0], GOOD[1]], ["manifest.json"], "both renames to and removes manifest.json"),
    ([GOOD[0], GOOD[1]], ["b.safetensors", "c", "b.safetensors"], "removes b.safetensors twice"),
    ([GOOD[0], GOOD[1]], ["../b"], "names '../b', which is not a plain file name of its directory"),
    ([GOOD[0], GOOD[1]], ["b\n"], "names 'b\\n', which is not a plain file name of its directory"),
    ([GOOD[0], GOOD[1]], ["b" * 256], "names " + repr("b" * 256)[:77] + "..., longer than 255 bytes"),
    ([GOOD[0], GOOD[1]], ["é" * 128], "names " + repr("é" * 128)[:77] + "..., which is not a plain file name of its directory"),
    ([[".c.json.0123456789abcdef.tmp", "c.json"], GOOD[1]], [], "cannot be finished: neither .c.json.0123456789abcdef.tmp nor c.json exists"),
])
def test_journal_name_refusals(tmp_path, renames, remove, what):
    out = tmp_path / "o"
    staged_build(out)
    journal(out, renames, remove)
    refused(out, what)


def test_names_at_the_length_limit(tmp_path):
    """255 bytes is a name (the final of a 233-byte name has a 255-byte temp name); 256 is not."""
    out = tmp_path / "o"
    staged_build(out)
    final = "f" * 233
    tmp = f".{final}.{H1}.tmp"
    assert len(tmp) == 255
    (out / tmp).write_bytes(b"long")
    journal(out, [[tmp, final], GOOD[1]], ["r" * 255])
    assert finish_switch(out) is True
    assert (out / final).read_bytes() == b"long" and (out / "manifest.json").read_bytes() == b"new manifest"
    out2 = tmp_path / "o2"
    staged_build(out2)
    final = "f" * 234
    tmp = f".{final}.{H1}.tmp"
    journal(out2, [[tmp, final], GOOD[1]], [])
    refused(out2, f"has {repr(tmp)[:77]}..., which is not a temp name of {final} in its directory")


@pytest.mark.parametrize("kind", ["dir", "link", "fifo"])
@pytest.mark.parametrize("where", ["temp", "final", "remove"])
def test_named_files_must_be_regular(tmp_path, kind, where):
    out = tmp_path / "o"
    staged_build(out)
    name = {"temp": f".a.safetensors.{H1}.tmp", "final": "a.safetensors", "remove": "b.safetensors"}[where]
    (out / name).unlink()
    if kind == "dir":
        (out / name).mkdir()
    elif kind == "link":
        (out / name).symlink_to(out / "config.json")
    else:
        os.mkfifo(out / name)
    journal(out, [GOOD[0], [f".config.json.{H2}.tmp", "config.json"], GOOD[1]], ["b.safetensors"])
    refused(out, f"{'removes' if where == 'remove' else 'names'} {name}, which is not a regular file")


def test_journal_that_is_not_json_or_too_big(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    (out / JOURNAL).write_bytes(b"[" * 100_000)  # deeper than the parser's recursion limit
    refused(out, "is not JSON")
    (out / JOURNAL).write_bytes(b"\xff")
    refused(out, "is not JSON")
    # a valid journal padded to exactly the limit is read; one byte more is refused
    body = json.dumps({"format": "shardc-switch", "version": 1, "renames": GOOD, "remove": []}).encode()
    (out / JOURNAL).write_bytes(body + b" " * ((4 << 20) + 1 - len(body)))
    before = listing(out)
    with pytest.raises(ManifestError, match="more than the limit of 4194304"):
        finish_switch(out)
    assert listing(out) == before
    (out / JOURNAL).write_bytes(body + b" " * ((4 << 20) - len(body)))
    assert finish_switch(out) is True
    assert (out / "a.safetensors").read_bytes() == b"new a" and (out / "manifest.json").read_bytes() == b"new manifest"
    assert (out / "config.json").read_bytes() == b"old config"  # not in this journal: kept


def test_journal_that_is_not_a_regular_file(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    (out / JOURNAL).mkdir()
    with pytest.raises(ManifestError) as e:
        finish_switch(out)
    assert e.value.message == f"switch journal {out / JOURNAL} is not a regular file (a link?); nothing was changed"
    (out / JOURNAL).rmdir()
    (tmp_path / "j").write_text("{}")
    (out / JOURNAL).symlink_to(tmp_path / "j")
    with pytest.raises(ManifestError, match="is not a regular file"):
        finish_switch(out)


def test_unreadable_directory_is_an_output_error(tmp_path):
    """A build directory that is a file: the journal cannot even be looked for (ENOTDIR)."""
    out = tmp_path / "o"
    out.write_text("a file")
    with pytest.raises(OutputError) as e:
        finish_switch(out)
    assert e.value.message == f"cannot read {out / JOURNAL}: Not a directory"
    assert e.value.hint == "fix the directory, then rerun" and e.value.exit_code == 1


def test_the_switch_in_its_states(tmp_path):
    """Roll forward from each state a kill can leave (the test arranges the files by hand): a
    rename already done, the manifest already renamed (nothing but the journal left to go)."""
    out = tmp_path / "o"
    staged_build(out)
    renames = [GOOD[0], [f".config.json.{H2}.tmp", "config.json"], GOOD[1]]
    os.replace(out / f".a.safetensors.{H1}.tmp", out / "a.safetensors")  # the first rename done
    (out / "manifest.json").unlink()  # and the old manifest gone
    apply_switch(out, renames, ["b.safetensors", "gone.bin"])
    assert listing(out) == NEW
    # the manifest renamed, the journal not yet removed: a stray temp (not the switch's) stays
    (out / f".config.json.{H2}.tmp").write_bytes(b"stray")
    (out / "b.safetensors").write_bytes(b"not removed")
    journal(out, renames, ["b.safetensors"])
    assert finish_switch(out) is True
    assert listing(out) == {**NEW, "b.safetensors": b"not removed", "config.json": b"stray"}


def test_an_empty_remove_and_one_file(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    journal(out, [GOOD[1]], [])
    assert finish_switch(out) is True
    assert (out / "manifest.json").read_bytes() == b"new manifest" and (out / "b.safetensors").exists()
    assert not (out / JOURNAL).exists()


def _child(fn) -> int:
    """Run ``fn`` in a forked child; its wait status (killed by a signal, or its exit code)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            fn()
        finally:
            os._exit(7)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.mark.parametrize("spec,at,killed", [
    ("switch:2", 2, True), ("switch:2", 1, False), ("switch:2", 3, False), ("switch:-1", -1, True),
    ("switch:0", 0, True), ("kill:2", 2, False), ("", 0, False), (None, 0, False), ("xswitch:2", 2, False),
])
def test_fault_hook(monkeypatch, spec, at, killed):
    monkeypatch.delenv("SHARDC_FAULT", raising=False)
    _fault(at)  # unset: nothing (and this process records the call)

    def run() -> None:
        if spec is not None:
            os.environ["SHARDC_FAULT"] = spec
        _fault(at)

    assert _child(run) == (-signal.SIGKILL if killed else 7)


@pytest.mark.parametrize("n,renamed", [(0, []), (1, ["a.safetensors"]), (2, ["a.safetensors", "config.json"])])
def test_the_switch_killed_after_n_renames(tmp_path, monkeypatch, n, renamed):
    """A forked child finishing a journal is SIGKILLed after its n-th rename: the old manifest is
    gone, exactly the first n files are in place, nothing is removed yet; this process then
    finishes the switch."""
    out = tmp_path / "o"
    content = staged_build(out)
    journal(out, [GOOD[0], [f".config.json.{H2}.tmp", "config.json"], GOOD[1]], ["b.safetensors"])
    monkeypatch.delenv("SHARDC_FAULT", raising=False)

    def run() -> None:
        os.environ["SHARDC_FAULT"] = f"switch:{n}"
        finish_switch(out)

    assert _child(run) == -signal.SIGKILL
    now = listing(out)
    assert "manifest.json" not in now and now["b.safetensors"] == b"old b" and JOURNAL in now
    for final, tmp in [("a.safetensors", f".a.safetensors.{H1}.tmp"), ("config.json", f".config.json.{H2}.tmp")]:
        if final in renamed:
            assert tmp not in now and now[final] == content[tmp]
        else:
            assert now[tmp] == content[tmp] and now[final] == content[final]
    assert finish_switch(out) is True
    assert listing(out) == NEW


def test_killed_after_the_manifest_rename(tmp_path, monkeypatch):
    out = tmp_path / "o"
    staged_build(out)
    journal(out, [GOOD[0], [f".config.json.{H2}.tmp", "config.json"], GOOD[1]], ["b.safetensors"])
    monkeypatch.delenv("SHARDC_FAULT", raising=False)

    def run() -> None:
        os.environ["SHARDC_FAULT"] = "switch:3"
        finish_switch(out)

    assert _child(run) == -signal.SIGKILL
    assert listing(out) == {**NEW, JOURNAL: (out / JOURNAL).read_bytes()}
    assert finish_switch(out) is True and listing(out) == NEW


def test_short_keeps_80_characters_and_cuts_81(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    for n, shown in [(78, repr("x" * 78)), (79, repr("x" * 79)[:77] + "...")]:  # reprs of 80 and 81
        journal(out, [["x" * n, "y"], GOOD[1]], [])
        refused(out, f"has {shown}, which is not a temp name of y in its directory")


def test_oversized_journal_line(tmp_path):
    out = tmp_path / "o"
    staged_build(out)
    (out / JOURNAL).write_bytes(b" " * ((4 << 20) + 1))
    with pytest.raises(ManifestError) as e:
        finish_switch(out)
    assert e.value.message == f"switch journal {out / JOURNAL} is 4194305 bytes, more than the limit of 4194304"


def test_the_fault_before_the_journal(tmp_path, monkeypatch):
    """SHARDC_FAULT=switch:-1 kills write_journal's process before the journal exists (a forked
    child, really SIGKILLed); any other point lets it write the journal."""
    monkeypatch.delenv("SHARDC_FAULT", raising=False)
    staged_build(tmp_path / "here")
    write(tmp_path / "here")  # unset: written (and mutmut sees this test reach write_journal)
    assert (tmp_path / "here" / JOURNAL).exists()
    for spec, killed in [("switch:-1", True), ("switch:1", False), ("switch:0", False)]:
        out = tmp_path / spec.replace(":", "_")
        staged_build(out)

        def run(spec: str = spec, out: Path = out) -> None:
            os.environ["SHARDC_FAULT"] = spec
            write(out)

        assert _child(run) == (-signal.SIGKILL if killed else 7)
        assert (out / JOURNAL).exists() is not killed


@pytest.fixture
def read_only_fs(tmpfs):
    """A real tmpfs, remounted read-only by the test (needs root, as test_build_output's does)."""
    return tmpfs("ro", "1M")


def test_a_disk_failure_during_the_switch_is_an_output_error(read_only_fs):
    """The switch's first step fails for real (EROFS): one OutputError, exit 1, the journal and
    every file as they were, for the rerun."""
    out = read_only_fs / "o"
    staged_build(out)
    journal(out, [GOOD[0], GOOD[1]], ["b.safetensors"])
    before = listing(out)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_fs)], check=True)
    with pytest.raises(OutputError) as e:
        finish_switch(out)
    assert e.value.message == f"cannot finish the interrupted switch in {out}: Read-only file system"
    assert e.value.hint == "fix the disk, then rerun the build: the switch is finished first"
    assert e.value.exit_code == 1 and listing(out) == before
