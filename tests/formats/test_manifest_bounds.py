"""Manifests that cost work before they are refused (issue #25 items 7 and 8), against every reader.

Item 7: a manifest nested thousands of levels deep (past the JSON decoder's own limit) or merely
deeper than any real one (past MAX_NESTING, within the decoder's) is one line, exit 2, for verify,
pull, load_shard, inspect and reshard's input, never a RecursionError. Item 8: a 2 KB manifest
declaring tp=64 over 1000 layers used to be expanded into a Layout of 600,000 tensor records
before it was refused (10 s, 400 MB); it must be refused by the bound check, before any Layout is
built (the tests prove that by making build_layout fail the test if it is called). The expected
lines are written out by hand; the crafted files are real files on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_run import shardc
from plan_helpers import plan as make_plan

from shardc.errors import ManifestError

HINT = "(hint: the manifest is damaged; rebuild, or pass the manifest.json that shardc build wrote)"


def _one_line(p: subprocess.CompletedProcess, line: str) -> None:
    assert (p.returncode, p.stderr) == (2, line + "\n"), p.stdout + p.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One tiny real build (tp=2, 2 layers): the manifest every crafted one starts from."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("bounds")
    src = write_checkpoint(root / "src", llama_config(num_layers=2, hidden_size=64, intermediate_size=96))
    plan = make_plan(2, name="bounds", source=src)
    return build(plan, out_dir=root / "b").manifest_path


def _planted(built: Path, tmp: Path, text: str) -> Path:
    """A build directory (the real shards, hard-linked) whose manifest.json is ``text``."""
    d = tmp / "planted"
    d.mkdir()
    for f in built.parent.iterdir():
        if f.is_file() and f.name != "manifest.json":
            os.link(f, d / f.name)
    (d / "manifest.json").write_text(text)
    return d / "manifest.json"


def _deep(built: Path, depth: int) -> str:
    """The real manifest with ``depth`` nested arrays planted in its model config."""
    m = json.loads(built.read_text())
    m["model"]["config"]["deep"] = None
    return json.dumps(m).replace('"deep": null', '"deep": ' + "[" * depth + "]" * depth)


def _hostile(built: Path, tp: int = 64, layers: int = 1000, shards: bool = False) -> dict:
    """The real manifest claiming tp ranks over ``layers`` layers (a consistent plan and config, a
    valid plan hash): with no shard entries, or (``shards``) one entry per rank, one record each."""
    from shardc.layout.plan import data_sha256

    m = json.loads(built.read_text())
    m["plan"]["replica_group"].update(tp_degree=tp, gpus_per_replica=tp)
    m["plan_sha256"] = data_sha256(m["plan"])
    m["model"]["config"].update(num_hidden_layers=layers, num_attention_heads=tp, num_key_value_heads=tp,
                                hidden_size=4 * tp, intermediate_size=4 * tp, head_dim=4)
    m["layout"].update(tp_degree=tp, stages=[[0, layers]])
    entry = next(iter(m["shards"].values()))
    one = {"model.norm.weight": entry["tensors"]["model.norm.weight"]}
    m["shards"] = {f"model-tp{r:02d}-pp00.safetensors": {**entry, "tp_rank": r, "rank": r, "layers": [0, layers],
                                                          "tensors": one} for r in range(tp)} if shards else {}
    return m


@pytest.fixture
def no_layout(monkeypatch):
    """Any Layout built from a manifest fails the test: the refusal must come first."""
    import shardc.formats.manifest as fm

    def refuse(*a, **k):
        raise AssertionError("a Layout was built before the manifest was refused")

    monkeypatch.setattr(fm, "build_layout", refuse)


# -- item 7: nesting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [5000, 100])
def test_deep_manifest_is_one_line_for_every_reader(built, tmp_path, depth):
    """5000 levels end in the decoder's RecursionError, 100 pass it and the depth check stops them:
    both are the same line (the path to the level past 64 when the decoder did not stop first) for
    verify, a local pull, inspect (file and directory) and reshard's input."""
    m = _planted(built, tmp_path, _deep(built, depth))
    key = "manifest" if depth == 5000 else "model.config.deep" + "[0]" * 14 + "[..."  # 60 characters, then ...
    line = f"error: {key}: {m}: is nested deeper than 64 levels {HINT}"
    _one_line(shardc("verify", "--manifest", str(m)), line)
    _one_line(shardc("inspect", str(m)), line)
    _one_line(shardc("inspect", str(m.parent)), line)
    dest = tmp_path / "dest"
    _one_line(shardc("pull", "--manifest", str(m), "--all", "--dest", str(dest), "-q"), line)
    assert not dest.exists() or not any(dest.iterdir())  # refused before anything was written
    plan = tmp_path / "to.yaml"
    plan.write_text(f"replica_group: {{name: to, tp_degree: 1, pp_degree: 1, dtype: bf16, gpus_per_replica: 1}}\n"
                    f"model: {{source: {built.parent}}}\n")
    out = tmp_path / "out"
    _one_line(shardc("reshard", "--manifest", str(m), "--plan", str(plan), "--out", str(out), "-q",
                   "--manifests-dir", str(tmp_path / "mf")), line)
    assert not out.exists()


def test_deep_manifest_load_shard_and_dicts(built, tmp_path):
    """load_shard by path and by dict: a ManifestError with the same message; a caller's dict
    holding a cycle, a set or a key that is not a string is one ManifestError too."""
    import shardc

    m = _planted(built, tmp_path, _deep(built, 5000))
    with pytest.raises(ManifestError) as e:
        shardc.load_shard(m, 0, 0, device="cpu")
    assert e.value.message == f"{m}: is nested deeper than 64 levels" and e.value.key == "manifest"
    deep = json.loads(_deep(built, 70))
    with pytest.raises(ManifestError) as e:
        shardc.load_shard(deep, 0, 0, device="cpu", directory=built.parent)
    assert e.value.message == "manifest: is nested deeper than 64 levels"
    assert e.value.key == "model.config.deep" + "[0]" * 14 + "[..."  # 60 characters, then ...
    good = json.loads(built.read_text())
    cyclic = json.loads(built.read_text())
    cyclic["model"]["config"]["self"] = cyclic
    odd = {**good, "plan": {**good["plan"], "x": {1, 2}}}
    keyed = {**good, "model": {**good["model"], ("a", "b"): 1}}
    for bad, why in ((cyclic, "Circular reference detected"), (odd, "Object of type set is not JSON serializable"),
                     (keyed, "keys must be str, int, float, bool or None, not tuple")):
        with pytest.raises(ManifestError) as e:
            shardc.load_shard(bad, 0, 0, device="cpu", directory=built.parent)
        assert e.value.message == f"manifest: is not plain JSON data ({why})", why
    assert sorted(shardc.load_shard(good, 1, 0, device="cpu", directory=built.parent))  # the real one loads


def test_nesting_limit_is_64_levels(built):
    """64 levels in all read; 65 do not (the config sits at level 3: its value adds the rest)."""
    from shardc.formats.manifest import loads

    assert loads(_deep(built, 61)).config["deep"] is not None  # manifest, model, config, 61 arrays: 64
    with pytest.raises(ManifestError, match="nested deeper than 64 levels"):
        loads(_deep(built, 62))


# -- item 8: bounded work before validation ------------------------------------------------------------
def test_hostile_degrees_refused_before_any_layout(built, tmp_path, no_layout):
    """tp=64 over 1000 layers with no shard entries, then with 64 entries of one record each: the
    shard count, then the record count, refuses it; build_layout is never reached."""
    from shardc.formats.manifest import loads

    with pytest.raises(ManifestError) as e:
        loads(json.dumps(_hostile(built)), "h.json")
    assert (e.value.key, e.value.message) == ("shards", "h.json: lists 0 shard(s); its plan (tp_degree=64, "
                                                        "pp_degree=1) has 64")
    with pytest.raises(ManifestError) as e:
        loads(json.dumps(_hostile(built, shards=True)), "h.json")
    assert (e.value.key, e.value.message) == ("shards", "h.json: lists 64 tensor record(s) in all; 1000 layers "
                                                        "on 64 TP rank(s) need at least 64000")
    import shardc

    with pytest.raises(ManifestError, match="lists 0 shard"):
        shardc.load_shard(_hostile(built, 128, 2000), 0, 0, device="cpu", directory=built.parent)


def test_bound_is_exact_at_the_floor(built):
    """Exactly tp x layers records pass the bound (and go on to the Layout); one fewer does not;
    one shard entry too many or too few is refused."""
    from shardc.formats.manifest import loads

    real = json.loads(built.read_text())
    assert len(loads(json.dumps(real)).shards) == 2
    m = json.loads(built.read_text())
    m["model"]["config"]["num_hidden_layers"] = 11  # 2 TP ranks x 11 layers = 22 records at the least
    records = sum(len(e["tensors"]) for e in m["shards"].values())
    assert records > 22
    files = sorted(m["shards"])
    keep = dict(list(m["shards"][files[0]]["tensors"].items())[:11])
    for f in files:
        m["shards"][f]["tensors"] = keep
    assert loads(json.dumps(m)).shards  # 22 records: read (verify reports what the Layout lacks)
    m["shards"][files[1]]["tensors"] = dict(list(keep.items())[:10])
    with pytest.raises(ManifestError, match=r"lists 21 tensor record\(s\) in all; 11 layers on 2 TP rank\(s\) "
                                            r"need at least 22"):
        loads(json.dumps(m))
    extra = json.loads(built.read_text())
    extra["shards"]["model-tp02-pp00.safetensors"] = {**extra["shards"][files[0]], "tp_rank": 2, "rank": 2}
    with pytest.raises(ManifestError, match=r"lists 3 shard\(s\); its plan \(tp_degree=2, pp_degree=1\) has 2"):
        loads(json.dumps(extra))
    del extra["shards"]["model-tp02-pp00.safetensors"], extra["shards"][files[1]]
    with pytest.raises(ManifestError, match=r"lists 1 shard\(s\)"):
        loads(json.dumps(extra))


def test_hostile_degrees_cli_verify_and_pull(built, tmp_path):
    """The CLI: verify and a local pull of the crafted files say the one line, exit 2, and pull
    writes nothing into its destination."""
    for shards, tail in ((False, "lists 0 shard(s); its plan (tp_degree=64, pp_degree=1) has 64"),
                         (True, "lists 64 tensor record(s) in all; 1000 layers on 64 TP rank(s) need at least 64000")):
        d = tmp_path / f"h{shards}"
        d.mkdir()
        m = d / "manifest.json"
        m.write_text(json.dumps(_hostile(built, shards=shards)))
        line = f"error: shards: {m}: {tail} {HINT}"
        _one_line(shardc("verify", "--manifest", str(m)), line)
        dest = tmp_path / f"dest{shards}"
        _one_line(shardc("pull", "--manifest", str(m), "--all", "--dest", str(dest), "-q"), line)
        assert not dest.exists() or not any(dest.iterdir())
