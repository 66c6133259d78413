"""The shard-file header parser and the file helpers, on real files."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
from manifest_edits import edit_at
from plan_helpers import plan as make_plan
from safetensors.numpy import save_file

from shardc.errors import ShardFormatError
from shardc.formats.files import create_temp, final_name, is_temp, temp_files, write_atomic
from shardc.formats.safetensors import read_header


def _raw(path, header: bytes, declared: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if declared is None else declared) + header)


def test_read_header_matches_safetensors(tmp_path):
    import numpy as np

    save_file({"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.int8)}, str(tmp_path / "x"),
              metadata={"k": "v"})
    tensors, meta, start = read_header(tmp_path / "x")
    assert meta == {"k": "v"} and set(tensors) == {"a", "b"}
    assert tensors["a"]["shape"] == [2, 3] and tensors["a"]["dtype"] == "F32"
    (n,) = struct.unpack("<Q", (tmp_path / "x").read_bytes()[:8])
    assert start == 8 + n


@pytest.mark.parametrize(("header", "declared", "words"), [
    (b"", None, "shorter"),
    (b"{}", 1 << 40, "implausible"),
    (b"{\"a\":", 100, "truncated"),
    (b"[1, 2]", None, "not a JSON object"),
    (b"{nope", None, "not JSON"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2, -1], "data_offsets": [0, 4]}}).encode(), None, "w"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}).encode(), None, "w"),
    (json.dumps({"__metadata__": {"a": 1}}).encode(), None, "__metadata__"),
])
def test_read_header_refuses_damage_naming_file_and_key(tmp_path, header, declared, words):
    p = tmp_path / "bad.safetensors"
    if header == b"":
        p.write_bytes(b"\x01\x02")
    else:
        _raw(p, header, declared)
    with pytest.raises(ShardFormatError) as exc:
        read_header(p)
    assert "bad.safetensors" in exc.value.one_line() and words in exc.value.one_line()


def test_one_temp_scheme(tmp_path):
    fd, tmp = create_temp(tmp_path / "out.bin")
    os.close(fd)
    assert is_temp(tmp) and final_name(tmp) == "out.bin" and temp_files(tmp_path) == [tmp]
    write_atomic(tmp_path / "out.bin", b"data")  # its own temp file is gone, the other one kept
    assert (tmp_path / "out.bin").read_bytes() == b"data" and temp_files(tmp_path) == [tmp]
    assert not is_temp(tmp_path / "out.bin")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    base = tmp_path_factory.mktemp("m")
    ckpt = write_checkpoint(base / "src", llama_config(num_layers=2))
    plan = make_plan(2, name="m", source="x")
    return build(plan.with_source(str(ckpt)), base / "o")


def test_manifest_round_trips_to_the_same_bytes(built):
    from shardc.formats.manifest import load, loads

    data = built.manifest_path.read_bytes()
    m = load(built.manifest_path)
    assert m.dumps() == data and loads(data) == m == built.manifest
    assert m.name == "m" and m.world_size == 2 and m.shard(m.shards[1].file) is m.shards[1]




S0, S1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"


@pytest.mark.parametrize(("path", "value", "key"), [
    (("shards", S0, "sha256"), None, f"shards.{S0}.sha256"),
    (("shards", S1, "size"), "12", f"shards.{S1}.size"),
    (("shards", S0, "size"), 1.5, f"shards.{S0}.size"),
    (("shards",), [], "shards"),
    (("files", 0, "sha256"), "abc", "files[0].sha256"),
    (("layout", "tp_degree"), KeyError, "layout.tp_degree"),
    (("layout", "pp_degree"), True, "layout.pp_degree"),
    (("model", "config", "num_hidden_layers"), 1e9, "model.config.num_hidden_layers"),
    (("model", "config", "num_hidden_layers"), 10**9, "model.config.num_hidden_layers"),
    (("model", "config", "vocab_size"), 1 << 40, "model.config.vocab_size"),
    (("source", "files"), {}, "source.files"),
    (("format_version",), 5, None),
    (("plan_sha256",), KeyError, "plan_sha256"),
    (("extra",), 1, "manifest"),
])
def test_manifest_reader_names_the_bad_key(built, tmp_path, path, value, key):
    from click.testing import CliRunner

    from shardc.cli import main
    from shardc.errors import ManifestError
    from shardc.formats.manifest import load

    m = json.loads(built.manifest_path.read_text())
    edit_at(m, path, value)
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(m))
    with pytest.raises(ManifestError) as exc:
        load(p)
    if key:
        assert exc.value.key == key, exc.value.one_line()
    r = CliRunner().invoke(main, ["verify", "--manifest", str(p), "--dir", str(built.out_dir)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output


V1 = Path(__file__).parents[1] / "data" / "manifest-v1-demo-tp3pp2-bf16.json"


def test_version_1_manifests_are_still_read():
    """A manifest written by format_version 1 (shards as a list) reads into the same Manifest,
    and writes back as version 2 with shards keyed by file name."""
    from shardc.formats.manifest import loads
    from shardc.layout.plan import canonical_json

    data = V1.read_bytes()
    old = json.loads(data)
    assert old["format_version"] == 1 and isinstance(old["shards"], list)
    m = loads(data, V1.name)
    assert [s.file for s in m.shards] == [s["file"] for s in old["shards"]]
    new = json.loads(m.dumps())
    assert new["format_version"] == 2
    as_v1 = {**new, "format_version": 1, "shards": [{"file": s["file"], **new["shards"][s["file"]]}
                                                     for s in old["shards"]]}
    assert canonical_json(as_v1) == data  # nothing lost
    for s in old["shards"]:  # a loader written from the design: manifest["shards"][file]["sha256"]
        assert new["shards"][s["file"]]["sha256"] == s["sha256"] and "file" not in new["shards"][s["file"]]
    assert loads(m.dumps()) == m


def test_version_3_shards_are_keyed_by_file_with_chunk_digests(built):
    """Keyed by file name (since version 2), the whole file's sha256 as before, and (version 3)
    the sha256 of every CHUNK_SIZE bytes, cut here independently of the writer."""
    from shardc.formats.chunk_digests import CHUNK_SIZE

    m = json.loads(built.manifest_path.read_text())
    assert m["format_version"] == 3
    for s in built.manifest.shards:
        data = (built.out_dir / s.file).read_bytes()
        entry = m["shards"][s.file]
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["chunk_size"] == CHUNK_SIZE
        assert entry["chunks"] == [hashlib.sha256(data[i : i + CHUNK_SIZE]).hexdigest()
                                   for i in range(0, len(data), CHUNK_SIZE)]


def test_version_2_shard_keys_are_safe_names(built, tmp_path):
    from shardc.errors import ManifestError
    from shardc.formats.manifest import load

    m = json.loads(built.manifest_path.read_text())
    m["shards"]["../escape.safetensors"] = m["shards"].pop(S0)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="unsafe shard file name"):
        load(tmp_path / "manifest.json")


@pytest.mark.parametrize("size", [0, 1, 4095, 65536, 65537, 3 * 65536 + 7])
def test_sha256_mapped_is_hashlib_over_the_bytes(tmp_path, monkeypatch, size):
    """Hashing from windows of mappings (reshard's input check) gives hashlib's digest of the
    file's bytes at every size around the window edges (windows shrunk to 64 KiB here)."""
    import hashlib
    import os

    from shardc.formats import files

    monkeypatch.setattr(files, "MAP_WINDOW", 65536)
    data = os.urandom(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    assert files.sha256_mapped(p, block=4096) == hashlib.sha256(data).hexdigest()
