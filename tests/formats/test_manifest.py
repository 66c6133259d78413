"""formats/manifest.py against a manifest written by hand here (no build): what the reader
accepts at the edges of its bounds, the exact line it gives for each kind of damage (the key path
and the hint are what a user acts on), the typed accessors, and the canonical bytes it writes."""

from __future__ import annotations

import copy
import json

import pytest
from manifest_edits import edit_at

from shardc.errors import ManifestError
from shardc.formats.manifest import Manifest, load, loads

H = {c: c * 64 for c in "0123456789abcdef"}  # 64-digit hashes, one per digit
S0, S1 = "model-tp00-pp00.safetensors", "model-tp00-pp01.safetensors"
HINT = " (hint: the manifest is damaged; rebuild, or pass the manifest.json that shardc build wrote)"
TENSOR = {"dtype": "BF16", "shape": [4, 4], "source": "x.weight", "split": "replicated"}


def base() -> dict:
    """A valid version 2 manifest: tp=1, pp=2, shards keyed out of rank order, a tokenizer, a
    reshard record and one compressed entry."""
    return {
        "format": "shardc-manifest", "format_version": 2, "shardc_version": "9.9.9",
        "plan": {"replica_group": {"name": "hand"}}, "plan_sha256": H["a"],
        "model": {"config": {"num_hidden_layers": 2, "vocab_size": 64, "head_dim": None}},
        "layout": {"tp_degree": 1, "pp_degree": 2, "stages": [[0, 1], [1, 2]], "base_dtype": "BF16",
                   "dtype": "bf16"},
        "source": {"uri": "/src", "revision": None,
                   "files": [{"name": "model.safetensors", "size": 7, "sha256": H["b"]}],
                   "reshard_of": {"manifest_sha256": H["c"], "plan": "old", "plan_sha256": H["d"],
                                  "dtype": "int8", "dequantized": ["x.weight"]}},
        "files": [{"name": "config.json", "size": 11, "sha256": H["e"]},
                  {"name": "tokenizer.json", "size": 13, "sha256": H["f"],
                   "compressed": {"codec": "zstd", "size": 9, "sha256": H["3"], "object": "tokenizer.json.zst"}}],
        "shards": {
            S1: {"tp_rank": 0, "pp_stage": 1, "rank": 1, "layers": [1, 2], "size": 200, "sha256": H["1"],
                 "tensors": {"x.weight": TENSOR},
                 "compressed": {"codec": "zstd", "size": 50, "sha256": H["2"], "object": S1 + ".zst"}},
            S0: {"tp_rank": 0, "pp_stage": 0, "rank": 0, "layers": [0, 1], "size": 100, "sha256": H["0"],
                 "tensors": {"x.weight": TENSOR}},
        },
    }


def _v1(m: dict) -> dict:
    """Version 1 of a manifest: the shards a list in rank order, each entry naming its file."""
    return {**m, "format_version": 1, "shards": [{"file": f, **m["shards"][f]} for f in (S0, S1)]}


def _parse(m: dict) -> Manifest:
    return loads(json.dumps(m).encode(), "m.json")


def test_typed_fields_of_the_hand_written_manifest():
    m = _parse(base())
    assert [s.file for s in m.shards] == [S0, S1]  # by rank, not by key order
    s0, s1 = m.shards
    assert (s1.tp_rank, s1.pp_stage, s1.rank, s1.layers, s1.size, s1.sha256) == (0, 1, 1, (1, 2), 200, H["1"])
    assert s1.compressed == {"codec": "zstd", "size": 50, "sha256": H["2"], "object": S1 + ".zst"}
    assert s0.compressed is None and s0.tensors == {"x.weight": TENSOR}
    assert (m.name, m.world_size, m.total_bytes, m.shardc_version) == ("hand", 2, 300, "9.9.9")
    assert m.layout.stages == [(0, 1), (1, 2)] and (m.layout.base_dtype, m.layout.dtype) == ("BF16", "bf16")
    assert m.config == {"num_hidden_layers": 2, "vocab_size": 64, "head_dim": None}
    assert m.shard(S1) is s1 and m.shard("nope") is None
    assert m.file("config.json").size == 11 and m.file("nope") is None and m.file("config.json").compressed is None
    assert m.file("tokenizer.json").compressed == {"codec": "zstd", "size": 9, "sha256": H["3"],
                                                   "object": "tokenizer.json.zst"}
    assert m.tokenizer_sha256 == H["f"]
    src = m.source
    assert (src.uri, src.revision, [(f.name, f.size, f.sha256) for f in src.files]) == \
        ("/src", None, [("model.safetensors", 7, H["b"])])
    r = src.reshard_of
    assert (r.manifest_sha256, r.plan, r.plan_sha256, r.dtype, r.dequantized) == (H["c"], "old", H["d"], "int8",
                                                                                  ["x.weight"])
    d = base()
    d["files"].pop()
    d["source"]["revision"] = "abc"
    del d["source"]["reshard_of"]
    m2 = _parse(d)
    assert m2.tokenizer_sha256 is None and m2.source.revision == "abc" and m2.source.reshard_of is None


def test_writes_canonical_bytes_of_what_it_read():
    """The writer's bytes are json.dumps(sort_keys, indent=1, no ASCII escaping) + newline of the
    manifest as given (shards keyed by file), whatever order and spacing it was read in."""
    want = (json.dumps(base(), sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()
    m = loads(json.dumps(base(), indent=3).encode())
    assert m.dumps() == want and m.to_dict() == base() and Manifest.from_dict(m.to_dict()) == m
    assert Manifest.from_dict(m.to_dict()).dumps() == want
    path_free = copy.deepcopy(base())
    path_free["source"]["uri"] = "/données"  # UTF-8 as is
    assert "/données".encode() in _parse(path_free).dumps()


def test_version_1_is_read_as_the_same_manifest_and_written_as_current():
    v1 = _v1(base())
    assert [s["file"] for s in v1["shards"]] == [S0, S1]
    assert v1["shards"][1] == {"file": S1, **base()["shards"][S1]}
    m = _parse(v1)
    assert m == _parse(base()) == Manifest.from_dict(v1) and m.dumps() == _parse(base()).dumps()
    assert m.to_dict()["format_version"] == 2 and m.to_dict()["shards"] == base()["shards"]


def test_load_and_save_take_a_path(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_bytes(_parse(base()).dumps())
    assert load(p) == _parse(base()) and load(str(p)) == load(p)
    assert load(p) == loads(p.read_bytes(), str(p))
    m = _parse(base())
    m.save(tmp_path / "w.json")
    assert (tmp_path / "w.json").read_bytes() == p.read_bytes()
    with pytest.raises(ManifestError) as e:
        load(tmp_path)
    assert e.value.one_line() == (f"manifest {tmp_path} is not a regular file "
                                  "(hint: pass the file itself, not a pipe or device)")
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(ManifestError) as e:
        load(p)
    assert e.value.one_line() == f"{p} is not JSON (hint: pass the manifest.json that shardc build wrote)"




MAXB = 1 << 50

ACCEPTED = [
    (("layout", "tp_degree"), 4096),
    (("shards", S0, "size"), MAXB),
    (("shards", S0, "size"), 0),
    (("shards", S0, "rank"), 4096 * 4096),
    (("shards", S1, "tp_rank"), 4096),
    (("shards", S1, "pp_stage"), 4096),
    (("shards", S0, "layers"), [0, 4096]),  # the model config's own limit (layout/model.py)
    (("model", "config", "num_hidden_layers"), 4096),
    (("model", "config", "vocab_size"), 1 << 24),
    (("model", "config", "num_hidden_layers"), KeyError),
    (("model", "config", "vocab_size"), None),
    (("files", 0, "compressed"), None),
    (("source", "reshard_of"), None),
    (("source", "reshard_of", "dequantized"), []),
]


@pytest.mark.parametrize(("path", "value"), ACCEPTED)
def test_values_at_the_edges_are_accepted(path, value):
    d = base()
    edit_at(d, path, value)
    m = _parse(d)
    if path[0] == "shards" and value is not KeyError:
        assert getattr(m.shard(path[1]), path[2]) == (tuple(value) if path[2] == "layers" else value)


def _err(key: str | None, msg: str) -> str:
    return (f"{key}: m.json: {msg}" if key else f"m.json: {msg}") + HINT


REFUSED = [
    (("layout", "tp_degree"), 0, _err("layout.tp_degree", "is 0, outside 1..4096")),
    (("layout", "tp_degree"), 4097, _err("layout.tp_degree", "is 4097, outside 1..4096")),
    (("layout", "pp_degree"), True, _err("layout.pp_degree", "is True, expected int")),
    (("layout", "pp_degree"), 1, _err("layout.stages", "is not 1 [start, stop] pairs")),
    (("layout", "stages"), [[0, 1], [1]], _err("layout.stages", "is not 2 [start, stop] pairs")),
    (("layout", "stages"), [[0, 1], [1, True]], _err("layout.stages", "is not 2 [start, stop] pairs")),
    (("layout", "stages"), [[0, 1], 5], _err("layout.stages", "is not 2 [start, stop] pairs")),
    (("layout", "dtype"), 8, _err("layout.dtype", "is 8, expected str")),
    (("layout", "base_dtype"), KeyError, _err("layout.base_dtype", "is missing")),
    (("layout", "extra"), 1, _err("layout", "has unknown key 'extra'")),
    (("shards", S0, "size"), MAXB + 1, _err(f"shards.{S0}.size", f"is {MAXB + 1}, outside 0..{MAXB}")),
    (("shards", S0, "size"), -1, _err(f"shards.{S0}.size", f"is -1, outside 0..{MAXB}")),
    (("shards", S0, "rank"), 4096 * 4096 + 1,
     _err(f"shards.{S0}.rank", f"is {4096 * 4096 + 1}, outside 0..{4096 * 4096}")),
    (("shards", S1, "tp_rank"), 4097, _err(f"shards.{S1}.tp_rank", "is 4097, outside 0..4096")),
    (("shards", S1, "pp_stage"), 4097, _err(f"shards.{S1}.pp_stage", "is 4097, outside 0..4096")),
    (("shards", S0, "layers"), [0], _err(f"shards.{S0}.layers", "is [0], expected [start, stop]")),
    (("shards", S0, "layers"), [0, 1, 2], _err(f"shards.{S0}.layers", "is [0, 1, 2], expected [start, stop]")),
    (("shards", S0, "layers"), [0, 4097], _err(f"shards.{S0}.layers", "is [0, 4097], expected [start, stop]")),
    (("shards", S0, "layers"), [-1, 1], _err(f"shards.{S0}.layers", "is [-1, 1], expected [start, stop]")),
    (("shards", S0, "layers"), [False, 1], _err(f"shards.{S0}.layers", "is [False, 1], expected [start, stop]")),
    (("shards", S0, "sha256"), H["0"][:63], _err(f"shards.{S0}.sha256", f"is '{H['0'][:63]}', expected 64 hex digits")),
    (("shards", S0, "sha256"), H["0"] + "0", _err(f"shards.{S0}.sha256", f"is '{H['0']}0', expected 64 hex digits")),
    (("shards", S0, "sha256"), "A" * 64, _err(f"shards.{S0}.sha256", f"is '{'A' * 64}', expected 64 hex digits")),
    (("shards", S0, "sha256"), "X" * 64, _err(f"shards.{S0}.sha256", f"is '{'X' * 64}', expected 64 hex digits")),
    (("shards", S0, "tensors", "x.weight"), {"dtype": "BF16"},
     _err(f"shards.{S0}.tensors.x.weight", "is not a tensor record with dtype and shape")),
    (("shards", S0, "tensors", "x.weight"), {"shape": [1]},
     _err(f"shards.{S0}.tensors.x.weight", "is not a tensor record with dtype and shape")),
    (("shards", S0, "tensors", "x.weight"), {"dtype": 1, "shape": [1]},
     _err(f"shards.{S0}.tensors.x.weight", "is not a tensor record with dtype and shape")),
    (("shards", S0, "tensors", "x.weight"), {"dtype": "F32", "shape": 1},
     _err(f"shards.{S0}.tensors.x.weight", "is not a tensor record with dtype and shape")),
    (("shards", S0, "tensors", "x.weight"), [], _err(f"shards.{S0}.tensors.x.weight",
                                                     "is not a tensor record with dtype and shape")),
    (("shards", S0, "file"), S0, _err(f"shards.{S0}", "has unknown key 'file'")),
    (("shards", S0, "compressed"), "zstd", _err(f"shards.{S0}.compressed", "is 'zstd', expected dict")),
    (("shards", S0), [], _err(f"shards.{S0}", "is list, expected an object")),
    (("files", 0, "compressed"), [], _err("files[0].compressed", "is [], expected dict")),
    (("files", 1), "tokenizer.json", _err("files[1]", "is str, expected an object")),
    (("files", 1, "extra"), 1, _err("files[1]", "has unknown key 'extra'")),
    (("files", 0, "size"), 1.0, _err("files[0].size", "is 1.0, expected int")),
    (("source", "files", 0, "sha256"), "g" * 64, _err("source.files[0].sha256", f"is '{'g' * 64}', expected 64 hex digits")),
    (("source", "revision"), 1, _err("source.revision", "is 1, expected str")),
    (("source", "uri"), None, _err("source.uri", "is None, expected str")),
    (("source", "extra"), 1, _err("source", "has unknown key 'extra'")),
    (("source", "reshard_of", "dequantized"), [1], _err("source.reshard_of.dequantized",
                                                        "is [1], expected a list of tensor names")),
    (("source", "reshard_of", "dequantized"), "x", _err("source.reshard_of.dequantized", "is 'x', expected list")),
    (("source", "reshard_of", "plan"), 1, _err("source.reshard_of.plan", "is 1, expected str")),
    (("source", "reshard_of", "dtype"), KeyError, _err("source.reshard_of.dtype", "is missing")),
    (("source", "reshard_of", "manifest_sha256"), "0", _err("source.reshard_of.manifest_sha256",
                                                            "is '0', expected 64 hex digits")),
    (("source", "reshard_of", "plan_sha256"), "0", _err("source.reshard_of.plan_sha256",
                                                        "is '0', expected 64 hex digits")),
    (("source", "reshard_of", "extra"), 1, _err("source.reshard_of", "has unknown key 'extra'")),
    (("source", "reshard_of"), [], _err("source.reshard_of", "is [], expected dict")),
    (("model", "config", "num_hidden_layers"), 0, _err("model.config.num_hidden_layers", "is 0, outside 1..4096")),
    (("model", "config", "num_hidden_layers"), 4097,
     _err("model.config.num_hidden_layers", "is 4097, outside 1..4096")),
    (("model", "config", "head_dim"), 1 << 15, _err("model.config.head_dim", f"is {1 << 15}, outside 1..16384")),
    (("model", "config"), [], _err("model.config", "is [], expected dict")),
    (("model",), KeyError, _err("model", "is missing")),
    (("plan", "replica_group", "name"), 1, _err("plan.replica_group.name", "is 1, expected str")),
    (("plan", "replica_group"), KeyError, _err("plan.replica_group", "is missing")),
    (("plan",), [], _err("plan", "is [], expected dict")),
    (("plan_sha256",), KeyError, _err("plan_sha256", "is missing")),
    (("shardc_version",), 2, _err("shardc_version", "is 2, expected str")),
    (("files",), {}, _err("files", "is {}, expected list")),
    (("shards",), [], _err("shards", "is [], expected dict")),
    (("zz",), 1, _err("manifest", "has unknown key 'zz'")),
    (("aa",), 1, _err("manifest", "has unknown key 'aa'")),
]


@pytest.mark.parametrize(("path", "value", "line"), REFUSED)
def test_each_damage_is_one_line_naming_its_key(path, value, line):
    d = base()
    edit_at(d, path, value)
    with pytest.raises(ManifestError) as e:
        _parse(d)
    assert e.value.one_line() == line


@pytest.mark.parametrize(("path", "value", "what"), [
    (("files", 0, "name"), "../config.json", "file name"),
    (("source", "files", 0, "name"), "a/b", "source file name"),
])
def test_unsafe_names_are_refused(path, value, what):
    d = base()
    edit_at(d, path, value)
    with pytest.raises(ManifestError, match=f"^unsafe {what} '{value}'$"):
        _parse(d)


def test_unsafe_shard_keys_and_version_1_names_are_refused():
    d = base()
    d["shards"]["a/b"] = d["shards"].pop(S0)
    with pytest.raises(ManifestError, match="^unsafe shard file name 'a/b'$"):
        _parse(d)
    v1 = _v1(base())
    v1["shards"][0]["file"] = ".."
    with pytest.raises(ManifestError, match=r"^unsafe shard file name '\.\.'$"):
        loads(json.dumps(v1))
    del v1["shards"][0]["file"]
    with pytest.raises(ManifestError) as e:
        loads(json.dumps(v1), "m.json")
    assert e.value.one_line() == _err("shards[0].file", "is missing")


@pytest.mark.parametrize(("data", "line"), [
    (b"[]", "m.json is not a shardc manifest (hint: pass the manifest.json that shardc build wrote)"),
    (b'{"format": "other"}', "m.json is not a shardc manifest (hint: pass the manifest.json that shardc build wrote)"),
    (b"{", "m.json is not JSON (hint: pass the manifest.json that shardc build wrote)"),
    (b'{"format": "shardc-manifest", "format_version": 5}',
     "m.json has format_version 5; this shardc reads 1, 2, 3 and 4 (hint: use the shardc version that wrote it)"),
    (b'{"format": "shardc-manifest", "format_version": true}',
     "m.json has format_version True; this shardc reads 1, 2, 3 and 4 (hint: use the shardc version that wrote it)"),
    (b'{"format": "shardc-manifest"}',
     "m.json has format_version None; this shardc reads 1, 2, 3 and 4 (hint: use the shardc version that wrote it)"),
])
def test_what_is_not_a_manifest_of_this_shardc(data, line):
    with pytest.raises(ManifestError) as e:
        loads(data, "m.json")
    assert e.value.one_line() == line


def test_default_origin_is_manifest():
    d = base()
    del d["plan_sha256"]
    with pytest.raises(ManifestError) as e:
        loads(json.dumps(d))
    assert e.value.one_line() == "plan_sha256: manifest: is missing" + HINT
    with pytest.raises(ManifestError) as e:
        Manifest.from_dict([])
    assert e.value.one_line().startswith("manifest is not a shardc manifest")


def test_loads_names_its_origin():
    with pytest.raises(ManifestError) as e:
        loads(b"{", "x.json")
    assert e.value.one_line() == "x.json is not JSON (hint: pass the manifest.json that shardc build wrote)"
    with pytest.raises(ManifestError) as e:
        loads(b"{")
    assert e.value.one_line() == "manifest is not JSON (hint: pass the manifest.json that shardc build wrote)"


def test_zero_pipeline_stages_are_refused():
    d = base()
    d["layout"]["pp_degree"], d["layout"]["stages"] = 0, []
    with pytest.raises(ManifestError) as e:
        _parse(d)
    assert e.value.one_line() == _err("layout.pp_degree", "is 0, outside 1..4096")


@pytest.mark.parametrize(("quant", "torch_dtype", "base"), [
    ({"base_dtype": "fp16"}, "bfloat16", "F16"),  # the plan's word wins
    (None, "float16", "F16"),  # else the source's 16-bit dtype
    (None, "float32", "BF16"),  # else bf16
])
def test_new_manifest_records_the_layout_it_was_built_from(quant, torch_dtype, base):
    """tp=4 pp=2 int8, vocabulary 102 (padded to 104 for tp=4); files and shards handed over out
    of order come out sorted by name and by rank."""
    from shardc.compiler.synthetic import llama_config
    from shardc.formats.manifest import FileEntry, ShardEntry, SourceRecord, new_manifest
    from shardc.layout.model import model_from_config
    from shardc.layout.plan import plan_from_dict
    from shardc.layout.ranks import build_layout

    cfg = llama_config(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
                       vocab_size=102)
    cfg["torch_dtype"] = torch_dtype
    plan_data = {"replica_group": {"name": "nm", "tp_degree": 4, "pp_degree": 2, "dtype": "int8",
                                   "gpus_per_replica": 8}, "model": {"source": "x"}}
    if quant:
        plan_data["quantization"] = quant
    plan = plan_from_dict(plan_data)
    layout = build_layout(model_from_config(cfg), plan)
    shards = [ShardEntry(rl.file, rl.tp_rank, rl.pp_stage, rl.rank, (0, 1), 1, H["0"],
                         {t.name: t.record() for t in rl.tensors}) for rl in reversed(layout.ranks)]
    files = [FileEntry("z.json", 1, H["1"]), FileEntry("config.json", 2, H["2"])]
    source = SourceRecord("/src", "rev", [])
    m = new_manifest(layout, source, shards, files)
    assert m.plan == plan.data and m.plan_sha256 == plan.sha256 and m.source is source
    assert [s.rank for s in m.shards] == list(range(8)) and [f.name for f in m.files] == ["config.json", "z.json"]
    assert (m.layout.tp_degree, m.layout.pp_degree, m.layout.base_dtype, m.layout.dtype) == (4, 2, base, "int8")
    assert m.layout.stages == [tuple(s) for s in layout.stages] and len(m.layout.stages) == 2
    assert m.model["padded_vocab_size"] == 104 and m.model["vocab_size"] == 102 and m.config == cfg
    assert (m.model["num_layers"], m.model["num_kv_heads"], m.model["hidden_size"]) == (4, 4, 64)
    assert m.world_size == 8
    back = m.to_layout()  # the layout recomputed from what the manifest recorded
    assert [rl.file for rl in back.ranks] == [rl.file for rl in layout.ranks] and back.padded_vocab == 104
    assert Manifest.from_dict(m.to_dict()).to_layout().plan.sha256 == plan.sha256
