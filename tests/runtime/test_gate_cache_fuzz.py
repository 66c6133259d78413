"""Property-based fuzzing (#25 item 6, in #17's style) of the gate's baseline-cache reader: any
bytes at the cache path end in a verdict that recomputes the baseline ("stale", "mismatch") or a
ShardcError, never another exception; and a "hit" only when the logits the candidate pass will
read (the checked copy, read back with the safetensors library) are the genuine ones, so a cache
never gives a verdict a fresh baseline pass would not give.

Inputs: arbitrary bytes, safetensors-shaped files with arbitrary JSON headers, and a genuine
sealed cache with bytes flipped, cut, appended, or its header's fields replaced.
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from shardc.errors import ShardcError  # noqa: E402
from shardc.runtime.gate_cache import CACHE_META, check_cache, seal_cache  # noqa: E402

FUZZ = settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.too_slow],
                database=None)
KEY = {"cpu_threads": 1, "baseline_manifest_sha256": "a" * 64, "golden_sha256": "b" * 64,
       "window": 6, "max_tokens": 12, "windows_sha256": "c" * 64}
LOGITS = torch.arange(2 * 5 * 7, dtype=torch.float32).reshape(2, 5, 7).div(8).to(torch.bfloat16)


@functools.cache
def genuine(work: Path) -> tuple[bytes, dict, bytes]:
    """A sealed cache of LOGITS under KEY: (file bytes, parsed header, data section). Made on first
    use, not at import (mutmut imports test modules with its mutants switched on)."""
    from safetensors.torch import save_file

    save_file({"logits": LOGITS}, str(work / "scratch"), metadata={CACHE_META: json.dumps(KEY, sort_keys=True)})
    seal_cache(work / "scratch", work / "genuine", KEY)
    raw = (work / "genuine").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Module-scoped (hypothesis runs many examples per test call); pytest removes it."""
    return tmp_path_factory.mktemp("fuzz-gate-cache")


def _file(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def assert_safe(work: Path, data: bytes) -> str:
    """The property, for the bytes ``data`` at the cache path."""
    path, copy = work / "cache.safetensors", work / "copy.safetensors"
    path.write_bytes(data)
    copy.unlink(missing_ok=True)
    try:
        status, why = check_cache(path, KEY, copy_to=copy)
    except ShardcError:
        assert not copy.exists()
        return "error"
    assert status in ("stale", "mismatch", "hit") and isinstance(why, str), status
    if status != "hit":
        assert not copy.exists()
        return status
    from safetensors import safe_open

    with safe_open(str(copy), framework="pt") as f:
        assert list(f.keys()) == ["logits"]
        assert torch.equal(f.get_tensor("logits"), LOGITS)  # what the candidate pass compares with
    return status


def test_the_genuine_cache_hits(work):
    assert assert_safe(work, genuine(work)[0]) == "hit"


@FUZZ
@given(st.binary(max_size=600))
def test_any_bytes(work, data):
    assert_safe(work, data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)


@FUZZ
@given(json_values | st.dictionaries(st.sampled_from(["logits", "__metadata__", "x"]), json_values, max_size=3),
       st.sampled_from(["", "data", "short", "long"]))
def test_any_json_header(work, header, which):
    data = genuine(work)[2]
    data = {"": b"", "data": data, "short": data[:-1], "long": data + b"\0"}[which]
    assert_safe(work, _file(json.dumps(header).encode(), data))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 10**6), st.binary(max_size=16))
def test_genuine_cache_with_bytes_changed(work, flips, cut, tail):
    data = bytearray(genuine(work)[0])
    for pos, value in flips:
        data[pos % len(data)] = value
    assert_safe(work, bytes(data[:cut % (len(data) + 1)]) + tail)


FIELDS = st.sampled_from([("logits", "shape"), ("logits", "dtype"), ("logits", "data_offsets"),
                          ("__metadata__", CACHE_META), ("__metadata__", "shardc.baseline_cache_hmac"),
                          ("__metadata__", "extra"), ("other", "dtype")])
VALUES = (json_values | st.sampled_from([[5, 2, 7], [2, 5, 7], [1, 10, 7], [0, 140], [0, 70], "BF16", "F16",
                                         "U8", json.dumps(KEY, sort_keys=True), json.dumps(KEY), "0" * 64,
                                         "GENUINE_DIGEST"]))


@FUZZ
@given(st.lists(st.tuples(FIELDS, VALUES), min_size=1, max_size=3))
def test_genuine_cache_with_header_fields_replaced(work, edits):
    _, header, data = genuine(work)
    header = json.loads(json.dumps(header))
    for (entry, field), value in edits:
        if value == "GENUINE_DIGEST":  # the digest the genuine cache carries
            value = genuine(work)[1]["__metadata__"]["shardc.baseline_cache_hmac"]
        header.setdefault(entry, {})
        if isinstance(header[entry], dict):
            header[entry][field] = value
    assert_safe(work, _file(header, data))
