"""Which model to plan: presets, config.json files and checkpoint directories.

Every model the planner sizes is a ModelSpec of a family shardc builds (DeepSeek-V3's MLA
included), so its figures come from the same Layout a build writes.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..layout.model import PRESET_SOURCES, PRESETS, ModelSpec, load_model
from ..layout.tensors import source_tensors

__all__ = ["PRESET_SOURCES", "param_count", "resolve_model"]


def param_count(model: ModelSpec) -> int:
    """Parameters of the checkpoint (tied embeddings counted once), from the Layout's tensor list."""
    return sum(math.prod(t.shape) for t in source_tensors(model))


def resolve_model(ref: str) -> tuple[ModelSpec, str, str]:
    """The model as (spec, short name, plan source): a preset, a config.json or a checkpoint dir."""
    spec = load_model(ref)
    key = ref.lower()
    if key in PRESETS:
        return spec, key, PRESET_SOURCES.get(key, key)
    path = Path(ref)
    ckpt = (path if path.is_dir() else path.parent).resolve()
    return spec, ckpt.name or "model", str(ckpt)
