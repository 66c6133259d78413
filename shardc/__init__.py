"""shardc: compile a Hugging Face checkpoint into per-rank TP x PP shard files, verify and ship them.

``shardc.load_shard(manifest, tp_rank, pp_stage, device=...)`` is the loader a serving runtime calls
(shardc.verify.loader; an ``s3://`` manifest is streamed by shardc.store.stream). It is resolved
lazily so that ``import shardc`` never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"
__all__ = ["load_shard"]


def lazy_seam(package: str, seam: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that imports a public name from its module on first use, so
    ``import shardc.compiler`` stays free (no numpy, numba or torch until a name is touched)."""

    def __getattr__(name: str) -> Any:
        if name not in seam:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{seam[name]}"), name)

    return __getattr__


__getattr__ = lazy_seam("shardc", {"load_shard": "store.stream"})
