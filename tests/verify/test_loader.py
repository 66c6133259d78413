"""shardc.load_shard, device resolution and the GPU-count check, on CPU.

The loader's oracle is the safetensors library itself (``load_file``): every tensor load_shard returns
must equal it bit for bit. The GPU checks run against this machine's torch.cuda.device_count() (0 on
the CPU-only CI) and against CUDA_VISIBLE_DEVICES; the CUDA paths themselves run in
scripts/gpu_check.sh on a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_run import shardc
from manifest_edits import reseal
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")

from shardc.errors import DeviceError, ManifestError, VerifyMismatch  # noqa: E402
from shardc.loader.devices import check_gpus, resolve_device, visible_gpus  # noqa: E402
from shardc.loader.tensors import nonfinite  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("loader")
    src = write_checkpoint(root / "src", llama_config(num_layers=2, hidden_size=64, intermediate_size=96))
    out = {}
    for tp, pp, dtype in ((2, 1, "bf16"), (1, 2, "int8"), (1, 1, "fp8")):
        name = f"ld-tp{tp}pp{pp}-{dtype}"
        plan = make_plan(tp, pp, dtype, name=name, source=src)
        out[dtype] = build(plan, out_dir=root / name).manifest_path
    return out


def _entry(man: dict, rank: int) -> tuple[str, dict]:
    """(file name, the manifest's own entry dict) of a rank's shard, for a list of entries (format 1)
    or a mapping keyed by file name (format 2)."""
    shards = man["shards"]
    if isinstance(shards, dict):
        name = next(n for n, e in shards.items() if e.get("rank", None) == rank) if all(
            "rank" in e for e in shards.values()) else sorted(shards)[rank]
        return name, shards[name]
    return shards[rank]["file"], shards[rank]


# -- devices -------------------------------------------------------------------------------------------
def test_cuda_means_local_rank_and_cuda_n_means_n(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("cuda") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == "cuda:3"
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    assert resolve_device("cuda", rank=5) == "cuda:5" and resolve_device(None) is None
    with pytest.raises(DeviceError, match="not cpu, cuda or cuda:N"):
        resolve_device("tpu")


def test_gpu_count_check_is_one_line(monkeypatch):
    have = visible_gpus()
    assert have == torch.cuda.device_count()
    with pytest.raises(DeviceError) as e:
        check_gpus("big-tp4pp2", "cuda", have + 8)
    assert e.value.message == f"plan big-tp4pp2 needs {have + 8} GPUs on this node; {have} " \
                              f"{'is' if have == 1 else 'are'} visible"
    with pytest.raises(DeviceError, match=rf"needs {have + 3} GPUs"):
        check_gpus("p", f"cuda:{have + 2}", 1)  # an explicit GPU must exist
    check_gpus("p", "cpu", 99)  # CPU jobs need no GPU
    check_gpus("p", None, 99)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0
    with pytest.raises(DeviceError, match="needs 1 GPU on this node; 0 are visible"):
        check_gpus("p", "cuda", 1)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the no-GPU answer")
def test_cli_refuses_cuda_without_gpus_before_loading(builds):
    m = str(builds["bf16"])
    name = builds["bf16"].parent.name
    p = shardc("verify", "--manifest", m, "--device", "cuda")
    assert p.returncode == 2 and p.stderr.startswith(f"error: plan {name} needs 1 GPU on this node; 0 are visible")
    p = shardc("run", "--manifest", m, "--prompt-ids", "1,2", "--device", "cuda")
    assert p.returncode == 2 and f"plan {name} needs 2 GPUs on this node; 0 are visible" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = shardc("run", "--manifest", m, "--prompt-ids", "1,2", "--device", "cuda:0")
    assert p.returncode == 2 and "pins one GPU" in p.stderr
    # torchrun's env: one process of a 2-rank distributed verify sees LOCAL_WORLD_SIZE=2 GPUs needed
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    p = shardc("verify", "--manifest", m, "--distributed", "--device", "cuda", env=env)
    assert p.returncode == 2 and f"plan {name} needs 2 GPUs on this node; 0 are visible" in p.stderr


# -- the loader ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8"])
def test_load_shard_equals_safetensors(builds, dtype):
    from safetensors.torch import load_file

    import shardc
    from shardc.formats.manifest import load

    lay = load(builds[dtype]).to_layout()
    m = json.loads(builds[dtype].read_text())  # a manifest as a serving runtime holds it: plain JSON
    for rl in lay.ranks:
        got = shardc.load_shard(builds[dtype], rl.tp_rank, rl.pp_stage, device="cpu")
        want = load_file(builds[dtype].parent / rl.file)
        assert sorted(got) == sorted(want) == sorted(t.name for t in rl.tensors)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    # a manifest dict needs the directory; with it, the same tensors
    same = shardc.load_shard(m, 0, 0, device="cpu", directory=builds[dtype].parent)
    assert sorted(same) == sorted(shardc.load_shard(builds[dtype].parent, 0, 0, device="cpu"))
    with pytest.raises(ManifestError, match="directory"):
        shardc.load_shard(m, 0, 0, device="cpu")


def test_load_shard_refuses_before_returning(builds, tmp_path):
    import shutil

    import shardc
    from shardc.errors import LayoutError, ShardcError

    d = tmp_path / "b"
    shutil.copytree(builds["bf16"].parent, d)
    man = json.loads((d / "manifest.json").read_text())
    f = d / _entry(man, 0)[0]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the last tensor
    f.write_bytes(bytes(data))
    with pytest.raises(VerifyMismatch, match="sha256"):
        shardc.load_shard(d, 0, 0, device="cpu")
    assert shardc.load_shard(d, 1, 0, device="cpu")  # the other rank is intact
    with pytest.raises(LayoutError):
        shardc.load_shard(d, 2, 0, device="cpu")
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(VerifyMismatch, match="size"):
        shardc.load_shard(d, 0, 0, device="cpu")
    # a shard of another rank under this rank's name: the header's metadata gives it away
    shutil.copy(d / _entry(man, 1)[0], f)
    _entry(man, 0)[1]["size"] = f.stat().st_size
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(VerifyMismatch, match="metadata"):
        shardc.load_shard(d, 0, 0, device="cpu")
    if torch.cuda.device_count() == 0:
        with pytest.raises(DeviceError, match="0 are visible"):
            shardc.load_shard(d, 1, 0)  # the default device is cuda
    assert issubclass(DeviceError, ShardcError)


def test_import_shardc_does_not_import_torch():
    code = "import sys, shardc; f = shardc.load_shard; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_local_load_shard_imports_none_of_the_store(builds):
    """A cold start from a local build pays for the checks' modules only: shardc.load_shard of a
    local manifest never imports shardc.store (30-40 ms of imports; boto3 besides)."""
    code = ("import sys, shardc\n"
            f"t = shardc.load_shard({str(builds['bf16'])!r}, 1, 0, device='cpu')\n"
            "assert t, 'no tensors'\n"
            "print(sorted(m for m in sys.modules if m.startswith(('shardc.store', 'boto3'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- finite checks -------------------------------------------------------------------------------------
def test_nonfinite_reads_exponent_bits():
    ok = torch.randn(1000)
    names = {}
    for dt, tag in ((torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = ok.to(dt).clone()
            x[777] = bad
            names[f"{tag}{bad}"] = (x, tag)
        names[f"{tag}ok"] = (ok.to(dt), tag)
    f8 = ok.to(torch.float8_e4m3fn).clone()
    f8.view(torch.uint8)[5] = 0xFF  # e4m3fn NaN
    names["F8bad"] = (f8, "F8_E4M3")
    names["F8ok"] = (ok.to(torch.float8_e4m3fn), "F8_E4M3")
    names["I8"] = (torch.full((10,), -1, dtype=torch.int8), "I8")  # 0xFF bytes, but integers
    big = torch.zeros(3 * (1 << 22) + 5, dtype=torch.bfloat16)
    big[-1] = float("inf")  # in the last of several chunks
    names["BF16big"] = (big, "BF16")
    found = nonfinite({k: v[0] for k, v in names.items()}, {k: v[1] for k, v in names.items()})
    assert sorted(found) == sorted(k for k in names if not k.endswith("ok") and k != "I8")


def test_verify_device_cpu_finds_nan_with_matching_sha(builds, tmp_path):
    """A NaN written into a shard whose manifest sha256 was updated to match: only the value check
    can catch it, and verify --device cpu must (and without --device it passes)."""
    import shutil
    import struct

    d = tmp_path / "n"
    shutil.copytree(builds["bf16"].parent, d)
    man = json.loads((d / "manifest.json").read_text())
    f = d / _entry(man, 0)[0]
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "BF16")
    start = 8 + n + header[name]["data_offsets"][0]
    data[start : start + 2] = struct.pack("<H", 0x7FC0)  # bf16 NaN
    f.write_bytes(bytes(data))
    reseal(_entry(man, 0)[1], bytes(data))
    (d / "manifest.json").write_text(json.dumps(man))
    p = shardc("verify", "--manifest", str(d / "manifest.json"), "--rank", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    p = shardc("verify", "--manifest", str(d / "manifest.json"), "--device", "cpu", "--json")
    assert p.returncode == 1
    r = json.loads(p.stdout)
    assert r["problems"] == [f"{f.name}: tensor {name} holds NaN or Inf on cpu"]
    assert r["ranks"][1]["ok"] and "load:cpu" in r["ranks"][1]["checks"]


def test_read_shard_checks_pieces_while_hashing(tmp_path):
    """verify --device's read of a shard without chunk digests (upgraded on read): a bad value in
    any dtype, at the start, middle or end of a tensor of several MiB, after odd-sized int8
    tensors, is found; the sha256 is the file's."""
    import hashlib

    from safetensors.torch import save_file

    from shardc.loader.local import load_for_verify
    from shardc.loader.tensors import tensors_of

    base = torch.randn(3 * (1 << 19) + 7)  # several 1 MiB pieces in every dtype
    t = {"a_i8": torch.full((13,), -1, dtype=torch.int8)}  # 0xFF bytes that are integers
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for where in (0, 1 << 19, -1):
            x = base.to(dt).clone()
            x[where] = float("nan") if where else float("-inf")
            t[f"{dt}-{where}"] = x
        t[f"{dt}-ok"] = base.to(dt)
    f8 = base.to(torch.float8_e4m3fn).clone()
    f8.view(torch.uint8)[-3] = 0x7F
    t["f8-bad"], t["f8-ok"] = f8, base.to(torch.float8_e4m3fn)
    path = tmp_path / "x.safetensors"
    save_file(t, path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    raw = load_for_verify(path, SimpleNamespace(chunk_size=None, size=path.stat().st_size, sha256=sha), "cpu")
    assert raw.sha256 == sha
    assert sorted(raw.nonfinite) == sorted(k for k in t if not k.endswith("ok") and k != "a_i8")
    got = tensors_of(raw)
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in t.items())


@pytest.mark.parametrize("chunk", [4096, 12288])
def test_read_shard_many_pieces_hash_and_keep(tmp_path, monkeypatch, chunk):
    """A shard without chunk digests upgraded on read in pieces of 4 KiB and chunks of ``chunk``
    bytes over a 200 KiB file of random bytes: the sha256 is hashlib's whatever the chunks' order
    through the engine's workers, the NaN planted in the last chunk is found and the data is the
    file's data section byte for byte."""
    import hashlib

    from safetensors.torch import save_file

    from shardc.loader import local, tensors, upgrade

    monkeypatch.setattr(upgrade, "PIECE", 4096)
    monkeypatch.setattr(upgrade, "CHUNK_SIZE", chunk)
    monkeypatch.setattr(local, "CHUNK_SIZE", chunk)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50_000, generator=g)
    x[-1] = float("nan")
    path = tmp_path / "x.safetensors"
    save_file({"w": x, "b": torch.randint(-128, 127, (999,), dtype=torch.int8, generator=g)}, path)
    blob = path.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    raw = local.load_for_verify(path, SimpleNamespace(chunk_size=None, size=len(blob), sha256=sha), "cpu")
    assert raw.sha256 == sha and raw.nonfinite == ["w"]
    start = 8 + int.from_bytes(blob[:8], "little")
    assert raw.data.numel() == len(blob) - start and raw.data.device.type == "cpu"
    assert bytes(raw.data.numpy()) == blob[start:]
    assert tensors.tensors_of(raw)["w"].shape == (50_000,)
