"""push publishes the bytes of the build it is given, never a stale object behind a new manifest.

Two builds of the same plan from different checkpoints have shards of identical names and sizes;
only their contents differ. Pushing the second over the first must replace every shard (a skip on
size alone would publish the new manifest over the old bytes), and the old manifest must be gone
before any object changes: a push that fails halfway leaves no manifest behind that names objects
it no longer describes. Checked on the local store and on a real S3 server (moto on 127.0.0.1).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from plan_helpers import plan as make_plan

from shardc.errors import ShardcError
from shardc.formats.manifest import Manifest
from shardc.store import pull_build, push_build


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Same plan, checkpoints of different seeds: same files, same sizes, different bytes."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("twins")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        src = write_checkpoint(root / f"src-{name}", llama_config(num_layers=2), seed=seed)
        plan = make_plan(2, name="twin", source=src)
        out[name] = build(plan, root / f"build-{name}")
    a, b = out["a"].manifest, out["b"].manifest
    assert [(s.file, s.size) for s in a.shards] == [(s.file, s.size) for s in b.shards]
    assert all(x.sha256 != y.sha256 for x, y in zip(a.shards, b.shards, strict=True))
    return out


def _digests(d: Path, manifest: Manifest) -> dict[str, str]:
    return {s.file: hashlib.sha256((d / s.file).read_bytes()).hexdigest() for s in manifest.shards}


def _dest(kind: str, tmp_path: Path, s3, name: str) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "store" / name), {}
    server, _ = s3
    bucket = f"oracle-{name}"
    server.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/x", {"endpoint_url": server.endpoint}


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_push_over_a_same_size_build_replaces_every_shard(twins, tmp_path, s3, aws_env, kind):
    uri, kw = _dest(kind, tmp_path, s3, f"same-size-{kind}")
    push_build(twins["a"].manifest_path, uri, **kw)
    res = push_build(twins["b"].manifest_path, uri, replace=True, **kw)  # another source (#25 item 12)
    shard_actions = {o.file: o.action for o in res.objects if o.file.endswith(".safetensors")}
    assert set(shard_actions.values()) == {"uploaded"}, shard_actions
    pull_build(f"{uri}/manifest.json", tmp_path / "pulled", **kw)
    assert _digests(tmp_path / "pulled", twins["b"].manifest) == _digests(twins["b"].out_dir, twins["b"].manifest)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_failed_repush_leaves_no_stale_manifest(twins, tmp_path, s3, aws_env, kind):
    """Build b's first shard rots on disk after its build (same size): the push of b fails while
    hashing it. By then the store's manifest of a must already be deleted."""
    import shutil

    uri, kw = _dest(kind, tmp_path, s3, f"stale-{kind}")
    push_build(twins["a"].manifest_path, uri, **kw)
    rotten = tmp_path / "b"
    shutil.copytree(twins["b"].out_dir, rotten)
    f = rotten / twins["b"].manifest.shards[0].file
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ShardcError):
        push_build(rotten / "manifest.json", uri, replace=True, **kw)
    with pytest.raises(ShardcError):  # nothing to pull: no manifest names the changed objects
        pull_build(f"{uri}/manifest.json", tmp_path / "pulled", **kw)


def test_old_manifest_is_deleted_before_the_first_object_write(twins, s3, aws_env):
    server, proxy = s3
    server.client().create_bucket(Bucket="oracle-order")
    uri = "s3://oracle-order/x"
    push_build(twins["a"].manifest_path, uri, endpoint_url=proxy.endpoint)
    proxy.clear()
    push_build(twins["b"].manifest_path, uri, endpoint_url=proxy.endpoint, replace=True)
    log = proxy.log
    key = "/oracle-order/x/manifest.json"
    deletes = [r for r in log if r.method == "DELETE" and r.path.split("?")[0] == key]
    writes = [r for r in log if r.method in ("PUT", "POST") and r.path.split("?")[0] != key]
    assert deletes and writes
    assert deletes[0].end <= min(w.start for w in writes)
