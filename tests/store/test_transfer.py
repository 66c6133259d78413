"""store/transfer.py behaviours that mutation testing found unchecked: the progress bar's form
(stderr only, byte units scaled by 1024, cleared when done, silent when off) and pull stripping
the store's ``compressed`` records from side-file entries too, not only from shards."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
from plan_helpers import plan as make_plan

from shardc.store import pull_build
from shardc.store.transfer import progress_bar

needs_zstd = pytest.mark.skipif(importlib.util.find_spec("zstandard") is None,
                                reason="zstandard is not installed (pip install 'shardc[zstd]')")


def _bar_output(capsys, progress: bool) -> tuple[str, str]:
    bar = progress_bar(progress, "push s3://b/p", 10 << 20)
    bar.update(5 << 20)
    bar.refresh()
    bar.close()
    out = capsys.readouterr()
    return out.out, out.err


def test_progress_bar_form(capsys, monkeypatch):
    from shardc import progress

    monkeypatch.setattr(progress, "terminal", lambda: True)  # the bar on a terminal (in a log: lines)
    out, err = _bar_output(capsys, True)
    assert out == ""  # stdout stays for --json
    first, *_ = err.strip("\r").split("\r")
    assert first.startswith("push s3://b/p:") and first.endswith("?B/s]")  # bytes, not items
    # 5 MiB of 10 MiB: with 1024 as the divisor exactly 5.00M / 10.0M (1000 would give 5.24M)
    assert "| 5.00M/10.0M [" in err
    assert err.endswith("\r") and "\n" not in err  # the finished bar is cleared, not left behind


def test_progress_bar_off_is_silent(capsys):
    assert _bar_output(capsys, False) == ("", "")


@needs_zstd
def test_pull_strips_compressed_records_of_side_files(make_ckpt, tmp_path):
    """A store manifest may record any entry as compressed (pull fetches side files through the
    same path as shards); the pulled manifest.json is still byte for byte the build's."""
    import zstandard

    from shardc.compiler.compile import build
    from shardc.store import push_build

    src = make_ckpt(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    vocab_size=64)
    plan = make_plan(1, name="t", source=src)
    b = build(plan, tmp_path / "o")
    store = tmp_path / "store"
    push_build(b.manifest_path, str(store), compress="zstd")
    remote = json.loads((store / "manifest.json").read_text())
    blob = zstandard.ZstdCompressor().compress((store / "config.json").read_bytes())
    (store / "config.json.zst").write_bytes(blob)
    (store / "config.json").unlink()
    (entry,) = [f for f in remote["files"] if f["name"] == "config.json"]
    entry["compressed"] = {"codec": "zstd", "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                           "object": "config.json.zst"}
    (store / "manifest.json").write_text(json.dumps(remote))
    dest = tmp_path / "node"
    res = pull_build(f"{store}/manifest.json", dest)
    assert res.verify.ok
    assert (dest / "manifest.json").read_bytes() == b.manifest_path.read_bytes()
    assert (dest / "config.json").read_bytes() == (b.out_dir / "config.json").read_bytes()
