"""The Layout: which slice of which source tensor goes to which rank. Pure: no I/O, no torch.

Split rules are data (each family's tensor table, layout/families/), interpreted by one function
(cuts.py ``slice_for_rank``); which tensors are quantized and how they are stored is quantization.py's.
build, verify, the runtime and the planner all ask the Layout; none of them re-derives a rule
(docs/architecture.md §4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import LayoutError
from .cuts import Cut, padded_vocab, slice_for_rank
from .dtypes import DTYPE_BYTES, PLAN_DTYPE
from .model import ModelSpec
from .plan import Plan
from .quant_formats import detect_source
from .quant_formats.slicing import check_source_cuts, source_specs

# The rules the Layout applies, each in its own module; re-exported here because every reader
# asks the Layout first.
from .quantization import (  # noqa: F401
    PACK,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    SHAPE_SUFFIX,
    base_dtype,
    check_packing,
    quantizable,
    quantized_names,
)
from .tensors import (  # noqa: F401
    MAX_TP_HINT,
    Row,
    SourceTensor,
    Split,
    _tp_problems,
    layer_of,
    source_tensors,
    split_kind,
    tensor_table,
    valid_tp_degrees,
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in one rank's shard file, and where its bytes come from."""

    name: str
    dtype: str  # safetensors dtype: F16, BF16, F32, I8, F8_E4M3
    shape: tuple[int, ...]
    source: str  # source tensor name in the checkpoint
    split: Split
    dim: int | None = None  # sliced dimension of the source (None: whole tensor)
    start: int | None = None
    stop: int | None = None
    pad_rows: int = 0  # zero rows appended after the slice (vocab padding)
    kv_head: int | None = None  # the replicated KV head this rank holds (tp > kv_heads)
    scale_of: str | None = None  # for X.weight_scale: the quantized weight it belongs to
    quant: str | None = None  # int8 | fp8 for a quantized weight and its companions
    pack: int | None = None  # values per stored element (start/stop count source columns)
    value: tuple[int, ...] | None = None  # contents fixed by the Layout (X.weight_shape)
    # fused (dim 0, no start/stop): the source-row ranges [start, stop) this rank holds, one per
    # part of the fused tensor (q, k, v; gate, up), concatenated in this order along dim 0
    pieces: tuple[tuple[int, int], ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def record(self) -> dict[str, Any]:
        """Manifest form: only the fields that say something."""
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "name"}
        out["shape"] = list(self.shape)
        if self.value is not None:
            out["value"] = list(self.value)
        if self.pieces is not None:
            out["pieces"] = [list(p) for p in self.pieces]
        if not self.pad_rows:
            out.pop("pad_rows")
        return out


    def split_pieces(self) -> tuple[TensorSpec, ...]:
        """The rank tensor as plain dim-0 slices of its source, in the order it stores them: a
        fused tensor's pieces (each a spec of its own rows), any other tensor itself."""
        if not self.pieces:
            return (self,)
        return tuple(replace(self, start=a, stop=b, pieces=None, shape=(b - a, *self.shape[1:]))
                     for a, b in self.pieces)


@dataclass(frozen=True)
class RankLayout:
    tp_rank: int
    pp_stage: int
    rank: int  # global rank = pp_stage * tp + tp_rank (TP groups contiguous)
    layers: tuple[int, int]  # [start, stop) of global layer indices
    file: str
    tensors: tuple[TensorSpec, ...]  # sorted by name: the order in the file
    experts: tuple[int, ...] = ()  # routed expert ids held whole (plan expert_parallel), sorted
    dp_rank: int = 0  # attention data-parallel group (dp_degree > 1): rank = (pp·dp + dp_rank)·tp + tp

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def stage_ranges(model: ModelSpec, plan: Plan) -> list[tuple[int, int]]:
    """[start, stop) layers per stage: plan.pp_layers, or even with the remainder to the first stages."""
    n, pp = model.num_layers, plan.pp
    if pp > n:
        raise LayoutError(
            f"pp_degree={pp} exceeds num_hidden_layers={n}",
            key="replica_group.pp_degree",
            hint=f"use pp_degree <= {n}",
        )
    if plan.pp_layers:
        if sum(plan.pp_layers) != n:
            raise LayoutError(
                f"{list(plan.pp_layers)} sums to {sum(plan.pp_layers)} but the model has {n} layers",
                key="model.pp_layers",
                hint="layer counts must cover every layer exactly once",
            )
        counts = list(plan.pp_layers)
    else:
        base, extra = divmod(n, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def check_degrees(model: ModelSpec, plan: Plan) -> None:
    """Every precondition of the split rules, before a byte is written."""
    moe = model.forward.moe
    if plan.expert_parallel and moe is None:
        raise LayoutError(f"{model.architecture} has no routed experts to place",
                          key="replica_group.expert_parallel",
                          hint="drop expert_parallel (it applies to mixture-of-experts models)")
    if moe is not None and plan.expert_parallel and plan.dp > 1 and moe.experts < plan.tp * plan.dp:
        raise LayoutError(f"{moe.experts} experts over tp_degree * dp_degree = {plan.tp * plan.dp} ranks "
                          "leave ranks without one", key="replica_group.dp_degree",
                          hint=f"use tp_degree * dp_degree <= {moe.experts}")
    problems = _tp_problems(model, plan.tp, plan.expert_parallel)
    if problems:
        good = valid_tp_degrees(model, expert_parallel=plan.expert_parallel)
        raise LayoutError(
            problems[0],
            key="replica_group.tp_degree",
            hint=f"tp_degree values that work for this model: {', '.join(map(str, good))}",
        )
    stage_ranges(model, plan)


@dataclass(frozen=True)
class Layout:
    model: ModelSpec
    plan: Plan
    stages: tuple[tuple[int, int], ...]
    ranks: tuple[RankLayout, ...]  # indexed by global rank
    padded_vocab: int

    def rank(self, tp_rank: int, pp_stage: int, dp_rank: int = 0) -> RankLayout:
        p = self.plan
        if not (0 <= tp_rank < p.tp and 0 <= pp_stage < p.pp and 0 <= dp_rank < p.dp):
            dp = f" dp={dp_rank}" if dp_rank or p.dp > 1 else ""
            dps = f" dp_degree={p.dp}" if p.dp > 1 else ""
            raise LayoutError(
                f"rank tp={tp_rank} pp={pp_stage}{dp} is outside tp_degree={p.tp} "
                f"pp_degree={p.pp}{dps}", key="tp_rank",
                hint=f"tp ranks 0..{p.tp - 1}, pp stages 0..{p.pp - 1}"
                     + (f", dp ranks 0..{p.dp - 1}" if p.dp > 1 else ""),
            )
        return self.ranks[(pp_stage * p.dp + dp_rank) * p.tp + tp_rank]

    def stage(self, pp_stage: int) -> list[RankLayout]:
        """The ranks of one pipeline stage (every DP group's TP ranks), in rank order."""
        n = self.plan.tp * self.plan.dp
        return list(self.ranks[pp_stage * n : (pp_stage + 1) * n])

    def select(self, ranks: Iterable[int] = (), pairs: Iterable[tuple[int, int]] = ()) -> list[RankLayout]:
        """The ranks named by global rank or by (tp_rank, pp_stage), each once, in rank order;
        every rank when neither names any. LayoutError (key ``rank``, or ``tp_rank`` for a pair)
        says which is not in this plan."""
        ranks, pairs = list(ranks), list(pairs)
        if not ranks and not pairs:
            return list(self.ranks)
        world = self.plan.world_size
        if pairs and self.plan.dp > 1:  # a pair names one rank in each DP group
            t, p = pairs[0]
            raise LayoutError(f"tp_rank={t} pp_stage={p} names {self.plan.dp} ranks of this plan "
                              f"(dp_degree={self.plan.dp})", key="rank",
                              hint=f"give `rank` one of 0..{world - 1}")
        chosen = {}
        for r in ranks:
            if not 0 <= r < world:
                raise LayoutError(f"{r} is outside 0..{world - 1} for this plan", key="rank",
                                  hint=f"this plan has {world} ranks")
            chosen[r] = self.ranks[r]
        for t, p in pairs:
            rank_layout = self.rank(t, p)
            chosen[rank_layout.rank] = rank_layout
        return [chosen[r] for r in sorted(chosen)]


def build_layout(model: ModelSpec, plan: Plan) -> Layout:
    """Check every precondition, then list every rank's tensors."""
    check_degrees(model, plan)
    source_format = detect_source(model.config)  # a quantization_config no format reads: refused here
    kept_stored = check_source_cuts(model, plan, source_format)
    stages = stage_ranges(model, plan)
    quantized = quantized_names(model, plan)
    check_packing(model, plan, quantized)
    base = base_dtype(model, plan)
    qdtype = PLAN_DTYPE.get(plan.dtype, "")
    last = plan.pp - 1

    names = model.forward.names

    def stage_of(name: str) -> list[int]:
        layer = layer_of(name)
        if layer is not None:
            return [next(s for s, (a, b) in enumerate(stages) if a <= layer < b)]
        return [0] if name == names.embed else [last]  # the final norm and lm_head: the last stage

    # (shard tensor name, source name, shape, split, its row, owning EP rank or None: all) for
    # every tensor the shards hold. With expert parallelism a routed expert's tensors go whole to
    # the one rank that holds the expert (Moe.owner over the stage's dp x tp ranks, EP rank
    # dp_rank·tp + tp_rank), and nowhere else; stacked experts give each EP rank the block of
    # dim 0 it holds (``slice_for_rank``'s ``experts``); every other tensor is cut by TP rank, the same in every DP group.
    moe = model.forward.moe
    by_expert = plan.expert_parallel and moe is not None
    ep_ranks = plan.tp * plan.dp
    held = {e: tuple(x for x in range(moe.experts) if moe.owner(x, ep_ranks) == e) if by_expert and moe else ()
            for e in range(ep_ranks)}
    Entry = tuple[str, str, tuple[int, ...], Split, Row | None, int | None]
    entries: list[Entry] = [
        (r.name, r.name, r.shape, Split.EXPERT if by_expert and r.expert is not None else r.split, r,
         moe.owner(r.expert, ep_ranks) if by_expert and moe is not None and r.expert is not None else None)
        for r in sorted(tensor_table(model).values(), key=lambda r: r.name)]
    if model.tie_word_embeddings and plan.pp > 1:
        entries.append((names.lm_head, names.embed,
                        (model.vocab_size, model.hidden_size), Split.VOCAB, None, None))

    kept = {r.name: r.dtype for r in tensor_table(model).values() if r.dtype}  # Row.dtype: fixed
    per_rank: dict[tuple[int, int], list[TensorSpec]] = {
        (s, e): [] for s in range(plan.pp) for e in range(ep_ranks)
    }
    for name, source, shape, kind, row, owner in entries:
        for s in stage_of(name):
            for e in range(ep_ranks) if owner is None else (owner,):
                cut = slice_for_rank(kind, shape, e % plan.tp, model, plan.tp, row.parts if row else (),
                                     row.tp_dim if row else None, held[e])
                local = cut.shape
                common = dict(name=name, source=source, split=kind, **cut.spec_fields())
                if source in kept_stored and name == source and source_format is not None:
                    per_rank[s, e] += [TensorSpec(**f) for f in source_specs(source_format, common, cut, shape)]
                elif source in quantized and name == source:
                    per_rank[s, e] += _weight_specs(common, qdtype, local, plan.dtype)
                    per_rank[s, e].append(_scale_spec(name, kind, local, shape, cut, plan.dtype))
                else:
                    per_rank[s, e].append(TensorSpec(dtype=kept.get(name, base), shape=local, **common))
    ranks = []
    for s in range(plan.pp):
        for e in range(ep_ranks):
            d, r = divmod(e, plan.tp)
            ranks.append(
                RankLayout(
                    tp_rank=r,
                    pp_stage=s,
                    rank=s * ep_ranks + e,
                    layers=stages[s],
                    file=plan.shard_name(r, s, d),
                    tensors=tuple(sorted(per_rank[s, e], key=lambda t: t.name)),
                    experts=held[e],
                    dp_rank=d,
                )
            )
    return Layout(model, plan, tuple(stages), tuple(ranks), padded_vocab(model, plan.tp))


def _weight_specs(common: dict[str, Any], qdtype: str, local: tuple[int, ...], quant: str) -> list[TensorSpec]:
    """A quantized weight as stored: X.weight (fp8), or X.weight_packed + X.weight_shape (int8)."""
    pack = PACK.get(quant)
    if pack is None:
        return [TensorSpec(dtype=qdtype, shape=local, quant=quant, **common)]
    common = dict(common)
    name = common.pop("name")
    packed = TensorSpec(name=name + PACKED_SUFFIX, dtype="I32", shape=(local[0], local[1] // pack),
                        quant=quant, pack=pack, **common)
    shape = TensorSpec(name=name + SHAPE_SUFFIX, dtype="I64", shape=(2,), source=common["source"],
                       split=common["split"], quant=quant, value=local)
    return [packed, shape]


def _scale_spec(name: str, kind: Split, local: tuple[int, ...], full: tuple[int, ...], cut: Cut,
                quant: str) -> TensorSpec:
    """Per-output-channel scale [out, 1]: sliced with the rows (column; fused: the same pieces),
    whole for row-parallel."""
    if cut.dim == 0:
        return TensorSpec(
            name=name + SCALE_SUFFIX,
            dtype="F32",
            shape=(local[0], 1),
            source=name,
            split=kind,
            dim=0,
            start=cut.start,
            stop=cut.stop,
            kv_head=cut.kv_head,
            pieces=cut.pieces,
            scale_of=name,
            quant=quant,
        )
    return TensorSpec(
        name=name + SCALE_SUFFIX,
        dtype="F32",
        shape=(full[0], 1),
        source=name,
        split=Split.EXPERT if kind == Split.EXPERT else Split.REPLICATED,
        scale_of=name,
        quant=quant,
    )
