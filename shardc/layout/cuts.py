"""One split rule applied for one TP rank: which part of a source tensor the rank holds (``Cut``).
Pure. ``slice_for_rank`` is the one interpreter of ``Split`` (docs/architecture.md §4); the Layout
(ranks.py) records its answers as TensorSpecs, and a quantized source's stored tensors are cut at
the same place (quant_formats/slicing.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .families.family import Split

if TYPE_CHECKING:
    from .model import ModelSpec


@dataclass(frozen=True)
class Cut:
    """The rank's part of a source tensor: ``shape`` its local shape; ``dim`` the sliced dimension
    (None: the whole tensor) and ``start``/``stop`` along it, or for a fused tensor the source-row
    ``pieces`` it concatenates; ``pad_rows`` zero rows appended (vocabulary padding); ``kv_head``
    the KV head a rank replicates when tp > kv_heads."""

    shape: tuple[int, ...]
    dim: int | None = None
    start: int | None = None
    stop: int | None = None
    pad_rows: int = 0
    kv_head: int | None = None
    pieces: tuple[tuple[int, int], ...] | None = None

    def spec_fields(self) -> dict[str, Any]:
        """The TensorSpec fields the cut sets (all but the shape, which the caller may change)."""
        return {"dim": self.dim, "start": self.start, "stop": self.stop, "pad_rows": self.pad_rows,
                "kv_head": self.kv_head, "pieces": self.pieces}


def padded_vocab(model: ModelSpec, tp: int) -> int:
    return -(-model.vocab_size // tp) * tp


def slice_for_rank(kind: Split, shape: tuple[int, ...], r: int, model: ModelSpec, tp: int,
                   parts: tuple[tuple[int, Split], ...] = (), tp_dim: int | None = None,
                   experts: tuple[int, ...] = ()) -> Cut:
    """Interpret one split rule for TP rank r: the slice of the source and the local shape.
    ``experts``: under expert parallelism, the ids of the experts this rank holds (contiguous,
    ``Moe.owner``); a STACKED tensor (dim 0: expert id) is cut to their block of dim 0."""
    if kind == Split.STACKED and experts:
        a, b = experts[0], experts[-1] + 1
        return Cut((b - a, *shape[1:]), 0, a, b)
    if kind in (Split.REPLICATED, Split.EXPERT) or tp == 1 and kind != Split.VOCAB:
        return Cut(shape)
    if kind == Split.STACKED:  # without expert parallelism: TP cuts tp_dim, or the tensor is whole
        if tp_dim is None:
            return Cut(shape)
        n = shape[tp_dim] // tp
        local = tuple(n if i == tp_dim else s for i, s in enumerate(shape))
        return Cut(local, tp_dim, r * n, (r + 1) * n)
    if kind == Split.FUSED:  # each part cut by its own kind; the rank's pieces end to end
        pieces: list[tuple[int, int]] = []
        at, kv_head = 0, None
        for rows, part in parts:
            c = slice_for_rank(part, (rows, *shape[1:]), r, model, tp)
            assert c.start is not None and c.stop is not None  # parts are column kinds
            pieces.append((at + c.start, at + c.stop))
            kv_head = c.kv_head if c.kv_head is not None else kv_head
            at += rows
        if at != shape[0]:
            raise AssertionError(f"fused parts cover {at} of {shape[0]} rows")
        return Cut((sum(b - a for a, b in pieces), *shape[1:]), 0, pieces=tuple(pieces), kv_head=kv_head)
    if kind == Split.COLUMN or (kind == Split.KV_COLUMN and model.num_kv_heads >= tp):
        n = shape[0] // tp
        return Cut((n, *shape[1:]), 0, r * n, (r + 1) * n)
    if kind == Split.KV_COLUMN:  # tp > kv_heads: one whole KV head per rank, replicated
        head = r // (tp // model.num_kv_heads)
        hd = model.head_dim
        return Cut((hd, *shape[1:]), 0, head * hd, (head + 1) * hd, kv_head=head)
    if kind == Split.ROW:
        n = shape[1] // tp
        return Cut((shape[0], n), 1, r * n, (r + 1) * n)
    if kind == Split.VOCAB:
        per = padded_vocab(model, tp) // tp
        start = min(r * per, shape[0])
        stop = min((r + 1) * per, shape[0])
        return Cut((per, *shape[1:]), 0, start, stop, pad_rows=per - (stop - start))
    raise AssertionError(kind)
