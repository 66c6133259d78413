"""shardc reshard / export on seeded synthetic models.

The oracle never comes from the reshard code: whenever the path is lossless, reshard(build(src, A), B)
must be byte-identical, file for file, to build(src, B), and the two manifests must agree in
everything but the recorded source. Exports are compared tensor by tensor with the checkpoint
itself, read by the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from manifest_edits import reseal
from plan_helpers import plan, write_plan

from shardc.cli import main
from shardc.compiler.build_files import open_local_input
from shardc.compiler.compile import build
from shardc.compiler.reshard import reshard
from shardc.errors import ManifestError, PlanError, VerifyMismatch
from shardc.formats.manifest import load, loads
from shardc.layout.plan import plan_from_dict

GQA = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=100)
TIED = dict(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8, num_kv_heads=8, vocab_size=97,
            tie_word_embeddings=True)
QWEN = dict(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=1, vocab_size=64,
            architecture="Qwen2ForCausalLM")
FP16 = dict(GQA, torch_dtype="float16")
MODELS = {"gqa": GQA, "tied": TIED, "qwen2": QWEN, "fp16": FP16}

# (model, (tp, pp, dtype[, pp_layers]) of A, same of B)
MATRIX = [
    ("gqa", (8, 1, "bf16"), (2, 2, "bf16")),  # KV replicas (8 ranks, 2 KV heads) merged, then split by stage
    ("gqa", (2, 2, "bf16"), (1, 1, "bf16")),  # stage merge
    ("gqa", (1, 1, "bf16"), (8, 3, "bf16")),  # split: KV heads replicated again, vocab 100 padded at tp8
    ("gqa", (4, 3, "bf16"), (2, 2, "bf16", [1, 3])),  # uneven stages in and out
    ("gqa", (2, 2, "bf16", [3, 1]), (4, 2, "bf16", [1, 3])),
    ("tied", (4, 3, "bf16"), (2, 2, "bf16")),  # tied embeddings: the lm_head copy is a replica
    ("tied", (8, 2, "bf16"), (1, 1, "bf16")),  # padded vocabulary (97 rows at tp8) stripped
    ("tied", (1, 1, "bf16"), (8, 3, "bf16")),
    ("qwen2", (4, 1, "bf16"), (2, 3, "bf16")),  # q/k/v biases, one KV head replicated 4x
    ("gqa", (4, 1, "int8"), (2, 2, "int8")),  # int8 re-sliced exactly
    ("gqa", (8, 2, "int8"), (1, 1, "int8")),
    ("tied", (2, 1, "fp8"), (8, 2, "fp8")),  # fp8 re-sliced exactly
    ("gqa", (8, 1, "bf16"), (2, 1, "int8")),  # quantized from 16-bit shards, whole tensor first
    ("gqa", (2, 2, "bf16"), (4, 1, "fp8")),
    ("gqa", (2, 1, "bf16"), (4, 2, "fp16")),  # 16-bit -> other 16-bit: build's cast
    ("fp16", (2, 1, "fp16"), (4, 2, "fp16")),  # an fp16 source
    ("fp16", (4, 1, "fp16"), (2, 1, "int8")),
]


def plan_of(ckpt: Path, tp: int, pp: int, dtype: str, pp_layers: list[int] | None = None, name: str = "t"):
    return plan(tp, pp, dtype, name=name, source=ckpt, model={"pp_layers": pp_layers} if pp_layers else None)


def digests(res) -> dict[str, str]:
    """Every file of a build but its manifest."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(res.out_dir.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"}


def without_source(manifest) -> dict:
    return {k: v for k, v in manifest.to_dict().items() if k != "source"}


@pytest.mark.parametrize(("model", "a", "b"), MATRIX, ids=[f"{m}-{a}-{b}" for m, a, b in MATRIX])
def test_reshard_equals_build(make_ckpt, tmp_path, model, a, b):
    ckpt = make_ckpt(model, num_files=2, **MODELS[model])
    built_a = build(plan_of(ckpt, *a), tmp_path / "a")
    want = build(plan_of(ckpt, *b), tmp_path / "b")
    got = reshard(open_local_input(built_a.manifest_path), plan_of(ckpt, *b), tmp_path / "r")
    assert digests(got) == digests(want)
    assert without_source(got.manifest) == without_source(want.manifest)
    src = got.manifest.source
    assert src.uri == str(built_a.manifest_path)
    assert src.reshard_of.manifest_sha256 == hashlib.sha256(built_a.manifest_path.read_bytes()).hexdigest()
    assert src.reshard_of.dequantized == [] and src.reshard_of.plan_sha256 == built_a.manifest.plan_sha256
    # the provenance survives the one reader (and a build's manifest has no reshard_of key)
    assert load(got.manifest_path) == got.manifest
    assert "reshard_of" not in json.loads(want.manifest_path.read_text())["source"]
    assert not [p for p in got.out_dir.iterdir() if p.name.startswith(".") and p.name != ".shardc-build.lock"]


@pytest.mark.parametrize(("key", "value"), [("manifest_sha256", "beef"), ("dequantized", [3]), ("extra", 1)])
def test_reshard_provenance_is_validated_on_read(make_ckpt, tmp_path, key, value):
    """reshard_of is part of the typed manifest: the one reader refuses a malformed record."""
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 1, "bf16"), tmp_path / "a")
    r = reshard(open_local_input(a.manifest_path), plan_of(ckpt, 1, 1, "bf16"), tmp_path / "r")
    data = json.loads(r.manifest_path.read_text())
    data["source"]["reshard_of"][key] = value
    with pytest.raises(ManifestError) as exc:
        loads(json.dumps(data))
    assert exc.value.key == ("source.reshard_of" if key == "extra" else f"source.reshard_of.{key}")


def test_deterministic_resumable_and_verified_deep(make_ckpt, tmp_path):
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 8, 1, "int8"), tmp_path / "a")
    plan = plan_of(ckpt, 2, 2, "int8")
    r1 = reshard(open_local_input(a.manifest_path), plan, tmp_path / "r1")
    r2 = reshard(open_local_input(a.manifest_path), plan, tmp_path / "r2")
    assert digests(r1) == digests(r2) and r1.manifest_path.read_bytes() == r2.manifest_path.read_bytes()
    again = reshard(open_local_input(a.manifest_path), plan, tmp_path / "r1")
    assert again.up_to_date
    res = CliRunner().invoke(main, ["verify", "--manifest", str(r1.manifest_path), "--deep",
                                    str(a.manifest_path), "--json"])
    assert res.exit_code == 0, res.output
    assert all("deep" in r["checks"] for r in json.loads(res.stdout)["ranks"])
    # a build of another model's weights is not a reference for these shards
    other = build(plan_of(make_ckpt("other", seed=1, **GQA), 8, 1, "int8"), tmp_path / "o")
    res = CliRunner().invoke(main, ["verify", "--manifest", str(r1.manifest_path), "--deep",
                                    str(other.manifest_path)])
    assert res.exit_code == 1 and "deep check" in res.output


def test_dtype_rules(make_ckpt, tmp_path):
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 1, "int8"), tmp_path / "a")
    for dtype in ("bf16", "fp8"):
        with pytest.raises(PlanError) as exc:
            reshard(open_local_input(a.manifest_path), plan_of(ckpt, 1, 1, dtype), tmp_path / dtype)
        assert exc.value.key == "replica_group.dtype" and "`dequantize`" in exc.value.hint
        assert not (tmp_path / dtype).exists()
    r = reshard(open_local_input(a.manifest_path), plan_of(ckpt, 1, 1, "bf16"), tmp_path / "deq", dequantize=True)
    lossy = r.manifest.source.reshard_of.dequantized
    assert len(lossy) == GQA["num_layers"] * 7 and all(n.endswith("proj.weight") for n in lossy)
    # the dequantized weights are q * scale, computed independently here with torch
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    q = load_file(a.out_dir / "model-tp00-pp00.safetensors")
    name = "model.layers.1.mlp.gate_proj.weight"
    got = load_file(r.out_dir / "model-tp00-pp00.safetensors")[name]
    packed = q[name + "_packed"]
    values = unpack_from_int32(packed, 8, torch.Size([packed.shape[0], packed.shape[1] * 4]))
    want = (values.float() * q[name + "_scale"]).to(torch.bfloat16)
    assert torch.equal(got[: want.shape[0]], want)
    # unquantized tensors stay exact
    src = load_file(ckpt / "model.safetensors")
    norm = load_file(r.out_dir / "model-tp00-pp00.safetensors")["model.norm.weight"]
    assert torch.equal(norm, src["model.norm.weight"])


# --- bad input: exit codes, one line, nothing written -------------------------------------------

def _cli(*args):
    return CliRunner().invoke(main, ["reshard", *map(str, args)])


def _plan_file(path: Path, ckpt: Path, tp: int, pp: int, dtype: str = "bf16") -> Path:
    return write_plan(path, tp, pp, dtype, source=ckpt)


def test_corrupted_input_is_exit_1_naming_the_file(make_ckpt, tmp_path):
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 4, 2, "bf16"), tmp_path / "a")
    victim = a.out_dir / "model-tp03-pp01.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 1
    victim.write_bytes(bytes(data))
    out = tmp_path / "r"
    res = _cli("--manifest", a.manifest_path, "--plan", _plan_file(tmp_path / "p.yaml", ckpt, 2, 1),
               "--out", out, "--manifests-dir", tmp_path / "m")
    assert res.exit_code == 1, res.output
    assert "model-tp03-pp01.safetensors" in res.stderr and "corrupted" in res.stderr
    assert "Traceback" not in res.output
    assert not out.exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("victim_name", ["model-tp00-pp00.safetensors", "model-tp01-pp01.safetensors"])
@pytest.mark.parametrize("replacing", [False, True])
def test_a_flip_only_the_hash_can_see_commits_nothing(make_ckpt, tmp_path, victim_name, replacing):
    """Input bytes are resharded while their sha256 is checked on another core; a flipped bit in a
    tensor without replicas (nothing but the hash can see it) must still leave nothing of the run:
    no shard renamed into place, no resume record, no manifest, and an older build in the output
    directory byte for byte as it was. The first file is read first (its stage is committed
    first); the last is read at the end."""
    from safetensors import safe_open

    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 2, "bf16"), tmp_path / "a")
    victim = a.out_dir / victim_name
    with safe_open(str(victim), "np") as f:  # the first layer's q_proj slice: held by this rank only
        name = next(k for k in sorted(f.keys()) if k.endswith("q_proj.weight"))
    header_len = int.from_bytes(victim.read_bytes()[:8], "little")
    offset = 8 + header_len + json.loads(victim.read_bytes()[8 : 8 + header_len])[name]["data_offsets"][0]
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x40
    victim.write_bytes(bytes(data))
    out = tmp_path / "r"
    plan = _plan_file(tmp_path / "p.yaml", ckpt, 1, 2)
    if replacing:
        build(plan_from_dict(yaml.safe_load(plan.read_text())), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if replacing else {}
    res = _cli("--manifest", a.manifest_path, "--plan", plan, "--out", out, "--manifests-dir", tmp_path / "m",
               "--force")
    assert res.exit_code == 1, res.output
    assert victim_name in res.stderr and "corrupted" in res.stderr, res.stderr
    if replacing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert not (tmp_path / "m").exists()


def test_replicas_that_differ_are_exit_1_naming_the_tensor(make_ckpt, tmp_path):
    """A KV replica changed and the manifest re-hashed to match: only the replica check sees it."""
    from shardc.formats.safetensors import read_header

    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 8, 1, "bf16"), tmp_path / "a")  # 4 ranks hold each of the 2 KV heads
    victim = a.out_dir / "model-tp05-pp00.safetensors"
    name = "model.layers.2.self_attn.v_proj.weight"
    data = bytearray(victim.read_bytes())
    tensors, _, start = read_header(victim)
    data[start + tensors[name]["data_offsets"][0] + 6] ^= 0x10
    victim.write_bytes(bytes(data))
    m = load(a.manifest_path)
    reseal(m.shard(victim.name), bytes(data))
    m.save(a.manifest_path)
    out = tmp_path / "r"
    res = _cli("--manifest", a.manifest_path, "--plan", _plan_file(tmp_path / "p.yaml", ckpt, 2, 1),
               "--out", out, "--manifests-dir", tmp_path / "m")
    assert res.exit_code == 1, res.output
    assert name in res.stderr and victim.name in res.stderr
    assert not out.exists()
    with pytest.raises(VerifyMismatch):
        reshard(open_local_input(a.manifest_path), plan_of(ckpt, 1, 1, "bf16"), tmp_path / "r2")


def test_plan_for_another_model_is_exit_2_naming_the_field(make_ckpt, tmp_path):
    ckpt = make_ckpt(**GQA)
    other = make_ckpt("other", **dict(GQA, num_layers=6))
    a = build(plan_of(ckpt, 2, 1, "bf16"), tmp_path / "a")
    out = tmp_path / "r"
    res = _cli("--manifest", a.manifest_path, "--plan", _plan_file(tmp_path / "p.yaml", other, 2, 2),
               "--out", out)
    assert res.exit_code == 2, res.output
    assert "num_hidden_layers" in res.stderr and "Traceback" not in res.output
    assert not out.exists()
    # degrees the build's model cannot take are named as build names them
    res = _cli("--manifest", a.manifest_path, "--plan", _plan_file(tmp_path / "q.yaml", ckpt, 3, 1), "--out", out)
    assert res.exit_code == 2 and "tp_degree" in res.stderr and not out.exists()


@pytest.mark.parametrize("how", ["not-json", "not-shardc", "edited-plan", "missing"])
def test_malformed_or_unknown_manifest_is_exit_2(make_ckpt, tmp_path, how):
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 1, "bf16"), tmp_path / "a")
    m = json.loads(a.manifest_path.read_text())
    if how == "not-json":
        a.manifest_path.write_text("{ nope")
    elif how == "not-shardc":
        a.manifest_path.write_text(json.dumps({"weight_map": {}}))
    elif how == "edited-plan":  # its tensors no longer match its own plan's Layout
        m["plan"]["replica_group"]["tp_degree"] = 4
        m["plan"]["replica_group"]["gpus_per_replica"] = 4
        a.manifest_path.write_text(json.dumps(m))
    else:
        a.manifest_path.unlink()
    out = tmp_path / "r"
    res = _cli("--manifest", a.manifest_path, "--plan", _plan_file(tmp_path / "p.yaml", ckpt, 1, 1), "--out", out)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and "Traceback" not in res.output
    assert not out.exists()


# --- export -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "a"), [("gqa", (8, 2, "bf16")), ("tied", (4, 3, "bf16")), ("fp16", (2, 1, "fp16"))])
def test_export_is_the_checkpoint(make_ckpt, tmp_path, model, a):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    ckpt = make_ckpt(model, **MODELS[model])
    built = build(plan_of(ckpt, *a), tmp_path / "a")
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["export", "--manifest", str(built.manifest_path), "--out", str(out),
                                    "--max-shard-size", "40KB", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    n = len(info["files"])
    assert n > 1 and all(f["size"] <= 40_000 + 30_000 for f in info["files"])  # header, one tensor over
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    src = load_file(ckpt / "model.safetensors")
    assert set(index["weight_map"]) == set(src)
    got = {}
    for name in names:
        got.update(load_file(out / name))
        with safe_open(out / name, "pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == name}
    for k, t in src.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in src.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads((ckpt / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_export_of_a_quantized_build_is_compressed_tensors(make_ckpt, tmp_path, dtype):
    """The export holds the build's quantized values and scales as they are, in the form a tp=1
    build of the checkpoint holds them (int8 pack-quantized), with its compressed-tensors config."""
    from reassemble import reassemble
    from safetensors.torch import load_file

    ckpt = make_ckpt(**GQA)
    built = build(plan_of(ckpt, 4, 2, dtype), tmp_path / "a")
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["export", "--manifest", str(built.manifest_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = load_file(out / "model-00001-of-00001.safetensors")
    # the oracle: a tp=1 build of the checkpoint itself
    one = build(plan_of(ckpt, 1, 1, dtype), tmp_path / "one")
    want = load_file(one.out_dir / "model-tp00-pp00.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].view(-1).view(torch.uint8).equal(
            want[k].view(-1).view(torch.uint8)), k
    assert (out / "config.json").read_bytes() == (one.out_dir / "config.json").read_bytes()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == ("pack-quantized" if dtype == "int8" else "float-quantized")
    # and, independently of shardc's Layout, the input's own shards put back together
    parts = reassemble(built.out_dir)
    for k, t in got.items():
        if k.endswith("_shape"):  # each rank holds its own slice's shape; the export the whole
            assert t.tolist() == list(parts[k.removesuffix("_shape")].shape)
        else:
            assert t.view(-1).view(torch.uint8).equal(parts[k].contiguous().view(-1).view(torch.uint8)), k


@pytest.mark.heavy
def test_int8_export_loads_in_transformers(make_ckpt, tmp_path):
    """transformers + compressed-tensors read the int8 export: the same logits as the tp=1 int8
    build of the source (which tests/compiler/test_clients.py checks against the dequantized source)."""
    from transformers import AutoModelForCausalLM

    ckpt = make_ckpt(**dict(GQA, num_layers=3))
    built = build(plan_of(ckpt, 2, 3, "int8"), tmp_path / "a")
    out = tmp_path / "hf"
    from shardc.compiler.export import export

    export(open_local_input(built.manifest_path), out)
    one = build(plan_of(ckpt, 1, 1, "int8"), tmp_path / "one")
    x = torch.randint(0, GQA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, path in (("export", out), ("build", one.out_dir), ("source", ckpt)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            logits[name] = model(x).logits.float()
    assert torch.isfinite(logits["export"]).all()
    assert torch.equal(logits["export"], logits["build"])
    assert not torch.equal(logits["export"], logits["source"])  # the weights really are the quantized ones
    torch.testing.assert_close(logits["export"], logits["source"], rtol=0, atol=0.1)


# --- from object storage ------------------------------------------------------------------------

@pytest.fixture
def s3_env(aws_env):
    """A fresh S3 server with a ``models`` bucket, under conftest's dummy credentials."""
    from s3server import S3Server

    aws_env.setenv("SHARDC_S3_MAX_ATTEMPTS", "3")
    server = S3Server().start()
    server.client().create_bucket(Bucket="models")
    yield server
    server.stop()


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_reshard_from_s3(make_ckpt, tmp_path, s3_env, compress):
    from shardc.store.push import push_build
    from shardc.store.reshard_input import RemoteBuildInput

    ckpt = make_ckpt(**TIED)
    a = build(plan_of(ckpt, 4, 3, "int8"), tmp_path / "a")
    # both parametrizations share the bucket; each pushes its own checkpoint's build over it
    push_build(a.manifest_path, "s3://models/a", endpoint_url=s3_env.endpoint, compress=compress,
               replace=True)
    b = plan_of(ckpt, 2, 2, "int8")
    want = build(b, tmp_path / "b")
    inp = RemoteBuildInput("s3://models/a/manifest.json", endpoint_url=s3_env.endpoint, spool_parent=tmp_path)
    got = reshard(inp, b, tmp_path / "r")
    assert digests(got) == digests(want)
    assert got.manifest.source.uri == "s3://models/a/manifest.json"
    assert got.manifest.source.reshard_of.manifest_sha256 == hashlib.sha256(a.manifest_path.read_bytes()).hexdigest()
    if not compress:  # each input byte is fetched once (plus the small manifest per stage pulled)
        shard_bytes = sum(s.size for s in a.manifest.shards)
        side = sum(f.size for f in a.manifest.files)
        assert shard_bytes + side <= inp.bytes_fetched <= (shard_bytes + side) * 1.05 + 4 * len(
            a.manifest_path.read_bytes())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardc-input-")]  # spool removed

    # a corrupted object: exit 1 naming the file, nothing left
    c = s3_env.client()
    victim = a.manifest.shards[2].file
    key = f"a/{victim}" + (".zst" if compress else "")
    obj = c.get_object(Bucket="models", Key=key)
    data = bytearray(obj["Body"].read())
    data[len(data) // 2] ^= 0x40
    c.put_object(Bucket="models", Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    out = tmp_path / "bad"
    plan_file = _plan_file(tmp_path / "p.yaml", ckpt, 1, 1, "int8")
    res = CliRunner().invoke(main, ["reshard", "--manifest", "s3://models/a/manifest.json", "--plan", str(plan_file),
                                    "--out", str(out), "--endpoint-url", s3_env.endpoint, "--manifests-dir",
                                    str(tmp_path / "m")])
    assert res.exit_code == 1, res.output
    assert victim in res.stderr and "Traceback" not in res.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".shardc-input-")]
    assert os.listdir(tmp_path / "r")  # the earlier output is untouched


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_reshard_and_export_never_import_torch(make_ckpt, tmp_path, dtype):
    """Like build: numpy and the numba kernels do the work, torch's 1-2 s import is not paid."""
    import subprocess
    import sys

    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 4, 1, dtype), tmp_path / "a")
    plan = _plan_file(tmp_path / "p.yaml", ckpt, 2, 2, dtype)
    args = [["reshard", "--manifest", str(a.manifest_path), "--plan", str(plan), "--out", str(tmp_path / "r"),
             "--manifests-dir", str(tmp_path / "m"), "-q"],
            ["export", "--manifest", str(a.manifest_path), "--out", str(tmp_path / "hf")]]
    code = ("import sys; from shardc.cli import main\n"
            f"for a in {args!r}:\n    main(a, standalone_mode=False)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert (tmp_path / "r" / "manifest.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


def test_missing_input_file_and_output_onto_input(make_ckpt, tmp_path):
    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 2, "bf16"), tmp_path / "a")
    plan = _plan_file(tmp_path / "p.yaml", ckpt, 1, 1)
    res = _cli("--manifest", a.out_dir, "--plan", plan, "--out", a.out_dir)  # a build directory works too
    assert res.exit_code == 2 and "--out" in res.stderr
    assert (a.out_dir / "manifest.json").is_file()
    (a.out_dir / "model-tp01-pp01.safetensors").unlink()
    res = _cli("--manifest", a.out_dir, "--plan", plan, "--out", tmp_path / "r", "--manifests-dir", tmp_path / "m")
    assert res.exit_code == 1 and "model-tp01-pp01.safetensors" in res.stderr and "missing" in res.stderr
    assert not (tmp_path / "r").exists()


def test_dequantize_to_the_other_scheme_requantizes_q_times_scale(make_ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file

    from shardc.compiler.quantize import quantize

    ckpt = make_ckpt(**GQA)
    a = build(plan_of(ckpt, 2, 1, "int8"), tmp_path / "a")
    r = reshard(open_local_input(a.manifest_path), plan_of(ckpt, 1, 1, "fp8"), tmp_path / "r", dequantize=True)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    assert r.manifest.source.reshard_of.dtype == "int8"
    name = "model.layers.3.self_attn.o_proj.weight"  # row-split in the input: whole scales on each rank
    parts = [load_file(a.out_dir / f"model-tp0{i}-pp00.safetensors") for i in range(2)]
    values = [unpack_from_int32(p[name + "_packed"], 8, torch.Size(p[name + "_shape"].tolist())) for p in parts]
    w = torch.cat([v.float() for v in values], dim=1) * parts[0][name + "_scale"]
    q, scale, _ = quantize(name, w, "fp8")
    got = load_file(r.out_dir / "model-tp00-pp00.safetensors")
    assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got[name + "_scale"], scale)


@pytest.mark.parametrize("dim", [0, 1])
def test_tiles_fill_any_window_like_the_whole_tensor(dim):
    """A writer's chunk filled piece by piece (compiler/tiles.py) equals the same window of the whole
    tensor put together by numpy, for windows inside one piece, across several, and at the ends."""
    import numpy as np

    from shardc.compiler.tiles import Tiles

    rng = np.random.default_rng(7)
    whole = rng.standard_normal((12, 10)).astype(np.float32)
    cuts = [0, 3, 4, 9, whole.shape[dim]]
    parts = tuple((a, b, np.take(whole, range(a, b), axis=dim)) for a, b in zip(cuts, cuts[1:], strict=False))
    tiles = Tiles(whole.shape, whole.dtype, dim, parts)
    assert np.array_equal(np.asarray(tiles), whole)
    for r0, r1, c0, c1 in [(0, 12, 0, 10), (1, 3, 0, 10), (2, 11, 3, 8), (4, 5, 4, 9), (11, 12, 9, 10)]:
        dst = np.full((r1 - r0, c1 - c0), np.nan, np.float32)
        tiles.fill(dst, (r0, c0))
        assert np.array_equal(dst, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)
