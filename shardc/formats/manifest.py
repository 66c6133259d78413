"""The manifest: the one record of a build. Canonical JSON (sorted keys, no timestamps).

Schema (format_version 1)::

    {
      "format": "shardc-manifest", "format_version": 1, "shardc_version": "0.1.0",
      "plan": {...normalized plan...}, "plan_sha256": "<hex>",
      "model": {...ModelSpec.summary()..., "padded_vocab_size": int, "config": {HF config.json}},
      "layout": {"tp_degree": int, "pp_degree": int, "stages": [[start, stop], ...],
                 "base_dtype": "BF16", "dtype": "fp16|bf16|int8|fp8"},
      "source": {"uri": str, "revision": str|null,
                 "files": [{"name": str, "size": int, "sha256": hex}, ...]},
      "files": [{"name": "config.json", "size": int, "sha256": hex}],
      "shards": [{"file": "model-tp00-pp00.safetensors", "tp_rank": 0, "pp_stage": 0, "rank": 0,
                  "layers": [start, stop], "size": int, "sha256": hex,
                  "tensors": {name: TensorSpec.record() (+ "stats" for quantized weights)}}, ...]
    }

File names in ``shards`` and ``files`` are relative to the manifest's own directory (or prefix).

A manifest pushed with ``--compress zstd`` adds to each compressed entry ``"compressed": {"codec":
"zstd", "size": int, "sha256": hex, "object": "<file>.zst"}`` (the stored object); the entry's own
size and sha256 stay those of the uncompressed file. ``shardc pull`` strips the key again, so a
pulled manifest.json is byte-identical to the build's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ManifestError
from ..spec.layout import Layout, build_layout
from ..spec.model import model_from_config
from ..spec.plan import canonical_json, plan_from_dict
from ..spec.readfile import MANIFEST_LIMIT, read_regular_file

FORMAT = "shardc-manifest"
FORMAT_VERSION = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def safe_name(name: str, what: str = "file name") -> str:
    """A name from a file may never escape its directory."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ManifestError(
            f"unsafe {what} {name!r}", hint="names must be plain file names without directories"
        )
    return name


def new_manifest(
    layout: Layout, source: dict[str, Any], shards: list[dict[str, Any]], files: list[dict[str, Any]]
) -> dict[str, Any]:
    plan, model = layout.plan, layout.model
    from ..spec.layout import base_dtype

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "shardc_version": __version__,
        "plan": plan.data,
        "plan_sha256": plan.sha256,
        "model": {**model.summary(), "padded_vocab_size": layout.padded_vocab, "config": model.config},
        "layout": {
            "tp_degree": plan.tp,
            "pp_degree": plan.pp,
            "stages": [list(s) for s in layout.stages],
            "base_dtype": base_dtype(model, plan),
            "dtype": plan.dtype,
        },
        "source": source,
        "files": sorted(files, key=lambda f: f["name"]),
        "shards": sorted(shards, key=lambda s: s["rank"]),
    }


def dumps(manifest: dict[str, Any]) -> bytes:
    return canonical_json(manifest)


def loads(data: bytes | str, origin: str = "manifest") -> dict[str, Any]:
    """Parse and sanity-check a manifest (ManifestError names what is wrong)."""
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ManifestError(f"{origin} is not JSON", hint="pass the manifest.json that shardc build wrote") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ManifestError(f"{origin} is not a shardc manifest", hint="pass the manifest.json that shardc build wrote")
    if m.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{origin} has format_version {m.get('format_version')!r}; this shardc reads {FORMAT_VERSION}",
            hint="use the shardc version that wrote it",
        )
    for key in ("plan", "plan_sha256", "model", "layout", "source", "files", "shards"):
        if key not in m:
            raise ManifestError(f"{origin} lacks the key {key!r}", hint="the manifest is damaged; rebuild")
    for shard in m["shards"]:
        safe_name(shard.get("file"), "shard file name")
    for f in m["files"]:
        safe_name(f.get("name"))
    return m


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    data = read_regular_file(path, limit=MANIFEST_LIMIT, what="manifest", error=ManifestError)
    return loads(data, str(path))


def write_atomic(path: str | Path, data: bytes) -> None:
    """temp file + fsync + rename: the file is either the old one or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def layout_of(manifest: dict[str, Any]) -> Layout:
    """Recompute the Layout from the manifest's plan and model config: the independent truth."""
    plan = plan_from_dict(manifest["plan"])
    model = model_from_config(manifest["model"]["config"])
    return build_layout(model, plan)
