"""load_shard against files that change under it and arguments of the wrong kind (issue #25 item 4).

What was hashed is what is returned: the shard is opened once and read into memory of the
loader's own. The races are made deterministic by running a real file operation (os.replace of
another real shard, an in-place write, a truncation, an append) from inside the loader's own read
call at a chosen moment; the oracles are the bytes the test kept (safetensors ``load`` of them,
hashlib of the file), never the loader's own output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import shardc as shardc_cli
from manifest_edits import reseal
from tiny_builds import tiny_build

torch = pytest.importorskip("torch")

import shardc  # noqa: E402
from shardc.errors import DeviceError, LayoutError, ManifestError, ShardcError, VerifyMismatch  # noqa: E402
from shardc.loader import sources, upgrade  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
S0, S1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One tiny real build, tp=2 bf16: two valid shards of one size."""
    out = tiny_build(tmp_path_factory.mktemp("hostile-loader"), "hl")
    assert (out / S0).stat().st_size == (out / S1).stat().st_size
    return out


@pytest.fixture(scope="module")
def built_chunked(tmp_path_factory) -> Path:
    """The same build cut into 4 KiB chunks (format_version 3): several chunks per tiny shard."""
    return tiny_build(tmp_path_factory.mktemp("hostile-loader-chunked"), "hl", chunk_size=4096)


@pytest.fixture
def build_dir(built, tmp_path) -> Path:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d


@pytest.fixture(params=["whole", "chunked"])
def any_dir(request, built, tmp_path) -> Path:
    """A build of either kind: ``whole``, its manifest without chunk digests (format_version 2:
    upgraded on read, one pass for the sha256 and the chunk digests, loader/upgrade.py, then the
    chunk engine); ``chunked``, in 4 KiB chunks (loader/sinks.py)."""
    d = tmp_path / "b"
    if request.param == "chunked":
        shutil.copytree(request.getfixturevalue("built_chunked"), d)
        return d
    shutil.copytree(built, d)
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = 2
    for entry in m["shards"].values():
        del entry["chunk_size"], entry["chunks"]
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def _chunk_line(path: Path, i: int, chunk: int) -> str:
    """The loader's line for one damaged chunk, worked out here from the file's header: the
    tensors whose bytes touch chunk ``i`` (``<header>`` when the chunk holds header bytes)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    lo, hi = i * chunk, min(len(raw), (i + 1) * chunk)
    held = sorted(k for k, v in header.items() if k != "__metadata__"
                  and 8 + n + v["data_offsets"][0] < hi and lo < 8 + n + v["data_offsets"][1])
    held = (["<header>"] if lo < 8 + n else []) + held
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return (f"{path.name}: sha256 of 1 of {-(-len(raw) // chunk)} chunk(s) differs from the manifest: chunk {i} "
            f"(bytes {lo}..{hi}: {shown}) (corrupted bytes)")


def _chunked(d: Path) -> bool:
    return "chunks" in json.loads((d / "manifest.json").read_text())["shards"][S0]


def _expected(data: bytes) -> dict:
    """The tensors of a shard's bytes, by the safetensors library (the oracle)."""
    from safetensors.torch import load

    return load(data)


def _same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
        for k in want)


def _hook(monkeypatch, when, action) -> list:
    """Run ``action(fd)`` once, inside the loader's reads: before the first read of the data
    (``when="start"``: a version 2 shard's upgrade pass, loader/upgrade.py, or a chunked shard's
    second chunk) or after the read of the last chunk (``"end"``: the chunk engine's, which both
    kinds end with)."""
    done: list = []
    real_piece = upgrade.read_piece

    def read_piece(fd, mv, offset):
        if when == "start" and not done:
            done.append(action(fd))
        return real_piece(fd, mv, offset)

    monkeypatch.setattr(upgrade, "read_piece", read_piece)
    monkeypatch.setattr(upgrade, "PIECE", 4096)  # several pieces even for a tiny shard

    real_chunk = sources.FileChunkReads.fetch  # the chunked pass: before the first data chunk, after the last

    def fetch_chunk(self, i, mv):
        if when == "start" and not done and i >= 1:
            done.append(action(self.fd))
        got = real_chunk(self, i, mv)
        if when == "end" and not done and i == self.count - 1:
            done.append(action(self.fd))
        return got

    monkeypatch.setattr(sources.FileChunkReads, "fetch", fetch_chunk)
    monkeypatch.setattr(sources.FileChunkReads, "parallel", lambda self: 1)  # chunks in order: the moment is exact
    return done


def _poke(path: Path, offset: int) -> None:
    """Flip one byte of ``path`` in place (the same inode, as a writer with the file open would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- what was hashed is what is returned -------------------------------------------------------------------
def test_replaced_after_the_hash_returns_the_checked_bytes(any_dir, monkeypatch):
    """Another valid shard os.replace'd over the file once every byte was hashed: the tensors are
    still those of the bytes hashed (the old loader mapped the file again by name and returned the
    other rank's)."""
    f0 = any_dir / S0
    want = _expected(f0.read_bytes())
    other = any_dir / "other.safetensors"
    shutil.copy(any_dir / S1, other)
    done = _hook(monkeypatch, "end", lambda f: os.replace(other, f0))
    got = shardc.load_shard(any_dir, 0, 0, device="cpu")
    assert done and f0.read_bytes() == (any_dir / S1).read_bytes()  # the replace did happen
    assert _same(got, want) and not _same(got, _expected(f0.read_bytes()))


def test_rewritten_in_place_ahead_of_the_read_is_a_mismatch(any_dir, monkeypatch):
    """A byte of the last tensor flipped in place before the data is read: it is hashed as read,
    and the sha256 mismatch (the hash of the file as it now is) names the file; chunked, the
    last chunk, its byte range and the tensor in it."""
    f0 = any_dir / S0
    want = hashlib.sha256(f0.read_bytes()).hexdigest()
    size = f0.stat().st_size
    _hook(monkeypatch, "start", lambda f: _poke(f0, size - 3))
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(any_dir, 0, 0, device="cpu")
    now = hashlib.sha256(f0.read_bytes()).hexdigest()
    assert now != want
    if not _chunked(any_dir):
        assert e.value.message == f"{S0}: sha256 {now[:16]}..., expected {want[:16]}... (corrupted bytes)"
        assert e.value.hint == "run shardc verify for the full report"
        return
    assert e.value.message == _chunk_line(f0, -(-size // 4096) - 1, 4096)
    assert e.value.hint == "re-pull the shard, or rebuild it; shardc verify gives the full report"


def test_rewritten_in_place_behind_the_read_is_not_returned(any_dir, monkeypatch):
    """A byte flipped in place once it was read (same inode, so a mapping of the file would show
    it): the tensors hold the bytes that were hashed, not the file's new contents."""
    f0 = any_dir / S0
    want = _expected(f0.read_bytes())
    done = _hook(monkeypatch, "end", lambda f: _poke(f0, f0.stat().st_size - 3))
    got = shardc.load_shard(any_dir, 0, 0, device="cpu")
    assert done and _same(got, want) and not _same(got, _expected(f0.read_bytes()))


@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_size_change_while_read_is_a_mismatch(any_dir, monkeypatch, change):
    """Truncated (in place) or appended to while the data is read: one VerifyMismatch line."""
    f0 = any_dir / S0
    size = f0.stat().st_size

    def act(f):
        if change == "shrink":
            os.truncate(f0, size - 5000)
        else:
            with open(f0, "ab") as g:
                g.write(b"\0" * 10)

    _hook(monkeypatch, "start", act)
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(any_dir, 0, 0, device="cpu")
    assert e.value.message == f"{f0}: file changed size while it was read"
    assert e.value.hint == "is something rewriting it?"


def test_file_changed_after_load_changes_nothing_returned(build_dir):
    """In a child process: load, then truncate the file in place to 8 bytes and rewrite it: the
    tensors still equal the bytes the parent kept (a mapping would fault with SIGBUS here)."""
    f0 = build_dir / S0
    keep = build_dir.parent / "kept.safetensors"
    shutil.copy(f0, keep)
    code = f"""
import os, shardc, torch
from safetensors.torch import load_file
t = shardc.load_shard({str(build_dir)!r}, 0, 0, device="cpu")
os.truncate({str(f0)!r}, 8)
with open({str(f0)!r}, "r+b") as f:
    f.write(b"\\xff" * 8)
want = load_file({str(keep)!r})
print(sorted(t) == sorted(want) and all(torch.equal(t[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (p.returncode, p.stdout) == (0, "True\n"), p.stderr[-2000:]


def test_shard_name_that_is_not_a_regular_file(build_dir):
    """A FIFO at the shard's name is refused at once (not waited on); a directory too."""
    f0 = build_dir / S0
    f0.unlink()
    os.mkfifo(f0)
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert (e.value.message, e.value.hint) == (f"{S0}: not a regular file (at {f0})", "re-pull the shard")
    f0.unlink()
    f0.mkdir()
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert (e.value.message, e.value.hint) == (f"{S0}: cannot be read (Is a directory)", "re-pull the shard")
    f0.rmdir()
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert e.value.message == f"{S0}: missing (expected at {f0})"


def test_header_checked_on_the_bytes_read(build_dir):
    """Rank 1's shard under rank 0's name (its manifest entry re-hashed to match): the header check,
    on the one descriptor's bytes, refuses it before the data is read."""
    f0 = build_dir / S0
    shutil.copy(build_dir / S1, f0)
    m = json.loads((build_dir / "manifest.json").read_text())
    reseal(m["shards"][S0], f0.read_bytes())
    (build_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert e.value.message == (f"{S0}: metadata shardc.tp_rank is '1', expected '0' "
                               "(a shard of another plan or rank?)")
    assert e.value.hint == "run shardc verify for the full report"


# -- hostile arguments ----------------------------------------------------------------------------------------
def test_hostile_arguments_are_one_line_errors(built, tmp_path):
    """Wrong types, ranks out of range, a manifest of the wrong kind: a ShardcError each, the exact
    one line (key, value, hint) written out here; never a TypeError or AttributeError from inside."""
    d = str(built)
    man = json.loads((built / "manifest.json").read_text())
    ints = " (hint: load_shard(manifest, tp_rank, pp_stage) takes the ranks as ints)"
    ranks = " (hint: tp ranks 0..1, pp stages 0..0)"
    kinds = " (hint: pass the manifest.json that shardc build wrote, or its directory)"
    where = " (hint: pass the directory holding the shard files)"
    text = " (hint: pass the path of manifest.json, or the parsed dict (json.loads) with directory=)"
    build = " (hint: pass the manifest.json that shardc build wrote)"
    cases = [
        ((d, "0", 0), {}, LayoutError, "tp_rank: is '0' (str), expected an int" + ints),
        ((d, 0, 0.0), {}, LayoutError, "pp_stage: is 0.0 (float), expected an int" + ints),
        ((d, True, 0), {}, LayoutError, "tp_rank: is True (bool), expected an int" + ints),
        ((d, None, 0), {}, LayoutError, "tp_rank: is None (NoneType), expected an int" + ints),
        ((d, 2, 0), {}, LayoutError, "tp_rank: rank tp=2 pp=0 is outside tp_degree=2 pp_degree=1" + ranks),
        ((d, 0, -1), {}, LayoutError, "tp_rank: rank tp=0 pp=-1 is outside tp_degree=2 pp_degree=1" + ranks),
        ((d, 10**30, 0), {}, LayoutError, f"tp_rank: rank tp={10**30} pp=0 is outside tp_degree=2 pp_degree=1" + ranks),
        ((d, 0, 0), {"device": 5}, DeviceError,
         'device: is 5 (int), expected a string (hint: device="cuda", "cuda:N" or "cpu")'),
        ((d, 0, 0), {"device": "tpu"}, DeviceError, "device: 'tpu' is not cpu, cuda or cuda:N"),
        ((d, 0, 0), {"directory": 5}, ManifestError, "directory: is 5 (int), expected a path" + where),
        ((d, 0, 0), {"directory": "a\0b"}, ManifestError, "directory: is 'a\\x00b' (str), expected a path" + where),
        ((man, 0, 0), {}, ManifestError, "directory: load_shard of a manifest dict needs directory=" + where),
        ((123, 0, 0), {}, ManifestError, "manifest: is int, expected a Manifest, a manifest dict or a path" + kinds),
        ((None, 0, 0), {}, ManifestError, "manifest: is NoneType, expected a Manifest, a manifest dict or a path" + kinds),
        (([man], 0, 0), {}, ManifestError, "manifest: is list, expected a Manifest, a manifest dict or a path" + kinds),
        ((b"x", 0, 0), {}, ManifestError, "manifest: is bytes, expected a Manifest, a manifest dict or a path" + kinds),
        (({"format": "x"}, 0, 0), {"directory": d}, ManifestError, "manifest is not a shardc manifest" + build),
        (({**man, "format_version": 9}, 0, 0), {"directory": d}, ManifestError,
         "manifest has format_version 9; this shardc reads 1, 2, 3 and 4 (hint: use the shardc version that wrote it)"),
        ((str(built / S0), 0, 0), {}, ManifestError, f"{built / S0} is not JSON" + build),
        ((json.dumps(man), 0, 0), {}, ManifestError,
         "manifest: is '{\"files\": [{\"name\": \"config.json\", \"sha2'..., not a path" + text),
        ((json.dumps(man, indent=1), 0, 0), {}, ManifestError,
         "manifest: is '{\\n \"files\": [\\n  {\\n   \"name\": \"config.jso'..., not a path" + text),
        ((" {}", 0, 0), {}, ManifestError, "manifest: is ' {}'..., not a path" + text),
        (("a\nb", 0, 0), {}, ManifestError, "manifest: is 'a\\nb'..., not a path" + text),
        (("a\0b", 0, 0), {}, ManifestError, "manifest: is 'a\\x00b'..., not a path" + text),
        (("x" * 5000, 0, 0), {}, ManifestError,
         "cannot read manifest " + "x" * 5000 + ": File name too long (hint: check the path)"),
        ((str(tmp_path / "nowhere.json"), 0, 0), {}, ManifestError,
         f"cannot read manifest {tmp_path / 'nowhere.json'}: No such file or directory (hint: check the path)"),
        ((f"file://{built}", 0, 0), {"directory": "/nonexistent"}, VerifyMismatch,
         f"{S0}: missing (expected at /nonexistent/{S0}) (hint: shardc pull it, or pass directory=)"),
    ]
    for args, kwargs, kind, want in cases:
        with pytest.raises(ShardcError) as e:
            shardc.load_shard(*args, **{"device": "cpu", **kwargs})
        assert (type(e.value), e.value.one_line()) == (kind, want), (args, kwargs)
    assert sorted(shardc.load_shard(Path(d), 1, 0, device="cpu"))  # and the real call still works
    assert sorted(shardc.load_shard(f"file://{built / 'manifest.json'}", 1, 0, device="cpu"))


def test_run_cli_says_one_line_for_a_shard_rewritten_in_place(build_dir):
    """The CLI's load_shard caller (``shardc run``): a shard rewritten in place since the build is
    the exact one line, exit 1, naming the file, the chunk (a tiny shard is one) and its tensors."""
    f0 = build_dir / S0
    _poke(f0, f0.stat().st_size - 3)
    p = shardc_cli("run", "--manifest", build_dir / "manifest.json", "--prompt-ids", "1,2", "--device", "cpu")
    line = (f"error: rank 0 (tp 0, pp 0): {_chunk_line(f0, 0, 16 << 20)} "
            "(hint: re-pull the shard, or rebuild it; shardc verify gives the full report)")
    assert (p.returncode, p.stderr.strip().splitlines()[-1:]) == (1, [line]), p.stdout + p.stderr


def test_manifest_records_checked_before_the_file(build_dir):
    """The manifest's own record of a tensor edited (the shard intact): load_shard refuses it with
    the manifest-against-Layout line, exit-1 kind, before the file is opened."""
    m = json.loads((build_dir / "manifest.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    m["shards"][S0]["tensors"][name]["shape"] = [24, 64]
    m["shards"][S0]["tensors"][name.replace("layers.0", "layers.1")]["shape"] = [24, 64]  # the second problem
    (build_dir / "manifest.json").write_text(json.dumps(m))
    (build_dir / S0).unlink()  # not reached: the manifest is refused first
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert e.value.message.startswith(f"manifest entry {S0} tensor {name}: expected ")  # the first problem
    assert e.value.hint == "run shardc verify for the full report"
    assert e.value.message.endswith("'shape': [24, 64], 'source': 'model.layers.0.mlp.up_proj.weight', "
                                    "'split': 'column', 'start': 0, 'stop': 48}")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the no-GPU answer")
def test_default_device_needs_one_gpu_named_by_plan(built):
    """device defaults to cuda: on a node without GPUs, the plan's name and one GPU are named."""
    with pytest.raises(DeviceError) as e:
        shardc.load_shard(built, 0, 0)
    assert e.value.message == "plan hl needs 1 GPU on this node; 0 are visible"


def test_size_and_unparsable_header_lines(build_dir):
    """A shard cut short (the manifest's size stands) and one whose header length was overwritten
    (same size, so only the header check sees it): the exact lines."""
    f0 = build_dir / S0
    data = f0.read_bytes()
    f0.write_bytes(data[:-10])
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert e.value.one_line() == (f"{S0}: size {len(data) - 10} bytes, expected {len(data)} (truncated or "
                                  "replaced?) (hint: re-pull the shard)")
    f0.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(VerifyMismatch) as e:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert e.value.one_line() == (f"{S0}: safetensors header does not parse (file shorter than its header "
                                  "length says) (hint: run shardc verify for the full report)")


def test_load_emits_no_warning(built):
    """A serving runtime's log gets nothing from a clean load: no Python warning is raised."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(shardc.load_shard(built, 0, 0, device="cpu"))
