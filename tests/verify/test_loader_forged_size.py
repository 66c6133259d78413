"""A manifest entry's size held against the plan's Layout (issue #41 item 12): a forged entry that
claims 4 GiB for a shard of 76 KB (a sparse file of that size, every chunk digest forged) is
refused by ``load_shard`` before any byte of the shard is read, naming ``shards.<file>.size`` and
the size the Layout gives the rank (any other size too, one byte off included), and reported by
``verify`` without hashing the claim; the loader's early start, which reads before the manifest is
checked, reads and holds a bounded window, never the claimed size.

What is read is counted by the kernel (``rchar`` of /proc/self/io: every byte this process's
threads read through read/pread/preadv, O_DIRECT included), and what is held by its high-water
mark of resident memory (``VmHWM``, in a process of its own): both deterministic bounds that the
old early start, which queued every claimed chunk at once, could not meet."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_run import shardc
from manifest_edits import sealed
from tiny_builds import tiny_build

import shardc as shardc_lib
from shardc.errors import ManifestError, VerifyMismatch
from shardc.loader import early_start
from shardc.loader import local as loader
from shardc.verify.checks import verify_build

ROOT = Path(__file__).resolve().parents[2]
S0, S1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"
CLAIM = 4 << 30  # what the forged entry claims
CHUNK = 16 << 20  # the builds' chunk size, which the forged entry keeps
MiB = 1 << 20


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The loaders' tiny tp=2 build, in the builds' 16 MiB chunks (one chunk per shard)."""
    return tiny_build(tmp_path_factory.mktemp("forged"), "forged")


@pytest.fixture(scope="module")
def real_size(built) -> int:
    """What the build wrote for rank 0: the figure the Layout must give."""
    return (built / S0).stat().st_size


def _copy(built: Path, tmp_path: Path) -> tuple[Path, dict]:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d, json.loads((d / "manifest.json").read_text())


def _forge(d: Path, man: dict, *, size: int = CLAIM, chunk_size: int = CHUNK, version: int = 3) -> None:
    """Rank 0's shard replaced by a sparse file of ``size`` bytes (no block of it on the disk) and
    its entry by one claiming that size, every digest forged; ``version`` 2 drops the chunk
    digests, 1 lists the shards (each naming its file)."""
    with open(d / S0, "wb") as f:
        f.truncate(size)
    e = man["shards"][S0]
    e["size"], e["sha256"] = size, "0" * 64
    e["chunk_size"], e["chunks"] = chunk_size, ["0" * 64] * -(-size // chunk_size)
    if version < 3:
        man["format_version"] = version
        for entry in man["shards"].values():
            del entry["chunk_size"], entry["chunks"]
    if version == 1:
        man["shards"] = [{"file": name, **entry} for name, entry in man["shards"].items()]
    (d / "manifest.json").write_text(json.dumps(man))


def _rchar() -> int:
    """Bytes this process (all its threads) has read so far."""
    return next(int(line.split()[1]) for line in Path("/proc/self/io").read_text().splitlines()
                if line.startswith("rchar:"))


def _loaders() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardc-load")]


def _size_line(claimed: int, real: int) -> str:
    return f"is {claimed} bytes; the plan's Layout gives this rank's shard {real} bytes ("


@pytest.mark.parametrize("version", [3, 2, 1])
def test_a_forged_size_is_refused_before_the_shard_is_read(built, real_size, tmp_path, version):
    """The checked path (no early start) refuses before it opens the shard: what it read is the
    manifest, not one piece (1 MiB) of the shard; versions 2 and 1 (no chunk digests) too."""
    d, man = _copy(built, tmp_path)
    _forge(d, man, version=version)
    before = _rchar()
    with pytest.raises(VerifyMismatch) as e:
        loader.load_shard(d, 0, 0, device="cpu")
    read = _rchar() - before
    assert e.value.key == f"shards.{S0}.size"
    assert e.value.message.startswith(_size_line(CLAIM, real_size)), e.value.message
    assert read < (d / "manifest.json").stat().st_size + MiB // 2, read
    assert shardc_lib.load_shard(d, 1, 0, device="cpu")  # the other rank's entry is sound


def test_the_early_start_reads_a_window_not_the_claim(built, real_size, tmp_path):
    """Through the facade, whose early start reads before the manifest is checked: the same line,
    and at most the window read (the old early start queued all 256 claimed chunks)."""
    d, man = _copy(built, tmp_path)
    _forge(d, man)
    fds = len(os.listdir("/proc/self/fd"))
    before = _rchar()
    with pytest.raises(VerifyMismatch, match=r"the plan's Layout gives this rank's shard \d+ bytes") as e:
        shardc_lib.load_shard(d, 0, 0, device="cpu")
    read = _rchar() - before
    assert e.value.key == f"shards.{S0}.size" and str(real_size) in e.value.message
    assert early_start.WINDOW == 256 * MiB
    assert read <= early_start.WINDOW + 2 * MiB, read
    assert not _loaders() and len(os.listdir("/proc/self/fd")) == fds


def test_the_window_is_all_that_is_queued_before_the_check(built, tmp_path):
    """Deterministically the worst case: every early read finished before the check runs. 16
    chunks of the 256 claimed were queued, and the rest never are once the check refuses."""
    d, man = _copy(built, tmp_path)
    _forge(d, man)
    early = early_start.start(d, None, 0, 0, 0, "cpu")
    assert early is not None
    try:
        assert len(early.reads.queued) == early_start.WINDOW // CHUNK == 16
        for f in early.reads.queued:
            assert f.result()[1] is False  # read, and its forged digest does not match
        with pytest.raises(VerifyMismatch, match=f"is {CLAIM} bytes") as e:
            loader.load_shard(d, 0, 0, device="cpu", early=early)
        assert e.value.key == f"shards.{S0}.size"
        assert len(early.reads.queued) <= 16
    finally:
        early.close()
    assert early.fd == -1 and not _loaders()


_RSS = """
import json, sys, time
from pathlib import Path
import torch  # the process's own baseline: the loader's imports are not the data it holds
import shardc
from shardc.errors import VerifyMismatch
from shardc.loader import early_start

def hwm():
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith("VmHWM:"))

d, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "warm":  # every module imported first: the window is read in full before the check
    import shardc.loader.local, shardc.verify.checks, shardc.formats.manifest
base = hwm()
if mode == "warm":
    early = early_start.start(d, None, 0, 0, 0, "cpu")
    [f.result() for f in early.reads.queued]
    try:
        shardc.loader.local.load_shard(d, 0, 0, device="cpu", early=early)
    except VerifyMismatch as exc:
        print(json.dumps({"grew": hwm() - base, "key": exc.key}))
    finally:
        early.close()
else:  # a cold start through the facade, as a serving runtime calls it
    try:
        shardc.load_shard(d, 0, 0, device="cpu")
    except VerifyMismatch as exc:
        print(json.dumps({"grew": hwm() - base, "key": exc.key}))
"""


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_peak_memory_stays_bounded(built, tmp_path, mode):
    """The high-water mark of resident memory grows by at most the window and some slack (the
    claimed 4 GiB buffer is address space: only the pages read into are memory), measured in a
    process of its own after torch is imported. Before, 0.75-2.1 GB was held."""
    d, man = _copy(built, tmp_path)
    _forge(d, man)
    out = subprocess.run([sys.executable, "-c", _RSS, str(d), mode], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["key"] == f"shards.{S0}.size"
    assert got["grew"] < 300_000_000, got


def test_a_size_that_agrees_with_a_chunk_count_that_does_not(built, real_size, tmp_path):
    """The size is the Layout's, the chunk list one longer than that size holds: the manifest's
    reader refuses it (``.chunks``), nothing started early and nothing of the shard read."""
    d, man = _copy(built, tmp_path)
    man["shards"][S0]["chunks"].append("0" * 64)
    (d / "manifest.json").write_text(json.dumps(man))
    assert early_start.start(d, None, 0, 0, 0, "cpu") is None
    before = _rchar()
    with pytest.raises(ManifestError, match=r"has \d+ entries|expected|chunks") as e:
        shardc_lib.load_shard(d, 0, 0, device="cpu")
    assert e.value.key == f"shards.{S0}.chunks", e.value.key
    assert _rchar() - before < (d / "manifest.json").stat().st_size + MiB // 2


@pytest.mark.parametrize("delta", [1, -1])
def test_a_size_off_by_one_is_refused(built, real_size, tmp_path, delta):
    """The file one byte longer (or shorter) and its entry resealed to it (size, sha256, chunks all
    agree with the bytes on disk): only the Layout can tell, and it does, before the header is read."""
    d, man = _copy(built, tmp_path)
    data = (d / S0).read_bytes()
    data = data + b"\0" if delta > 0 else data[:-1]
    (d / S0).write_bytes(data)
    man["shards"][S0].update(sealed(data, man["shards"][S0]["chunk_size"]))
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(VerifyMismatch) as e:
        shardc_lib.load_shard(d, 0, 0, device="cpu")
    assert e.value.key == f"shards.{S0}.size"
    assert e.value.message.startswith(_size_line(real_size + delta, real_size)), e.value.message
    assert hashlib.sha256(data).hexdigest() == man["shards"][S0]["sha256"]


def test_verify_reports_a_forged_size_without_hashing_it(built, real_size, tmp_path):
    """verify (the library call and the CLI) reports the same figure for the rank, exit 1, and
    hashes none of the 4 GiB claimed; the other rank is checked as usual."""
    d, man = _copy(built, tmp_path)
    _forge(d, man)
    from shardc.formats.manifest import load

    before = _rchar()
    report = verify_build(load(d / "manifest.json"), d)
    assert _rchar() - before < MiB
    want = f"{S0}: shards.{S0}.size {_size_line(CLAIM, real_size)}"
    assert [r.ok for r in report.ranks] == [False, True] and report.problems[0].startswith(want), report.problems
    r = shardc("verify", "--manifest", d / "manifest.json", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert want in r.stderr, r.stderr


def test_a_larger_claim_is_not_hashed_and_a_smaller_one_is_left_to_the_header(built, real_size, tmp_path):
    """verify does not hash by a claim above the Layout's size (a file grown by one byte, its entry
    resealed): the line gives the figure. One byte short, the header check names it (the data
    ends past the file's end), as it names a missing tensor: what the file holds. (load_shard
    refuses both by their size: test_a_size_off_by_one_is_refused.)"""
    from shardc.formats.manifest import load

    for delta in (1, -1):
        d, man = _copy(built, tmp_path / str(delta))
        data = (d / S0).read_bytes()
        data = data + b"\0" if delta > 0 else data[:-1]
        (d / S0).write_bytes(data)
        man["shards"][S0].update(sealed(data, man["shards"][S0]["chunk_size"]))
        (d / "manifest.json").write_text(json.dumps(man))
        problems = verify_build(load(d / "manifest.json"), d).problems
        if delta > 0:  # the figure first, then what the header says of the byte too many
            assert problems[0].startswith(f"{S0}: shards.{S0}.size {_size_line(real_size + 1, real_size)}")
            assert list(problems[1:]) == [f"{S0}: safetensors data layout: the tensors' data ends at 74368, the file's "
                                    "data section holds 74369 bytes"], problems
        else:
            assert list(problems) == [f"{S0}: safetensors data layout: the tensors' data ends at 74368, the file's data "
                                "section holds 74367 bytes (the file is cut short)"], problems


def test_no_early_start_beyond_a_window_or_the_host(built, tmp_path):
    """A chunk larger than the window, or a claim larger than the host's memory, starts nothing
    early (the checked path refuses the size); nothing is allocated at such a claim."""
    d, man = _copy(built, tmp_path)
    _forge(d, man, chunk_size=512 * MiB)
    assert early_start.start(d, None, 0, 0, 0, "cpu") is None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    big = -(-(ram + 1) // (1 << 30)) << 30  # whole GiB, more than the host has
    _forge(d, json.loads((d / "manifest.json").read_text()), size=big, chunk_size=1 << 30)
    assert early_start.start(d, None, 0, 0, 0, "cpu") is None
    with pytest.raises(VerifyMismatch, match=f"is {big} bytes"):
        shardc_lib.load_shard(d, 0, 0, device="cpu")


def test_a_shard_larger_than_the_window_loads_through_it(tmp_path, monkeypatch):
    """A sound load whose shard is more chunks than the window: the window is read early, the rest
    queued once the entry matched, and the tensors are the file's (a window of two 4 KiB chunks)."""
    from safetensors.torch import load_file

    d = tiny_build(tmp_path, "window", chunk_size=4096)
    monkeypatch.setattr(early_start, "WINDOW", 8192)
    early = early_start.start(d, None, 0, 0, 0, "cpu")
    assert early is not None and early.source.count > 2 and len(early.reads.queued) == 2
    try:
        got = loader.load_shard(d, 0, 0, device="cpu", early=early)
    finally:
        early.close()
    assert early.fd == -1 and len(early.reads.queued) == 0  # taken, then let go of once done
    want = load_file(d / S0)
    assert sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
    assert not _loaders()
