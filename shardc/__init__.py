"""shardc: compile a Hugging Face checkpoint into per-rank TP x PP shard files, verify and ship them.

``shardc.load_shard(manifest, tp_rank, pp_stage, device=...)`` is the loader a serving runtime calls
(see shardc.verify.loader). It is resolved lazily so that ``import shardc`` never imports torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["load_shard"]


def __getattr__(name: str) -> Any:
    if name == "load_shard":
        from .verify.loader import load_shard

        return load_shard
    raise AttributeError(f"module 'shardc' has no attribute {name!r}")
