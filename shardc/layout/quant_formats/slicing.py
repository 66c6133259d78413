"""Cutting a quantized source's stored tensors per TP rank (``dtype: source`` plans). Pure.

The Layout's cut of a weight (``layout/cuts.py`` ``Cut``: dim, start/stop or fused pieces, in
weight elements) becomes, for each stored tensor, the same cut divided by its grid
(``Stored.cut``); the stored tensors are then plain slices of source tensors of their own, so the
build, verify, reshard and export handle them like any other tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..model import ModelSpec
    from ..plan import Plan

from ...errors import LayoutError
from ..cuts import Cut, slice_for_rank
from ..tensors import STACKED, Split, tensor_table, valid_tp_degrees
from .format import SourceQuantization, Stored


def stored_cut(st: Stored, cut: Cut, full: tuple[int, ...]) -> dict[str, Any] | None:
    """TensorSpec fields (less name/source/split/dtype) of stored tensor ``st`` for a rank whose
    weight slice is ``cut`` of a weight of shape ``full``; None when the cut splits a grid cell.
    ``dim``/``start``/``stop`` are the stored tensor's own (``Stored.stored_dim``, ``Stored.cut``):
    what materialize.py slices and build_tensors.py reassembles."""
    local = cut.shape
    if st.value:
        return {"shape": st.shape(local), "value": tuple(local)}
    whole = st.shape(full)
    dim = cut.dim
    if dim is None or st.flat:
        return {"shape": whole}
    if cut.pad_rows:
        return None  # vocabulary padding has no scales to pad with
    if cut.pieces:
        cuts = [st.cut(dim, a, b, full[dim]) for a, b in cut.pieces]
        pieces = [p for p in cuts if p is not None]
        if len(pieces) != len(cuts):
            return None
        rows = sum(b - a for a, b in pieces)
        return {"shape": (rows, *whole[1:]), "dim": dim, "pieces": tuple(pieces), "kv_head": cut.kv_head}
    assert cut.start is not None and cut.stop is not None  # a cut along dim has its bounds
    ab = st.cut(dim, cut.start, cut.stop, full[dim])
    if ab is None:
        return None
    at = st.stored_dim(dim)  # the stored tensor's own dimension (MXFP4 stores its experts transposed)
    shape = tuple(ab[1] - ab[0] if i == at else n for i, n in enumerate(whole))
    return {"shape": shape, "dim": at, "start": ab[0], "stop": ab[1], "kv_head": cut.kv_head}


def cut_problem(source_format: SourceQuantization, rows: list[tuple[str, tuple[int, ...], Cut]]) -> str | None:
    """The first (weight, rank cut) whose stored tensors cannot be cut there, as a message."""
    for name, full, cut in rows:
        for st in source_format.stored(name):
            if stored_cut(st, cut, full) is None:
                words = source_format.cut_words(name, full, cut)
                if words is not None:
                    return words
                return _in_words(name, full, cut, st, source_format.label)
    return None


def _in_words(name: str, full: tuple[int, ...], cut: Cut, st: Stored, label: str) -> str:
    """A cut inside a block, said as a person would: which rows or columns a rank would hold and
    how many of the blocks one stored element covers that is (not the internal grid)."""
    assert cut.dim is not None  # a whole tensor is never inside a cell
    g, n = st.grid[cut.dim], full[cut.dim]
    axis = "rows" if cut.dim == 0 else "columns"
    spans = cut.pieces or ((cut.start or 0, cut.stop or 0),)
    a, b = next(((a, b) for a, b in spans if a % g or (b % g and b != n)), spans[0])
    part = " of one fused part" if cut.pieces else ""
    return (f"tensor {name} {list(full)}: a rank would hold {axis} [{a}, {b}){part}, {(b - a) / g:g} of the "
            f"{g}-{axis[:-1]} blocks that each element of {st.tensor(name).rpartition('.')[2]} covers ({label})")


# A source-quantized weight as the TP check needs it: name, shape, split kind, a fused tensor's
# parts and a stacked tensor's TP dimension.
QuantizedRow = tuple[str, tuple[int, ...], Split, tuple[tuple[int, Split], ...], int | None]


def tp_problem(source_format: SourceQuantization, model: ModelSpec, quantized: list[QuantizedRow], tp: int) -> str | None:
    """Whether every rank's cut (the Layout's rule, ``slice_for_rank``) of every source-quantized
    weight falls on its grid at ``tp``. Weights alike in shape and split kind are checked once
    (an MoE model's experts)."""
    seen: set[tuple[object, ...]] = set()
    rows = []
    for name, shape, kind, parts, tp_dim in quantized:
        if (shape, kind, parts, tp_dim) in seen:
            continue
        seen.add((shape, kind, parts, tp_dim))
        rows += [(name, shape, slice_for_rank(kind, shape, r, model, tp, parts, tp_dim)) for r in range(tp)]
    return cut_problem(source_format, rows)


def check_source_cuts(model: ModelSpec, plan: Plan, source_format: SourceQuantization | None) -> set[str]:
    """The source-quantized weights a ``dtype: source`` plan keeps as they are stored, once every
    rank's cut of them (``slice_for_rank``: the Layout's rule) is known to fall on their grids
    (else LayoutError naming the tensor and the tp degrees that work)."""
    if source_format is None or plan.dtype != "source":
        return set()
    kept = source_format.applied(model)
    table = tensor_table(model)
    # expert parallelism keeps routed experts whole (a stacked tensor: whole experts of dim 0),
    # which every format's grid allows; TP cuts the rest, each by its own row
    rows: list[QuantizedRow] = [
        (n, table[n].shape, table[n].split, table[n].parts, table[n].tp_dim) for n in sorted(kept)
        if not (plan.expert_parallel and (table[n].expert is not None or table[n].split == STACKED))]
    problem = tp_problem(source_format, model, rows, plan.tp)
    if problem:
        good = [t for t in valid_tp_degrees(model, expert_parallel=plan.expert_parallel)
                if not tp_problem(source_format, model, rows, t)]
        raise LayoutError(f"{problem} at tp={plan.tp}", key="replica_group.tp_degree",
                          hint=f"tp_degree values that keep every {source_format.label} cell whole: "
                               f"{', '.join(map(str, good)) or 'none'} (or dtype: bf16, which dequantizes)")
    return kept


def source_specs(source_format: SourceQuantization, common: dict[str, Any], cut: Cut,
                 full: tuple[int, ...]) -> list[dict[str, Any]]:
    """TensorSpec fields of a source-quantized weight kept as stored: each stored tensor cut at the
    weight's cut over its grid, a plain slice of a source tensor of its own (X.weight_shape: its
    contents, from the weight's name)."""
    out = []
    for st in source_format.stored(common["name"]):
        fields = stored_cut(st, cut, full)
        assert fields is not None  # check_source_cuts refused such a tp
        name = st.tensor(common["name"])
        out.append({"name": name, "dtype": st.dtypes[0], "source": common["name"] if st.value else name,
                    "split": common["split"], **{k: v for k, v in fields.items() if v is not None}})
    return out
