"""The loader tests' tiny build, written once: a seeded two-layer Llama (hidden 64) built tp=2
bf16, so two shards of one size. Import by name: ``from tiny_builds import tiny_build``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from plan_helpers import plan as make_plan


def tiny_build(root: Path, name: str, *, chunk_size: int | None = None, group: dict[str, Any] | None = None) -> Path:
    """Its build directory under ``root``. ``chunk_size``: chunk digests of that many bytes
    (4096: several chunks per tiny shard) instead of the builds' 16 MiB; ``group``: more
    ``replica_group`` keys (``{"checkpoint": {"chunk_digest": "blake3"}}``)."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.formats import chunk_digests as chunks

    src = write_checkpoint(root / "src", llama_config(num_layers=2, hidden_size=64, intermediate_size=96))
    plan = make_plan(2, name=name, source=src, group=group)
    with pytest.MonkeyPatch.context() as mp:
        if chunk_size is not None:
            mp.setattr(chunks, "CHUNK_SIZE", chunk_size)
        return build(plan, out_dir=root / "b").out_dir
