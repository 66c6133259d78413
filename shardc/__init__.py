"""shardc: compile a Hugging Face checkpoint into per-rank TP x PP shard files, verify and ship them.

``shardc.load_shard(manifest, tp_rank, pp_stage, device=...)`` is the loader a serving runtime calls.
This module is the package's facade and sits above every package (tests/test_layering.py): it
imports its implementation inside the function, so ``import shardc`` (which every ``import
shardc.<package>`` runs first) stays free of torch, numpy and the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .version import __version__

__all__ = ["__version__", "load_shard"]


def load_shard(manifest: Any, tp_rank: int, pp_stage: int, *, device: str = "cuda",
               directory: str | Path | None = None, dp_rank: int = 0,
               endpoint_url: str | None = None) -> dict[str, Any]:
    """One rank's tensors ``{name: torch.Tensor}`` on ``device``, every byte checked against the
    manifest first. ``manifest``: a manifest path, a build directory, a ``Manifest``, or an
    ``s3://`` URI (streamed by shardc.store.stream, nothing written to disk); local ones are read
    by shardc.verify.loader. Raises ShardcError subclasses (VerifyMismatch for damaged bytes)."""
    from .store.stream import load_shard as load

    return load(manifest, tp_rank, pp_stage, device=device, directory=directory, dp_rank=dp_rank,
                endpoint_url=endpoint_url)
