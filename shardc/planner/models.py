"""Which model to plan: presets, config.json files and checkpoint directories, Llama or MLA.

Kept apart from formulas.py so that the MLA arithmetic (mla.py, which builds on formulas'
records) and the model lookup do not import each other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..spec.layout import source_tensors
from ..spec.model import PRESET_SOURCES, PRESETS, ModelSpec, load_model
from .mla import MLA_PRESETS, is_mla_config, mla_from_config, mla_param_count


def param_count(model: Any) -> int:
    """Parameters of the checkpoint (tied embeddings counted once), from the Layout's tensor list."""
    if not isinstance(model, ModelSpec):  # an MLA model: no Layout, the config's matrices
        return mla_param_count(model)

    return sum(math.prod(t.shape) for t in source_tensors(model))


def resolve_model(ref: str) -> tuple[Any, str, str]:
    """The model as (spec, short name, plan source): a preset, a config.json or a checkpoint dir.

    A config of a family shardc builds gives a ModelSpec (what ``shardc build`` compiles); an MLA config
    (kv_lora_rank, qk_rope_head_dim) or an MLA preset gives an MlaModel, planned as advisory."""
    key = ref.lower()
    if key in MLA_PRESETS:
        return mla_from_config(MLA_PRESETS[key]), key, key
    try:
        spec: Any = load_model(ref)
    except ModelError:
        path = Path(ref) / "config.json" if Path(ref).is_dir() else Path(ref)
        try:
            cfg = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            cfg = None
        if not is_mla_config(cfg):
            raise
        spec = mla_from_config(cfg)
    if key in PRESETS:
        return spec, key, PRESET_SOURCES.get(key, key)
    path = Path(ref)
    ckpt = (path if path.is_dir() else path.parent).resolve()
    return spec, ckpt.name or "model", str(ckpt)
