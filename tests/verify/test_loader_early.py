"""load_shard's early start (shardc/loader/early_start.py): a local CPU load starts the shard's chunk
reads before the checking modules are imported, and uses them only when they are exactly what the
validated manifest asks for. Every other case reads as before, and nothing is left running or open
when a load fails."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
from manifest_edits import reseal
from safetensors.torch import load_file
from tiny_builds import tiny_build

import shardc
from shardc.errors import LayoutError, VerifyMismatch
from shardc.loader import early_start
from shardc.loader import local as loader

ROOT = Path(__file__).resolve().parents[2]
S0, S1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A tiny tp=2 build in 4 KiB chunks (several chunks per shard), blake3 digests."""
    return tiny_build(tmp_path_factory.mktemp("early"), "early", chunk_size=4096,
                      group={"checkpoint": {"chunk_digest": "blake3"}})


@pytest.fixture
def copy(built, tmp_path) -> Path:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d


@pytest.fixture
def spy(monkeypatch) -> list:
    """What each early start was, and whether the loader used it: [(EarlyRead or None, used)]."""
    seen: list = []
    real_start, real_matches = early_start.start, early_start.EarlyRead.matches

    def start(*a):
        early = real_start(*a)
        seen.append([early, False])
        return early

    def matches(self, *a):
        ok = real_matches(self, *a)
        seen[-1][1] = ok
        return ok

    monkeypatch.setattr(early_start, "start", start)
    monkeypatch.setattr(early_start.EarlyRead, "matches", matches)
    return seen


def _loaders() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardc-load")]


def _same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(got[k].dtype == want[k].dtype and (got[k] == want[k]).all() for k in want)


def test_a_local_cpu_load_uses_its_early_reads(built, spy):
    got = shardc.load_shard(built, 1, 0, device="cpu")
    assert len(spy) == 1 and spy[0][0] is not None and spy[0][1], spy
    assert _same(got, load_file(built / S1))
    assert spy[0][0].fd == -1  # the loader took the descriptor and closed it
    assert not _loaders()


def test_a_damaged_chunk_is_named_through_the_early_reads(copy, spy):
    data = bytearray((copy / S0).read_bytes())
    data[3 * 4096 + 7] ^= 0x40
    (copy / S0).write_bytes(bytes(data))
    with pytest.raises(VerifyMismatch, match=r"blake3 of 1 of \d+ chunk\(s\) differs from the manifest: chunk 3 "):
        shardc.load_shard(copy, 0, 0, device="cpu")
    assert spy[0][1]  # the failure came from the early reads' digests
    assert not _loaders()


def test_reads_of_another_file_are_not_used(built):
    """Early reads that do not match the validated entry (here: rank 1's file, while rank 0 is
    loaded) are stopped and closed; the rank's own file is read and returned."""
    early = early_start.start(built / "manifest.json", None, 1, 0, 0, "cpu")
    assert early is not None and early.path.name == S1
    buffer = weakref.ref(early.reads.raw.untyped_storage())
    got = loader.load_shard(built, 0, 0, device="cpu", early=early)
    assert _same(got, load_file(built / S0))
    assert early.fd == -1 and not _loaders()
    gc.collect()
    assert buffer() is None  # the discarded reads' buffer is freed, not held while the file is read again


@pytest.mark.parametrize("field", ["size", "chunk_size", "chunks", "chunk_digest", "path"])
def test_every_field_must_match(built, field):
    """``matches`` compares the file path and every recorded fact of the reads with the entry."""
    entry = json.loads((built / "manifest.json").read_text())["shards"][S0]
    early = early_start.start(built, None, 0, 0, 0, "cpu")
    try:
        args = {"path": built / S0, "size": entry["size"], "chunk_size": entry["chunk_size"],
                "chunks": tuple(entry["chunks"]), "digest": entry["chunk_digest"]}
        assert early.matches(**args)
        changed = {"size": ("size", entry["size"] + 1), "chunk_size": ("chunk_size", 8192),
                   "chunks": ("chunks", (*entry["chunks"][:-1], "0" * 64)), "chunk_digest": ("digest", "sha256"),
                   "path": ("path", built / S1)}[field]
        assert not early.matches(**{**args, changed[0]: changed[1]})
    finally:
        early.close()
    assert not _loaders()


@pytest.mark.parametrize("where", ["manifest", "header"])
def test_a_failed_check_stops_the_early_reads(copy, spy, where):
    """A load that fails after its reads started leaves no reader thread running and no
    descriptor open: refused by the manifest's check against the plan (the reads are not used),
    or by the header check (they were: rank 1's bytes under rank 0's name, the entry resealed to
    them, so only the header's tensors and metadata tell)."""
    fds = len(os.listdir("/proc/self/fd"))
    man = json.loads((copy / "manifest.json").read_text())
    data = (copy / S1).read_bytes()
    (copy / S0).write_bytes(data)
    if where == "manifest":
        man["shards"][S0] = man["shards"][S1] | {"tp_rank": 0, "rank": 0}
    else:
        reseal(man["shards"][S0], data)
    (copy / "manifest.json").write_text(json.dumps(man))
    match = {"manifest": f"manifest entry {S0} tensor lm_head.weight", "header": S0}[where]
    with pytest.raises(VerifyMismatch, match=match) as e:
        shardc.load_shard(copy, 0, 0, device="cpu")
    assert (where == "manifest") == ("manifest entry" in e.value.message), e.value.message
    assert spy[-1][0] is not None and spy[-1][1] == (where == "header")
    assert spy[-1][0].fd == -1
    assert not _loaders()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_no_such_rank_starts_nothing(built, spy):
    with pytest.raises(LayoutError):
        shardc.load_shard(built, 7, 0, device="cpu")
    assert spy == [[None, False]]


def _hostile(d: Path, how: str) -> None:
    man = json.loads((d / "manifest.json").read_text())
    e = man["shards"][S0]
    if how == "name":
        man["shards"]["../" + S0] = man["shards"].pop(S0)
    elif how == "chunk_size":
        e["chunk_size"] = 0
    elif how == "chunks":
        e["chunks"] = e["chunks"][:-1]
    elif how == "digest":
        e["chunk_digest"] = "md5"
    elif how == "size":
        e["size"] = -1
    elif how == "list":
        man["shards"] = [e]
    elif how == "fifo":
        (d / S0).unlink()
        os.mkfifo(d / S0)
    elif how == "missing":
        (d / S0).unlink()
    elif how == "manifest-fifo":
        (d / "manifest.json").unlink()
        os.mkfifo(d / "manifest.json")
        return
    (d / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("how", ["name", "chunk_size", "chunks", "digest", "size", "list", "fifo", "missing",
                                 "manifest-fifo"])
def test_hostile_input_starts_nothing_and_is_still_refused(copy, spy, how):
    """An entry of the wrong shape, a path out of the directory, a FIFO: no early start (nothing
    opened outside the build, nothing blocks), and the checked path's one-line refusal."""
    _hostile(copy, how)
    with pytest.raises(shardc.errors.ShardcError):
        shardc.load_shard(copy, 0, 0, device="cpu")
    assert spy == [[None, False]]
    assert not _loaders()


def test_gpu_and_object_storage_loads_start_nothing_early(built):
    assert early_start.start(built, None, 0, 0, 0, "cuda:0") is None
    assert early_start.start("s3://bucket/b/manifest.json", None, 0, 0, 0, "cpu") is None
    assert early_start.start(built, None, True, 0, 0, "cpu") is None  # a bool is not a rank


def test_the_early_start_imports_nothing_heavy():
    """What makes it early: formats/early_start.py and what it imports load none of layout, the
    manifest reader or verify (those are what it overlaps)."""
    code = ("import sys, shardc.loader.early_start\n"
            "print(sorted(m for m in sys.modules if m.startswith('shardc.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.replace("'", '"')) == [
        "shardc.digests", "shardc.errors", "shardc.formats", "shardc.formats.chunk_digests", "shardc.formats.direct_io",
        "shardc.formats.manifest_raw", "shardc.loader", "shardc.loader.early_start", "shardc.loader.sources",
        "shardc.version"]
