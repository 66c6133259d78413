"""The build's data path: casts without torch, direct I/O, full disks and failing writes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cli_run import shardc_in
from plan_helpers import plan_data
from reassemble import reassemble
from safetensors.torch import load_file, save_file

from shardc.compiler.compile import build
from shardc.formats.safetensors import STAGE_BYTES, ShardWriter
from shardc.layout.plan import plan_from_dict

TINY = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
            vocab_size=256)


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if not p.name.startswith(".")}


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """[256, 256] holding every 16-bit pattern once (a float32 source gets a spread of values
    around every 16-bit boundary case instead: ties, subnormals, overflow, inf, nan)."""
    if dtype == torch.float32:
        base = torch.arange(1 << 16, dtype=torch.int32).view(-1) << 16
        jitter = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
        bits = (base[:, None] + jitter[None, :]).reshape(-1)[: 1 << 16]
        return bits.view(torch.float32).reshape(256, 256)
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)


@pytest.mark.parametrize(("src_dtype", "plan_dtype"), [
    ("bfloat16", "fp16"), ("float16", "bf16"), ("float32", "bf16"), ("float32", "fp16"),
])
def test_casts_match_torch_for_every_bit_pattern(make_ckpt, tmp_path, src_dtype, plan_dtype):
    """The build casts with numpy + ml_dtypes; torch's round-to-nearest-even is the reference."""
    ckpt = make_ckpt(**TINY, torch_dtype=src_dtype)
    sd = load_file(ckpt / "model.safetensors")
    src = every_pattern(getattr(torch, src_dtype))
    sd["model.embed_tokens.weight"] = src
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    res = build(plan_from_dict(plan_data(2, 1, plan_dtype)).with_source(str(ckpt)), tmp_path / "o")
    got = reassemble(res.out_dir)["model.embed_tokens.weight"]
    want = src.to({"fp16": torch.float16, "bf16": torch.bfloat16}[plan_dtype])
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_direct_and_buffered_io_write_the_same_bytes(make_ckpt, tmp_path):
    """O_DIRECT pads the last block and truncates; the page-cache path writes as is. Shapes
    are chosen so that shard sizes are not block multiples and cross several staging buffers."""
    probe = ShardWriter(tmp_path / "probe.safetensors", [("x", "F16", (1,))])
    probe.abort()
    if not probe.direct:
        pytest.skip("this filesystem refuses O_DIRECT: both runs would take the same path")
    ckpt = make_ckpt(hidden_size=1032, intermediate_size=2064, num_layers=3, num_heads=8,
                     num_kv_heads=4, vocab_size=1001)
    plan = plan_from_dict(plan_data(2, 2, "fp16")).with_source(str(ckpt))
    script = ("import sys; from shardc.compiler.compile import build; from shardc.layout.plan import load_plan; "
              "build(load_plan(sys.argv[1]).with_source(sys.argv[2]), sys.argv[3])")
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(yaml.safe_dump(plan_data(2, 2, "fp16")))
    env_off = {**__import__("os").environ, "SHARDC_DIRECT_IO": "0"}
    subprocess.run([sys.executable, "-c", script, str(plan_file), str(ckpt), str(tmp_path / "buffered")],
                   check=True, env=env_off)
    direct = build(plan, tmp_path / "direct")
    sizes = [s.size for s in direct.manifest.shards]
    assert any(s % 4096 for s in sizes) and max(sizes) > 2 * STAGE_BYTES
    assert digests(tmp_path / "direct") == digests(tmp_path / "buffered")
    for s in direct.manifest.shards:  # the manifest's hashes are those of the files on disk
        assert hashlib.sha256((tmp_path / "direct" / s.file).read_bytes()).hexdigest() == s.sha256


@pytest.fixture
def small_fs(tmpfs):
    """A real 6 MiB tmpfs (tmpfs may or may not take O_DIRECT: either way must work)."""
    return tmpfs("small", "6M")


def _cli_build(plan_file: Path, ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return shardc_in("build", plan_file, "--source", ckpt, "--out", out, "--manifests-dir", out.parent / "m", "--quiet")


def test_too_little_disk_is_refused_before_writing(make_ckpt, tmp_path, small_fs):
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(yaml.safe_dump(plan_data(2, 1)))
    # a build that fits: tmpfs takes it, with or without O_DIRECT, byte for byte
    small = make_ckpt("small", **TINY)  # 2.5 MiB of shards
    r = _cli_build(plan_file, small, small_fs / "o")
    assert r.returncode == 0, r.stderr
    before = digests(small_fs / "o")
    assert before == digests(build(plan_from_dict(plan_data(2, 1)).with_source(str(small)), tmp_path / "ref").out_dir)
    # one that does not: refused up front, and the build already there is left whole
    big = make_ckpt("big", **{**TINY, "vocab_size": 8192})  # 10.6 MiB
    r = _cli_build(plan_file, big, small_fs / "o")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "MiB free" in lines[0] and "--out" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert digests(small_fs / "o") == before and (small_fs / "o" / "manifest.json").is_file()
    assert not list((small_fs / "o").glob(".*.tmp"))


def test_failed_write_keeps_finished_stages_and_a_rerun_resumes(make_ckpt, tmp_path):
    """A directory squats on a stage-1 shard's name: the rename into place fails mid-build."""
    ckpt = make_ckpt(**TINY)
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(yaml.safe_dump(plan_data(2, 2, name="io")))
    out = tmp_path / "o"
    (out / "model-tp01-pp01.safetensors").mkdir(parents=True)
    r = _cli_build(plan_file, ckpt, out)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model-tp01-pp01.safetensors" in lines[0] and "rerun" in lines[0], r.stderr
    assert not (out / "manifest.json").exists()
    assert (out / "model-tp00-pp00.safetensors").is_file() and (out / ".model-tp00-pp00.safetensors.done.json").is_file()
    assert not list(out.glob(".*.tmp"))
    (out / "model-tp01-pp01.safetensors").rmdir()
    r = shardc_in("build", plan_file, "--source", ckpt, "--out", out, "--manifests-dir", tmp_path / "m", "--quiet",
                  "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert {"model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"} <= set(summary["skipped"])
    assert "model-tp01-pp01.safetensors" in summary["built"]
    clean = build(plan_from_dict(plan_data(2, 2, name="io")).with_source(str(ckpt)), tmp_path / "clean")
    assert digests(out) == digests(clean.out_dir)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8", "fp8"])
def test_builds_never_import_torch(make_ckpt, tmp_path, dtype):
    """torch's import costs 1-2 s of CPU (~4 s from a cold page cache): a build casts in numpy
    and quantizes with numba kernels instead, and a 16-bit build does not load numba either."""
    ckpt = make_ckpt(**TINY)
    numba = dtype in ("int8", "fp8")
    code = ("import sys; from shardc.compiler.compile import build; from shardc.layout.plan import plan_from_dict; "
            f"build(plan_from_dict({plan_data(2, 2, dtype)!r}).with_source({str(ckpt)!r}), "
            f"{str(tmp_path / 'o')!r}); assert 'torch' not in sys.modules, 'torch was imported'; "
            f"assert ('numba' in sys.modules) == {numba}, 'numba: expected {numba}'")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(list((tmp_path / "o").glob("*.safetensors"))) == 4
