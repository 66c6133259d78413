"""push / pull against a local directory and a real S3 server (moto on 127.0.0.1, real HTTP).

Shards are ~6-8 MB so that, with the multipart threshold lowered to 1 MiB, every shard upload is a
real multipart upload of two parts (S3's minimum part size is 5 MiB; boto3 enforces it too).
Faults come from tests/s3server.py's proxy; the interrupted push kills a real subprocess.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3server import Faults

from shardc.cli import main
from shardc.errors import ManifestError, StoreError, VerifyMismatch
from shardc.formats.manifest import Manifest, loads
from shardc.store import S3Settings, parse_uri, pull_build, push_build, split_object_uri

SECRET = "shardc-test-secret-DO-NOT-PRINT"
ROOT = Path(__file__).resolve().parents[2]
_bucket_ids = itertools.count()
needs_zstd = pytest.mark.skipif(importlib.util.find_spec("zstandard") is None,
                                reason="zstandard is not installed (pip install 'shardc[zstd]')")


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(s3_server):
    """The module's S3 server (conftest), by the name this file's tests use."""
    return s3_server


@pytest.fixture(scope="module")
def proxy(s3_proxy):
    """conftest's fault proxy in front of it."""
    return s3_proxy


@pytest.fixture(autouse=True)
def aws_env(aws_env):
    """conftest's isolated dummy credentials with a secret the tests look for in every output;
    small parts."""
    monkeypatch = aws_env
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "shardc-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("SHARDC_MULTIPART_THRESHOLD", str(1 << 20))
    monkeypatch.setenv("SHARDC_MULTIPART_CHUNKSIZE", str(5 << 20))
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "8")
    monkeypatch.setenv("SHARDC_S3_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("SHARDC_S3_READ_TIMEOUT", "10")


@pytest.fixture
def bucket(s3):
    name = f"shardc-test-{next(_bucket_ids)}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Real builds (shardc.compiler.compile) of one seeded synthetic checkpoint: bf16, int8 and fp8."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    base = tmp_path_factory.mktemp("builds")
    ckpt = write_checkpoint(base / "ckpt", llama_config(
        hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
        vocab_size=8192), seed=5)
    out = {}
    for dtype, tp, pp in (("bf16", 2, 1), ("int8", 2, 1), ("fp8", 1, 2)):
        name = f"store-{dtype}-tp{tp}pp{pp}"
        plan = plan_from_dict({
            "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                              "gpus_per_replica": tp * pp,
                              "checkpoint": {"manifest_uri": f"s3://unused/{name}/manifest.json"}},
            "model": {"source": str(ckpt)},
        })
        out[dtype] = build(plan, out_dir=base / name, manifests_dir=base / "manifests")
    return out


def run_cli(*args: str, env: dict[str, str | None] | None = None):
    res = CliRunner().invoke(main, list(args), env=env)
    return res


def one_error_line(res) -> str:
    """Expected errors end as exactly one line on stderr, no traceback, no credentials."""
    err = res.stderr
    assert "Traceback" not in err and "Traceback" not in res.stdout
    assert SECRET not in err and SECRET not in res.stdout
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def build_files(res) -> dict[str, str]:
    names = [s.file for s in res.manifest.shards] + [f.name for f in res.manifest.files]
    return {n: hashlib.sha256((res.out_dir / n).read_bytes()).hexdigest() for n in names}


# --- URIs ---------------------------------------------------------------------------------------

def test_uris(tmp_path):
    assert parse_uri("s3://models/llama/fp16/") == ("s3", "models", "llama/fp16")
    assert parse_uri("file:///data/x") == ("file", "", "/data/x")
    assert parse_uri("rel/dir") == ("file", "", "rel/dir")
    assert split_object_uri("s3://b/p/q/manifest.json") == ("s3://b/p/q", "manifest.json")
    assert split_object_uri("s3://b/m.json") == ("s3://b", "m.json")
    assert split_object_uri("s3://b/p/") == ("s3://b/p", "manifest.json")
    assert split_object_uri(str(tmp_path)) == (str(tmp_path), "manifest.json")
    assert split_object_uri("file:///a/b/m.json") == ("/a/b", "m.json")
    for bad in ("gs://b/x", "s3:///x", "file://host/x", "", "s3://b/../../x", "s3://b/p/./q", "s3://b/.."):
        with pytest.raises(StoreError):
            parse_uri(bad)


# --- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,scheme,compress", [
    ("bf16", "path", None), pytest.param("int8", "file", "zstd", marks=needs_zstd), ("fp8", "path", None)])
def test_local_round_trip(builds, tmp_path, dtype, scheme, compress):
    b = builds[dtype]
    store = tmp_path / "store"
    uri = f"file://{store}" if scheme == "file" else str(store)
    res = push_build(b.manifest_path, uri, compress=compress)
    assert res.uploaded == len(res.objects) and (store / "manifest.json").is_file()
    assert all((store / o.object).is_file() for o in res.objects)
    again = push_build(b.manifest_path, uri, compress=compress)
    assert again.uploaded == 0 and again.manifest == "unchanged"

    dest = tmp_path / "node"
    out = pull_build(f"{uri}/manifest.json", dest, fsync_downloads=dtype == "fp8")  # both commits
    assert out.verify.ok and len(out.verify.ranks) == len(b.manifest.shards)
    assert (dest / "manifest.json").read_bytes() == b.manifest_path.read_bytes()
    assert {k: v for k, v in tree(dest).items() if k != "manifest.json"} == build_files(b)
    again = pull_build(uri, dest)  # a directory URI means its manifest.json
    assert again.downloaded == 0 and again.present == len(out.files)


@needs_zstd
def test_cli_push_compress_zstd_round_trip(builds, tmp_path):
    """README: `push --compress zstd` stores .zst objects; a pull decompresses and verifies them."""
    b = builds["bf16"]
    store = tmp_path / "store"
    res = run_cli("push", "--manifest", str(b.manifest_path), "--to", str(store), "--compress", "zstd",
                  "--json")
    assert res.exit_code == 0, res.output
    shards = {s.file for s in b.manifest.shards}
    assert {p.name for p in store.iterdir() if p.suffix == ".zst"} == {f + ".zst" for f in shards}
    assert not any((store / f).exists() for f in shards)  # only the compressed objects
    remote = json.loads((store / "manifest.json").read_text())
    assert all(e["compressed"]["codec"] == "zstd" for e in remote["shards"].values())
    dest = tmp_path / "node"
    res = run_cli("pull", "--manifest", f"{store}/manifest.json", "--all", "--dest", str(dest), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verify"]["ok"]
    assert {k: v for k, v in tree(dest).items() if k != "manifest.json"} == build_files(b)


@pytest.mark.parametrize("dtype,compress", [("bf16", None), pytest.param("int8", "zstd", marks=needs_zstd),
                                            ("fp8", None)])
def test_s3_round_trip(builds, s3, bucket, tmp_path, dtype, compress):
    b = builds[dtype]
    uri = f"s3://{bucket}/models/{dtype}"
    res = push_build(b.manifest_path, uri, endpoint_url=s3.endpoint, compress=compress, progress=True)
    assert res.manifest_uri == f"{uri}/manifest.json" and res.uploaded == len(res.objects)

    c = s3.client()
    shard = b.manifest.shards[0]
    key = f"models/{dtype}/{shard.file}" + (".zst" if compress else "")
    head = c.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    parts = -(-head["ContentLength"] // (5 << 20))
    assert head["ETag"].strip('"').endswith(f"-{parts}")  # a multipart upload, 5 MiB parts
    assert compress or parts == 2
    assert "ChecksumSHA256" in head  # parts carried SHA-256 checksums
    assert head["Metadata"]["content-sha256" if compress else "sha256"] == shard.sha256
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads") is None

    remote = loads(c.get_object(Bucket=bucket, Key=f"models/{dtype}/manifest.json")["Body"].read())
    if compress:
        comp = remote.shards[0].compressed
        assert comp is not None and comp["codec"] == "zstd" and comp["object"] == shard.file + ".zst"
        assert comp["size"] == head["ContentLength"] < shard.size
        assert remote.files[0].compressed is None  # side files stay plain
    else:
        assert remote.dumps() == b.manifest_path.read_bytes()

    # a GPU node pulls only its own rank
    last = b.manifest.shards[-1]
    dest = tmp_path / "node"
    one = run_cli("pull", "--manifest", f"{uri}/manifest.json", "--rank", str(last.rank),
                  "--dest", str(dest), "--endpoint-url", s3.endpoint, "--json")
    assert one.exit_code == 0, one.output
    info = json.loads(one.stdout)
    assert [r["rank"] for r in info["ranks"]] == [last.rank] and info["verify"]["ok"]
    index = ["model.safetensors.index.json"] if b.manifest.layout.tp_degree == 1 else []
    assert sorted(tree(dest)) == sorted(["config.json", "manifest.json", last.file] + index)
    assert (dest / "manifest.json").read_bytes() == b.manifest_path.read_bytes()
    # the node's cold-start check can read the manifest straight from the store
    ver = run_cli("verify", "--manifest", f"{uri}/manifest.json", "--dir", str(dest), "--rank",
                  str(last.rank), "--endpoint-url", s3.endpoint)
    assert ver.exit_code == 0, ver.output
    assert run_cli("verify", "--manifest", f"{uri}/manifest.json", "--endpoint-url", s3.endpoint).exit_code == 2

    full = pull_build(f"{uri}/manifest.json", dest, endpoint_url=s3.endpoint)
    assert full.present == 2 + len(index) and full.downloaded == len(b.manifest.shards) - 1
    assert {k: v for k, v in tree(dest).items() if k != "manifest.json"} == build_files(b)

    again = push_build(b.manifest_path, uri, endpoint_url=s3.endpoint, compress=compress)
    assert again.uploaded == 0 and again.bytes_uploaded == 0 and again.manifest == "unchanged"


def test_cli_push_pull_and_build_upload(builds, s3, bucket, tmp_path, monkeypatch):
    """The commands, AWS_ENDPOINT_URL from the environment, and `shardc build --upload`."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    b = builds["bf16"]
    res = run_cli("push", "--manifest", str(b.manifest_path), "--to", f"s3://{bucket}/cli")
    assert res.exit_code == 0, res.output
    assert "pushed 3 file(s)" in res.stdout and f"s3://{bucket}/cli/manifest.json" in res.stdout
    res = run_cli("pull", "--manifest", f"s3://{bucket}/cli/manifest.json", "--tp-rank", "1",
                  "--pp-stage", "0", "--dest", str(tmp_path / "n"), "--quiet")
    assert res.exit_code == 0 and res.stdout == "" and (tmp_path / "n" / b.manifest.shards[1].file).is_file()

    # the copy in manifests/ names no directory: --build-dir says where the shards are
    record = b.out_dir.parent / "manifests" / f"{b.manifest.name}.json"
    res = run_cli("push", "--manifest", str(record), "--to", f"s3://{bucket}/rec", "--json")
    assert res.exit_code == 2 and "--build-dir" in res.stderr
    res = run_cli("push", "--manifest", str(record), "--build-dir", str(b.out_dir),
                  "--to", f"s3://{bucket}/rec", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["uploaded"] == 3

    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({**b.manifest.plan, "model": {"source": b.manifest.source.uri}}))
    res = run_cli("build", str(plan), "--out", str(tmp_path / "b"), "--manifests-dir", str(tmp_path / "m"),
                  "--upload", "--to", f"s3://{bucket}/built", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["upload"]["manifest_uri"] == f"s3://{bucket}/built/manifest.json"


def test_default_destination_is_plan_manifest_uri(builds, tmp_path):
    """No --to: the directory of the plan's checkpoint.manifest_uri (here a file:// one)."""
    from shardc.compiler.compile import build
    from shardc.layout.plan import plan_from_dict

    src = builds["bf16"].manifest.to_dict()
    data = json.loads(json.dumps(src["plan"]))
    data["replica_group"]["checkpoint"]["manifest_uri"] = f"file://{tmp_path}/pub/v1/manifest.json"
    data["model"]["source"] = src["source"]["uri"]
    b = build(plan_from_dict(data), out_dir=tmp_path / "b")
    res = push_build(b.manifest_path)
    assert res.manifest_uri == f"{tmp_path}/pub/v1/manifest.json"
    assert (tmp_path / "pub" / "v1" / "manifest.json").read_bytes() == b.manifest_path.read_bytes()


# --- the commit protocol ------------------------------------------------------------------------

def _writes(log, bucket):
    return [r for r in log if r.method in ("PUT", "POST") and r.path.startswith(f"/{bucket}/")]


def test_manifest_is_written_last(builds, proxy, bucket):
    proxy.clear()
    b = builds["bf16"]
    push_build(b.manifest_path, f"s3://{bucket}/order", endpoint_url=proxy.endpoint)
    writes = _writes(proxy.log, bucket)
    manifest_puts = [r for r in writes if r.path.split("?")[0] == f"/{bucket}/order/manifest.json"]
    assert len(manifest_puts) == 1
    m = manifest_puts[0]
    others = [r for r in writes if r is not m]
    assert len(others) == 2 * 4 + 1  # create + 2 parts + complete per shard, and config.json
    assert all(r.end <= m.start for r in others)
    heads = [r for r in proxy.log if r.method == "HEAD" and r.start >= max(o.end for o in others)]
    assert len(heads) >= 3  # every object checked after the uploads, before the manifest


def test_repush_replaces_changed_objects_behind_the_manifest(builds, s3, bucket):
    """Objects that went missing are re-uploaded; the old manifest is gone while they are."""
    b = builds["bf16"]
    uri = f"s3://{bucket}/re"
    push_build(b.manifest_path, uri, endpoint_url=s3.endpoint)
    c = s3.client()
    c.delete_object(Bucket=bucket, Key=f"re/{b.manifest.shards[1].file}")
    res = push_build(b.manifest_path, uri, endpoint_url=s3.endpoint)
    assert res.uploaded == 1 and res.present == 2 and res.manifest == "uploaded"
    assert [o.action for o in res.objects] == ["present", "present", "uploaded"]


@pytest.mark.heavy
def test_interrupted_push_resumes(builds, s3, proxy, bucket, tmp_path):
    """A real `shardc push` subprocess, slowed by the proxy, killed mid-upload; then a rerun."""
    b = builds["bf16"]
    uri = f"s3://{bucket}/killed"
    proxy.clear()
    proxy.faults = Faults(stall="partNumber=2")  # every second part waits: the push cannot end
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", "from shardc.cli import main; main()", "push",
           "--manifest", str(b.manifest_path), "--to", uri, "--endpoint-url", proxy.endpoint, "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        started = proxy.wait_for(lambda log: any("partNumber=2" in r.path for r in log), timeout=60)
        assert started, proc.stderr.read() if proc.poll() is not None else "no part upload seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    proxy.faults = Faults()
    c = s3.client()
    keys = {o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="killed/").get("Contents", [])}
    assert "killed/manifest.json" not in keys  # nothing visible to readers
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads")  # it was mid-upload

    res = run_cli("push", "--manifest", str(b.manifest_path), "--to", uri,
                  "--endpoint-url", s3.endpoint, "--json")
    assert res.exit_code == 0, res.output
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads") is None  # leftovers aborted
    out = pull_build(f"{uri}/manifest.json", tmp_path / "node", endpoint_url=s3.endpoint)
    assert out.verify.ok
    assert {k: v for k, v in tree(tmp_path / "node").items() if k != "manifest.json"} == build_files(b)


# --- corruption ---------------------------------------------------------------------------------

def _assert_nothing_corrupt(dest: Path, name: str) -> None:
    assert not (dest / name).exists()
    assert not list(dest.glob(f".{name}.partial-*"))
    assert not (dest / "manifest.json").exists()


@pytest.mark.parametrize("how", ["flip", "truncate", pytest.param("replace-zst", marks=needs_zstd)])
def test_corrupted_object_fails_pull(builds, s3, bucket, tmp_path, how):
    b = builds["bf16"]
    compress = "zstd" if how == "replace-zst" else None
    push_build(b.manifest_path, f"s3://{bucket}/c", endpoint_url=s3.endpoint, compress=compress)
    c = s3.client()
    victim = b.manifest.shards[1].file
    key = f"c/{victim}" + (".zst" if compress else "")
    obj = c.get_object(Bucket=bucket, Key=key)
    data, meta = bytearray(obj["Body"].read()), obj["Metadata"]
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    elif how == "truncate":
        del data[-4096:]
    else:  # a valid zstd stream of other bytes, same metadata: only our hashes can tell
        import zstandard

        other = (b.out_dir / b.manifest.shards[0].file).read_bytes()
        data = bytearray(zstandard.ZstdCompressor().compress(other))
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata=meta)

    dest = tmp_path / "node"
    res = run_cli("pull", "--manifest", f"s3://{bucket}/c/manifest.json", "--all", "--dest", str(dest),
                  "--endpoint-url", s3.endpoint)
    assert res.exit_code == 1
    assert victim in one_error_line(res)
    _assert_nothing_corrupt(dest, victim)


def test_corrupted_local_store_and_bad_local_files(builds, tmp_path):
    b = builds["fp8"]
    store = tmp_path / "store"
    push_build(b.manifest_path, str(store))
    victim = b.manifest.shards[0].file
    with open(store / victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(VerifyMismatch, match=victim):
        pull_build(str(store / "manifest.json"), tmp_path / "node")
    _assert_nothing_corrupt(tmp_path / "node", victim)

    # a corrupt file already under the final name is replaced by a verified download
    dest = tmp_path / "node2"
    push_build(b.manifest_path, str(tmp_path / "good"))
    dest.mkdir()
    good = (b.out_dir / victim).read_bytes()
    (dest / victim).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    out = pull_build(str(tmp_path / "good" / "manifest.json"), dest)
    assert out.verify.ok and (dest / victim).read_bytes() == good


@pytest.mark.parametrize("where", ["local", "s3"])
def test_push_refuses_a_shard_that_rotted_on_disk(builds, s3, bucket, tmp_path, where):
    """The local file no longer matches the manifest: exit 1, and its object never appears (on S3
    the parts upload while the file is hashed, but the upload is not completed)."""
    import shutil

    b = builds["bf16"]
    copy = tmp_path / "build"
    shutil.copytree(b.out_dir, copy)
    victim = b.manifest.shards[1].file
    with open(copy / victim, "r+b") as f:
        f.seek(5000)
        f.write(b"\x00\x01\x02")
    dest = str(tmp_path / "store") if where == "local" else f"s3://{bucket}/rot"
    res = run_cli("push", "--manifest", str(copy / "manifest.json"), "--to", dest, "--endpoint-url", s3.endpoint)
    assert res.exit_code == 1 and victim in one_error_line(res)
    if where == "local":
        assert not (tmp_path / "store" / "manifest.json").exists()
        assert not (tmp_path / "store" / victim).exists()
    else:
        c = s3.client()
        keys = {o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])}
        assert "rot/manifest.json" not in keys and f"rot/{victim}" not in keys
        assert c.list_multipart_uploads(Bucket=bucket).get("Uploads") is None


# --- faults -------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [None, pytest.param("zstd", marks=needs_zstd)])
def test_push_and_pull_survive_faults(builds, s3, proxy, tmp_path, compress):
    b = builds["int8"]
    # The proxy seeds each fault by object path and attempt: a bucket of its own (not the numbered
    # fixture's, which depends on the tests run before) makes the faults met the same in every run.
    bucket = f"faults-{compress or 'raw'}"
    s3.client().create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/faulty"
    proxy.clear()
    proxy.faults = Faults(p500=0.15, preset=0.1, pcut=0.2, seed=7)
    settings = S3Settings.from_env(max_attempts=12)
    try:
        push_build(b.manifest_path, uri, endpoint_url=proxy.endpoint, compress=compress,
                   settings=settings)
        out = pull_build(f"{uri}/manifest.json", tmp_path / "a", endpoint_url=proxy.endpoint,
                         settings=settings)
    finally:
        proxy.faults = Faults()
    statuses = {str(r.status) for r in proxy.log}
    assert {"500", "reset", "cut"} <= statuses  # the faults really happened
    assert out.verify.ok
    assert {k: v for k, v in tree(tmp_path / "a").items() if k != "manifest.json"} == build_files(b)


ENDLESS = {
    "500": (Faults(p500=1.0), "HTTP 500 InternalError after 3 attempts"),
    "reset": (Faults(preset=1.0), "kept breaking off after 3 attempts"),
    "cut": (Faults(pcut=1.0), "kept breaking off after 3 attempts"),
    # only the data transfers fail (the manifest and HEADs get through)
    "shards-500": (Faults(p500=1.0, match=".safetensors"), "after 3 attempts"),
    "shards-cut": (Faults(pcut=1.0, preset=0.0, match=".safetensors"), "kept breaking off after 3 attempts"),
}


@pytest.mark.parametrize("fault", list(ENDLESS))
def test_endless_faults_fail_clearly(builds, s3, proxy, bucket, tmp_path, monkeypatch, fault):
    b = builds["bf16"]
    push_build(b.manifest_path, f"s3://{bucket}/x", endpoint_url=s3.endpoint)
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "3")
    proxy.faults, says = ENDLESS[fault]
    try:
        t0 = time.monotonic()
        push = run_cli("push", "--manifest", str(b.manifest_path), "--to", f"s3://{bucket}/y",
                       "--endpoint-url", proxy.endpoint)
        pull = run_cli("pull", "--manifest", f"s3://{bucket}/x/manifest.json", "--all",
                       "--dest", str(tmp_path / "n"), "--endpoint-url", proxy.endpoint)
        elapsed = time.monotonic() - t0
    finally:
        proxy.faults = Faults()
    for res in (push, pull) if fault != "shards-cut" else (pull,):  # cuts hit GETs only
        assert res.exit_code == 2
        assert says in one_error_line(res)
    assert elapsed < 30
    if fault.startswith("shards"):
        assert "model-tp" in one_error_line(pull)  # names the file it could not fetch
        assert not list((tmp_path / "n").glob("model-*")) and not list((tmp_path / "n").glob(".*partial*"))
    c = s3.client()
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads") is None  # failed pushes aborted
    keys = {o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert ("y/manifest.json" in keys) == (push.exit_code == 0)


def test_dead_endpoint_fails_fast(builds, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "2")
    held, port = _held_port()  # a port with nobody listening, and nobody can start to meanwhile
    t0 = time.monotonic()
    with held:  # type: ignore[attr-defined]
        res = run_cli("pull", "--manifest", "s3://bkt/m/manifest.json", "--all", "--dest", str(tmp_path),
                      "--endpoint-url", f"http://127.0.0.1:{port}")
    assert res.exit_code == 2 and "cannot reach" in one_error_line(res)
    assert time.monotonic() - t0 < 15


# --- bad input ----------------------------------------------------------------------------------

def test_bad_input_is_one_line_exit_2(builds, s3, bucket, tmp_path):
    b = builds["bf16"]
    m = str(b.manifest_path)
    ep = ["--endpoint-url", s3.endpoint]
    push_build(b.manifest_path, f"s3://{bucket}/ok", endpoint_url=s3.endpoint)
    cases = {
        "unknown storage scheme 'gs'": ["push", "--manifest", m, "--to", "gs://bkt/x"],
        "unknown storage scheme 'ftp'": ["pull", "--manifest", "ftp://h/m.json", "--all", "--dest", str(tmp_path / "a")],
        "bucket 'no-such-bucket' does not exist": ["push", "--manifest", m, "--to", "s3://no-such-bucket/x", *ep],
        "does not exist": ["pull", "--manifest", "s3://no-such-bucket/m.json", "--all", "--dest", str(tmp_path / "b"), *ep],
        "is not a shardc manifest": ["pull", "--manifest", f"s3://{bucket}/ok/config.json", "--all", "--dest", str(tmp_path / "c"), *ep],
        "no manifest at": ["pull", "--manifest", f"s3://{bucket}/nothing/manifest.json", "--all", "--dest", str(tmp_path / "d"), *ep],
        "is not JSON": ["pull", "--manifest", str(b.out_dir / b.manifest.shards[0].file), "--all", "--dest", str(tmp_path / "e")],
        "outside this build": ["pull", "--manifest", f"s3://{bucket}/ok/manifest.json", "--rank", "7", "--dest", str(tmp_path / "f"), *ep],
        "choose which shards": ["pull", "--manifest", f"s3://{bucket}/ok/manifest.json", "--dest", str(tmp_path / "g")],
        "go together": ["pull", "--manifest", f"s3://{bucket}/ok/manifest.json", "--tp-rank", "0", "--dest", str(tmp_path / "h")],
        "cannot read manifest": ["push", "--manifest", str(tmp_path / "missing.json"), "--to", str(tmp_path / "s")],
    }
    for expect, args in cases.items():
        res = run_cli(*args)
        assert res.exit_code == 2, (args, res.output)
        assert expect in one_error_line(res), (expect, res.stderr)


def test_environment_problems_are_one_line(builds, tmp_path):
    """A directory where a shard should go (like a full disk): exit 2, one line, nothing left."""
    b = builds["bf16"]
    push_build(b.manifest_path, str(tmp_path / "store"))
    dest = tmp_path / "node"
    victim = b.manifest.shards[0].file
    (dest / victim).mkdir(parents=True)
    res = run_cli("pull", "--manifest", str(tmp_path / "store"), "--all", "--dest", str(dest))
    assert res.exit_code == 2 and victim in one_error_line(res)
    assert not list(dest.glob(".*.partial-*")) and not (dest / "manifest.json").exists()


def test_no_credentials(builds, s3, bucket, tmp_path):
    env = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    for args in (["push", "--manifest", str(builds["bf16"].manifest_path), "--to", f"s3://{bucket}/x"],
                 ["pull", "--manifest", f"s3://{bucket}/x/manifest.json", "--all", "--dest", str(tmp_path)]):
        res = run_cli(*args, "--endpoint-url", s3.endpoint, env=env)
        assert res.exit_code == 2 and "no AWS credentials" in one_error_line(res)


def test_library_errors_are_typed(builds, tmp_path):
    with pytest.raises(ManifestError):
        pull_build(str(builds["bf16"].out_dir / "config.json"), tmp_path / "x")
    with pytest.raises(StoreError, match="unknown compression"):
        push_build(builds["bf16"].manifest_path, str(tmp_path / "s"), compress="lz4")
    with pytest.raises(StoreError, match="no destination"):
        data = json.loads(builds["bf16"].manifest_path.read_text())
        data["plan"]["replica_group"]["checkpoint"].pop("manifest_uri")
        (tmp_path / "b").mkdir()
        for f in builds["bf16"].out_dir.iterdir():
            if not f.name.startswith("."):
                (tmp_path / "b" / f.name).write_bytes(f.read_bytes())
        (tmp_path / "b" / "manifest.json").write_bytes(Manifest.from_dict(data).dumps())
        push_build(tmp_path / "b" / "manifest.json")


@pytest.mark.parametrize("compress", [None, pytest.param("zstd", marks=needs_zstd)])
def test_pull_of_many_parts_per_file_completes(builds, s3, bucket, tmp_path, monkeypatch, compress):
    """More ranged parts per file than transfer threads: parts land at their offsets in the
    seekable sink (plain) or in the .zst download (decompressed at commit), all verified.
    (The in-order stream path this replaced hung on 1.4 GB shards with 64 MiB parts; that size is
    measured by scripts/bench_store.py --llama3-70b-shapes, too big for a unit test.)"""
    b = builds["bf16"]
    uri = f"s3://{bucket}/many"
    push_build(b.manifest_path, uri, endpoint_url=s3.endpoint, compress=compress)
    # downloads are ranged GETs of any size: 1 MiB ranges, 2 threads -> ~8 parts per shard
    monkeypatch.setenv("SHARDC_S3_CONCURRENCY", "2")
    monkeypatch.setenv("SHARDC_MULTIPART_THRESHOLD", str(1 << 20))
    monkeypatch.setenv("SHARDC_MULTIPART_CHUNKSIZE", str(1 << 20))
    assert max(s.size for s in b.manifest.shards) > 4 * (1 << 20)
    dest = tmp_path / "node"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(pull_build, f"{uri}/manifest.json", dest, endpoint_url=s3.endpoint)
        out = fut.result(timeout=120)
    assert out.verify.ok
    assert {k: v for k, v in tree(dest).items() if k != "manifest.json"} == build_files(b)


def test_upload_failing_while_another_is_in_flight(builds, s3, proxy, bucket, monkeypatch):
    """Issue 19: config.json's PUT fails (500, no retry) while the shards' parts are uploading
    (slowed by the proxy): one line and exit 2 (not s3transfer's TypeError from shutdown), the
    in-flight multipart uploads aborted, no manifest."""
    b = builds["bf16"]
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "1")
    proxy.clear()
    proxy.faults = Faults(bandwidth=2e6)  # a 5 MiB part takes ~2.6 s through the proxy
    decide = proxy._decide

    def fail_config_once_parts_fly(method: str, path: str) -> str | None:
        if method == "PUT" and path.split("?")[0].endswith("/inflight/config.json"):
            assert proxy.wait_for(lambda log: any("partNumber=" in r.path for r in log), timeout=30)
            return "500"
        return decide(method, path)

    monkeypatch.setattr(proxy, "_decide", fail_config_once_parts_fly)
    try:
        res = run_cli("push", "--manifest", str(b.manifest_path), "--to", f"s3://{bucket}/inflight",
                      "--endpoint-url", proxy.endpoint)
    finally:
        proxy.faults = Faults()
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert "config.json" in line and "HTTP 500" in line
    log = proxy.log
    failed = next(r for r in log if r.status == 500)
    # the scenario really happened: a part upload was still running when config.json failed
    assert any("partNumber=" in r.path and r.start < failed.end < r.end for r in log)
    c = s3.client()
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads") is None
    keys = {o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert "inflight/manifest.json" not in keys


# --- hostile input (issue 17) and missing optional packages (issue 19) -------------------------

def _held_port() -> tuple[object, int]:
    """A bound port that nobody listens on (held, so no other test can take it meanwhile)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def test_credentials_in_the_endpoint_url_are_not_echoed(builds, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "1")
    held, port = _held_port()
    with held:  # type: ignore[attr-defined]
        url = f"http://shardc-user:{SECRET}@127.0.0.1:{port}"
        pull = run_cli("pull", "--manifest", "s3://bkt/m/manifest.json", "--all", "--dest",
                       str(tmp_path / "n"), "--endpoint-url", url)
        push = run_cli("push", "--manifest", str(builds["bf16"].manifest_path), "--to", "s3://bkt/m",
                       env={"AWS_ENDPOINT_URL": url})
    for res in (pull, push):
        assert res.exit_code == 2
        line = one_error_line(res)  # asserts SECRET is not in the output
        assert f"cannot reach http://***@127.0.0.1:{port}" in line and "shardc-user" not in line


def test_silent_endpoint_is_bounded_by_the_stall_limit(tmp_path, monkeypatch):
    """A server that accepts connections and never answers: each try waits read_timeout, and the
    request stops once another try would pass SHARDC_S3_STALL_LIMIT, although more attempts are
    allowed; the message names both settings."""
    import socket
    import threading

    monkeypatch.setenv("SHARDC_S3_READ_TIMEOUT", "0.5")
    monkeypatch.setenv("SHARDC_S3_STALL_LIMIT", "1")
    monkeypatch.setenv("SHARDC_S3_MAX_ATTEMPTS", "8")
    conns: list[socket.socket] = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        srv.settimeout(0.2)
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    conns.append(srv.accept()[0])  # accepted, read from never, answered never
                except OSError:
                    continue

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        t0 = time.monotonic()
        try:
            res = run_cli("pull", "--manifest", "s3://bkt/m/manifest.json", "--all", "--dest",
                          str(tmp_path / "n"), "--endpoint-url",
                          f"http://k:{SECRET}@127.0.0.1:{srv.getsockname()[1]}")
            elapsed = time.monotonic() - t0
        finally:
            stop.set()
            t.join()
            for c in conns:
                c.close()
    assert res.exit_code == 2
    line = one_error_line(res)
    assert "stopped answering" in line and "http://***@127.0.0.1" in line
    assert "SHARDC_S3_READ_TIMEOUT" in line and "SHARDC_S3_STALL_LIMIT" in line
    assert len(conns) == 2  # 0.5 s + 0.5 s of stalls reach the 1 s limit; not 8 attempts
    assert elapsed < 6
    # the defaults: two tries of botocore's 60 s read timeout, not six plus backoff (422 s)
    d = S3Settings()
    assert d.read_timeout == 60 and d.stall_limit == 120


def test_dot_segments_in_an_s3_prefix_are_refused(builds, s3, bucket, tmp_path):
    for uri in (f"s3://{bucket}/../../x", f"s3://{bucket}/a/./b", f"s3://{bucket}/a/../b"):
        res = run_cli("push", "--manifest", str(builds["bf16"].manifest_path), "--to", uri,
                      "--endpoint-url", s3.endpoint)
        assert res.exit_code == 2 and "'..'" in one_error_line(res)
        res = run_cli("pull", "--manifest", f"{uri}/manifest.json", "--all", "--dest", str(tmp_path / "n"),
                      "--endpoint-url", s3.endpoint)
        assert res.exit_code == 2 and "'..'" in one_error_line(res)
    assert s3.client().list_objects_v2(Bucket=bucket).get("Contents") is None


def test_planted_symlinks_at_temp_names_redirect_nothing(builds, tmp_path):
    """Issue 17: a symlink at the temp names writers used to pick (``.manifest.json.tmp-<pid>``,
    ``.<file>.partial-<pid>``) in a local store or a pull destination receives no write."""
    b = builds["bf16"]
    pid = os.getpid()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    store, dest = tmp_path / "store", tmp_path / "node"
    for d in (store, dest):
        d.mkdir()
        for name in ["manifest.json", *build_files(b)]:
            (d / f".{name}.tmp-{pid}").symlink_to(victim)
            (d / f".{name}.partial-{pid}").symlink_to(victim)
    push_build(b.manifest_path, str(store))
    out = pull_build(str(store / "manifest.json"), dest)
    assert out.verify.ok and out.downloaded == len(build_files(b))
    assert victim.read_bytes() == b"precious"
    for d in (store, dest):
        assert (d / "manifest.json").read_bytes() == b.manifest_path.read_bytes()
        assert {n: h for n, h in tree(d).items() if n in build_files(b)} == build_files(b)
        assert not any((d / n).is_symlink() for n in ["manifest.json", *build_files(b)])


def test_partial_files_are_created_exclusively(tmp_path, monkeypatch):
    """The random partial name a writer draws is taken (here: forced) by a planted symlink: the
    writer draws again instead of writing through it."""
    import secrets

    from shardc.store.codec import new_partial

    victim, final = tmp_path / "victim", tmp_path / "model.safetensors"
    victim.write_bytes(b"precious")
    tokens = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(secrets, "token_hex", lambda n=32: next(tokens))
    planted = tmp_path / f".model.safetensors.partial-{os.getpid()}.{'0' * 16}"
    planted.symlink_to(victim)
    path, f = new_partial(final)
    with f:
        f.write(b"new bytes")
    assert path.name.endswith("1" * 16) and path.read_bytes() == b"new bytes"
    assert victim.read_bytes() == b"precious" and planted.is_symlink()


def test_push_compress_zstd_without_zstandard_is_one_line(builds, tmp_path):
    """zstandard is optional: without it, `push --compress zstd` says so (exit 2) and writes nothing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; sys.modules['zstandard'] = None; from shardc.cli import main; main()"
    store = tmp_path / "store"
    res = subprocess.run([sys.executable, "-c", code, "push", "--manifest", str(builds["bf16"].manifest_path),
                          "--to", str(store), "--compress", "zstd"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "zstd compression needs the zstandard package" in lines[0], res.stderr
    assert "shardc[zstd]" in lines[0] and not store.exists()


@needs_zstd
def test_pull_of_zstd_objects_without_zstandard_is_one_line(builds, tmp_path):
    b = builds["bf16"]
    store = tmp_path / "store"
    push_build(b.manifest_path, str(store), compress="zstd")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; sys.modules['zstandard'] = None; from shardc.cli import main; main()"
    dest = tmp_path / "node"
    res = subprocess.run([sys.executable, "-c", code, "pull", "--manifest", str(store), "--all",
                          "--dest", str(dest)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "zstd compression needs the zstandard package" in lines[0], res.stderr
    assert not dest.exists() or not any(dest.iterdir())
