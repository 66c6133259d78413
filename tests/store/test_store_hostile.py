"""Hostile input on push and pull (#25 items 9 and 12), against real builds, a local store and the
real moto S3 server (``s3`` fixture of conftest: server and proxy).

Item 9: pull writes shard files, the manifest and a build's side files, nothing else: a manifest
naming ``authorized_keys`` (or a shard under a name its plan does not give its rank) is refused,
one line, exit 2, before ``dest`` is created.
Item 12: a push to a prefix that holds another plan's build (or one from another source) is
refused, exit 2, unless ``--replace``; with it, the old build's objects the new one does not name
are removed once the new manifest is in place, and nothing else under the prefix.

Oracles: bytes and names the tests wrote, hashlib, directory listings and S3 listings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cli_run import one_line, shardc

from shardc.errors import ManifestError, StoreError
from shardc.store import pull_build, push_build

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=64)
A_SHARD = "model-tp00-pp00.safetensors"  # the default shard_prefix, tp1 pp1
B_SHARDS = ["b-00-00.safetensors", "b-00-01.safetensors"]


def tree(d: Path) -> dict[str, str]:
    """Every file in ``d`` and its sha256 (a build directory's own lock file left out)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != ".shardc-build.lock"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Real builds of a tiny synthetic checkpoint: plan h-a (tp1 pp1), plan h-b (tp1 pp2, its own
    shard names), h-a again from another directory (a rebuild of the same plan and source), and h-a
    read from another checkpoint (``--source``: the same plan file, another source)."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    base = tmp_path_factory.mktemp("hostile-store")
    ck = write_checkpoint(base / "ck", llama_config(**TINY), seed=1)
    other = write_checkpoint(base / "ck2", llama_config(**TINY), seed=2)

    def plan(name: str, pp: int, prefix: str | None = None):
        rg = {"name": name, "tp_degree": 1, "pp_degree": pp, "dtype": "bf16", "gpus_per_replica": pp}
        if prefix:
            rg["checkpoint"] = {"shard_prefix": prefix}
        return plan_from_dict({"replica_group": rg, "model": {"source": str(ck)}})

    a = plan("h-a", 1)
    return {
        "a": build(a, base / "a").out_dir,
        "b": build(plan("h-b", 2, "b-{tp_rank:02d}-{pp_stage:02d}.safetensors"), base / "b").out_dir,
        "a_again": build(a, base / "a-again").out_dir,
        "a_other_source": build(a.with_source(str(other)), base / "a-other").out_dir,
    }


# --- item 9: pull writes only what a build consists of ------------------------------------------

def _hostile_store(builds, tmp_path: Path, edit) -> Path:
    """A local store holding build h-a whose manifest ``edit`` changed; returns the store dir."""
    store = tmp_path / "store"
    push_build(builds["a"] / "manifest.json", str(store))
    m = json.loads((store / "manifest.json").read_text())
    edit(m, store)
    (store / "manifest.json").write_text(json.dumps(m))
    return store


def _plant_file(m: dict, store: Path) -> None:
    data = b"ssh-ed25519 AAAA attacker@example\n"
    (store / "authorized_keys").write_bytes(data)
    m["files"].append({"name": "authorized_keys", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})


def _rename_shard(m: dict, store: Path) -> None:
    m["shards"]["evil.safetensors"] = m["shards"].pop(A_SHARD)
    shutil.copy(store / A_SHARD, store / "evil.safetensors")


def test_pull_refuses_a_manifest_naming_a_file_no_build_writes(builds, tmp_path):
    store = _hostile_store(builds, tmp_path, _plant_file)
    dest = tmp_path / "dest"
    r = shardc("pull", "--manifest", str(store / "manifest.json"), "--all", "--dest", str(dest))
    want = (f"{store}/manifest.json lists authorized_keys, which is not a file a build writes (hint: "
            "a build's side files are config.json, model.safetensors.index.json, tokenizer.json, "
            "tokenizer_config.json, special_tokens_map.json, tokenizer.model, generation_config.json, "
            "chat_template.jinja; pull only manifests shardc wrote)")
    assert one_line(r) == f"error: {want}"
    assert not dest.exists()  # nothing written, not even the directory
    with pytest.raises(ManifestError) as exc:
        pull_build(str(store / "manifest.json"), dest, global_ranks=[0])
    assert exc.value.one_line() == want and exc.value.exit_code == 2
    assert not dest.exists()


def test_pull_refuses_a_shard_under_a_name_its_plan_does_not_give(builds, tmp_path):
    store = _hostile_store(builds, tmp_path, _rename_shard)
    dest = tmp_path / "dest"
    line = one_line(shardc("pull", "--manifest", str(store / "manifest.json"), "--rank", "0",
                           "--dest", str(dest)))
    want = (f"{store}/manifest.json lists evil.safetensors for tp_rank=0 pp_stage=0, whose shard its "
            f"plan names {A_SHARD} (hint: pull only manifests shardc wrote)")
    assert line == f"error: {want}"
    assert not dest.exists()
    with pytest.raises(ManifestError) as exc:
        pull_build(str(store / "manifest.json"), dest)
    assert exc.value.one_line() == want and not dest.exists()


def test_pull_of_an_honest_build_writes_exactly_its_files(builds, tmp_path):
    """The check lets every file a real build has through: the pulled tree is the build's."""
    store = tmp_path / "store"
    push_build(builds["b"] / "manifest.json", str(store))
    pull_build(str(store / "manifest.json"), tmp_path / "dest")
    assert tree(tmp_path / "dest") == tree(builds["b"])


def test_pull_from_s3_refuses_a_planted_file(builds, s3, tmp_path, s3_env):
    server, _ = s3
    server.client().create_bucket(Bucket="hostile-pull")
    push_build(builds["a"] / "manifest.json", "s3://hostile-pull/a", endpoint_url=server.endpoint)
    cl = server.client()
    m = json.loads(cl.get_object(Bucket="hostile-pull", Key="a/manifest.json")["Body"].read())
    data = b"#!/bin/sh\necho owned\n"
    cl.put_object(Bucket="hostile-pull", Key="a/.bashrc", Body=data)
    m["files"].append({"name": "bashrc", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    cl.put_object(Bucket="hostile-pull", Key="a/manifest.json", Body=json.dumps(m).encode())
    with pytest.raises(ManifestError, match=r"s3://hostile-pull/a/manifest.json lists bashrc"):
        pull_build("s3://hostile-pull/a/manifest.json", tmp_path / "d", endpoint_url=server.endpoint)
    assert not (tmp_path / "d").exists()


# --- item 12: push does not replace another plan's build without being asked ---------------------

@pytest.fixture
def s3_env(aws_env) -> None:
    """conftest's isolated dummy credentials, under this file's key names; two attempts."""
    aws_env.setenv("AWS_ACCESS_KEY_ID", "shardc-test-key")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "shardc-test-secret")
    aws_env.setenv("SHARDC_S3_MAX_ATTEMPTS", "2")


def test_push_of_another_plan_is_refused_locally_then_replaced(builds, tmp_path):
    store = tmp_path / "store"
    assert shardc("push", "--manifest", str(builds["a"] / "manifest.json"), "--to", str(store), "-q").returncode == 0
    (store / "notes.txt").write_text("not shardc's")  # something else under the prefix
    before = tree(store)
    line = one_line(shardc("push", "--manifest", str(builds["b"] / "manifest.json"), "--to", str(store)))
    a, b = (json.loads((builds[k] / "manifest.json").read_text()) for k in "ab")
    want = (f"{store}/manifest.json holds plan h-a (sha256 {a['plan_sha256'][:12]}, source "
            f"{a['source']['uri']}), not plan h-b (sha256 {b['plan_sha256'][:12]}, source "
            f"{b['source']['uri']}) (hint: use --replace to replace it (the old build's objects are "
            "removed), or push to another prefix)")
    assert line == f"error: {want}"
    assert tree(store) == before  # nothing uploaded, nothing deleted, the old manifest in place
    with pytest.raises(StoreError) as exc:
        push_build(builds["b"] / "manifest.json", str(store))
    # the library names its field, `replace`; the CLI line above says the flag
    assert exc.value.one_line() == want.replace("--replace", "`replace`") and exc.value.exit_code == 2
    assert tree(store) == before

    r = shardc("push", "--manifest", str(builds["b"] / "manifest.json"), "--to", str(store), "--json")
    assert r.returncode == 2 and tree(store) == before
    r = shardc("push", "--manifest", str(builds["b"] / "manifest.json"), "--to", str(store), "--replace", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["manifest"] == "uploaded" and res["removed"] == [A_SHARD]
    b_tree = tree(builds["b"])
    assert tree(store) == {**b_tree, "notes.txt": before["notes.txt"]}  # a's shard gone, notes kept
    pull_build(str(store / "manifest.json"), tmp_path / "dest")
    assert tree(tmp_path / "dest") == b_tree


def test_repush_of_the_same_plan_and_source_is_allowed(builds, tmp_path):
    store = tmp_path / "store"
    push_build(builds["a"] / "manifest.json", str(store))
    again = push_build(builds["a_again"] / "manifest.json", str(store))  # a rebuild, elsewhere
    assert again.manifest == "unchanged" and again.removed == ()
    assert shardc("push", "--manifest", str(builds["a"] / "manifest.json"), "--to", str(store), "-q").returncode == 0


def test_push_of_the_same_plan_from_another_source_is_refused(builds, tmp_path):
    store = tmp_path / "store"
    push_build(builds["a"] / "manifest.json", str(store))
    before = tree(store)
    with pytest.raises(StoreError, match=r"holds plan h-a .* not plan h-a .*ck2") as exc:
        push_build(builds["a_other_source"] / "manifest.json", str(store))
    assert "`replace`" in exc.value.hint and tree(store) == before
    res = push_build(builds["a_other_source"] / "manifest.json", str(store), replace=True)
    assert res.removed == ()  # same file names: every old object was overwritten
    assert tree(store) == tree(builds["a_other_source"])


def test_push_over_an_unreadable_manifest_needs_replace(builds, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text("{ not json")
    (store / A_SHARD).write_bytes(b"old")
    line = one_line(shardc("push", "--manifest", str(builds["a"] / "manifest.json"), "--to", str(store)))
    where = f"{store}/manifest.json"
    want = (f"{where} is not a manifest shardc can read ({where} is not JSON); refusing to replace it "
            "with plan h-a (hint: use --replace to overwrite it (no other object is removed))")
    assert line == f"error: {want}"
    with pytest.raises(StoreError) as exc:
        push_build(builds["a"] / "manifest.json", str(store))
    assert exc.value.one_line() == want.replace("--replace", "`replace`")  # the field, not the flag
    assert (store / "manifest.json").read_text() == "{ not json" and (store / A_SHARD).read_bytes() == b"old"
    res = push_build(builds["a"] / "manifest.json", str(store), replace=True)
    assert res.removed == () and tree(store) == tree(builds["a"])


def test_push_to_s3_refuses_another_plan_then_replaces_only_its_objects(builds, s3, tmp_path, s3_env):
    server, _ = s3
    cl = server.client()
    cl.create_bucket(Bucket="hostile-push")
    uri = "s3://hostile-push/model"
    env = {"AWS_ENDPOINT_URL": server.endpoint}
    assert shardc("push", "--manifest", str(builds["a"] / "manifest.json"), "--to", uri, "-q",
                  env=env).returncode == 0
    cl.put_object(Bucket="hostile-push", Key="model/README.txt", Body=b"kept")
    cl.put_object(Bucket="hostile-push", Key="model-other/x", Body=b"kept too")

    def listing() -> dict[str, str]:
        keys = [o["Key"] for o in cl.list_objects_v2(Bucket="hostile-push")["Contents"]]
        return {k: hashlib.sha256(cl.get_object(Bucket="hostile-push", Key=k)["Body"].read()).hexdigest()
                for k in keys}

    before = listing()
    line = one_line(shardc("push", "--manifest", str(builds["b"] / "manifest.json"), "--to", uri, env=env))
    assert (f"{uri}/manifest.json holds plan h-a" in line and "not plan h-b" in line
            and "--replace" in line), line
    assert listing() == before

    r = shardc("push", "--manifest", str(builds["b"] / "manifest.json"), "--to", uri, "--replace", env=env)
    assert r.returncode == 0, r.stderr
    assert "removed 1 object(s) of the replaced build" in r.stdout
    want = {f"model/{n}": h for n, h in tree(builds["b"]).items()}
    want |= {"model/README.txt": before["model/README.txt"], "model-other/x": before["model-other/x"]}
    assert listing() == want


def test_replace_removes_exactly_the_old_objects_plain_and_compressed(builds, tmp_path):
    """In-process: a plain old build loses its shard; a compressed one its .zst object; a hostile
    old manifest naming an object outside the prefix (a compressed record's "../victim") removes
    nothing outside, and the other old objects still go."""
    plain = tmp_path / "plain"
    push_build(builds["a"] / "manifest.json", str(plain))
    assert push_build(builds["b"] / "manifest.json", str(plain), replace=True).removed == (A_SHARD,)
    assert tree(plain) == tree(builds["b"])

    hostile = tmp_path / "hostile" / "store"
    push_build(builds["a"] / "manifest.json", str(hostile))
    victim = tmp_path / "hostile" / "victim"
    victim.write_text("outside the prefix")
    m = json.loads((hostile / "manifest.json").read_text())
    m["files"][0]["compressed"] = {"codec": "zstd", "size": 1, "sha256": "0" * 64, "object": "../victim"}
    (hostile / "manifest.json").write_text(json.dumps(m))
    assert push_build(builds["b"] / "manifest.json", str(hostile), replace=True).removed == (A_SHARD,)
    assert victim.read_text() == "outside the prefix" and tree(hostile) == tree(builds["b"])

    pytest.importorskip("zstandard")
    packed = tmp_path / "packed"
    push_build(builds["a"] / "manifest.json", str(packed), compress="zstd")
    assert (packed / f"{A_SHARD}.zst").is_file()
    res = push_build(builds["b"] / "manifest.json", str(packed), replace=True)
    assert res.removed == (f"{A_SHARD}.zst",) and tree(packed) == tree(builds["b"])
