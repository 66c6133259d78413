"""What a checkpoint holds and how each tensor splits under tensor parallelism.

Both come from the model's family module (layout/families/): its one table of tensors (``Row``:
name, shape from the config, split kind, quantizable). ``source_tensors`` lists every tensor a
checkpoint of a model must contain, ``tensor_table`` maps each name to its row, and
``valid_tp_degrees`` says which TP degrees the model's shapes allow. Pure.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import LayoutError
from .families.family import (
    COLUMN,
    EXPERT,
    FUSED,
    KV_COLUMN,
    REPLICATED,
    ROW,
    STACKED,
    VOCAB,
    Row,
    Split,
)
from .model import ModelSpec

__all__ = ["COLUMN", "EXPERT", "FUSED", "KV_COLUMN", "REPLICATED", "ROW", "STACKED", "VOCAB", "Row", "Split"]

MAX_TP_HINT = 64


# The tables of the last few models asked about, by identity (the model is kept, so its id is not
# reused while cached). A family's table is a pure function of the model, and a search asks for it
# hundreds of times: Kimi-K2's 70,000 rows were built 385 times by one `shardc plan` (5 of its 12 s).
_TABLES: dict[int, tuple[ModelSpec, tuple[Row, ...], Mapping[str, Row]]] = {}


def _cached(model: ModelSpec) -> tuple[tuple[Row, ...], Mapping[str, Row]]:
    hit = _TABLES.get(id(model))
    if hit is None or hit[0] is not model:
        rows = tuple(model.spec.tensors(model))
        if len(_TABLES) >= 8:
            _TABLES.pop(next(iter(_TABLES)))
        hit = _TABLES[id(model)] = (model, rows, MappingProxyType({r.name: r for r in rows}))
    return hit[1], hit[2]


def table_rows(model: ModelSpec) -> tuple[Row, ...]:
    """The model's family table, in the family's order (computed once per model)."""
    return _cached(model)[0]


def tensor_table(model: ModelSpec) -> Mapping[str, Row]:
    """Every tensor of a checkpoint of ``model``, by name, as its family declares it (read-only)."""
    return _cached(model)[1]


def split_kind(name: str, model: ModelSpec) -> Split:
    """The split rule of one of the model's tensors (LayoutError for a name outside its table)."""
    row = tensor_table(model).get(name)
    if row is not None:
        return row.split
    raise LayoutError(f"no split rule for tensor {name!r}", hint="only names in the model's family table are known")


@functools.lru_cache(maxsize=1 << 16)  # a search asks about the same few thousand names a million times
def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class SourceTensor:
    """A tensor the checkpoint must contain, with the shape the config implies."""

    name: str
    shape: tuple[int, ...]


def source_tensors(model: ModelSpec) -> list[SourceTensor]:
    """Every tensor a checkpoint of this model must hold, in HF naming, with its shape, by name."""
    return sorted((SourceTensor(r.name, r.shape) for r in table_rows(model)), key=lambda t: t.name)


_SPLIT_ROWS: dict[int, tuple[ModelSpec, list[Row]]] = {}


def _split_rows(model: ModelSpec) -> list[Row]:
    """The first column / row split row of each (kind, shape, routed or not) in the model's table:
    what the TP checks need, without walking a 36,000-row table (Qwen3-235B) for every degree a
    search tries. Kept for the last few models asked about (a search asks about one many times)."""
    hit = _SPLIT_ROWS.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    seen: dict[tuple[object, ...], Row] = {}
    for row in table_rows(model):
        if row.split in (COLUMN, ROW) or row.split == STACKED and row.tp_dim is not None:
            seen.setdefault((row.split, row.shape, row.tp_dim, row.expert is not None), row)
    if len(_SPLIT_ROWS) >= 8:
        _SPLIT_ROWS.pop(next(iter(_SPLIT_ROWS)))
    _SPLIT_ROWS[id(model)] = (model, list(seen.values()))
    return _SPLIT_ROWS[id(model)][1]


def valid_tp_degrees(model: ModelSpec, limit: int = MAX_TP_HINT, *, expert_parallel: bool = False) -> list[int]:
    return [t for t in range(1, limit + 1) if not _tp_problems(model, t, expert_parallel)]


def _tp_problems(model: ModelSpec, tp: int, expert_parallel: bool = False) -> list[str]:
    problems = []
    if model.num_heads % tp:
        problems.append(f"num_attention_heads={model.num_heads} is not divisible by tp={tp}")
    kv = model.num_kv_heads
    if kv >= tp and kv % tp:
        problems.append(f"num_key_value_heads={kv} is not divisible by tp={tp}")
    if kv < tp and tp % kv:
        problems.append(f"tp={tp} is not a multiple of num_key_value_heads={kv}")
    if model.intermediate_size % tp:
        problems.append(f"intermediate_size={model.intermediate_size} is not divisible by tp={tp}")
    if model.hidden_size % tp:
        problems.append(f"hidden_size={model.hidden_size} is not divisible by tp={tp}")
    hybrid = model.forward.hybrid  # a rank holds whole key heads of each linear-attention layer
    if hybrid is not None and hybrid.key_heads % tp:
        problems.append(f"linear_num_key_heads={hybrid.key_heads} is not divisible by tp={tp}")
    moe = model.forward.moe
    if moe is not None and expert_parallel and moe.experts < tp:
        problems.append(f"{moe.experts} experts leave ranks without one at tp={tp} with expert_parallel")
    # every other column / row split of the family's table (a routed expert's or a shared
    # expert's intermediate size): whole rows or columns per rank
    for row in () if problems else _split_rows(model):
        if expert_parallel and (row.expert is not None or row.split == STACKED):
            continue
        dim = row.tp_dim if row.split == STACKED else 0 if row.split == COLUMN else 1
        assert dim is not None
        if row.shape[dim] % tp:
            what = "rows" if dim == 0 else "columns"
            problems.append(f"{row.name} has {row.shape[dim]} {what}, not divisible by tp={tp}")
            break
    return problems
