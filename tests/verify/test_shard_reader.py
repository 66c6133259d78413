"""Behaviours that mutation testing found unchecked in the one-pass shard reader that used to serve
shards without chunk digests, now held against the loader's read of such a shard (format_version
2: upgraded on read, loader/upgrade.py, then the one chunk engine, loader/sinks.py), as ``load_shard``
and ``verify --device`` read it (loader/local.py ``load_for_verify``).

Every file here is written byte by byte by the test (an 8-byte length, a JSON header, data), so the
oracles are hashlib over those bytes, the header text the test chose and the values it planted; none
comes from shardc. Covered: a header length past the end of the file (or exactly at it), a header
that does not parse, a data section that is empty or has gaps, zero-element tensors, overlapping or
odd-sized spans, a file that grows while it is read, the copy-on-write mapping, and ``finite``
being opt-in.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from manifest_edits import reseal
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")

from shardc.errors import VerifyMismatch  # noqa: E402
from shardc.loader.local import load_for_verify  # noqa: E402
from shardc.loader.tensors import RawShard, nonfinite, tensors_of  # noqa: E402

BF16_NAN, BF16_ONE = b"\xc0\x7f", b"\x80\x3f"  # little-endian 0x7FC0 / 0x3F80


def _file(path: Path, header: dict | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    """Write [8-byte length][header][data]; ``n`` overrides the length field. Returns the bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    blob = struct.pack("<Q", len(raw) if n is None else n) + raw + data
    path.write_bytes(blob)
    return blob


def _entry(dtype: str, shape: list[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def read_shard(path: Path, device: str, *, finite: bool = False) -> RawShard:
    """The loader's read of ``path`` as a format_version 2 entry recording its size and sha256 (no
    chunk digests): ``load_for_verify``; with ``finite`` the NaN / Inf tensors it found."""
    entry = SimpleNamespace(chunk_size=None, size=path.stat().st_size, sha256=_sha(path.read_bytes()))
    raw = load_for_verify(path, entry, device)  # type: ignore[arg-type]
    if not finite:
        raw.nonfinite = []
    return raw


# -- the length prefix ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", ["one past", "top bit", "2^64-1"])
def test_header_length_past_the_end_is_reported_and_the_rest_still_hashed(tmp_path, n):
    """A length field that points past the file (by one byte, or with the top bit set, which a signed
    read would take as negative) is reported as such; the data section is everything after the 8
    bytes, and the sha256 is the whole file's."""
    path = tmp_path / "x.safetensors"
    header = json.dumps({"a": _entry("BF16", [2], 0, 4)}).encode()
    header += b" " * (-len(header) % 8)
    size = 8 + len(header) + 4
    field = {"one past": size - 8 + 1, "top bit": 1 << 63 | len(header), "2^64-1": 2**64 - 1}[n]
    blob = _file(path, header, BF16_ONE * 2, n=field)
    for finite in (False, True):
        raw = read_shard(path, "cpu", finite=finite)
        assert raw.header is None and raw.header_error == "file shorter than its header length says"
        assert raw.sha256 == _sha(blob)
        assert bytes(raw.data.numpy()) == blob[8:]
        assert raw.nonfinite == []


def test_file_shorter_than_the_length_field(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x05\x00\x00")
    raw = read_shard(path, "cpu", finite=True)
    assert raw.header is None and raw.header_error == "file shorter than its header length says"
    assert raw.sha256 == _sha(b"\x05\x00\x00") and raw.data.numel() == 0


def test_header_that_fills_the_file_has_an_empty_data_section(tmp_path):
    """Length field = size - 8 exactly (no tensor data): valid, and the data is an empty uint8 tensor."""
    path = tmp_path / "x.safetensors"
    blob = _file(path, {"__metadata__": {"format": "pt"}, "e": _entry("F32", [0, 3], 0, 0)})
    raw = read_shard(path, "cpu", finite=True)
    assert raw.header_error is None and raw.header == {"e": _entry("F32", [0, 3], 0, 0),
                                                       "__metadata__": {"format": "pt"}}
    assert raw.sha256 == _sha(blob)
    assert raw.data.dtype == torch.uint8 and raw.data.shape == (0,)
    got = tensors_of(raw)
    assert list(got) == ["e"] and got["e"].dtype == torch.float32 and got["e"].shape == (0, 3)
    assert raw.nonfinite == []


def test_header_that_does_not_parse_keeps_the_parser_message(tmp_path):
    path = tmp_path / "x.safetensors"
    blob = _file(path, b"{not json", b"\x00" * 8)
    raw = read_shard(path, "cpu", finite=True)
    assert raw.header is None and raw.header_error.startswith("header is not JSON (")
    assert raw.sha256 == _sha(blob) and bytes(raw.data.numpy()) == blob[8 + 16 :]
    path2 = tmp_path / "y.safetensors"
    _file(path2, {"a": {"shape": [1], "data_offsets": [0, 2]}}, BF16_ONE)
    assert read_shard(path2, "cpu").header_error == "entry has no dtype"


def test_reading_emits_no_warning(tmp_path):
    """``verify --device`` prints nothing but its report: the reader raises no Python warning."""
    path = tmp_path / "x.safetensors"
    _file(path, {"a": _entry("BF16", [2], 0, 4)}, BF16_ONE * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_shard(path, "cpu", finite=True)
        read_shard(path, "cpu")


# -- the data section ------------------------------------------------------------------------------------
def test_finite_is_opt_in(tmp_path):
    """Without ``finite`` (load_shard's call) no value is checked: ``nonfinite`` stays empty even for a
    tensor holding NaN; with it, the tensor is named."""
    path = tmp_path / "x.safetensors"
    _file(path, {"a": _entry("BF16", [2], 0, 4)}, BF16_ONE + BF16_NAN)
    assert read_shard(path, "cpu").nonfinite == []
    assert read_shard(path, "cpu", finite=False).nonfinite == []
    assert read_shard(path, "cpu", finite=True).nonfinite == ["a"]


def test_gaps_between_tensors_are_hashed_and_skipped(tmp_path):
    """Data offsets with unused bytes between tensors (NaN bits planted in the gap): both tensors load,
    the gap is hashed, and only the tensor that holds a NaN is named."""
    path = tmp_path / "x.safetensors"
    data = BF16_ONE * 2 + BF16_NAN * 2 + BF16_NAN + BF16_ONE  # a: [0, 4), gap [4, 8), b: [8, 12)
    blob = _file(path, {"a": _entry("BF16", [2], 0, 4), "b": _entry("BF16", [2], 8, 12)}, data)
    raw = read_shard(path, "cpu", finite=True)
    assert raw.sha256 == _sha(blob) and raw.nonfinite == ["b"]
    got = tensors_of(raw)
    assert got["a"].tolist() == [1.0, 1.0]
    assert math.isnan(got["b"][0].item()) and got["b"][1].item() == 1.0


@pytest.mark.parametrize("case", ["overlap", "past the end"])
def test_inconsistent_spans_are_hashed_only(tmp_path, case):
    """Spans that overlap, or that reach past the data section (the header check fails the file in
    every caller): the sha256 is the file's; past the end, nothing is value-checked and tensors_of
    refuses it; overlapping, each tensor is read as its header says (b's NaN is b's)."""
    path = tmp_path / "x.safetensors"
    if case == "overlap":  # b starts inside a; its second element (bytes 4..6) is NaN
        header = {"a": _entry("BF16", [2], 0, 4), "b": _entry("BF16", [2], 2, 6)}
        data = BF16_ONE * 2 + BF16_NAN
    else:  # b's NaN lies inside the file, its end does not
        header = {"a": _entry("BF16", [1], 0, 2), "b": _entry("BF16", [2], 2, 8)}
        data = BF16_ONE + BF16_NAN
    blob = _file(path, header, data)
    raw = read_shard(path, "cpu", finite=True)
    assert raw.sha256 == _sha(blob) and raw.nonfinite == ([] if case == "past the end" else ["b"])
    if case == "past the end":
        with pytest.raises(VerifyMismatch, match=r"tensor b: data_offsets \[2, 8\] do not fit"):
            tensors_of(raw)


def test_odd_sized_float_span_is_refused_not_a_crash(tmp_path):
    """A BF16 tensor whose span is an odd number of bytes (a damaged header): the finite check used to
    raise numpy's ValueError here, so ``verify --device cpu`` printed a traceback. Now the span is
    hashed only and tensors_of names it."""
    path = tmp_path / "x.safetensors"
    blob = _file(path, {"a": _entry("BF16", [2], 0, 3), "b": _entry("F32", [1], 4, 8)},
                 BF16_NAN * 2 + b"\x00\x00\xc0\x7f")
    raw = read_shard(path, "cpu", finite=True)
    assert raw.sha256 == _sha(blob) and raw.header is not None
    with pytest.raises(VerifyMismatch) as e:
        tensors_of(raw)
    assert e.value.message == "tensor a: data_offsets [0, 3] do not fit BF16[2] in the file"
    assert e.value.hint == "rebuild the shard"


def test_zero_element_tensor_between_others(tmp_path):
    path = tmp_path / "x.safetensors"
    _file(path, {"a": _entry("BF16", [1], 0, 2), "z": _entry("BF16", [0], 2, 2),
                 "b": _entry("BF16", [1], 2, 4)}, BF16_ONE + BF16_NAN)
    raw = read_shard(path, "cpu", finite=True)
    got = tensors_of(raw)
    assert got["z"].shape == (0,) and got["a"].item() == 1.0 and raw.nonfinite == ["b"]


def test_unknown_dtype_is_a_malformed_entry(tmp_path):
    path = tmp_path / "x.safetensors"
    _file(path, {"q": _entry("Q9", [2], 0, 2)}, b"\x01\x02")
    raw = read_shard(path, "cpu", finite=True)
    with pytest.raises(VerifyMismatch) as e:
        tensors_of(raw)
    info = str(_entry("Q9", [2], 0, 2))
    assert e.value.message == f"tensor q: malformed header entry {info}"
    assert e.value.hint == "rebuild the shard"
    long = {"dtype": "Q9", "shape": [2], "data_offsets": [0, 2], "pad": "p" * 300}
    _file(path, {"q": long}, b"\x01\x02")
    with pytest.raises(VerifyMismatch) as e:
        tensors_of(read_shard(path, "cpu"))
    assert e.value.message == f"tensor q: malformed header entry {str(long)[:200]}"


def test_tensors_are_copy_on_write(tmp_path):
    """A runtime may write into the tensors load_shard returns: the shard file must not change."""
    path = tmp_path / "x.safetensors"
    data = np.arange(6, dtype=np.float32).tobytes()
    blob = _file(path, {"w": _entry("F32", [6], 0, 24)}, data)
    t = tensors_of(read_shard(path, "cpu"))["w"]
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    t.mul_(7)
    assert t[5].item() == 35.0
    assert path.read_bytes() == blob


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs procfs")
def test_file_that_grows_while_read(tmp_path):
    """procfs files report size 0 and then yield bytes: the reader finds more data than the size it
    started from, the case of a shard being rewritten under it, and says so."""
    path = Path("/proc/self/status")
    with pytest.raises(VerifyMismatch) as e:
        read_shard(path, "cpu")
    assert e.value.message == f"{path}: file changed size while it was read"
    assert e.value.hint == "is something rewriting it?"


# -- nonfinite (the CUDA path's check, called directly here on CPU tensors) -----------------------------------
def test_nonfinite_edges():
    """A one-element tensor is checked, a zero-element one skipped, an unknown name skipped."""
    one = torch.tensor([float("nan")], dtype=torch.bfloat16)
    empty = torch.empty(0, dtype=torch.float16)
    ints = torch.tensor([0x7F, -1], dtype=torch.int8)
    got = nonfinite({"one": one, "empty": empty, "ints": ints, "anon": one},
                    {"one": "BF16", "empty": "F16", "ints": "I8"})
    assert got == ["one"]
    assert nonfinite({"empty": empty}, {"empty": "F16"}) == []


def test_sha_is_hashlib_of_a_multi_piece_file(tmp_path):
    """Several 1 MiB pieces in one tensor, a short last piece: the digest is the file's; the bytes
    land intact."""
    path = tmp_path / "x.safetensors"
    n = (3 << 20) // 4 + 3
    vals = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    vals[-1] = np.inf
    blob = _file(path, {"w": _entry("F32", [n], 0, 4 * n)}, vals.tobytes())
    raw = read_shard(path, "cpu", finite=True)
    assert raw.sha256 == _sha(blob) and raw.nonfinite == ["w"]
    assert re.fullmatch(r"[0-9a-f]{64}", raw.sha256)
    assert np.array_equal(tensors_of(raw)["w"].numpy(), vals)


def test_verify_device_reports_a_damaged_span_in_one_line(tmp_path):
    """End to end: one digit of a real shard's header changed (a BF16 tensor's end offset made odd, the
    JSON the same length, the manifest re-hashed to match): ``verify --device cpu`` exits 1 with the
    tensor named, where it used to die in numpy with a traceback."""
    from click.testing import CliRunner

    from shardc.cli import main
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    src = write_checkpoint(tmp_path / "src", llama_config(hidden_size=32, intermediate_size=64, num_layers=1,
                                                          num_heads=4, num_kv_heads=2, vocab_size=64))
    plan = make_plan(1, name="odd", source=src)
    res = build(plan, tmp_path / "o")
    file = res.manifest.shards[0].file
    path = res.out_dir / file
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    name, (s, e) = next((k, v["data_offsets"]) for k, v in sorted(header.items())
                        if k != "__metadata__" and v["dtype"] == "BF16" and v["data_offsets"][1] % 10)
    text = blob[8 : 8 + n].decode()
    old = f'"data_offsets":[{s},{e}]'
    assert text.count(old) == 1
    blob[8 : 8 + n] = text.replace(old, f'"data_offsets":[{s},{e - 1}]').encode()
    path.write_bytes(bytes(blob))
    man = json.loads((res.out_dir / "manifest.json").read_text())
    reseal(man["shards"][file], bytes(blob))
    (res.out_dir / "manifest.json").write_text(json.dumps(man))
    r = CliRunner().invoke(main, ["verify", "--manifest", str(res.out_dir / "manifest.json"), "--device", "cpu"])
    assert r.exit_code == 1, r.output
    shape = header[name]["shape"]
    # the header check's data-layout rule names it before any byte is loaded (the reader's own
    # fallback, hashed only and named by tensors_of, is pinned on a hand-written file above)
    need = 2 * math.prod(shape)
    assert (f"{file}: safetensors data layout: tensor {name}: data_offsets [{s}, {e - 1}] hold {e - 1 - s} "
            f"bytes, its BF16{shape} needs {need}") in r.stderr
    assert "Traceback" not in r.output + r.stderr


def test_aligned_tensors_are_views_misaligned_ones_copies(tmp_path):
    """tensors_of views the data buffer (nothing copied) where a tensor starts on a multiple of its
    element size, and copies only one that does not (a view would be misaligned)."""
    path = tmp_path / "x.safetensors"
    b = np.array([1.5, -2.25], dtype=np.float32).tobytes()
    c = np.array([3.0], dtype=np.float32).tobytes()
    _file(path, {"a": _entry("BF16", [1], 0, 2), "b": _entry("F32", [2], 2, 10), "c": _entry("F32", [1], 12, 16)},
          BF16_ONE + b + b"\x00\x00" + c)
    raw = read_shard(path, "cpu")
    got = tensors_of(raw)
    base = raw.data.data_ptr()
    assert got["a"].item() == 1.0 and got["a"].data_ptr() == base
    assert got["c"].tolist() == [3.0] and got["c"].data_ptr() == base + 12
    assert got["b"].tolist() == [1.5, -2.25] and got["b"].data_ptr() != base + 2


def test_float_tensor_at_an_odd_offset_is_checked(tmp_path):
    """An F32 tensor starting at byte 1 (after one int8): its span is whole elements, so its values are
    checked while hashing and the planted NaN is found; tensors_of copies it out intact."""
    path = tmp_path / "x.safetensors"
    f = np.array([2.0, np.nan], dtype=np.float32).tobytes()
    _file(path, {"i": _entry("I8", [1], 0, 1), "f": _entry("F32", [2], 1, 9)}, b"\x07" + f)
    raw = read_shard(path, "cpu", finite=True)
    assert raw.nonfinite == ["f"]
    got = tensors_of(raw)["f"]
    assert got[0].item() == 2.0 and math.isnan(got[1].item())
