"""The Layout: which slice of which source tensor goes to which rank. Pure: no I/O, no torch.

Split rules are data (``SPLIT_RULES``), interpreted by one function (``_slice_for_rank``). build,
verify, the runtime and the planner all ask the Layout; none of them re-derives a rule
(docs/architecture.md §4).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import LayoutError, QuantizationError
from .dtypes import DTYPE_BYTES, PLAN_DTYPE
from .model import ModelSpec
from .plan import Plan

# HF name pattern -> split kind. First match wins.
#   column:    dim 0 split evenly (output rows); biases the same way
#   kv_column: like column, but when tp > kv_heads each rank holds one whole (replicated) KV head
#   row:       dim 1 split evenly (input columns)
#   vocab:     dim 0 split by vocabulary rows, padded with zero rows to a multiple of tp
#   replicated: whole tensor on every TP rank of the owning stage
SPLIT_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "vocab"),
    (r"lm_head\.weight", "vocab"),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)", "kv_column"),
    (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.(self_attn\.o|mlp\.down)_proj\.weight", "row"),
    (r"model\.layers\.\d+\.(self_attn\.o|mlp\.down)_proj\.bias", "replicated"),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", "replicated"),
    (r"model\.norm\.weight", "replicated"),
)
_COMPILED = tuple((re.compile(p), kind) for p, kind in SPLIT_RULES)
# Weight-only quantization applies to the linear projections of the decoder layers only.
QUANTIZABLE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")
SCALE_SUFFIX = "_scale"  # X.weight -> X.weight_scale
# int8 is stored as compressed-tensors "pack-quantized": X.weight_packed holds the int8 values
# (+128) four to an int32 (little-endian, along the input dimension), X.weight_shape the unpacked
# [out, in] of the tensor in the file. vLLM selects its W8A16 int kernels only for this format.
PACKED_SUFFIX, SHAPE_SUFFIX = "_packed", "_shape"
PACK = {"int8": 4}  # quantized values per stored int32, by scheme (fp8 is stored unpacked)

MAX_TP_HINT = 64


def split_kind(name: str) -> str:
    """The split rule for an HF tensor name (LayoutError for names outside the Llama family)."""
    for pattern, kind in _COMPILED:
        if pattern.fullmatch(name):
            return kind
    raise LayoutError(f"no split rule for tensor {name!r}", hint="only Llama-family names are known")


def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in one rank's shard file, and where its bytes come from."""

    name: str
    dtype: str  # safetensors dtype: F16, BF16, F32, I8, F8_E4M3
    shape: tuple[int, ...]
    source: str  # source tensor name in the checkpoint
    split: str  # column | kv_column | row | vocab | replicated
    dim: int | None = None  # sliced dimension of the source (None: whole tensor)
    start: int | None = None
    stop: int | None = None
    pad_rows: int = 0  # zero rows appended after the slice (vocab padding)
    kv_head: int | None = None  # the replicated KV head this rank holds (tp > kv_heads)
    scale_of: str | None = None  # for X.weight_scale: the quantized weight it belongs to
    quant: str | None = None  # int8 | fp8 for a quantized weight and its companions
    pack: int | None = None  # values per stored element (start/stop count source columns)
    value: tuple[int, ...] | None = None  # contents fixed by the Layout (X.weight_shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def record(self) -> dict[str, Any]:
        """Manifest form: only the fields that say something."""
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "name"}
        out["shape"] = list(self.shape)
        if self.value is not None:
            out["value"] = list(self.value)
        if not self.pad_rows:
            out.pop("pad_rows")
        return out


@dataclass(frozen=True)
class RankLayout:
    tp_rank: int
    pp_stage: int
    rank: int  # global rank = pp_stage * tp + tp_rank (TP groups contiguous)
    layers: tuple[int, int]  # [start, stop) of global layer indices
    file: str
    tensors: tuple[TensorSpec, ...]  # sorted by name: the order in the file

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True)
class SourceTensor:
    """A tensor the checkpoint must contain, with the shape the config implies."""

    name: str
    shape: tuple[int, ...]


def source_tensors(model: ModelSpec) -> list[SourceTensor]:
    """Every tensor a checkpoint of this model must hold, in HF naming, with its shape."""
    h, hd = model.hidden_size, model.head_dim
    q_out, kv_out, inter = model.num_heads * hd, model.num_kv_heads * hd, model.intermediate_size
    out = [SourceTensor("model.embed_tokens.weight", (model.vocab_size, h))]
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        out += [
            SourceTensor(p + "input_layernorm.weight", (h,)),
            SourceTensor(p + "post_attention_layernorm.weight", (h,)),
            SourceTensor(p + "self_attn.q_proj.weight", (q_out, h)),
            SourceTensor(p + "self_attn.k_proj.weight", (kv_out, h)),
            SourceTensor(p + "self_attn.v_proj.weight", (kv_out, h)),
            SourceTensor(p + "self_attn.o_proj.weight", (h, q_out)),
            SourceTensor(p + "mlp.gate_proj.weight", (inter, h)),
            SourceTensor(p + "mlp.up_proj.weight", (inter, h)),
            SourceTensor(p + "mlp.down_proj.weight", (h, inter)),
        ]
        if model.qkv_bias:
            out += [
                SourceTensor(p + "self_attn.q_proj.bias", (q_out,)),
                SourceTensor(p + "self_attn.k_proj.bias", (kv_out,)),
                SourceTensor(p + "self_attn.v_proj.bias", (kv_out,)),
            ]
        if model.o_bias:
            out.append(SourceTensor(p + "self_attn.o_proj.bias", (h,)))
        if model.mlp_bias:
            out += [
                SourceTensor(p + "mlp.gate_proj.bias", (inter,)),
                SourceTensor(p + "mlp.up_proj.bias", (inter,)),
                SourceTensor(p + "mlp.down_proj.bias", (h,)),
            ]
    out.append(SourceTensor("model.norm.weight", (h,)))
    if not model.tie_word_embeddings:
        out.append(SourceTensor("lm_head.weight", (model.vocab_size, h)))
    return sorted(out, key=lambda t: t.name)


def valid_tp_degrees(model: ModelSpec, limit: int = MAX_TP_HINT) -> list[int]:
    return [t for t in range(1, limit + 1) if not _tp_problems(model, t)]


def _tp_problems(model: ModelSpec, tp: int) -> list[str]:
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
    return problems


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
    problems = _tp_problems(model, plan.tp)
    if problems:
        good = valid_tp_degrees(model)
        raise LayoutError(
            problems[0],
            key="replica_group.tp_degree",
            hint=f"tp_degree values that work for this model: {', '.join(map(str, good))}",
        )
    stage_ranges(model, plan)


def padded_vocab(model: ModelSpec, tp: int) -> int:
    return -(-model.vocab_size // tp) * tp


def _slice_for_rank(kind: str, shape: tuple[int, ...], r: int, model: ModelSpec, tp: int) -> dict:
    """Interpret one split rule for TP rank r: the slice of the source and the local shape."""
    if kind == "replicated" or tp == 1 and kind != "vocab":
        return {"dim": None, "start": None, "stop": None, "shape": shape}
    if kind == "column" or (kind == "kv_column" and model.num_kv_heads >= tp):
        n = shape[0] // tp
        return {"dim": 0, "start": r * n, "stop": (r + 1) * n, "shape": (n, *shape[1:])}
    if kind == "kv_column":  # tp > kv_heads: one whole KV head per rank, replicated
        head = r // (tp // model.num_kv_heads)
        hd = model.head_dim
        return {
            "dim": 0,
            "start": head * hd,
            "stop": (head + 1) * hd,
            "shape": (hd, *shape[1:]),
            "kv_head": head,
        }
    if kind == "row":
        n = shape[1] // tp
        return {"dim": 1, "start": r * n, "stop": (r + 1) * n, "shape": (shape[0], n)}
    if kind == "vocab":
        per = padded_vocab(model, tp) // tp
        start = min(r * per, shape[0])
        stop = min((r + 1) * per, shape[0])
        return {
            "dim": 0,
            "start": start,
            "stop": stop,
            "shape": (per, *shape[1:]),
            "pad_rows": per - (stop - start),
        }
    raise AssertionError(kind)


def _ignore_matches(entry: str, name: str) -> bool:
    """Segment-aligned match: 'layers.1' matches model.layers.1.* but not model.layers.10.*."""
    parts, want = name.split("."), entry.split(".")
    return any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def quantized_names(model: ModelSpec, plan: Plan) -> set[str]:
    """Source weights the plan quantizes; an ignore entry that matches nothing is an error."""
    if not plan.quantized:
        return set()
    names = [t.name for t in source_tensors(model)]
    for entry in plan.quant_ignore:
        if not any(_ignore_matches(entry, n) for n in names) and entry not in ("lm_head",):
            raise QuantizationError(
                f"ignore entry {entry!r} matches no tensor of this model",
                key="quantization.ignore",
                hint="use name parts such as lm_head, embed_tokens, layers.0, layers.79.mlp, q_proj",
            )
    return {
        n
        for n in names
        if QUANTIZABLE.fullmatch(n) and not any(_ignore_matches(e, n) for e in plan.quant_ignore)
    }


def base_dtype(model: ModelSpec, plan: Plan) -> str:
    """The 16-bit dtype for tensors that are not quantized."""
    if not plan.quantized:
        return PLAN_DTYPE[plan.dtype]
    if plan.base_dtype:
        return PLAN_DTYPE[plan.base_dtype]
    return model.source_dtype if model.source_dtype in ("F16", "BF16") else "BF16"


@dataclass(frozen=True)
class Layout:
    model: ModelSpec
    plan: Plan
    stages: tuple[tuple[int, int], ...]
    ranks: tuple[RankLayout, ...]  # indexed by global rank
    padded_vocab: int

    def rank(self, tp_rank: int, pp_stage: int) -> RankLayout:
        if not (0 <= tp_rank < self.plan.tp and 0 <= pp_stage < self.plan.pp):
            raise LayoutError(
                f"rank tp={tp_rank} pp={pp_stage} is outside tp_degree={self.plan.tp} "
                f"pp_degree={self.plan.pp}", key="tp_rank",
                hint=f"tp ranks 0..{self.plan.tp - 1}, pp stages 0..{self.plan.pp - 1}",
            )
        return self.ranks[pp_stage * self.plan.tp + tp_rank]

    def select(self, ranks: Iterable[int] = (), pairs: Iterable[tuple[int, int]] = ()) -> list[RankLayout]:
        """The ranks named by global rank or by (tp_rank, pp_stage), each once, in rank order;
        every rank when neither names any. LayoutError (key ``rank``, or ``tp_rank`` for a pair)
        says which is not in this plan."""
        ranks, pairs = list(ranks), list(pairs)
        if not ranks and not pairs:
            return list(self.ranks)
        world = self.plan.world_size
        chosen = {}
        for r in ranks:
            if not 0 <= r < world:
                raise LayoutError(f"{r} is outside 0..{world - 1} for this plan", key="rank",
                                  hint=f"this plan has {world} ranks")
            chosen[r] = self.ranks[r]
        for t, p in pairs:
            rl = self.rank(t, p)
            chosen[rl.rank] = rl
        return [chosen[r] for r in sorted(chosen)]


def build_layout(model: ModelSpec, plan: Plan) -> Layout:
    """Check every precondition, then list every rank's tensors."""
    check_degrees(model, plan)
    if "quantization_config" in model.config:
        # the build's config.json is the source's plus (int8/fp8) its own compressed-tensors
        # block: a block already there would describe weights the shards do not hold
        block = model.config["quantization_config"]
        method = block.get("quant_method", "?") if isinstance(block, dict) else "?"
        raise QuantizationError(
            f"the source config.json already has a quantization_config (quant_method {method!r})",
            key="quantization_config",
            hint="start from the unquantized checkpoint; shardc writes its own quantization_config",
        )
    stages = stage_ranges(model, plan)
    quantized = quantized_names(model, plan)
    check_packing(model, plan, quantized)
    base = base_dtype(model, plan)
    qdtype = PLAN_DTYPE[plan.dtype]
    last = plan.pp - 1

    def stage_of(name: str) -> list[int]:
        layer = layer_of(name)
        if layer is not None:
            return [next(s for s, (a, b) in enumerate(stages) if a <= layer < b)]
        if name == "model.embed_tokens.weight":
            return [0]
        return [last]  # model.norm.weight, lm_head.weight

    # (shard tensor name, source name, shape) for every tensor the shards hold.
    entries = [(t.name, t.name, t.shape) for t in source_tensors(model)]
    if model.tie_word_embeddings and plan.pp > 1:
        entries.append(("lm_head.weight", "model.embed_tokens.weight", (model.vocab_size, model.hidden_size)))

    per_rank: dict[tuple[int, int], list[TensorSpec]] = {
        (s, r): [] for s in range(plan.pp) for r in range(plan.tp)
    }
    for name, source, shape in entries:
        kind = split_kind(name)
        for s in stage_of(name):
            for r in range(plan.tp):
                cut = _slice_for_rank(kind, shape, r, model, plan.tp)
                local = cut.pop("shape")
                common = dict(name=name, source=source, split=kind, **cut)
                if source in quantized and name == source:
                    per_rank[s, r] += _weight_specs(common, qdtype, local, plan.dtype)
                    per_rank[s, r].append(_scale_spec(name, kind, local, shape, cut, plan.dtype))
                else:
                    per_rank[s, r].append(TensorSpec(dtype=base, shape=local, **common))
    ranks = []
    for s in range(plan.pp):
        for r in range(plan.tp):
            ranks.append(
                RankLayout(
                    tp_rank=r,
                    pp_stage=s,
                    rank=s * plan.tp + r,
                    layers=stages[s],
                    file=plan.shard_name(r, s),
                    tensors=tuple(sorted(per_rank[s, r], key=lambda t: t.name)),
                )
            )
    return Layout(model, plan, tuple(stages), tuple(ranks), padded_vocab(model, plan.tp))


def _weight_specs(common: dict, qdtype: str, local: tuple[int, ...], quant: str) -> list[TensorSpec]:
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


def check_packing(model: ModelSpec, plan: Plan, quantized: set[str]) -> None:
    """A packed weight holds ``pack`` input columns per stored int32, so every rank's input width
    (the row-parallel slice of o_proj / down_proj) must be a multiple of it: checked before a
    byte is written, naming the tensor and the tp degrees that would work."""
    pack = PACK.get(plan.dtype)
    if not pack:
        return

    def bad(tp: int) -> tuple[str, int] | None:
        for t in source_tensors(model):
            if t.name in quantized:
                width = t.shape[1] // tp if split_kind(t.name) == "row" else t.shape[1]
                if width % pack:
                    return t.name, width
        return None

    problem = bad(plan.tp)
    if problem:
        good = [t for t in valid_tp_degrees(model) if not bad(t)]
        name, width = problem
        raise LayoutError(
            f"tensor {name} gets {width} input columns per rank at tp={plan.tp}; {plan.dtype} is "
            f"stored pack-quantized ({pack} values per int32), which needs a multiple of {pack}",
            key="replica_group.tp_degree",
            hint=f"tp_degree values that work for this model with {plan.dtype}: "
                 f"{', '.join(map(str, good)) or 'none'}",
        )


def _scale_spec(name, kind, local, full, cut, quant) -> TensorSpec:
    """Per-output-channel scale [out, 1]: sliced with the rows (column), whole for row-parallel."""
    if cut.get("dim") == 0:
        return TensorSpec(
            name=name + SCALE_SUFFIX,
            dtype="F32",
            shape=(local[0], 1),
            source=name,
            split=kind,
            dim=0,
            start=cut["start"],
            stop=cut["stop"],
            kv_head=cut.get("kv_head"),
            scale_of=name,
            quant=quant,
        )
    return TensorSpec(
        name=name + SCALE_SUFFIX,
        dtype="F32",
        shape=(full[0], 1),
        source=name,
        split="replicated",
        scale_of=name,
        quant=quant,
    )
