"""Property-based fuzzing (#25) of export's input: a real tiny tp=2 build whose manifest.json
(values, keys, raw bytes) or shard headers (with the manifest's sha256 and size made to match, so
the header parser itself sees the bytes) are mutated. Every example ends in an export whose files
the index names and the safetensors library reads, with the sha256s the result reports, or in a
ShardcError with the export that was in the output directory byte for byte as it was; never
another exception."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from manifest_edits import reseal
from plan_helpers import plan as make_plan

from shardc.compiler.build_files import open_local_input
from shardc.compiler.compile import build
from shardc.compiler.export import ExportResult, export
from shardc.compiler.lock import LOCK
from shardc.errors import ShardcError

FUZZ = settings(max_examples=60, deadline=10_000, suppress_health_check=[HealthCheck.too_slow],
                database=None)
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
INDEX = "model.safetensors.index.json"
LIMIT = 30_000

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["BF16", "F32", "I8", "bf16", "int8", "vocab", "column", "row", "model-tp00-pp00.safetensors",
                       "../x", "config.json"]) | st.integers(-2, 200),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

_DIR = tempfile.TemporaryDirectory(prefix="shardc-fuzz-export-")
ROOT = Path(_DIR.name)


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    _DIR.cleanup()


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != LOCK}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    """One build (tp=2) and one export of it: the input to mutate and the output to keep."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    src = write_checkpoint(ROOT / "src", llama_config(**TINY), seed=5)
    (src / "tokenizer.json").write_bytes(b'{"model": {}}\n')
    plan = make_plan(2, name="f", source=src)
    pristine = build(plan, ROOT / "build").out_dir
    out = ROOT / "out"
    export(open_local_input(pristine / "manifest.json"), out, max_shard_size=LIMIT)
    return {"build": pristine, "out": out, "previous": _files(out),
            "manifest": json.loads((pristine / "manifest.json").read_bytes())}


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON document (dict keys and list indexes)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _at(doc: Any, path: tuple) -> tuple[Any, Any]:
    *head, last = path
    for k in head:
        doc = doc[k]
    return doc, last


def _run(world: dict[str, Any], work: Path) -> None:
    """Export the mutated build over the previous export: a verified result or a ShardcError
    with the previous export untouched."""
    out = world["out"]
    try:
        result = export(open_local_input(work / "manifest.json"), out, max_shard_size=LIMIT)
    except ShardcError as exc:
        event(f"{type(exc).__name__}: {exc.message[:60]}")
        assert _files(out) == world["previous"]
        return
    event("exported")
    _check_export(out, result)
    shutil.rmtree(out)  # back to the previous export for the next example
    out.mkdir()
    for name, data in world["previous"].items():
        (out / name).write_bytes(data)


def _check_export(out: Path, result: ExportResult) -> None:
    from safetensors import safe_open

    index = json.loads((out / INDEX).read_bytes())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards == sorted(f.name for f in result.files)
    for f in result.files:
        data = (out / f.name).read_bytes()
        assert len(data) == f.size and hashlib.sha256(data).hexdigest() == f.sha256
        with safe_open(out / f.name, "np") as st_file:
            assert set(st_file.keys()) == {k for k, v in index["weight_map"].items() if v == f.name}
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def _fresh(world: dict[str, Any]) -> Path:
    work = ROOT / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(world["build"], work)
    return work


@FUZZ
@given(st.data(), json_values)
def test_manifest_value(world, data, value):
    doc = json.loads(json.dumps(world["manifest"]))
    path = data.draw(st.sampled_from(_paths(doc)))
    parent, key = _at(doc, path)
    parent[key] = value
    work = _fresh(world)
    (work / "manifest.json").write_text(json.dumps(doc))
    _run(world, work)


@FUZZ
@given(st.data(), st.sampled_from(["delete", "rename", "add"]), st.text(min_size=1, max_size=10))
def test_manifest_key(world, data, how, new_key):
    doc = json.loads(json.dumps(world["manifest"]))
    path = data.draw(st.sampled_from([p for p in _paths(doc) if isinstance(p[-1], str)]))
    parent, key = _at(doc, path)
    if how == "delete":
        del parent[key]
    elif how == "rename":
        parent[new_key] = parent.pop(key)
    else:
        parent[new_key] = parent[key]
    work = _fresh(world)
    (work / "manifest.json").write_text(json.dumps(doc))
    _run(world, work)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=8))
def test_manifest_bytes(world, flips):
    work = _fresh(world)
    raw = bytearray((work / "manifest.json").read_bytes())
    for pos, bit in flips:
        raw[pos % len(raw)] ^= bit
    (work / "manifest.json").write_bytes(bytes(raw))
    _run(world, work)


@FUZZ
@given(st.data(), st.sampled_from(["flip", "length", "json"]), json_values)
def test_shard_header(world, data, how, value):
    """A hostile header the manifest vouches for (its sha256 and size are the mutated file's)."""
    doc = json.loads(json.dumps(world["manifest"]))
    name = data.draw(st.sampled_from(sorted(doc["shards"])))
    work = _fresh(world)
    raw = bytearray((work / name).read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, 8 + n - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    else:  # a header that is JSON, with one value replaced
        header = json.loads(raw[8 : 8 + n])
        path = data.draw(st.sampled_from(_paths(header)))
        parent, key = _at(header, path)
        parent[key] = value
        body = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    (work / name).write_bytes(bytes(raw))
    reseal(doc["shards"][name], bytes(raw))
    (work / "manifest.json").write_text(json.dumps(doc))
    _run(world, work)
