"""store/push.py and store/pull.py behaviours that mutation testing found unchecked.

Push: which objects are skipped (a stored object must match by size and recorded sha256; a .zst
object by its codec, content size and content sha256, and it must carry its own sha256), the
report, where the build's files are looked for, the destination, every refusal's message, the
order of store operations on a real S3 server (moto on 127.0.0.1 behind the logging proxy), and
the check that every object is still there before the manifest is written. Pull: the report,
the rank selection and its refusals, the checked ``compressed`` records, what happens to an old
manifest and to dead writers' partial files, and which error wins when downloads fail.

Oracles come from outside the code under test: bytes and sizes read from the filesystem or
through boto3, sha256 from hashlib, zstd frames decompressed with the zstandard library, request
order from the proxy's log, messages written out by hand.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from manifest_edits import reseal
from plan_helpers import plan as make_plan
from s3server import Faults

from shardc.errors import ManifestError, StoreError, VerifyMismatch
from shardc.results import to_json
from shardc.store import S3Settings, pull_build, push_build
from shardc.store.pull import fetch_manifest

needs_zstd = pytest.mark.skipif(importlib.util.find_spec("zstandard") is None,
                                reason="zstandard is not installed (pip install 'shardc[zstd]')")
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "vocab_size": 64}
NAME = "mtwin"
SHARD0, SHARD1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"
FILES = ["config.json", SHARD0, SHARD1]  # a tp=2 pp=1 build: the side file, then the shards by rank
_buckets = itertools.count()


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """One tp=2 bf16 plan built from two checkpoints (seeds 0 and 1): same names and sizes,
    different bytes. Each build sits at <root>/build/mtwin with its record in <root>/manifests."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    base = tmp_path_factory.mktemp("mtwins")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        src = write_checkpoint(base / f"src-{name}", llama_config(**TINY), seed=seed)
        plan = make_plan(2, name=NAME, source=src)
        root = base / name
        out[name] = build(plan, root / "build" / NAME, manifests_dir=root / "manifests")
    for f in FILES:
        assert (out["a"].out_dir / f).stat().st_size == (out["b"].out_dir / f).stat().st_size
    assert sha(out["a"].out_dir / SHARD0) != sha(out["b"].out_dir / SHARD0)
    return out


@pytest.fixture(autouse=True)
def aws_env(aws_env):
    """conftest's dummy credentials, for every test here; two attempts, and downloads synced as
    by default."""
    aws_env.delenv("SHARDC_FSYNC_DOWNLOADS", raising=False)
    aws_env.setenv("SHARDC_S3_MAX_ATTEMPTS", "2")


def bucket(s3) -> str:
    name = f"mstore-{next(_buckets)}"
    s3[0].client().create_bucket(Bucket=name)
    return name


def sha(path_or_bytes) -> str:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return hashlib.sha256(data).hexdigest()


def unzstd(path: Path) -> bytes:
    import zstandard

    with open(path, "rb") as f:
        return zstandard.ZstdDecompressor().stream_reader(f).read()


def copy_build(b, dest: Path) -> Path:
    """A copy of a build's files and manifest (not the lock file)."""
    dest.mkdir(parents=True)
    for f in [*FILES, "manifest.json"]:
        shutil.copy(b.out_dir / f, dest / f)
    return dest / "manifest.json"


def flip(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def stat_key(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_ino, st.st_mtime_ns


# --- push: the report, and what a repush skips --------------------------------------------------

def _expected_report(store: Path, src: Path, sizes: dict[str, int], objects: dict[str, str],
                     action: str, compress, manifest: str) -> dict:
    rows = [{"file": f, "object": objects[f], "size": sizes[f], "action": action} for f in FILES]
    total = sum(sizes.values())
    return {"dest": str(store), "manifest_uri": f"{store}/manifest.json", "manifest": manifest,
            "compress": compress, "objects": rows,
            "uploaded": len(FILES) if action == "uploaded" else 0,
            "present": len(FILES) if action == "present" else 0,
            "bytes_uploaded": total if action == "uploaded" else 0, "bytes_total": total,
            "removed": []}  # nothing replaced (#25 item 12: store/test_store_hostile.py)


def _seconds(res: Any) -> dict:
    res = to_json(res)  # the report's JSON form, the keys --json prints
    s = res.pop("seconds")
    assert isinstance(s, float) and 0 <= s < 60 and s == round(s, 3)
    return res


def test_push_report_and_repush_of_a_plain_build(twins, tmp_path):
    a = twins["a"]
    store = tmp_path / "store"
    res = push_build(a.manifest_path, str(store))
    sizes = {f: (a.out_dir / f).stat().st_size for f in FILES}
    assert _seconds(res) == _expected_report(store, a.out_dir, sizes, {f: f for f in FILES},
                                             "uploaded", None, "uploaded")
    assert sorted(os.listdir(store)) == sorted([*FILES, "manifest.json"])  # no partials left
    for f in [*FILES, "manifest.json"]:
        assert (store / f).read_bytes() == (a.out_dir / f).read_bytes()

    before = {f: stat_key(store / f) for f in os.listdir(store)}
    again = push_build(a.manifest_path, str(store))
    assert _seconds(again) == _expected_report(store, a.out_dir, sizes, {f: f for f in FILES},
                                               "present", None, "unchanged")
    assert {f: stat_key(store / f) for f in os.listdir(store)} == before  # nothing rewritten


@needs_zstd
def test_push_report_and_repush_of_a_compressed_build(twins, tmp_path):
    a = twins["a"]
    store = tmp_path / "store"
    res = push_build(a.manifest_path, str(store), compress="zstd")
    objects = {"config.json": "config.json", SHARD0: SHARD0 + ".zst", SHARD1: SHARD1 + ".zst"}
    assert sorted(os.listdir(store)) == sorted([*objects.values(), "manifest.json"])
    sizes = {f: (store / o).stat().st_size for f, o in objects.items()}
    assert _seconds(res) == _expected_report(store, a.out_dir, sizes, objects, "uploaded", "zstd",
                                             "uploaded")
    assert (store / "config.json").read_bytes() == (a.out_dir / "config.json").read_bytes()
    for f in (SHARD0, SHARD1):
        assert unzstd(store / objects[f]) == (a.out_dir / f).read_bytes()
    remote = json.loads((store / "manifest.json").read_text())
    assert "compressed" not in remote["files"][0]  # side files stay plain
    for f in (SHARD0, SHARD1):
        assert remote["shards"][f]["compressed"] == {
            "codec": "zstd", "size": sizes[f], "sha256": sha(store / objects[f]), "object": objects[f]}
        assert remote["shards"][f]["sha256"] == sha(a.out_dir / f)

    before = {f: stat_key(store / f) for f in os.listdir(store)}
    again = push_build(a.manifest_path, str(store), compress="zstd")
    assert _seconds(again) == _expected_report(store, a.out_dir, sizes, objects, "present", "zstd",
                                               "unchanged")
    assert {f: stat_key(store / f) for f in os.listdir(store)} == before


@needs_zstd
def test_compressed_push_over_a_same_size_build_replaces_every_shard(twins, tmp_path):
    """.zst objects of the same content size but other content must be replaced."""
    store = tmp_path / "store"
    push_build(twins["a"].manifest_path, str(store), compress="zstd")
    # b is built from another source: replacing a's build must be asked for (#25 item 12)
    res = push_build(twins["b"].manifest_path, str(store), compress="zstd", replace=True)
    assert [o.action for o in res.objects] == ["present", "uploaded", "uploaded"]
    for f in (SHARD0, SHARD1):
        assert unzstd(store / (f + ".zst")) == (twins["b"].out_dir / f).read_bytes()


def test_a_changed_manifest_alone_is_rewritten(twins, tmp_path):
    """Every object present, but the store's manifest differs: it is replaced, nothing else."""
    a = twins["a"]
    store = tmp_path / "store"
    push_build(a.manifest_path, str(store))
    (store / "manifest.json").write_bytes(b"{}")
    res = push_build(a.manifest_path, str(store), replace=True)  # unreadable: asked for (#25 item 12)
    assert res.manifest == "uploaded" and res.uploaded == 0 and res.present == 3
    assert (store / "manifest.json").read_bytes() == a.manifest_path.read_bytes()


def test_a_missing_object_is_uploaded_and_the_manifest_rewritten(twins, tmp_path):
    a = twins["a"]
    store = tmp_path / "store"
    push_build(a.manifest_path, str(store))
    (store / SHARD1).unlink()
    res = push_build(a.manifest_path, str(store))
    assert [o.action for o in res.objects] == ["present", "present", "uploaded"]
    assert res.manifest == "uploaded" and res.bytes_uploaded == (a.out_dir / SHARD1).stat().st_size
    assert (store / SHARD1).read_bytes() == (a.out_dir / SHARD1).read_bytes()
    assert (store / "manifest.json").read_bytes() == a.manifest_path.read_bytes()


# --- push on S3: stored metadata, what counts as present, the order of requests ------------------

def test_s3_objects_carry_their_sha256_and_content_type(twins, s3):
    server, _ = s3
    a, bkt = twins["a"], bucket(s3)
    push_build(a.manifest_path, f"s3://{bkt}/p", endpoint_url=server.endpoint)
    c = server.client()
    for f, ctype in (("config.json", "application/json"), (SHARD0, "application/octet-stream"),
                     ("manifest.json", "application/json")):
        obj = c.get_object(Bucket=bkt, Key=f"p/{f}")
        body = obj["Body"].read()
        assert body == (a.out_dir / f).read_bytes()
        assert obj["ContentType"] == ctype and obj["Metadata"] == {"sha256": sha(body)}


def test_s3_object_with_the_right_sha256_but_wrong_size_is_replaced(twins, s3):
    server, _ = s3
    a, bkt = twins["a"], bucket(s3)
    uri = f"s3://{bkt}/p"
    push_build(a.manifest_path, uri, endpoint_url=server.endpoint)
    c = server.client()
    good = (a.out_dir / SHARD0).read_bytes()
    c.put_object(Bucket=bkt, Key=f"p/{SHARD0}", Body=good[:-1], Metadata={"sha256": sha(good)})
    res = push_build(a.manifest_path, uri, endpoint_url=server.endpoint)
    assert [o.action for o in res.objects] == ["present", "uploaded", "present"]
    assert c.get_object(Bucket=bkt, Key=f"p/{SHARD0}")["Body"].read() == good


@needs_zstd
def test_s3_zst_object_without_its_own_sha256_is_replaced(twins, s3, tmp_path):
    """Its content records match, but without the stored bytes' sha256 the manifest could not say
    what pull must find: it is uploaded again, and the manifest records the new object's hash."""
    server, _ = s3
    a, bkt = twins["a"], bucket(s3)
    uri = f"s3://{bkt}/z"
    push_build(a.manifest_path, uri, endpoint_url=server.endpoint, compress="zstd")
    c = server.client()
    key = f"z/{SHARD0}.zst"
    obj = c.get_object(Bucket=bkt, Key=key)
    body, meta = obj["Body"].read(), obj["Metadata"]
    assert meta["content-sha256"] == sha(a.out_dir / SHARD0) and meta["codec"] == "zstd"
    c.put_object(Bucket=bkt, Key=key, Body=body, Metadata={k: v for k, v in meta.items() if k != "sha256"})
    res = push_build(a.manifest_path, uri, endpoint_url=server.endpoint, compress="zstd")
    assert [o.action for o in res.objects] == ["present", "uploaded", "present"]
    stored = c.get_object(Bucket=bkt, Key=key)
    data = stored["Body"].read()
    assert stored["Metadata"]["sha256"] == sha(data)
    remote = json.loads(c.get_object(Bucket=bkt, Key="z/manifest.json")["Body"].read())
    assert remote["shards"][SHARD0]["compressed"]["sha256"] == sha(data)
    pulled = pull_build(f"{uri}/manifest.json", tmp_path / "node", endpoint_url=server.endpoint)
    assert pulled.verify.ok


def _manifest_requests(log, bkt: str) -> list[str]:
    return [r.method for r in log if r.path.split("?")[0] == f"/{bkt}/p/manifest.json"]


def test_s3_request_order_of_first_push_repush_and_repair(twins, s3):
    """First push: the manifest is looked for, never deleted, written last. An unchanged repush
    writes nothing. A repush that must replace an object deletes the manifest before any write
    and writes it again after every other write ended."""
    server, proxy = s3
    a, bkt = twins["a"], bucket(s3)
    uri = f"s3://{bkt}/p"
    proxy.clear()
    push_build(a.manifest_path, uri, endpoint_url=proxy.endpoint)
    log = proxy.log
    assert _manifest_requests(log, bkt) == ["GET", "PUT"]
    assert not [r for r in log if r.method == "DELETE"]

    proxy.clear()
    push_build(a.manifest_path, uri, endpoint_url=proxy.endpoint)
    log = proxy.log
    assert _manifest_requests(log, bkt) == ["GET"]
    assert not [r for r in log if r.method in ("PUT", "POST", "DELETE")]

    server.client().delete_object(Bucket=bkt, Key=f"p/{SHARD1}")
    proxy.clear()
    push_build(a.manifest_path, uri, endpoint_url=proxy.endpoint)
    log = proxy.log
    assert _manifest_requests(log, bkt) == ["GET", "DELETE", "PUT"]
    key = f"/{bkt}/p/manifest.json"
    delete = next(r for r in log if r.method == "DELETE")
    put = next(r for r in log if r.method == "PUT" and r.path.split("?")[0] == key)
    writes = [r for r in log if r.method in ("PUT", "POST") and r is not put]
    assert writes and all(r.path.split("?")[0] == f"/{bkt}/p/{SHARD1}" for r in writes)
    assert delete.end <= min(r.start for r in writes) and max(r.end for r in writes) <= put.start


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_an_object_changed_during_the_push_stops_it_before_the_manifest(twins, s3, monkeypatch, change):
    """Another writer removes (or rewrites) config.json after push uploaded it and while the shards
    are still uploading: the final check finds it and no manifest is written."""
    server, proxy = s3
    a, bkt = twins["a"], bucket(s3)
    monkeypatch.setenv("SHARDC_MULTIPART_THRESHOLD", "1024")  # shards: multipart; config.json: one PUT
    config = f"/{bkt}/p/config.json"
    proxy.clear()
    stall = f"{SHARD1}?uploads"  # the last shard's CreateMultipartUpload waits
    proxy.faults = Faults(stall=stall)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(push_build, a.manifest_path, f"s3://{bkt}/p", endpoint_url=proxy.endpoint)
            assert proxy.wait_for(lambda log: any(
                r.method == "PUT" and r.path.split("?")[0] == config and r.status == 200 and r.end
                for r in log) and any(stall in r.path for r in log), 60)
            c = server.client()
            if change == "deleted":
                c.delete_object(Bucket=bkt, Key="p/config.json")
            else:
                c.put_object(Bucket=bkt, Key="p/config.json", Body=b"{}")
            proxy.faults = Faults()  # the shards go on
            with pytest.raises(StoreError) as exc:
                fut.result(timeout=120)
    finally:
        proxy.faults = Faults()
    size = (a.out_dir / "config.json").stat().st_size
    what = "missing" if change == "deleted" else f"2 bytes, expected {size}"
    assert exc.value.message == f"after upload, s3://{bkt}/p/config.json is {what}"
    assert exc.value.hint == "another writer changed the store during the push; rerun"
    keys = [o["Key"] for o in server.client().list_objects_v2(Bucket=bkt).get("Contents", [])]
    assert "p/manifest.json" not in keys


# --- push: where the files are, where they go, and every refusal --------------------------------

def test_push_finds_the_build_from_its_record_in_manifests(twins, tmp_path, monkeypatch):
    a = twins["a"]
    record = a.out_dir.parent.parent / "manifests" / f"{NAME}.json"
    store = tmp_path / "s1"
    push_build(record, str(store))  # <record>/../../build/<name>
    assert (store / SHARD1).read_bytes() == (a.out_dir / SHARD1).read_bytes()

    elsewhere = tmp_path / "elsewhere" / "m.json"
    elsewhere.parent.mkdir()
    shutil.copy(record, elsewhere)
    monkeypatch.chdir(a.out_dir.parent.parent)  # ./build/<name>
    store = tmp_path / "s2"
    push_build(elsewhere, str(store))
    assert (store / SHARD0).read_bytes() == (a.out_dir / SHARD0).read_bytes()


def test_push_names_the_first_missing_file(twins, tmp_path):
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(twins["a"].manifest_path, lonely / "manifest.json")
    shutil.copy(twins["a"].out_dir / "config.json", lonely / "config.json")
    store = tmp_path / "store"
    for kw, missing in (({}, SHARD0), ({"build_dir": tmp_path / "nowhere"}, "config.json")):
        with pytest.raises(StoreError) as exc:
            push_build(lonely / "manifest.json", str(store), **kw)
        assert exc.value.message == (f"the build's files are not next to {lonely / 'manifest.json'} "
                                     f"(missing {missing})")
        assert exc.value.hint == "give the manifest.json inside the build directory, or `build_dir`"
    assert not store.exists()
    push_build(lonely / "manifest.json", str(store), build_dir=twins["a"].out_dir)
    assert (store / SHARD0).read_bytes() == (twins["a"].out_dir / SHARD0).read_bytes()


def test_push_destinations(twins, tmp_path):
    a = twins["a"]
    store = tmp_path / "store"
    res = push_build(a.manifest_path, f"{store}/v1.json")
    assert res.manifest_uri == f"{store}/v1.json" and res.dest == str(store)
    assert (store / "v1.json").read_bytes() == a.manifest_path.read_bytes()
    assert not (store / "manifest.json").exists()
    res = push_build(a.manifest_path, f"{tmp_path}/otherX/")  # only the slash is stripped
    assert res.dest == f"{tmp_path}/otherX" and res.manifest_uri == f"{tmp_path}/otherX/manifest.json"
    assert (tmp_path / "otherX" / "manifest.json").read_bytes() == a.manifest_path.read_bytes()

    from shardc.formats.manifest import load
    from shardc.store.push import _destination

    assert _destination(load(a.manifest_path), "//") == ("/", "manifest.json")  # not written to
    with pytest.raises(StoreError) as exc:
        push_build(a.manifest_path)  # the plan names no checkpoint.manifest_uri
    assert exc.value.message == "no destination: the plan has no replica_group.checkpoint.manifest_uri"
    assert exc.value.hint == "give `dest_uri` (a local directory, file:// or s3://bucket/prefix)"


def test_unknown_compression_is_refused_before_anything_is_written(twins, tmp_path):
    store = tmp_path / "store"
    with pytest.raises(StoreError) as exc:
        push_build(twins["a"].manifest_path, str(store), compress="lz4")
    assert exc.value.message == "unknown compression 'lz4'" and exc.value.hint == "use one of: zstd"
    assert not store.exists()


def test_a_file_of_the_wrong_size_is_refused_before_anything_is_written(twins, tmp_path):
    m = copy_build(twins["a"], tmp_path / "b")
    shard = tmp_path / "b" / SHARD1
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    store = tmp_path / "store"
    with pytest.raises(VerifyMismatch) as exc:
        push_build(m, str(store))
    assert exc.value.message == f"{shard}: {size + 1} bytes, the manifest says {size}"
    assert exc.value.hint == "the build directory changed after the build; rebuild"
    assert not store.exists()


@pytest.mark.parametrize("compress", [None, pytest.param("zstd", marks=needs_zstd)])
def test_a_rotted_shard_is_named_with_both_hashes(twins, tmp_path, monkeypatch, compress):
    m = copy_build(twins["a"], tmp_path / "b")
    shard = tmp_path / "b" / SHARD1
    want = sha(shard)
    flip(shard)
    got = sha(shard)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where compress_file puts its .zst
    store = tmp_path / "store"
    with pytest.raises(VerifyMismatch) as exc:
        push_build(m, str(store), compress=compress)
    assert exc.value.message == (f"{shard}: sha256 {got[:16]}... does not match the manifest's "
                                 f"{want[:16]}...")
    assert exc.value.hint == "the file changed after the build; rebuild"
    assert os.listdir(tmp) == []  # the compressed copy is removed
    assert not (store / "manifest.json").exists()
    assert not [n for n in os.listdir(store) if SHARD1 in n]


def test_push_progress_counts_the_bytes_it_uploads(twins, tmp_path, capsys, terminal):
    from tqdm import tqdm

    a = twins["a"]
    store = tmp_path / "store"
    push_build(a.manifest_path, str(store), progress=True)
    out, err = capsys.readouterr()
    total = tqdm.format_sizeof(sum((a.out_dir / f).stat().st_size for f in FILES), divisor=1024)
    assert out == "" and f"push {store}:" in err
    assert f"/{total} [" in err  # the total grows to every byte pushed
    assert err.endswith("\r") and "\n" not in err  # closed: the line is cleared


# --- pull ---------------------------------------------------------------------------------------

def _pushed(twins, tmp_path: Path, which: str = "a", compress=None) -> str:
    store = tmp_path / f"store-{which}"
    push_build(twins[which].manifest_path, str(store), compress=compress)
    return str(store)


@pytest.mark.parametrize("compress", [None, pytest.param("zstd", marks=needs_zstd)])
def test_pull_report_of_one_rank_then_all(twins, tmp_path, compress):
    a = twins["a"]
    store = _pushed(twins, tmp_path, compress=compress)
    uri = f"{store}/manifest.json"
    dest = tmp_path / "new" / "node"  # parents are created
    stored = {f: Path(store, f + (".zst" if compress and f != "config.json" else "")).stat().st_size
              for f in FILES}
    size = {f: (a.out_dir / f).stat().st_size for f in FILES}

    res = pull_build(uri, dest, ranks=[(1, 0)])
    verify = res.verify
    assert verify.ok and [r.rank for r in verify.ranks] == [1]
    assert {k: v for k, v in _seconds(res).items() if k != "verify"} == {
        "manifest_uri": uri, "dest": str(dest), "manifest": str(dest / "manifest.json"),
        "ranks": [{"file": SHARD1, "tp_rank": 1, "pp_stage": 0, "rank": 1}],
        "files": [{"name": f, "size": size[f], "action": "downloaded"} for f in ("config.json", SHARD1)],
        "downloaded": 2, "present": 0, "bytes_downloaded": stored["config.json"] + stored[SHARD1]}
    assert sorted(os.listdir(dest)) == sorted(["config.json", SHARD1, "manifest.json"])
    kept = {f: stat_key(dest / f) for f in ("config.json", SHARD1)}

    res = pull_build(uri, dest)
    assert to_json(res.files) == [{"name": "config.json", "size": size["config.json"], "action": "present"},
                            {"name": SHARD0, "size": size[SHARD0], "action": "downloaded"},
                            {"name": SHARD1, "size": size[SHARD1], "action": "present"}]
    assert res.downloaded == 1 and res.present == 2 and res.bytes_downloaded == stored[SHARD0]
    assert [r.rank for r in res.ranks] == [0, 1]
    assert {f: stat_key(dest / f) for f in ("config.json", SHARD1)} == kept
    for f in [*FILES, "manifest.json"]:
        assert (dest / f).read_bytes() == (a.out_dir / f).read_bytes()


def test_pull_rank_selection(twins, tmp_path):
    uri = _pushed(twins, tmp_path)
    res = pull_build(uri, tmp_path / "n1", ranks=[(1, 0), (0, 0), (1, 0)])
    assert [r.rank for r in res.ranks] == [0, 1]
    res = pull_build(uri, tmp_path / "n2", ranks=[(1, 0)], global_ranks=[0, 1])
    assert [r.file for r in res.ranks] == [SHARD0, SHARD1]
    res = pull_build(uri, tmp_path / "n3", global_ranks=[0])
    assert [r.file for r in res.ranks] == [SHARD0]
    assert sorted(os.listdir(tmp_path / "n3")) == sorted(["config.json", SHARD0, "manifest.json"])

    with pytest.raises(ManifestError) as exc:
        pull_build(uri, tmp_path / "n4", ranks=[(0, 0), (0, 1)])
    assert exc.value.message == "tp_rank=0 pp_stage=1 is outside this build (tp_degree=2, pp_degree=1)"
    assert exc.value.hint == "tp ranks 0..1, pp stages 0..0"
    with pytest.raises(ManifestError) as exc:
        pull_build(uri, tmp_path / "n4", global_ranks=[2])
    assert exc.value.message == "rank 2 is outside this build (world size 2)"
    assert exc.value.hint == "ranks 0..1"
    assert not (tmp_path / "n4").exists()


@needs_zstd
@pytest.mark.parametrize("bad", [{"codec": "lz4"}, {"size": "18718"}, {"sha256": 5}])
def test_pull_refuses_a_malformed_compressed_record(twins, tmp_path, bad):
    store = Path(_pushed(twins, tmp_path, compress="zstd"))
    remote = json.loads((store / "manifest.json").read_text())
    remote["shards"][SHARD1]["compressed"].update(bad)
    (store / "manifest.json").write_text(json.dumps(remote))
    dest = tmp_path / "node"
    with pytest.raises(ManifestError) as exc:
        pull_build(str(store), dest)
    assert exc.value.message == (f"the manifest's compressed record of {SHARD1} is malformed or uses "
                                 f"an unknown codec")
    assert exc.value.hint == "push the build again with this shardc version"
    assert not dest.exists()


@needs_zstd
def test_pull_refuses_a_compressed_object_name_outside_the_store(twins, tmp_path):
    store = Path(_pushed(twins, tmp_path, compress="zstd"))
    remote = json.loads((store / "manifest.json").read_text())
    remote["shards"][SHARD1]["compressed"]["object"] = "../escape.zst"
    (store / "manifest.json").write_text(json.dumps(remote))
    with pytest.raises(ManifestError) as exc:
        pull_build(str(store), tmp_path / "node")
    assert exc.value.message == "unsafe compressed object name '../escape.zst'"
    assert not (tmp_path / "node").exists()


@needs_zstd
def test_fetch_manifest_is_the_builds_own(twins, tmp_path):
    store = _pushed(twins, tmp_path, compress="zstd")
    assert fetch_manifest(f"{store}/manifest.json").dumps() == twins["a"].manifest_path.read_bytes()


def test_pull_without_a_manifest(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError) as exc:
        pull_build(str(tmp_path / "empty"), tmp_path / "node")
    assert exc.value.message == f"no manifest at {tmp_path / 'empty'}/manifest.json"
    assert exc.value.hint == "check the URI; a build is visible only once shardc push has finished"


def test_pull_into_a_file_is_refused(twins, tmp_path):
    uri = _pushed(twins, tmp_path)
    dest = tmp_path / "file"
    dest.write_bytes(b"x")
    with pytest.raises(StoreError) as exc:
        pull_build(uri, dest)
    assert exc.value.message == f"cannot prepare {dest}: File exists"


def test_pull_removes_dead_writers_partials_and_keeps_live_ones(twins, tmp_path):
    uri = _pushed(twins, tmp_path)
    dest = tmp_path / "node"
    dest.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = dest / f".{SHARD0}.partial-{dead}.0123456789abcdef"
    live = dest / f".{SHARD1}.partial-1.0123456789abcdef"  # pid 1 is alive
    other = dest / ".unrelated.partial-1.0"
    for p in (stale, live, other):
        p.write_bytes(b"partial")
    pull_build(uri, dest)
    assert not stale.exists() and live.exists() and other.exists()


def test_a_failed_pull_of_another_build_leaves_no_old_manifest(twins, tmp_path):
    """dest holds build a; a pull of b fails on a corrupted object: a's manifest must be gone (its
    files may be half replaced). A failed pull of the same build keeps it."""
    a_uri = _pushed(twins, tmp_path, "a")
    b_store = Path(_pushed(twins, tmp_path, "b"))
    dest = tmp_path / "node"
    pull_build(a_uri, dest)
    flip(b_store / SHARD1)
    with pytest.raises(VerifyMismatch):
        pull_build(str(b_store), dest)
    assert not (dest / "manifest.json").exists()

    dest2 = tmp_path / "node2"
    pull_build(a_uri, dest2)
    flip(Path(a_uri) / SHARD1)
    flip(dest2 / SHARD1)  # must be fetched again, and the store's copy is bad too
    with pytest.raises(VerifyMismatch):
        pull_build(a_uri, dest2)
    assert (dest2 / "manifest.json").read_bytes() == twins["a"].manifest_path.read_bytes()


def test_a_present_file_must_match_by_hash(twins, tmp_path):
    a = twins["a"]
    uri = _pushed(twins, tmp_path)
    dest = tmp_path / "node"
    pull_build(uri, dest)
    flip(dest / SHARD0)  # same size, other bytes
    with open(dest / SHARD1, "ab") as f:
        f.write(b"\0")  # other size
    res = pull_build(uri, dest)
    assert [f.action for f in res.files] == ["present", "downloaded", "downloaded"]
    for f in FILES:
        assert (dest / f).read_bytes() == (a.out_dir / f).read_bytes()


def test_pull_mismatches_win_and_are_counted(twins, tmp_path):
    a = twins["a"]
    store = Path(_pushed(twins, tmp_path))
    for f in (SHARD0, SHARD1):
        flip(store / f)
    dest = tmp_path / "node"
    with pytest.raises(VerifyMismatch) as exc:
        pull_build(str(store), dest)
    size, got, want = (store / SHARD0).stat().st_size, sha(store / SHARD0), sha(a.out_dir / SHARD0)
    assert exc.value.message == (f"{SHARD0}: downloaded data does not match the manifest: {size} bytes, "
                                 f"sha256 {got[:16]}..., expected {size} bytes, {want[:16]}... "
                                 f"(and 1 more file(s))")
    assert exc.value.hint == "the object was corrupted or replaced in the store; push the build again"
    assert sorted(os.listdir(dest)) == ["config.json"]  # no shard, no partial, no manifest

    (store / SHARD0).unlink()
    (store / SHARD0).mkdir()  # cannot be read: a StoreError, but SHARD1's mismatch wins
    with pytest.raises(VerifyMismatch) as exc:
        pull_build(str(store), dest)
    size, got, want = (store / SHARD1).stat().st_size, sha(store / SHARD1), sha(a.out_dir / SHARD1)
    assert exc.value.message == (f"{SHARD1}: downloaded data does not match the manifest: {size} bytes, "
                                 f"sha256 {got[:16]}..., expected {size} bytes, {want[:16]}...")
    shutil.copy(a.out_dir / SHARD1, store / SHARD1)
    with pytest.raises(StoreError) as exc:
        pull_build(str(store), dest)
    assert exc.value.message == f"cannot read {store / SHARD0}: Is a directory"


def test_pull_cannot_rename_over_a_directory(twins, tmp_path):
    uri = _pushed(twins, tmp_path)
    dest = tmp_path / "node"
    (dest / SHARD0).mkdir(parents=True)
    with pytest.raises(StoreError) as exc:
        pull_build(uri, dest)
    assert exc.value.message == f"cannot write {dest / SHARD0}: Is a directory"
    assert exc.value.hint == "check free space, permissions and what is at that path"
    assert sorted(os.listdir(dest)) == sorted(["config.json", SHARD0, SHARD1])
    assert (dest / SHARD1).read_bytes() == (twins["a"].out_dir / SHARD1).read_bytes()


def test_pull_progress_counts_the_bytes_it_fetches(twins, tmp_path, capsys, terminal):
    from tqdm import tqdm

    a = twins["a"]
    store = _pushed(twins, tmp_path)
    capsys.readouterr()
    pull_build(store, tmp_path / "node", ranks=[(0, 0)], progress=True)
    out, err = capsys.readouterr()
    total = tqdm.format_sizeof(sum((a.out_dir / f).stat().st_size for f in ("config.json", SHARD0)),
                               divisor=1024)
    assert out == "" and f"pull {store}:" in err and f"/{total} [" in err
    assert err.endswith("\r") and "\n" not in err


def test_pull_runs_verify_on_the_pulled_ranks(twins, tmp_path):
    """A shard whose bytes match the store's manifest but whose header names another rank: the
    download is fine, the rank check after it is not."""
    store = Path(_pushed(twins, tmp_path))
    obj = store / SHARD1
    data = obj.read_bytes()
    assert data.count(b'"shardc.tp_rank":"1"') == 1
    obj.write_bytes(data.replace(b'"shardc.tp_rank":"1"', b'"shardc.tp_rank":"0"'))
    remote = json.loads((store / "manifest.json").read_text())
    reseal(remote["shards"][SHARD1], obj.read_bytes())
    (store / "manifest.json").write_text(json.dumps(remote))
    with pytest.raises(VerifyMismatch) as exc:
        pull_build(str(store), tmp_path / "node", ranks=[(1, 0)])
    assert SHARD1 in exc.value.message and "tp_rank" in exc.value.message
    assert exc.value.hint == "run shardc verify for the full report"


@needs_zstd
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_pushing_a_manifest_in_the_stores_form_records_only_what_it_stored(twins, tmp_path, compress):
    """The store's manifest.json (with ``compressed`` records) copied next to the build files and
    pushed elsewhere: the new store's manifest records only the objects this push stored."""
    a = twins["a"]
    first = Path(_pushed(twins, tmp_path, compress="zstd"))
    m = copy_build(a, tmp_path / "copy")
    remote = json.loads((first / "manifest.json").read_text())
    remote["files"][0]["compressed"] = dict(remote["shards"][SHARD0]["compressed"])  # even there
    m.write_text(json.dumps(remote))
    store = tmp_path / "second"
    push_build(m, str(store), compress=compress)
    second = json.loads((store / "manifest.json").read_text())
    assert "compressed" not in second["files"][0]
    for f in (SHARD0, SHARD1):
        if compress:
            assert second["shards"][f]["compressed"]["sha256"] == sha(store / (f + ".zst"))
        else:
            assert "compressed" not in second["shards"][f] and (store / f).is_file()
    res = pull_build(str(store), tmp_path / "node")
    assert res.verify.ok
    assert (tmp_path / "node" / "manifest.json").read_bytes() == a.manifest_path.read_bytes()


def test_a_download_that_cannot_start_leaves_no_partial_file(twins, tmp_path, monkeypatch):
    """A side file whose name fits but whose partial file's name is too long (over 255 bytes):
    the partial files opened before it are removed and the error is one StoreError."""
    store = Path(_pushed(twins, tmp_path))
    name = "z" * 240 + ".json"  # after config.json
    (store / name).write_bytes(b"{}")
    remote = json.loads((store / "manifest.json").read_text())
    remote["files"].append({"name": name, "size": 2, "sha256": sha(b"{}")})
    # pull writes only a build's side files (#25 item 9): let this one name through
    from shardc.compiler import outputs
    monkeypatch.setattr(outputs, "SIDE_FILES", (*outputs.SIDE_FILES, name))
    (store / "manifest.json").write_text(json.dumps(remote))
    dest = tmp_path / "node"
    with pytest.raises(StoreError) as exc:
        pull_build(str(store), dest)
    assert exc.value.message.endswith(": File name too long")
    assert os.listdir(dest) == []


def test_a_failed_pull_clears_its_progress_bar_before_the_error(twins, tmp_path, capsys, terminal):
    """The bar is closed (its line cleared) before the error reaches the caller, who prints it."""
    store = Path(_pushed(twins, tmp_path))
    flip(store / SHARD0)
    capsys.readouterr()
    with pytest.raises(VerifyMismatch):
        pull_build(str(store), tmp_path / "node", progress=True)
    # the exception (and the frame holding the bar) is still alive when stderr is read
    err = capsys.readouterr().err
    assert f"pull {store}:" in err and err.endswith("\r") and err.split("\r")[-2].strip() == ""


@pytest.mark.parametrize("env", ["1", ""])
def test_fsync_downloads_from_the_environment(twins, tmp_path, monkeypatch, env):
    """SHARDC_FSYNC_DOWNLOADS=1: every downloaded file is fsynced before its rename, then the
    directory. Observed with a wrapper that records what the real os.fsync is called on."""
    uri = _pushed(twins, tmp_path)
    dest = tmp_path / "node"
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setenv("SHARDC_FSYNC_DOWNLOADS", env)
    pull_build(uri, dest)
    before = synced[:next(i for i, p in enumerate(synced) if ".manifest.json." in p)]  # its own
    partials = sorted({Path(p).name.split(".partial-")[0][1:] for p in before if ".partial-" in p})
    if env:
        assert partials == sorted(FILES) and before[-1] == str(dest)
    else:
        assert before == []


def test_pull_names_the_manifest_it_could_not_parse(twins, tmp_path):
    store = Path(_pushed(twins, tmp_path))
    (store / "manifest.json").write_text("not json")
    with pytest.raises(ManifestError) as exc:
        pull_build(str(store), tmp_path / "node")
    assert exc.value.message == f"{store}/manifest.json is not JSON"


@pytest.mark.parametrize("attempts", [None, 1, 3])
def test_pull_makes_as_many_attempts_as_it_is_told(twins, s3, tmp_path, attempts):
    """SHARDC_S3_MAX_ATTEMPTS=2 here; settings=... wins over it. The number is of requests in
    all, the first one included, as the error says (botocore's own "max_attempts" key would
    count the retries only: one request more)."""
    server, proxy = s3
    bkt = bucket(s3)
    push_build(twins["a"].manifest_path, f"s3://{bkt}/p", endpoint_url=server.endpoint)
    proxy.clear()
    proxy.faults = Faults(p500=1.0, match=f"/{bkt}/p/manifest.json")
    settings = None if attempts is None else S3Settings.from_env(max_attempts=attempts)
    try:
        with pytest.raises(StoreError) as exc:
            pull_build(f"s3://{bkt}/p/manifest.json", tmp_path / "node", endpoint_url=proxy.endpoint,
                       settings=settings)
    finally:
        proxy.faults = Faults()
    n = attempts or 2
    assert [r.status for r in proxy.log if r.path == f"/{bkt}/p/manifest.json"] == [500] * n
    assert f"after {n} attempts" in exc.value.message


def test_push_progress_total_is_exact_for_a_small_repair(twins, tmp_path, capsys, terminal):
    """Only config.json (a few hundred bytes, shown to the byte) is missing: the bar's total is
    its size, not one byte more."""
    a = twins["a"]
    store = tmp_path / "store"
    push_build(a.manifest_path, str(store))
    (store / "config.json").unlink()
    capsys.readouterr()
    push_build(a.manifest_path, str(store), progress=True)
    size = (a.out_dir / "config.json").stat().st_size
    assert size < 1000
    assert f"/{size} [" in capsys.readouterr().err


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (its bar redrawn in place: what these tests read); in a log it is
    lines every few seconds (shardc/progress.py, tests/cli/test_progress_log.py)."""
    from shardc import progress

    monkeypatch.setattr(progress, "terminal", lambda: True)
