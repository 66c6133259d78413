"""load_shard and verify straight from object storage (issue #30 item 3): a rank's shard streamed
by parallel ranged GETs from the real moto server on 127.0.0.1, every chunk checked, no disk.

Oracles: the safetensors library's reading of the build's own file; the damaged chunk and its
tensors worked out here from the header; the proxy's request log for what was fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_helpers import plan as make_plan

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

from shardc.errors import StoreError, VerifyMismatch  # noqa: E402

CHUNK = 4096
S1 = "model-tp01-pp00.safetensors"


@pytest.fixture(autouse=True)
def aws_env(aws_env):
    """conftest's dummy credentials, for every test here; two attempts, so a fault shows fast."""
    aws_env.setenv("SHARDC_S3_MAX_ATTEMPTS", "2")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A tiny tp=2 build in 4 KiB chunks (several per shard)."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.formats import chunk_digests as chunks

    root = tmp_path_factory.mktemp("stream")
    src = write_checkpoint(root / "src", llama_config(num_layers=2, hidden_size=64, intermediate_size=96))
    plan = make_plan(2, name="st", source=src)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks, "CHUNK_SIZE", CHUNK)
        return build(plan, out_dir=root / "b").out_dir


_n = iter(range(10_000))


@pytest.fixture
def pushed(built, s3, monkeypatch) -> tuple[str, str]:
    """The build pushed to a fresh bucket through the fault proxy; (manifest URI, bucket)."""
    from shardc.store import push_build

    server, proxy = s3
    bkt = f"stream-{next(_n)}"
    server.client().create_bucket(Bucket=bkt)
    push_build(built / "manifest.json", f"s3://{bkt}/p", endpoint_url=server.endpoint)
    proxy.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return f"s3://{bkt}/p/manifest.json", bkt


def _same(got: dict, path: Path) -> bool:
    from safetensors.torch import load_file

    want = load_file(str(path))
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_load_shard_streams_a_rank_from_s3(built, pushed, s3):
    """The public call with an s3:// manifest: rank 1's tensors equal the build's file; the shard
    came in one ranged GET per chunk, nothing else of it."""
    import shardc

    uri, bkt = pushed
    got = shardc.load_shard(uri, 1, 0, device="cpu")
    assert _same(got, built / S1)
    size = (built / S1).stat().st_size
    gets = [r for r in s3[1].log if r.method == "GET" and r.path.split("?")[0].endswith(S1)]
    assert len(gets) == -(-size // CHUNK)


def test_a_damaged_object_is_fetched_again_once_then_named(built, pushed, s3):
    """A byte of rank 1's object changed in the store (same size): its chunk is fetched twice,
    then one VerifyMismatch names the chunk, its bytes and the tensors in it."""
    import shardc

    uri, bkt = pushed
    data = bytearray((built / S1).read_bytes())
    at = len(data) - 2 * CHUNK - 7
    data[at] ^= 0x01
    s3[0].client().put_object(Bucket=bkt, Key=f"p/{S1}", Body=bytes(data))
    s3[1].clear()
    with pytest.raises(VerifyMismatch) as exc:
        shardc.load_shard(uri, 1, 0, device="cpu")
    i = at // CHUNK
    lo, hi = i * CHUNK, min(len(data), (i + 1) * CHUNK)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    held = sorted(k for k, v in header.items() if k != "__metadata__"
                  and 8 + n + v["data_offsets"][0] < hi and lo < 8 + n + v["data_offsets"][1])
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    assert exc.value.message == (f"{S1}: sha256 of 1 of {-(-len(data) // CHUNK)} chunk(s) differs from the "
                                 f"manifest: chunk {i} (bytes {lo}..{hi}: {shown}) (corrupted bytes)")
    gets = [r for r in s3[1].log if r.method == "GET" and r.path.split("?")[0].endswith(S1)]
    assert len(gets) == -(-len(data) // CHUNK) + 1  # the damaged chunk once more


def test_an_object_replaced_while_read_is_one_line(built, pushed, s3, monkeypatch):
    """The object pushed again after the first chunk arrived: the next ranged GET, pinned to the
    ETag the read started with, is refused; one StoreError line, no tensor returned."""
    import shardc
    from shardc.store import ranged

    uri, bkt = pushed
    real, done = ranged.RangedChunks.read, []

    def read(self, i, mv):
        got = real(self, i, mv)
        if not done:
            done.append(s3[0].client().put_object(Bucket=bkt, Key=f"p/{S1}", Body=(built / S1).read_bytes()[::-1]))
        return got

    monkeypatch.setattr(ranged.RangedChunks, "read", read)
    with pytest.raises(StoreError) as exc:
        shardc.load_shard(uri, 1, 0, device="cpu")
    assert done and exc.value.message.startswith(f"s3://{bkt}/p/{S1} changed while it was read (its ETag is no longer ")
    assert "\n" not in exc.value.one_line()


def test_verify_streams_ranks_without_a_directory(built, pushed, s3):
    """shardc verify --manifest s3://... --rank R --device cpu, no --dir: ok, exit 0; with rank 1's
    object damaged: exit 1 naming the chunk; with neither --dir nor --device: one line, exit 2."""
    from click.testing import CliRunner

    from shardc.cli import main

    uri, bkt = pushed
    r = CliRunner().invoke(main, ["verify", "--manifest", uri, "--rank", "1"])  # neither --dir nor --device
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--device" in r.stderr, r.output
    r = CliRunner().invoke(main, ["verify", "--manifest", uri, "--rank", "1", "--device", "cpu"])
    assert r.exit_code == 0 and r.output.startswith(f"ok   {S1} (rank 1: tp 1, pp 0)"), r.output
    data = bytearray((built / S1).read_bytes())
    data[-1] ^= 0x01
    s3[0].client().put_object(Bucket=bkt, Key=f"p/{S1}", Body=bytes(data))
    r = CliRunner().invoke(main, ["verify", "--manifest", uri, "--rank", "1", "--device", "cpu"])
    assert r.exit_code == 1 and f"differs from the manifest: chunk {(len(data) - 1) // CHUNK} " in r.stderr, r.output


def test_pull_downloads_by_the_same_ranged_chunks(built, pushed, s3, tmp_path):
    """shardc pull of rank 1: one ranged GET per chunk, the file equal to the build's; with the
    object damaged in the store, one line naming the chunk and nothing under the final name (no
    partial file left either)."""
    from shardc.store import pull_build

    uri, bkt = pushed
    res = pull_build(uri, tmp_path / "node", ranks=[(1, 0)])
    assert res.verify.ok and (tmp_path / "node" / S1).read_bytes() == (built / S1).read_bytes()
    size = (built / S1).stat().st_size
    gets = [r for r in s3[1].log if r.method == "GET" and r.path.split("?")[0].endswith(S1)]
    assert len(gets) == -(-size // CHUNK)
    data = bytearray((built / S1).read_bytes())
    data[CHUNK + 5] ^= 0x01
    s3[0].client().put_object(Bucket=bkt, Key=f"p/{S1}", Body=bytes(data))
    with pytest.raises(VerifyMismatch) as exc:
        pull_build(uri, tmp_path / "other", ranks=[(1, 0)])
    assert exc.value.message.startswith(f"{S1}: downloaded data does not match the manifest: sha256 of 1 of "
                                        f"{-(-size // CHUNK)} chunk(s) differs from the manifest: chunk 1 (bytes "
                                        f"{CHUNK}..{2 * CHUNK}")
    assert not [p.name for p in (tmp_path / "other").iterdir() if S1 in p.name]
