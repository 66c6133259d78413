"""The manifest's JSON, decoded and nothing more: ``decode``, the one place its bytes become JSON
data (formats/manifest.py ``loads`` validates what it returns), and for the loader's early start
(loader/early_start.py), which runs before the validating modules are imported, ``read_unchecked``
(a bounded read of a regular file) and ``rank_entry`` (one rank's shard entry picked out by
shape). What these two return is a claim, never trusted: the early start uses it only to start
reads that the loader later holds against the validated manifest, field by field.

Imports only the standard library, the digest kinds and formats/chunk_digests.py (it is part of
the early start's light imports: tests/verify/test_loader_early.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ..digests import CHUNK_DIGESTS, DEFAULT_CHUNK_DIGEST
from ..errors import ManifestError
from .chunk_digests import chunk_count, chunk_size_problem

MAX_MANIFEST = 64 << 20  # read_unchecked: a larger manifest is left to the checked reader (and its own bound)


def decode(data: bytes | str, origin: str = "manifest") -> Any:
    """JSON bytes -> JSON data (ManifestError where they are not JSON; RecursionError propagates:
    the caller names its nesting bound)."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ManifestError(f"{origin} is not JSON", hint="pass the manifest.json that shardc build wrote") from None


def read_unchecked(path: Path) -> Any:
    """The manifest's JSON data, unvalidated, read from a regular file of a sane size (else
    ValueError, or ManifestError where it is not JSON)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
            raise ValueError("not a plain manifest file")
        return decode(f.read(MAX_MANIFEST + 1), str(path))


def rank_entry(data: Any, tp_rank: int, pp_stage: int, dp_rank: int) -> tuple[str, int, int, tuple[str, ...], str] | None:
    """The one shard entry of (tp_rank, pp_stage, dp_rank) with chunk digests of a sane shape:
    (file name, size, chunk size, digests, digest kind), or None."""
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, dict):
        return None
    hits = [(name, e) for name, e in shards.items() if isinstance(e, dict) and e.get("tp_rank") == tp_rank
            and e.get("pp_stage") == pp_stage and (e.get("dp_rank") or 0) == dp_rank]
    if len(hits) != 1:
        return None
    name, e = hits[0]
    size, chunk_size, chunks = e.get("size"), e.get("chunk_size"), e.get("chunks")
    digest = e.get("chunk_digest", DEFAULT_CHUNK_DIGEST)
    if chunk_size_problem(chunk_size) is not None or type(size) is not int or size < 0:
        return None
    assert isinstance(chunk_size, int)
    if (not isinstance(name, str) or os.path.basename(name) != name or name.startswith(".")
            or not isinstance(chunks, list) or len(chunks) != chunk_count(size, chunk_size)
            or not all(isinstance(c, str) for c in chunks) or not isinstance(digest, str)
            or digest not in CHUNK_DIGESTS):
        return None
    return name, size, chunk_size, tuple(chunks), digest
