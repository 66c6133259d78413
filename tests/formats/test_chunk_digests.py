"""Chunk digests (issue #30 item 1, docs/architecture.md §3.3): the writer cuts them while it
writes, the manifest (format_version 3) records and bounds them, verify and load_shard check every
chunk on all cores and name a damaged chunk and the tensors in it.

Oracles: hashlib over slices of the file's bytes cut here, the safetensors library's own reading
of the file, the header parsed here."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from manifest_edits import edit_at, reseal
from plan_helpers import plan as make_plan

from shardc.errors import ManifestError, VerifyMismatch

CHUNK = 4096
S0 = "model-tp00-pp00.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A tiny tp=1 build in 4 KiB chunks whose header alone is more than one chunk."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.formats import chunk_digests as chunks

    root = tmp_path_factory.mktemp("chunks")
    src = write_checkpoint(root / "src", llama_config(num_layers=6, hidden_size=32, intermediate_size=64,
                                                      num_heads=4, num_kv_heads=2, vocab_size=64))
    plan = make_plan(1, name="ck", source=src)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks, "CHUNK_SIZE", CHUNK)
        out = build(plan, out_dir=root / "b").out_dir
    raw = (out / S0).read_bytes()
    assert 8 + int.from_bytes(raw[:8], "little") > CHUNK and len(raw) > 4 * CHUNK  # header spans chunks
    return out


@pytest.fixture
def build_dir(built, tmp_path) -> Path:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d


def _oracle_chunks(data: bytes, chunk: int) -> list[str]:
    return [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]


def test_writer_cuts_chunks_across_its_staging_buffers(tmp_path, monkeypatch):
    """Staging buffers of 8 KiB and chunks of 12 KiB (neither divides the other), a file whose end
    is O_DIRECT padding: the digests are those of the file's own bytes, the padding not hashed."""
    from shardc.formats import safetensors

    monkeypatch.setattr(safetensors, "STAGE_BYTES", 8192)
    payload = bytes(range(256)) * 150  # 38400 bytes of F32
    w = safetensors.ShardWriter(tmp_path / "x.safetensors", [("t", "F32", [len(payload) // 4])], {},
                                chunk_size=3 * CHUNK)
    w.write(payload)
    size, sha = w.commit()
    data = (tmp_path / "x.safetensors").read_bytes()
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert w.chunks == _oracle_chunks(data, 3 * CHUNK) and len(w.chunks) == 4


def test_build_records_every_chunk(built):
    m = json.loads((built / "manifest.json").read_text())
    entry = m["shards"][S0]
    data = (built / S0).read_bytes()
    assert (m["format_version"], entry["chunk_size"]) == (3, CHUNK)
    assert entry["chunks"] == _oracle_chunks(data, CHUNK)


@pytest.mark.parametrize(("path", "value", "key", "says"), [
    (("chunk_size",), 0, "chunk_size", "is 0; a chunk size is a multiple of 4096 bytes from 4096 to 1073741824"),
    (("chunk_size",), 1 << 31, "chunk_size", "is 2147483648; a chunk size is a multiple of 4096"),
    (("chunk_size",), 5000, "chunk_size", "is 5000; a chunk size is a multiple of 4096"),
    (("chunk_size",), True, "chunk_size", "is True, expected int"),
    (("chunk_size",), KeyError, "chunk_size", "is missing"),
    (("chunk_size",), 8192, "chunks", "digest(s); "),  # the list no longer fits the size
    (("chunks",), ["0" * 64], "chunks", "lists 1 digest(s); "),
    (("chunks", 1), "xyz", "chunks[1]", "is 'xyz', expected 64 hex digits"),
])
def test_bad_chunk_records_are_one_line_exit_2(built, tmp_path, path, value, key, says):
    """Each a ManifestError naming the key; through the CLI one line on stderr, exit 2, before any
    shard is read."""
    from click.testing import CliRunner

    from shardc.cli import main
    from shardc.formats.manifest import load

    m = json.loads((built / "manifest.json").read_text())
    edit_at(m, ("shards", S0, *path), value)
    d = tmp_path / "b"
    shutil.copytree(built, d)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError) as exc:
        load(d / "manifest.json")
    assert exc.value.key == f"shards.{S0}.{key}" and says in exc.value.message
    r = CliRunner().invoke(main, ["verify", "--manifest", str(d / "manifest.json")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and f"shards.{S0}.{key}" in r.stderr, r.output


@pytest.mark.parametrize(("version", "strip", "key"), [
    (3, True, f"shards.{S0}.chunk_size"),  # version 3 without digests
    (2, False, f"shards.{S0}.chunks"),  # version 2 with them (an older shardc would refuse it)
])
def test_version_and_chunk_digests_agree(built, version, strip, key):
    from shardc.formats.manifest import loads

    m = json.loads((built / "manifest.json").read_text())
    m["format_version"] = version
    if strip:
        del m["shards"][S0]["chunk_size"], m["shards"][S0]["chunks"]
    with pytest.raises(ManifestError) as exc:
        loads(json.dumps(m))
    assert exc.value.key == key


def test_manifest_without_digests_stays_version_2(built):
    """An older build's manifest (no chunk digests) passed through the reader and writer keeps its
    version and bytes, so a pull of it is byte-identical."""
    from shardc.formats.manifest import loads
    from shardc.layout.plan import canonical_json

    m = json.loads((built / "manifest.json").read_text())
    m["format_version"] = 2
    del m["shards"][S0]["chunk_size"], m["shards"][S0]["chunks"]
    old = canonical_json(m)
    assert loads(old).dumps() == old


def _damage(path: Path, offsets: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for o in offsets:
        data[o] ^= 0x01
    path.write_bytes(bytes(data))


def _names_in(path: Path, lo: int, hi: int) -> list[str]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    held = sorted(k for k, v in header.items() if k != "__metadata__"
                  and 8 + n + v["data_offsets"][0] < hi and lo < 8 + n + v["data_offsets"][1])
    return (["<header>"] if lo < 8 + n else []) + held


def test_verify_and_load_name_the_damaged_chunks_and_their_tensors(build_dir):
    """Two bytes flipped in two data chunks: verify (exit 1) and load_shard name both chunks, their
    byte ranges and the tensors whose bytes they hold."""
    from click.testing import CliRunner

    import shardc
    from shardc.cli import main

    f = build_dir / S0
    size = f.stat().st_size
    bad = [size - 10, size - 3 * CHUNK - 10]
    _damage(f, bad)
    idx = sorted(o // CHUNK for o in bad)
    parts = []
    for i in idx:
        lo, hi = i * CHUNK, min(size, (i + 1) * CHUNK)
        names = _names_in(f, lo, hi)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"chunk {i} (bytes {lo}..{hi}: {shown})")
    line = (f"{S0}: sha256 of 2 of {-(-size // CHUNK)} chunk(s) differs from the manifest: {'; '.join(parts)} "
            "(corrupted bytes)")
    r = CliRunner().invoke(main, ["verify", "--manifest", str(build_dir / "manifest.json")])
    assert r.exit_code == 1 and f"error: {line}" in r.stderr, r.output
    with pytest.raises(VerifyMismatch) as exc:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert exc.value.message == line


@pytest.mark.parametrize("direct", ["1", "0"])
def test_chunked_load_returns_the_files_tensors(built, monkeypatch, direct):
    """Every chunk read in parallel (O_DIRECT, or through the cache with SHARDC_DIRECT_IO=0): the
    tensors equal the safetensors library's reading of the file, and none maps it."""
    import torch
    from safetensors.torch import load_file

    import shardc

    monkeypatch.setenv("SHARDC_DIRECT_IO", direct)
    got = shardc.load_shard(built, 0, 0, device="cpu")
    want = load_file(str(built / S0))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_a_resealed_edit_passes_the_chunk_check(build_dir):
    """A byte of the last tensor changed and the entry resealed (size, sha256, chunks, as
    conftest.reseal cuts them): the chunk check accepts it, so the chunk digests are the file's
    bytes and nothing else (a test that plants a NaN under matching digests relies on this)."""
    import shardc

    f = build_dir / S0
    _damage(f, [f.stat().st_size - 1])
    m = json.loads((build_dir / "manifest.json").read_text())
    reseal(m["shards"][S0], f.read_bytes())
    (build_dir / "manifest.json").write_text(json.dumps(m))
    assert sorted(shardc.load_shard(build_dir, 0, 0, device="cpu"))


def _chunk_line(f: Path, offsets: list[int]) -> str:
    """The damaged-chunk line for ``offsets`` of file ``f``, cut here (names from the header)."""
    size = f.stat().st_size
    idx = sorted({o // CHUNK for o in offsets})
    parts = []
    for i in idx:
        lo, hi = i * CHUNK, min(size, (i + 1) * CHUNK)
        names = _names_in(f, lo, hi)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"chunk {i} (bytes {lo}..{hi}: {shown})")
    return (f"sha256 of {len(idx)} of {-(-size // CHUNK)} chunk(s) differs from the manifest: {'; '.join(parts)} "
            "(corrupted bytes)")


def test_verify_device_reads_chunks_once_on_every_core(build_dir, monkeypatch):
    """verify --device cpu of a build with chunk digests loads it through the chunked parallel
    read (never the one-core whole-file pass): clean, it passes with its load and sha256 checks;
    one damaged chunk is the line verify without --device gives, naming the chunk and tensors."""
    from shardc.formats.manifest import load
    from shardc.loader import local
    from shardc.verify.checks import verify_build

    calls = []
    real = local.load_chunks
    monkeypatch.setattr(local, "load_chunks", lambda source, *a: calls.append(source.name) or real(source, *a))
    monkeypatch.setattr(local, "digest_pass", lambda *a, **k: pytest.fail("whole-file pass on a chunked shard"))
    (rank,) = verify_build(load(build_dir / "manifest.json"), build_dir, device="cpu").ranks
    assert rank.ok and {"sha256", "load:cpu"} <= set(rank.checks) and calls == [S0]
    f = build_dir / S0
    _damage(f, [f.stat().st_size - 5])
    on_device = verify_build(load(build_dir / "manifest.json"), build_dir, device="cpu")
    plain = verify_build(load(build_dir / "manifest.json"), build_dir)
    assert not on_device.ok and on_device.problems == plain.problems
    assert list(on_device.problems) == [f"{S0}: {_chunk_line(f, [f.stat().st_size - 5])}"]


def test_reshard_input_checks_chunks_and_names_the_damaged_one(built, build_dir, tmp_path):
    """A reshard input with chunk digests is checked chunk by chunk: a flipped byte is the input's
    corruption, named by chunk and tensors, and nothing is written under the output's name."""
    from shardc.compiler.build_files import open_local_input
    from shardc.compiler.reshard import reshard
    from shardc.layout.plan import plan_from_dict

    f = build_dir / S0
    at = f.stat().st_size - 3 * CHUNK - 7
    _damage(f, [at])
    plan = plan_from_dict({"replica_group": {"name": "ck2", "tp_degree": 2, "pp_degree": 1, "dtype": "bf16",
                                             "gpus_per_replica": 2}, "model": {"source": str(built.parent / "src")}})
    inp = open_local_input(build_dir)
    try:
        with pytest.raises(VerifyMismatch) as exc:
            reshard(inp, plan, tmp_path / "r")
    finally:
        inp.close()
    assert exc.value.message == f"input file {f} is corrupted: {_chunk_line(f, [at])}"
    assert not (tmp_path / "r" / "manifest.json").exists()


def test_export_reports_the_chunk_digests_of_what_it_wrote(built, tmp_path):
    """The export's shard writer cut chunk digests while writing (no extra pass): its report lists
    them per file, and they are the sha256 of every CHUNK_SIZE bytes of the file."""
    from shardc.compiler.build_files import open_local_input
    from shardc.compiler.export import export
    from shardc.formats import chunk_digests as chunks

    inp = open_local_input(built)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(chunks, "CHUNK_SIZE", CHUNK)
            res = export(inp, tmp_path / "hf", max_shard_size=40_000)
    finally:
        inp.close()
    assert len(res.files) >= 2
    for rec in res.files:
        data = (tmp_path / "hf" / rec.name).read_bytes()
        assert rec.chunk_size == CHUNK and list(rec.chunks) == _oracle_chunks(data, CHUNK)
