"""Chunk digests of another kind (issue #30): a plan's ``replica_group.checkpoint.chunk_digest:
blake3`` makes the build record blake3 chunk digests (manifest format_version 4, the whole-file
sha256 unchanged), and every reader checks them: load_shard, verify, pull and the streamed load
from S3, reshard's input check, a resumed build.

Oracles: the blake3 and hashlib libraries over slices of the file's bytes cut here; the
safetensors library's reading of the file; the header parsed here for the tensors named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from manifest_edits import edit_at
from plan_helpers import plan as make_plan
from plan_helpers import plan_data, write_plan

from shardc.errors import ManifestError, PlanError, VerifyMismatch

blake3 = pytest.importorskip("blake3").blake3

CHUNK = 4096
S0 = "model-tp00-pp00.safetensors"
KIND = {"checkpoint": {"chunk_digest": "blake3"}}


def _build(src: Path, out: Path, tp: int = 1, **kw):
    from shardc.compiler.compile import build
    from shardc.formats import chunk_digests as chunks

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks, "CHUNK_SIZE", CHUNK)
        return build(make_plan(tp, name="b3", source=src, group=KIND, **kw), out_dir=out)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("b3src")
    return write_checkpoint(root / "src", llama_config(num_layers=4, hidden_size=32, intermediate_size=64,
                                                       num_heads=4, num_kv_heads=2, vocab_size=64))


@pytest.fixture(scope="module")
def built(src, tmp_path_factory) -> Path:
    """A tiny tp=2 build with blake3 chunk digests in 4 KiB chunks (several per shard)."""
    return _build(src, tmp_path_factory.mktemp("b3") / "b", tp=2).out_dir


@pytest.fixture
def build_dir(built, tmp_path) -> Path:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d


def _blake3_chunks(data: bytes) -> list[str]:
    return [blake3(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]


def _damage(path: Path, at: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return bytes(data)


def _line(data: bytes, at: int) -> str:
    """The one damaged chunk's line, cut here: which chunk, its bytes, the tensors in it."""
    i = at // CHUNK
    lo, hi = i * CHUNK, min(len(data), (i + 1) * CHUNK)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    held = (["<header>"] if lo < 8 + n else []) + sorted(
        k for k, v in header.items() if k != "__metadata__"
        and 8 + n + v["data_offsets"][0] < hi and lo < 8 + n + v["data_offsets"][1])
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return (f"blake3 of 1 of {-(-len(data) // CHUNK)} chunk(s) differs from the manifest: chunk {i} "
            f"(bytes {lo}..{hi}: {shown}) (corrupted bytes)")


def test_build_records_blake3_chunks_in_format_version_4(built, src, tmp_path):
    """Every shard entry names its kind and lists blake3 of every chunk; the whole-file sha256 is
    still sha256; a second build of the same plan is byte-identical, manifest included."""
    m = json.loads((built / "manifest.json").read_text())
    assert m["format_version"] == 4 and m["plan"]["replica_group"]["checkpoint"]["chunk_digest"] == "blake3"
    for name, entry in m["shards"].items():
        data = (built / name).read_bytes()
        assert entry["chunk_digest"] == "blake3" and entry["chunk_size"] == CHUNK
        assert entry["chunks"] == _blake3_chunks(data) and len(entry["chunks"]) > 2
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    again = _build(src, tmp_path / "again", tp=2).out_dir
    for name in [*m["shards"], "manifest.json"]:
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_the_default_stays_sha256_in_format_version_3(src, tmp_path):
    """A plan without the key (or with chunk_digest: sha256) records sha256 chunks, version 3, no
    chunk_digest key anywhere: such builds keep the bytes they had."""
    from shardc.compiler.compile import build

    m = json.loads(build(make_plan(1, name="d", source=src), out_dir=tmp_path / "d").manifest_path.read_text())
    assert m["format_version"] == 3 and "chunk_digest" not in m["shards"][S0]
    plan = make_plan(1, name="d", source=src, group={"checkpoint": {"chunk_digest": "sha256"}})
    assert plan.chunk_digest == "sha256"


def test_load_shard_checks_blake3_chunks(build_dir):
    """load_shard returns the file's tensors; a flipped byte is one VerifyMismatch naming the
    chunk by its blake3, its byte range and its tensors; verify says the same line, exit 1."""
    import torch
    from click.testing import CliRunner
    from safetensors.torch import load_file

    import shardc
    from shardc.cli import main

    got = shardc.load_shard(build_dir, 0, 0, device="cpu")
    want = load_file(str(build_dir / S0))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    at = (build_dir / S0).stat().st_size - CHUNK - 11
    data = _damage(build_dir / S0, at)
    with pytest.raises(VerifyMismatch) as exc:
        shardc.load_shard(build_dir, 0, 0, device="cpu")
    assert exc.value.message == f"{S0}: {_line(data, at)}"
    for extra in ([], ["--device", "cpu"]):  # the parallel chunk check, and the one-pass device read
        r = CliRunner().invoke(main, ["verify", "--manifest", str(build_dir / "manifest.json"), *extra])
        assert r.exit_code == 1 and f"{S0}: {_line(data, at)}" in r.stderr, r.output


@pytest.mark.parametrize(("path", "value", "key", "says"), [
    (("shards", S0, "chunk_digest"), "md5", f"shards.{S0}.chunk_digest",
     "is 'md5'; chunk digests are one of sha256, blake3, beside chunk_size and chunks"),
    (("shards", S0, "chunk_digest"), 3, f"shards.{S0}.chunk_digest", "is 3, expected str"),
    (("format_version",), 3, f"shards.{S0}.chunk_digest",
     "is not a format_version 3 key (chunk digests other than sha256 are format_version 4)"),
])
def test_bad_chunk_digest_records_are_one_line_exit_2(built, tmp_path, path, value, key, says):
    """A digest kind this shardc does not know, or blake3 chunks under a version that cannot have
    them (what a reader of version 3 would check as sha256): a ManifestError naming the key; the
    CLI prints one line and exits 2 before any shard is read."""
    from click.testing import CliRunner

    from shardc.cli import main
    from shardc.formats.manifest import load

    m = json.loads((built / "manifest.json").read_text())
    edit_at(m, path, value)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError) as exc:
        load(tmp_path / "manifest.json")
    assert exc.value.key == key and says in exc.value.message, exc.value.one_line()
    r = CliRunner().invoke(main, ["verify", "--manifest", str(tmp_path / "manifest.json"), "--dir", str(built)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and key in r.stderr, r.output


def test_manifest_round_trips_to_the_same_bytes(built):
    from shardc.formats.manifest import load

    data = (built / "manifest.json").read_bytes()
    m = load(built / "manifest.json")
    assert m.dumps() == data and {s.chunk_digest for s in m.shards} == {"blake3"}


def test_a_plan_naming_another_digest_is_one_line_exit_2(src, tmp_path):
    """chunk_digest: md5 in a plan file: shardc build says which key and what would work, exit 2,
    and writes nothing."""
    from click.testing import CliRunner

    from shardc.cli import main
    from shardc.layout.plan import plan_from_dict

    data = plan_data(1, name="bad", source=src, group={"checkpoint": {"chunk_digest": "md5"}})
    with pytest.raises(PlanError) as exc:
        plan_from_dict(data)
    assert exc.value.key == "replica_group.checkpoint.chunk_digest" and "sha256" in exc.value.one_line()
    plan = write_plan(tmp_path / "p.yaml", 1, name="bad", source=src, group={"checkpoint": {"chunk_digest": "md5"}})
    r = CliRunner().invoke(main, ["build", str(plan), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "chunk_digest" in r.stderr, r.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_reshard_checks_a_blake3_input_and_writes_its_own_plans_kind(built, build_dir, tmp_path):
    """A blake3 build resharded to tp=1 (a plan without the key): the input's chunks are checked
    as blake3 and the output has sha256 chunks (its plan's); with a byte of the input flipped, one
    line names the input's chunk by its blake3."""
    from shardc.compiler.build_files import open_local_input
    from shardc.compiler.reshard import reshard
    from shardc.formats.manifest import load

    plan = make_plan(1, name="r1", source=built.parent / "src")
    inp = open_local_input(built)
    try:
        out = reshard(inp, plan, tmp_path / "r").manifest_path
    finally:
        inp.close()
    assert {s.chunk_digest for s in load(out).shards} == {"sha256"} and load(out).format_version == 3
    f = build_dir / "model-tp01-pp00.safetensors"
    at = f.stat().st_size - 9
    data = _damage(f, at)
    inp = open_local_input(build_dir)
    try:
        with pytest.raises(VerifyMismatch) as exc:
            reshard(inp, plan, tmp_path / "r2")
    finally:
        inp.close()
    assert exc.value.message == f"input file {f} is corrupted: {_line(data, at)}"


def test_a_resumed_blake3_build_cuts_the_same_digests(src, tmp_path):
    """A build stopped after its first stage and run again keeps that stage's shard (re-hashed
    in one read that also cuts its blake3 chunks): the manifest is the uninterrupted build's."""
    from shardc.errors import ShardcError

    clean = _build(src, tmp_path / "clean", pp=2).manifest_path.read_bytes()
    out = tmp_path / "o"
    squat = out / "model-tp00-pp01.safetensors"
    squat.mkdir(parents=True)  # stage 1 cannot be renamed into place: stage 0 stays, finished
    with pytest.raises(ShardcError):
        _build(src, out, pp=2)
    squat.rmdir()
    res = _build(src, out, pp=2)
    assert res.skipped == [S0] and res.manifest_path.read_bytes() == clean


def test_streamed_load_and_pull_check_blake3_chunks(built, s3, aws_env, tmp_path):
    """From the moto server on 127.0.0.1: load_shard of the s3:// manifest and pull check every
    ranged chunk as blake3; with a byte changed in the store, both name the chunk (after one
    refetch) and pull leaves nothing under the shard's name."""
    pytest.importorskip("moto")
    import torch
    from safetensors.torch import load_file

    import shardc
    from shardc.store import pull_build, push_build

    server, _ = s3
    server.client().create_bucket(Bucket="blake3")
    push_build(built / "manifest.json", "s3://blake3/p", endpoint_url=server.endpoint)
    aws_env.setenv("AWS_ENDPOINT_URL", server.endpoint)
    uri = "s3://blake3/p/manifest.json"
    got = shardc.load_shard(uri, 0, 0, device="cpu")
    want = load_file(str(built / S0))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    assert pull_build(uri, tmp_path / "node", ranks=[(0, 0)]).verify.ok
    data = bytearray((built / S0).read_bytes())
    at = len(data) - 2 * CHUNK - 3
    data[at] ^= 0x01
    server.client().put_object(Bucket="blake3", Key=f"p/{S0}", Body=bytes(data))
    with pytest.raises(VerifyMismatch) as exc:
        shardc.load_shard(uri, 0, 0, device="cpu")
    assert exc.value.message == f"{S0}: {_line(bytes(data), at)}"
    with pytest.raises(VerifyMismatch) as exc:
        pull_build(uri, tmp_path / "other", ranks=[(0, 0)])
    assert exc.value.message == f"{S0}: downloaded data does not match the manifest: {_line(bytes(data), at)}"
    assert not [p.name for p in (tmp_path / "other").iterdir() if S0 in p.name]
