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
               endpoint_url: str | None = None, into: Any = None) -> dict[str, Any]:
    """One rank's tensors ``{name: torch.Tensor}`` on ``device``, every byte checked against the
    manifest first. ``manifest``: a manifest path, a build directory, a ``Manifest``, or an
    ``s3://`` URI (streamed by shardc.loader.remote from the store shardc.store.stream opens,
    nothing written to disk); local ones are read by shardc.loader.local, without importing the
    store (its modules are 30-40 ms of a cold start's imports), the shard's reads started first
    (shardc.loader.early_start). Raises ShardcError subclasses (VerifyMismatch for damaged bytes).
    ``into``: {name: tensor}, CPU tensors (an engine's parameters) the named tensors are read
    straight into, no copy (a local shard, device="cpu"; shardc.loader.local.load_shard)."""
    if isinstance(manifest, str) and manifest.startswith("s3://"):
        from .errors import StoreError
        from .loader.remote import load_remote
        from .loader.tensors import tensors_of
        from .store.stream import open_ranged

        if into is not None:
            raise StoreError("load_shard of an s3:// manifest takes no into=", key="into",
                             hint="shardc pull the build, then load_shard the local directory with into=")
        if directory is not None:
            raise StoreError("load_shard of an s3:// manifest streams the shard; directory= does not apply",
                             hint="drop directory=, or load_shard the local directory a pull wrote")
        uri = manifest
        return tensors_of(load_remote(uri, tp_rank, pp_stage, device=device, dp_rank=dp_rank,
                                      open_objects=lambda: open_ranged(uri, endpoint_url=endpoint_url)))
    from .loader import early_start

    # the shard starts coming off the disk before the modules that check it are imported (70 ms
    # of a cold start); nothing from it is used unless it matches the checked manifest
    early = early_start.start(manifest, directory, tp_rank, pp_stage, dp_rank, device) if into is None else None
    try:
        from .loader.local import load_shard as load_local

        return load_local(manifest, tp_rank, pp_stage, device=device, directory=directory, dp_rank=dp_rank,
                          early=early, into=into)
    finally:
        if early is not None:
            early.close()  # stops reads the loader did not take (a failed check, a mismatch)
