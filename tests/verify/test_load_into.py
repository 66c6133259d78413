"""``load_shard(..., into={name: tensor})`` (loader/sinks.py ``into_host``): the named tensors are
read straight into the caller's memory (an engine's parameters, vLLM's load format), every chunk
hashed as it arrives, and nothing is returned unless every digest matched. A caller's mistake in
``into`` is one LayoutError before any data byte lands."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_builds import tiny_build

import shardc
from shardc.errors import LayoutError, StoreError, VerifyMismatch

S0, S1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"
CHUNK = 4096  # the smallest chunk: several per tiny shard


@pytest.fixture(scope="module", params=["sha256", "blake3"])
def built(request, tmp_path_factory) -> Path:
    return tiny_build(tmp_path_factory.mktemp(f"into-{request.param}"), f"into-{request.param}", chunk_size=CHUNK,
                      group={"checkpoint": {"chunk_digest": request.param}})


@pytest.fixture
def copy(built, tmp_path) -> Path:
    d = tmp_path / "b"
    shutil.copytree(built, d)
    return d


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _sentinels(want: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Destinations for ``names``, filled with a byte no tensor of the tiny build is made of."""
    return {n: _bits(torch.empty_like(want[n])).fill_(0xA5).view(want[n].dtype).view(want[n].shape) for n in names}


def test_the_shards_have_several_chunks(built):
    """What the other tests rely on: the header's chunk, data chunks, then a last short one."""
    data = (built / S1).read_bytes()
    assert len(data) % CHUNK and len(data) > 10 * CHUNK


@pytest.mark.parametrize("chunk_size", [512, 1000, 2000])
def test_a_header_over_several_chunks(built, chunk_size):
    """into_host itself, on chunks smaller than a build writes (a manifest takes 4 KiB and up):
    the header's chunks are read and checked first, their tensor bytes copied from that buffer,
    the rest read into place."""
    from shardc.digests import new_hash
    from shardc.loader.sinks import into_host
    from shardc.loader.sources import FileChunkReads

    data = (built / S1).read_bytes()
    assert 8 + struct.unpack("<Q", data[:8])[0] > chunk_size  # the header spans chunks
    digests = []
    for i in range(0, len(data), chunk_size):
        h = new_hash("sha256")
        h.update(data[i : i + chunk_size])
        digests.append(h.hexdigest())
    want = load_file(built / S1)
    into = _sentinels(want, sorted(want)[1::2])
    seen = []
    with open(built / S1, "rb", buffering=0) as f:
        source = FileChunkReads(f.fileno(), S1, len(data), chunk_size, digests, "sha256", direct=False)
        got = into_host(source, lambda header, error, n: seen.append((sorted(header), error, n)), into)
    assert seen == [(sorted([*want, "__metadata__"]), None, len(data) - 8 - struct.unpack("<Q", data[:8])[0])]
    for n, t in want.items():
        assert torch.equal(_bits(got[n]), _bits(t)), n


@pytest.mark.parametrize("every", [1, 2, 3])
def test_into_holds_the_shards_bytes_and_is_returned(built, every):
    want = load_file(built / S1)
    names = sorted(want)[::every]
    into = _sentinels(want, names)
    got = shardc.load_shard(built, 1, 0, device="cpu", into=into)
    assert sorted(got) == sorted(want)
    for n in names:
        assert got[n] is into[n]
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(_bits(got[n]), _bits(t)), n


def test_into_a_view_of_a_larger_tensor(built):
    """A destination may be a piece of a larger parameter (rows of a fused one): only its bytes are
    written, the rest of the parameter is left as it was."""
    want = load_file(built / S0)
    name = next(n for n, t in want.items() if t.dim() == 2)
    big = torch.full((want[name].shape[0] + 3, *want[name].shape[1:]), 7, dtype=want[name].dtype)
    shardc.load_shard(built, 0, 0, device="cpu", into={name: big.narrow(0, 2, want[name].shape[0])})
    assert torch.equal(big[2 : 2 + want[name].shape[0]], want[name])
    assert (big[:2] == 7).all() and (big[-1] == 7).all()


@pytest.mark.parametrize("where", ["header", "data", "last"])
def test_a_damaged_chunk_is_named(copy, where):
    data = bytearray((copy / S0).read_bytes())
    count = -(-len(data) // CHUNK)
    chunk = {"header": 1, "data": count // 2, "last": count - 1}[where]
    data[chunk * CHUNK + 5] ^= 0x10
    (copy / S0).write_bytes(bytes(data))
    # every tensor read into the caller's memory, or (the header's case) none
    into = {n: torch.empty_like(t) for n, t in load_file(copy / S0).items()} if where != "header" else {}
    with pytest.raises(VerifyMismatch, match=rf"{S0}: .* 1 of {count} chunk\(s\) differs from the manifest: chunk {chunk} "):
        shardc.load_shard(copy, 0, 0, device="cpu", into=into)


def test_a_truncated_shard_is_refused(copy):
    data = (copy / S0).read_bytes()
    (copy / S0).write_bytes(data[:-100])
    with pytest.raises(VerifyMismatch, match="size"):
        shardc.load_shard(copy, 0, 0, device="cpu", into={})


def _bad(want: dict[str, torch.Tensor], how: str) -> tuple[str, object]:
    name = next(n for n, t in sorted(want.items()) if t.dim() == 2)
    t = want[name]
    return {"dtype": (name, torch.empty(t.shape, dtype=torch.float32)),
            "shape": (name, torch.empty(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)),
            "strided": (name, torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t()),
            "not a tensor": (name, _bits(t).numpy()),
            "unknown": ("model.layers.99.mlp.up_proj.weight", torch.empty(1))}[how]


@pytest.mark.parametrize("how", ["dtype", "shape", "strided", "not a tensor", "unknown"])
def test_a_wrong_destination_is_one_line_before_any_data(built, how):
    """Refused with the tensor named, the shard's dtype and shape beside what was given; the other
    destinations are untouched (nothing past the header was read into them)."""
    want = load_file(built / S0)
    into = _sentinels(want, sorted(want))
    name, bad = _bad(want, how)
    into[name] = bad
    with pytest.raises(LayoutError) as exc:
        shardc.load_shard(built, 0, 0, device="cpu", into=into)
    assert exc.value.key == "into" and name in exc.value.message and "\n" not in exc.value.one_line()
    for n, t in into.items():
        if n != name:
            assert (_bits(t) == 0xA5).all(), n


@pytest.mark.parametrize("call", [{"device": "cuda:0"}, {"into_list": True}])
def test_into_needs_a_mapping_on_the_cpu(built, call):
    into = [] if call.get("into_list") else {}
    with pytest.raises(LayoutError, match='device="cpu"') as exc:
        shardc.load_shard(built, 0, 0, device=call.get("device", "cpu"), into=into)
    assert exc.value.key == "into"


def test_an_s3_manifest_takes_no_into():
    with pytest.raises(StoreError, match="into="):
        shardc.load_shard("s3://bucket/build/manifest.json", 0, 0, device="cpu", into={})


def test_a_manifest_without_chunk_digests_is_checked_then_copied(copy):
    """A format_version 2 manifest (one sha256 per shard): read whole and checked, then copied into
    ``into``'s tensors, which are the ones returned; a wrong destination is still refused."""
    m = json.loads((copy / "manifest.json").read_text())
    m["format_version"] = 2
    for entry in m["shards"].values():
        for key in ("chunk_size", "chunks", "chunk_digest"):
            entry.pop(key, None)
    (copy / "manifest.json").write_text(json.dumps(m))
    want = load_file(copy / S1)
    into = _sentinels(want, sorted(want)[::2])
    got = shardc.load_shard(copy, 1, 0, device="cpu", into=into)
    for n, t in want.items():
        assert torch.equal(_bits(got[n]), _bits(t)), n
    for n in into:
        assert got[n] is into[n]
    name, bad = _bad(want, "shape")
    with pytest.raises(LayoutError) as exc:
        shardc.load_shard(copy, 1, 0, device="cpu", into={name: bad})
    assert exc.value.key == "into"
