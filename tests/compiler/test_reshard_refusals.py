"""Mutation-testing kills for ``shardc/compiler/reshard.py`` (docs/mutation-testing.md).

Every expected value is written here by hand or computed by the test from bytes it wrote (json,
struct, hashlib, numpy on the test's own arrays), never by the reshard code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from manifest_edits import reseal
from plan_helpers import plan as make_plan

from shardc.compiler.build_files import open_local_input
from shardc.compiler.build_tensors import BuildSource, _need_order
from shardc.compiler.compile import build
from shardc.compiler.reshard import reshard
from shardc.compiler.synthetic import llama_config, write_checkpoint
from shardc.errors import ManifestError, PlanError, VerifyMismatch
from shardc.layout.model import model_from_config
from shardc.layout.ranks import build_layout

GQA = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=100)
TOKENIZER = b'{"version": "1.0", "model": {"type": "mutants"}}\n'
EDITED = "the manifest was edited or is damaged; run shardc verify on the input"


def plan(ckpt: Path, tp: int, pp: int, dtype: str = "bf16", name: str = "t"):
    return make_plan(tp, pp, dtype, name=name, source=ckpt)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One checkpoint (with a tokenizer file of ours), its tp2 x pp2 bf16 build and tp2 int8 build."""
    root = tmp_path_factory.mktemp("rmut")
    ckpt = write_checkpoint(root / "ck", llama_config(**GQA), seed=0)
    (ckpt / "tokenizer.json").write_bytes(TOKENIZER)
    return {"root": root, "ckpt": ckpt, "a": build(plan(ckpt, 2, 2), root / "a").out_dir,
            "int8": build(plan(ckpt, 2, 1, "int8"), root / "a8").out_dir}


def copy_of(build_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(build_dir, tmp_path / "in"))


def edit_manifest(build_dir: Path, change) -> None:
    m = json.loads((build_dir / "manifest.json").read_text())
    change(m)
    (build_dir / "manifest.json").write_text(json.dumps(m))


# --- check_model: the first field that differs, named as config.json names it -------------------

@pytest.mark.parametrize(("change", "field", "theirs", "ours"), [
    ({"vocab_size": 128}, "vocab_size", 128, 100),  # a summary key config.json spells the same
    ({"num_kv_heads": 4}, "num_key_value_heads", 4, 2),  # one it spells otherwise
])
def test_plan_for_another_model_names_the_field(work, tmp_path, change, field, theirs, ours):
    other = write_checkpoint(tmp_path / "other", llama_config(**{**GQA, **change}), seed=0)
    out = tmp_path / "r"
    with pytest.raises(PlanError) as exc:
        reshard(open_local_input(work["a"]), plan(other, 1, 1), out)
    assert exc.value.one_line() == (
        f"{field}: the plan's model ({other}) has {field}={theirs} but the input build's model has "
        f"{field}={ours} (hint: reshard with a plan for the same model as the input build)")
    assert exc.value.exit_code == 2 and not out.exists()


# --- check_dtypes: the refusal names the tensor, both dtypes and the way out --------------------

@pytest.mark.parametrize(("dtype", "want"), [("bf16", "BF16"), ("fp8", "fp8")])
def test_quantized_input_to_another_dtype_is_refused_in_one_line(work, tmp_path, dtype, want):
    # a rank's tensors are in name order: layer 0's down_proj is its first quantized one
    out = tmp_path / "r"
    with pytest.raises(PlanError) as exc:
        reshard(open_local_input(work["int8"]), plan(work["ckpt"], 1, 1, dtype), out)
    assert exc.value.one_line() == (
        "replica_group.dtype: the input build holds model.layers.0.mlp.down_proj.weight as int8; a "
        f"{dtype} plan needs it as {want}, which means dequantizing (lossy) (hint: reshard to dtype int8 "
        "(exact), or use `dequantize` to accept the loss)")
    assert not out.exists()


# --- _check_records: the manifest's tensor records are its own plan's ---------------------------

def _edit_record(m: dict) -> None:
    rec = m["shards"]["model-tp01-pp01.safetensors"]["tensors"]["model.norm.weight"]
    rec["source"] = "model.layers.3.input_layernorm.weight"  # same shape and dtype: another tensor


def _rename_shard(m: dict) -> None:
    """The same number of shards (the manifest reader checks the count), one under another name."""
    m["shards"]["model-tp01-pp01.x.safetensors"] = m["shards"].pop("model-tp01-pp01.safetensors")


@pytest.mark.parametrize(("edit", "line"), [
    (_edit_record, "the input manifest's record of model-tp01-pp01.safetensors does not match its own plan"),
    (_rename_shard, "the input manifest's record of model-tp01-pp01.safetensors does not match its own plan"),
], ids=["edited-record", "renamed-shard"])
def test_manifest_records_must_be_its_plan_s(work, tmp_path, edit, line):
    inp = copy_of(work["a"], tmp_path)
    edit_manifest(inp, edit)
    out = tmp_path / "r"
    with pytest.raises(ManifestError) as exc:
        reshard(open_local_input(inp), plan(work["ckpt"], 1, 2), out)
    assert exc.value.one_line() == f"{line} (hint: {EDITED})"
    assert not out.exists()


# --- reshard(): where the output goes and what a failure leaves ---------------------------------

def test_output_onto_the_input_is_refused_in_one_line(work, tmp_path):
    inp = copy_of(work["a"], tmp_path)
    before = sorted(p.name for p in inp.iterdir())
    with pytest.raises(PlanError) as exc:
        reshard(open_local_input(inp), plan(work["ckpt"], 1, 2), inp)
    # the library names its field; the CLI (error_line) says --out
    assert exc.value.one_line() == (f"out: the output directory {inp} is the input build's own directory "
                                    "(hint: reshard into another directory)")
    assert sorted(p.name for p in inp.iterdir()) == before


def test_defaults_out_dir_manifests_copy_tokenizer_and_silence(work, tmp_path, monkeypatch, capsys):
    """No --out: build/<plan name> under the working directory, as build does; the rollout copy of
    the manifest goes where asked; the listed tokenizer file is copied as the input holds it; no
    progress bar unless asked."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    res = reshard(open_local_input(work["a"]), plan(work["ckpt"], 1, 2, name="mine"),
                  manifests_dir=tmp_path / "m")
    assert capsys.readouterr().err == ""
    out = tmp_path / "build" / "mine"
    assert (out / "manifest.json").is_file() and res.out_dir.resolve() == out
    assert (tmp_path / "m" / "mine.json").read_bytes() == (out / "manifest.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER
    names = {f["name"] for f in json.loads((out / "manifest.json").read_text())["files"]}
    assert "tokenizer.json" in names


def test_a_failed_reshard_keeps_an_output_directory_that_existed(work, tmp_path):
    """Only a directory this run created is removed after bad input; one the user made stays."""
    inp = copy_of(work["a"], tmp_path)
    victim = inp / "model-tp01-pp01.safetensors"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    out = tmp_path / "r"
    out.mkdir()
    with pytest.raises(VerifyMismatch) as exc:
        reshard(open_local_input(inp), plan(work["ckpt"], 1, 2), out)
    assert victim.name in exc.value.message
    assert out.is_dir() and not (out / "manifest.json").exists()


# --- _need_order: input files in the order the output's stages need them ------------------------

def test_input_files_are_scheduled_stage_by_stage(work):
    p = plan(work["ckpt"], 1, 2)
    layout = build_layout(model_from_config(json.loads((work["a"] / "config.json").read_text())), p)
    inp = open_local_input(work["a"])
    try:
        src = BuildSource(inp, layout)
        assert _need_order(src, layout) == ["model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors",
                                            "model-tp00-pp01.safetensors", "model-tp01-pp01.safetensors"]
    finally:
        inp.close()


# --- BuildSource as verify --deep's reference: each file checked before it is read --------------

def test_a_corrupted_reference_build_is_named_not_compared(work, tmp_path):
    """reshard reads while it hashes (and confirms before committing); verify --deep never commits,
    so its reference build's files are hashed before use: a flipped byte is the reference's
    corruption, not a deep-check difference of the verified build."""
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    out = reshard(open_local_input(work["a"]), plan(work["ckpt"], 1, 2), tmp_path / "r").out_dir
    ref = copy_of(work["a"], tmp_path)
    victim = ref / "model-tp01-pp01.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(VerifyMismatch) as exc:
        verify_build(load(out / "manifest.json"), out, deep=str(ref))
    # its manifest has chunk digests (one 16 MiB chunk here): the chunk is named, with its tensors
    n = int.from_bytes(data[:8], "little")
    names = ["<header>", *sorted(k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__")]
    assert exc.value.message == (f"input file {victim} is corrupted: sha256 of 1 of 1 chunk(s) differs from the "
                                 f"manifest: chunk 0 (bytes 0..{len(data)}: {', '.join(names[:3])} and "
                                 f"{len(names) - 3} more) (corrupted bytes)")


# --- _assemble_stored: replicas must be identical, the line names both files --------------------

def _flip_in(path: Path, name: str, at: int) -> None:
    """Flip one byte of tensor ``name`` (offsets from the test's own parse of the header)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + n])[name]["data_offsets"][0]
    raw[8 + n + begin + at] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("dtype", "tensor", "what"), [
    ("bf16", "model.layers.2.self_attn.v_proj.weight", "model.layers.2.self_attn.v_proj.weight"),
    ("int8", "model.layers.2.self_attn.v_proj.weight_scale", "model.layers.2.self_attn.v_proj.weight scales"),
])
def test_replicas_that_differ_are_named_in_one_line(work, tmp_path, dtype, tensor, what):
    """tp 8 with 2 KV heads: ranks 4-7 each hold KV head 1. Rank 5's copy edited, the manifest
    re-hashed to match: only the replica check sees it, naming rank 5's file and rank 4's."""
    a = build(plan(work["ckpt"], 8, 1, dtype), tmp_path / "a").out_dir
    victim = a / "model-tp05-pp00.safetensors"
    _flip_in(victim, tensor, 6)
    edit_manifest(a, lambda m: reseal(m["shards"][victim.name], victim.read_bytes()))
    out = tmp_path / "r"
    with pytest.raises(VerifyMismatch) as exc:
        reshard(open_local_input(a), plan(work["ckpt"], 2, 1, dtype), out)
    assert exc.value.one_line() == (
        f"tensor {tensor} of model-tp05-pp00.safetensors differs from its replica in model-tp04-pp00.safetensors "
        f"({what}) (hint: the input build's replicas must be identical; it was not written by shardc build)")
    assert not out.exists()


# --- round 3: check_dtypes, _check_records, BuildSource.__init__ --------------------------------

def _layout_for(build_dir: Path, p):
    """The output Layout of plan ``p`` over the input build's model, as reshard makes it."""
    return build_layout(model_from_config(json.loads((build_dir / "manifest.json").read_text())["model"]["config"]), p)


def test_a_manifest_listing_a_shard_its_plan_lacks_is_refused(work):
    """The manifest reader refuses a shard count other than tp x pp, so no file reaches this; a
    Manifest handed to BuildSource in memory with one entry too many is refused all the same."""
    import dataclasses

    inp = open_local_input(work["a"])
    try:
        extra = dataclasses.replace(inp.manifest.shards[0], file="model-tp07-pp07.safetensors")
        inp.manifest.shards.append(extra)
        with pytest.raises(ManifestError) as exc:
            BuildSource(inp, _layout_for(work["a"], plan(work["ckpt"], 1, 2)))
        assert exc.value.one_line() == f"the input manifest lists shards its plan does not have (hint: {EDITED})"
    finally:
        inp.close()


def test_build_source_refuses_a_lossy_plan_unless_asked(work):
    """``dequantize`` is off unless the caller says so: an int8 build read for a bf16 layout is
    refused as reshard refuses it; with ``dequantize=True`` the int8 weights are the ones dequantized."""
    layout = _layout_for(work["int8"], plan(work["ckpt"], 1, 1, "bf16"))
    inp = open_local_input(work["int8"])
    try:
        with pytest.raises(PlanError) as exc:
            BuildSource(inp, layout)
        assert exc.value.key == "replica_group.dtype"
        assert exc.value.message.startswith("the input build holds model.layers.0.mlp.down_proj.weight as int8")
        src = BuildSource(inp, layout, dequantize=True)
        projs = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        assert src.dequantized == {f"model.layers.{i}.{p}.weight" for i in range(4) for p in projs}
    finally:
        inp.close()


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute [begin, end) of tensor ``name``'s bytes (the test's own parse of the header)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def test_a_nan_payload_survives_reshard_and_the_deep_reference(tmp_path):
    """A 16-bit plan copies weights as they are, NaN payloads included (a signaling NaN, bf16
    0x7F81, planted in the checkpoint here). Resharded from two ranks to one, the tensor is the
    checkpoint's bytes exactly, and verify --deep against the input build (whose ranks its
    reference puts together again) passes: no float conversion on either way (one through float64
    turns 0x7F81 into 0x7FC0)."""
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    ckpt = write_checkpoint(tmp_path / "ck", llama_config(**GQA), seed=0)
    (src_file,) = ckpt.glob("*.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"  # split by rows at tp 2
    begin, end = _tensor_span(src_file, name)
    raw = bytearray(src_file.read_bytes())
    raw[begin + 2 * 70 : begin + 2 * 71] = b"\x81\x7f"  # element 70 (row 1): rank 0's piece
    src_file.write_bytes(bytes(raw))
    want = bytes(raw[begin:end])

    a = build(plan(ckpt, 2, 1), tmp_path / "a").out_dir
    out = reshard(open_local_input(a), plan(ckpt, 1, 1), tmp_path / "r").out_dir
    shard = out / "model-tp00-pp00.safetensors"
    b, e = _tensor_span(shard, name)
    assert shard.read_bytes()[b:e] == want
    report = verify_build(load(out / "manifest.json"), out, deep=str(a))
    assert report.ok and report.problems == ()
    assert all(r.ok and "deep" in r.checks for r in report.ranks)
