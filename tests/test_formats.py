"""The shard-file header parser and the file helpers, on real files."""

from __future__ import annotations

import json
import os
import struct

import pytest
from safetensors.numpy import save_file

from shardc.errors import ShardFormatError
from shardc.formats.files import create_temp, final_name, is_temp, temp_files, write_atomic
from shardc.formats.safetensors import read_header


def _raw(path, header: bytes, declared: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if declared is None else declared) + header)


def test_read_header_matches_safetensors(tmp_path):
    import numpy as np

    save_file({"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.int8)}, str(tmp_path / "x"),
              metadata={"k": "v"})
    tensors, meta, start = read_header(tmp_path / "x")
    assert meta == {"k": "v"} and set(tensors) == {"a", "b"}
    assert tensors["a"]["shape"] == [2, 3] and tensors["a"]["dtype"] == "F32"
    (n,) = struct.unpack("<Q", (tmp_path / "x").read_bytes()[:8])
    assert start == 8 + n


@pytest.mark.parametrize(("header", "declared", "words"), [
    (b"", None, "shorter"),
    (b"{}", 1 << 40, "implausible"),
    (b"{\"a\":", 100, "truncated"),
    (b"[1, 2]", None, "not a JSON object"),
    (b"{nope", None, "not JSON"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2, -1], "data_offsets": [0, 4]}}).encode(), None, "w"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}).encode(), None, "w"),
    (json.dumps({"__metadata__": {"a": 1}}).encode(), None, "__metadata__"),
])
def test_read_header_refuses_damage_naming_file_and_key(tmp_path, header, declared, words):
    p = tmp_path / "bad.safetensors"
    if header == b"":
        p.write_bytes(b"\x01\x02")
    else:
        _raw(p, header, declared)
    with pytest.raises(ShardFormatError) as exc:
        read_header(p)
    assert "bad.safetensors" in exc.value.one_line() and words in exc.value.one_line()


def test_one_temp_scheme(tmp_path):
    fd, tmp = create_temp(tmp_path / "out.bin")
    os.close(fd)
    assert is_temp(tmp) and final_name(tmp) == "out.bin" and temp_files(tmp_path) == [tmp]
    write_atomic(tmp_path / "out.bin", b"data")  # its own temp file is gone, the other one kept
    assert (tmp_path / "out.bin").read_bytes() == b"data" and temp_files(tmp_path) == [tmp]
    assert not is_temp(tmp_path / "out.bin")
