"""The chunk digest kinds a manifest may record (docs/architecture.md §3.3) and their hash objects.

A leaf module, like errors.py: the plan schema (layout/plan.py) names the kinds a build may ask
for, the chunk readers and writers (formats/) hash with them, and the loader's early start
(loader/early_start.py) imports them before anything heavy is: importing this costs hashlib only.
formats/chunk_digests.py says why there are two kinds.
"""

from __future__ import annotations

import hashlib
from typing import Any

# replica_group.checkpoint.chunk_digest: recorded in the plan and the manifest only when it is not
# the default (a sha256 build keeps the bytes it had before blake3 existed)
CHUNK_DIGESTS = ("sha256", "blake3")
DEFAULT_CHUNK_DIGEST = "sha256"


def new_hash(digest: str = DEFAULT_CHUNK_DIGEST) -> Any:
    """A fresh hash object for chunk digests of kind ``digest`` (``update``/``hexdigest``; both
    kinds give 64 hex digits). blake3 is imported here: only a blake3 build's readers pay it."""
    if digest == "sha256":
        return hashlib.sha256()
    if digest == "blake3":
        from blake3 import blake3

        return blake3()
    raise ValueError(f"unknown chunk digest {digest!r}")  # the manifest and plan readers refuse it first
