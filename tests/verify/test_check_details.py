"""verify/checks.py behaviours that mutation testing found unchecked: the warning that a rank's
weights plus the plan's KV-cache cap exceed host memory (at its exact threshold, with the memory
read from /proc/meminfo, not from the code under test), and the plan-mismatch line."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from manifest_edits import reseal
from plan_helpers import plan_data

from shardc.compiler.compile import build
from shardc.results import to_json
from shardc.verify.checks import plan_mismatch, verify_build

CFG = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)
GiB = 2**30
TENSOR_REC = {"dtype": "BF16", "shape": [1], "source": "bogus.weight", "split": "replicated"}


def _plan_data(name: str, cap: float | None) -> dict:
    return plan_data(1, 1, name=name, group={} if cap is None else {"kv_cache_cap_gb": cap})


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def _data_bytes(shard: Path) -> int:
    """The tensor bytes of a safetensors file: all of it but the 8-byte length and the header."""
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    return shard.stat().st_size - 8 - n


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("c") / "src", llama_config(**CFG))


def _warnings(src: Path, out: Path, cap: float | None) -> tuple[list[str], int]:
    from shardc.layout.plan import plan_from_dict

    res = build(plan_from_dict(_plan_data("c", cap)).with_source(str(src)), out)
    (rank,) = verify_build(res.manifest, res.out_dir, device="cpu").ranks
    assert rank.ok, rank
    return list(rank.warnings), _data_bytes(res.out_dir / res.manifest.shards[0].file)


def _gib(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def test_kv_cap_that_exceeds_host_memory_is_a_warning(src, tmp_path):
    total = _host_memory()
    # one byte over: weights + cap = total + 1 (exact in floats: far below 2^53)
    probe, nbytes = _warnings(src, tmp_path / "probe", None)
    assert probe == []
    cap = (total + 1 - nbytes) / GiB
    got, _ = _warnings(src, tmp_path / "over", cap)
    assert got == [f"weights {_gib(nbytes)} + KV cap {_gib(cap * GiB)} exceed host memory ({_gib(total)})"]
    at, _ = _warnings(src, tmp_path / "at", (total - nbytes) / GiB)  # exactly fits: no warning
    assert at == []
    small, _ = _warnings(src, tmp_path / "small", 1.0)
    assert small == []


def test_plan_mismatch_names_both_plans_by_12_hex_digits(src, tmp_path):
    from shardc.layout.plan import plan_from_dict

    res = build(plan_from_dict(_plan_data("built", None)).with_source(str(src)), tmp_path / "o")
    other = plan_from_dict(_plan_data("other", None))
    # the build read --source src: the plan as applied matches, the plan alone does not
    assert plan_mismatch(res.manifest, plan_from_dict(_plan_data("built", None)).with_source(str(src)), "p.yaml") is None
    assert plan_mismatch(res.manifest, plan_from_dict(_plan_data("built", None)), "p.yaml") is not None
    assert plan_mismatch(res.manifest, other, "p.yaml") == (
        f"the manifest is of plan 'built' (sha256 {res.manifest.plan_sha256[:12]}), not of p.yaml "
        f"(plan 'other', sha256 {other.sha256[:12]}); pass the manifest built from this plan")
    assert len(res.manifest.plan_sha256) == 64 and res.manifest.plan_sha256 != other.sha256


def test_deep_against_a_build_as_the_reference(src, tmp_path):
    """verify --deep may name a build (a reshard's input) instead of a checkpoint: a tp=2 build
    checked against a tp=1 build of the same checkpoint agrees byte for byte."""
    from shardc.layout.plan import plan_from_dict

    ref = build(plan_from_dict(_plan_data("ref", None)).with_source(str(src)), tmp_path / "ref")
    d = _plan_data("tp2", None)
    d["replica_group"].update(tp_degree=2, gpus_per_replica=2)
    res = build(plan_from_dict(d).with_source(str(src)), tmp_path / "tp2")
    out = verify_build(res.manifest, res.out_dir, deep=str(ref.out_dir))
    assert out.ok, out.problems
    assert all("deep" in r.checks for r in out.ranks)
    out = verify_build(res.manifest, res.out_dir, deep=str(ref.manifest_path))
    assert out.ok, out.problems


BASE_CHECKS = ["present", "size", "sha256", "header", "metadata", "tensor-set", "dtype-shape", "extent"]


def test_checks_run_are_listed_and_deep_trims_vocab_padding(src, tmp_path):
    """Vocabulary 62 at tp=4 pads to 64: the last rank's embedding and lm_head slices end in two
    zero rows, which --deep trims before comparing with the checkpoint (a clean build passes).
    Every rank lists the checks it ran, in order."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    ck = write_checkpoint(tmp_path / "src62", llama_config(**{**CFG, "vocab_size": 62}))
    d = _plan_data("pad", None)
    d["replica_group"].update(tp_degree=4, gpus_per_replica=4)
    res = build(plan_from_dict(d).with_source(str(ck)), tmp_path / "o")
    assert res.manifest.model["padded_vocab_size"] == 64
    out = verify_build(res.manifest, res.out_dir, deep=str(ck))
    assert out.ok, out.problems
    assert [list(r.checks) for r in out.ranks] == [BASE_CHECKS + ["deep"]] * 4
    out = verify_build(res.manifest, res.out_dir, device="cpu")
    assert [list(r.checks) for r in out.ranks] == [BASE_CHECKS + ["load:cpu"]] * 4


def _rehash(d: Path, file: str) -> None:
    import json

    m = json.loads((d / "manifest.json").read_text())
    reseal(m["shards"][file], (d / file).read_bytes())
    (d / "manifest.json").write_text(json.dumps(m))


def test_header_problems_are_named(src, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardc.formats.manifest import load
    from shardc.layout.plan import plan_from_dict

    res = build(plan_from_dict(_plan_data("h", None)).with_source(str(src)), tmp_path / "o")
    file = res.manifest.shards[0].file
    path = res.out_dir / file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del tensors["model.norm.weight"]
    save_file(tensors, str(path), metadata=meta)
    _rehash(res.out_dir, file)
    out = verify_build(load(res.out_dir / "manifest.json"), res.out_dir)
    assert list(out.problems) == [f"{file}: missing tensor model.norm.weight"]
    assert to_json(out.ranks) == [{"file": file, "tp_rank": 0, "pp_stage": 0, "rank": 0, "ok": False,
                             "problems": list(out.problems), "warnings": [],
                             "checks": BASE_CHECKS}]  # the checks that ran, not only those passed
    path.write_bytes(struct.pack("<Q", 2) + b"[]")  # a header that is JSON but not an object
    _rehash(res.out_dir, file)
    out = verify_build(load(res.out_dir / "manifest.json"), res.out_dir)
    (problem,) = out.problems
    assert problem.startswith(f"{file}: safetensors header does not parse (") and "JSON object" in problem


def test_a_manifest_whose_plan_hash_is_not_its_plans(src, tmp_path):
    import dataclasses

    from shardc.layout.plan import plan_from_dict
    from shardc.verify.checks import check_manifest_against_layout

    res = build(plan_from_dict(_plan_data("p", None)).with_source(str(src)), tmp_path / "o")
    layout = res.manifest.to_layout()
    assert check_manifest_against_layout(res.manifest, layout) == []
    edited = dataclasses.replace(res.manifest, plan_sha256="0" * 64)
    assert check_manifest_against_layout(edited, layout) == [
        "manifest plan_sha256 does not match the hash of its own plan"]


def test_a_shard_cut_short_is_named_with_or_without_device(src, tmp_path):
    """A shard cut 2 bytes short (its manifest entry re-hashed to match, so size and sha256 agree):
    its header still parses, but the last tensor's data would end past the end of the file. verify
    names it from the header alone, without --device as with it (the safetensors library refuses
    such a file when it opens it)."""
    from shardc.formats.manifest import load
    from shardc.layout.plan import plan_from_dict

    res = build(plan_from_dict(_plan_data("t", None)).with_source(str(src)), tmp_path / "o")
    file = res.manifest.shards[0].file
    path = res.out_dir / file
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    _rehash(res.out_dir, file)
    (n,) = struct.unpack("<Q", data[:8])
    end = len(data) - 8 - n  # the data section's length before the cut
    want = [f"{file}: safetensors data layout: the tensors' data ends at {end}, the file's data "
            f"section holds {end - 2} bytes (the file is cut short)"]
    for device in (None, "cpu"):
        out = verify_build(load(res.out_dir / "manifest.json"), res.out_dir, device=device)
        assert list(out.problems) == want
        assert out.ranks[0].ok is False  # the rank's own verdict, not only the build's


def test_extent_problems_follow_the_safetensors_rule():
    """Each way a header can misplace data, against byte counts written out by hand."""
    from shardc.formats.safetensors import extent_problem

    def t(dtype, shape, b, e):
        return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}

    ok = {"a": t("BF16", [2, 3], 0, 12), "b": t("F32", [2], 12, 20), "c": t("I8", [0], 20, 20)}
    assert extent_problem(ok, 20) is None
    assert extent_problem({"x": t("C64", [3], 0, 5)}, 5) is None  # unknown dtype: tiling only
    assert extent_problem(ok, 21) == "the tensors' data ends at 20, the file's data section holds 21 bytes"
    assert extent_problem({**ok, "b": t("F32", [2], 12, 16), "c": t("I8", [4], 16, 20)}, 20) == (
        "tensor b: data_offsets [12, 16] hold 4 bytes, its F32[2] needs 8")
    assert extent_problem({"a": t("BF16", [2], 4, 8)}, 8) == (
        "tensor a: data starts at 4, expected 0 (a gap)")
    assert extent_problem({"a": t("BF16", [4], 0, 8), "b": t("BF16", [2], 4, 8)}, 8) == (
        "tensor b: data starts at 4, expected 8 (overlapping the previous tensor)")
    assert extent_problem({"a": t("BF16", [4], 0, 8), "b": t("BF16", [4], 0, 8)}, 8) == (
        "tensor b: data starts at 0, expected 8 (overlapping the previous tensor)")


def test_side_file_problems_each_named(src, tmp_path):
    """config.json and (tp = 1) the index: an edited manifest entry, a file changed on disk at
    the same size, an entry missing while a later file is missing too (both reported), an index
    listed by a tp=2 manifest, and a shard the manifest lacks."""
    import dataclasses

    from shardc.compiler.outputs import INDEX, side_files
    from shardc.formats.manifest import FileEntry
    from shardc.layout.plan import plan_from_dict
    from shardc.verify.checks import check_side_files

    res = build(plan_from_dict(_plan_data("s", None)).with_source(str(src)), tmp_path / "o")
    m, d = res.manifest, res.out_dir
    layout = m.to_layout()
    assert check_side_files(m, layout, d) == []
    cfg = d / "config.json"
    good = cfg.read_bytes()
    cfg.write_bytes(good.replace(b"{", b"[", 1))  # same size, other bytes
    assert check_side_files(m, layout, d) == ["config.json: size or sha256 differs from the manifest"]
    cfg.write_bytes(good)
    edited = dataclasses.replace(m, files=[dataclasses.replace(f, sha256="0" * 64) if f.name == "config.json"
                                           else f for f in m.files])
    assert check_side_files(edited, layout, d) == [
        "manifest's config.json is not the one this plan's build writes (an older shardc, or edited)",
        "config.json: size or sha256 differs from the manifest"]
    first, second = list(side_files(layout))
    assert {first, second} == {"config.json", INDEX}
    (d / second).unlink()
    unlisted = dataclasses.replace(m, files=[f for f in m.files if f.name != first])
    assert check_side_files(unlisted, layout, d) == [f"manifest does not list {first}",
                                                     f"{second}: missing (expected at {d / second})"]
    d2 = _plan_data("s2", None)
    d2["replica_group"].update(tp_degree=2, gpus_per_replica=2)
    res2 = build(plan_from_dict(d2).with_source(str(src)), tmp_path / "o2")
    extra = dataclasses.replace(res2.manifest, files=[*res2.manifest.files, FileEntry(INDEX, 1, "0" * 64)])
    assert check_side_files(extra, res2.manifest.to_layout(), res2.out_dir) == [
        f"manifest lists {INDEX}, which a tp=2 build does not have"]
    lacking = dataclasses.replace(res2.manifest, shards=res2.manifest.shards[:1])
    out = verify_build(lacking, res2.out_dir)
    lost = res2.manifest.shards[1].file
    assert list(out.problems) == [f"manifest lacks shard {lost} that the plan requires", f"{lost}: not in the manifest"]
    from shardc.verify.checks import check_manifest_against_layout

    s0, s1 = res2.manifest.shards
    both = dataclasses.replace(res2.manifest, shards=[dataclasses.replace(s1, rank=0)])  # rank 0 gone, rank 1 wrong
    assert check_manifest_against_layout(both, res2.manifest.to_layout()) == [
        f"manifest lacks shard {s0.file} that the plan requires", f"manifest entry {s1.file} has the wrong ranks"]
    tensors = {k: v for k, v in s0.tensors.items() if k != "model.norm.weight"} | {"bogus.weight": TENSOR_REC}
    odd = dataclasses.replace(res2.manifest, shards=[dataclasses.replace(s0, tensors=tensors), s1])
    assert check_manifest_against_layout(odd, res2.manifest.to_layout()) == [
        f"manifest entry {s0.file} lists unexpected tensor bogus.weight",
        f"manifest entry {s0.file} lacks tensor model.norm.weight"]


def test_digests_given_are_used_and_ranks_can_be_chosen(src, tmp_path):
    """``hashed`` (digests a pull took while downloading) stands in for reading the file: a wrong
    one is a mismatch, named by both hashes' first 16 digits. ``ranks`` verifies only those."""
    from shardc.layout.plan import plan_from_dict

    d = _plan_data("r", None)
    d["replica_group"].update(tp_degree=2, gpus_per_replica=2)
    res = build(plan_from_dict(d).with_source(str(src)), tmp_path / "o")
    s0, s1 = res.manifest.shards
    wrong = "f" * 64
    out = verify_build(res.manifest, res.out_dir, hashed={s0.file: wrong})
    assert list(out.problems) == [f"{s0.file}: sha256 {wrong[:16]}..., expected {s0.sha256[:16]}... (corrupted bytes)"]
    (res.out_dir / s1.file).unlink()  # only rank 0 is here, as after a pull of one rank
    layout = res.manifest.to_layout()
    out = verify_build(res.manifest, res.out_dir, ranks=[layout.ranks[0]])
    assert out.ok and [r.file for r in out.ranks] == [s0.file]
    assert {k: v for k, v in to_json(out).items() if k != "ranks"} == {
        "ok": True, "plan": "r", "plan_sha256": res.manifest.plan_sha256, "problems": []}
