"""Which tensors a plan quantizes and how they are stored (docs/architecture.md §5). Pure.

Weight-only quantization touches the decoder's linear projections only; a plan's
``quantization.ignore`` entries keep some in 16 bits. int8 is stored compressed-tensors
pack-quantized, four values to an int32 along the input dimension, which constrains TP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import LayoutError, QuantizationError
from .dtypes import PLAN_DTYPE
from .model import ModelSpec
from .plan import Plan
from .tensors import ROW, STACKED, Row, table_rows, tensor_table, valid_tp_degrees

SCALE_SUFFIX = "_scale"  # X.weight -> X.weight_scale
# int8 is stored as compressed-tensors "pack-quantized": X.weight_packed holds the int8 values
# (+128) four to an int32 (little-endian, along the input dimension), X.weight_shape the unpacked
# [out, in] of the tensor in the file. vLLM selects its W8A16 int kernels only for this format.
PACKED_SUFFIX, SHAPE_SUFFIX = "_packed", "_shape"
PACK = {"int8": 4}  # quantized values per stored int32, by scheme (fp8 is stored unpacked)


def _ignore_matches(entry: str, name: str) -> bool:
    """Segment-aligned match: 'layers.1' matches model.layers.1.* but not model.layers.10.*."""
    parts, want = name.split("."), entry.split(".")
    return any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def quantizable(model: ModelSpec) -> set[str]:
    """The decoder's linear projections: the rows its family table marks quantizable."""
    return {r.name for r in table_rows(model) if r.quantizable}


def quantized_names(model: ModelSpec, plan: Plan) -> set[str]:
    """Source weights the plan quantizes; an ignore entry that matches nothing is an error."""
    if not plan.quantized:
        return set()
    table = tensor_table(model)
    _refuse_stacked(model, plan, table)
    return set(_kept_quantizable(model, plan.quant_ignore))


# by model object and ignore list: a search asks the same question for every candidate of a dtype
_QUANTIZED: dict[tuple[int, tuple[str, ...]], tuple[ModelSpec, frozenset[str]]] = {}


def _kept_quantizable(model: ModelSpec, ignore: tuple[str, ...]) -> frozenset[str]:
    """The quantizable rows no ``ignore`` entry matches; an entry that matches nothing is an error."""
    hit = _QUANTIZED.get((id(model), ignore))
    if hit is not None and hit[0] is model:
        return hit[1]
    names, linear = sorted(tensor_table(model)), quantizable(model)
    head = model.forward.names.lm_head.removesuffix(".weight")  # ignored whether tied or not
    for entry in ignore:
        if not any(_ignore_matches(entry, n) for n in names) and entry != head:
            raise QuantizationError(
                f"ignore entry {entry!r} matches no tensor of this model",
                key="quantization.ignore",
                hint="use name parts such as lm_head, embed_tokens, layers.0, layers.79.mlp, q_proj",
            )
    kept = frozenset(n for n in names if n in linear and not any(_ignore_matches(e, n) for e in ignore))
    if len(_QUANTIZED) >= 16:
        _QUANTIZED.pop(next(iter(_QUANTIZED)))
    _QUANTIZED[(id(model), ignore)] = (model, kept)
    return kept


def _refuse_stacked(model: ModelSpec, plan: Plan, table: Mapping[str, Row]) -> None:
    """Experts stacked in one tensor per layer (gpt-oss: [E, in, out]) have no int8/fp8 form the
    clients load (compressed-tensors quantizes Linear modules; transformers and vLLM read such
    experts as bf16 or MXFP4), so an int8/fp8 plan would quantize only the attention and leave
    most of the weights 16-bit: refused, rather than a build that is not what the plan says."""
    layer = [r for n, r in table.items() if n.startswith("model.layers.0.")]
    stacked = sum(math.prod(r.shape) for r in layer if r.split == STACKED)
    if stacked:
        share = stacked / sum(math.prod(r.shape) for r in layer)
        raise QuantizationError(
            f"dtype {plan.dtype} cannot quantize {model.architecture}'s stacked experts ({share:.0%} of a "
            "decoder layer's weights): no int8/fp8 form of them loads in transformers or vLLM",
            key="replica_group.dtype",
            hint="use dtype: bf16 (or fp16), or dtype: source on the MXFP4 checkpoint (experts stay MXFP4)")


def base_dtype(model: ModelSpec, plan: Plan) -> str:
    """The 16-bit dtype for tensors that are not quantized."""
    if plan.dtype == "source":  # the source's own dtype (its quantized weights kept as stored)
        return model.source_dtype if model.source_dtype in ("F16", "BF16") else "BF16"
    if not plan.quantized:
        return PLAN_DTYPE[plan.dtype]
    if plan.base_dtype:
        return PLAN_DTYPE[plan.base_dtype]
    return model.source_dtype if model.source_dtype in ("F16", "BF16") else "BF16"


def check_packing(model: ModelSpec, plan: Plan, quantized: set[str]) -> None:
    """A packed weight holds ``pack`` input columns per stored int32, so every rank's input width
    (the row-parallel slice of o_proj / down_proj) must be a multiple of it: checked before a
    byte is written, naming the tensor and the tp degrees that would work."""
    pack = PACK.get(plan.dtype)
    if not pack:
        return

    table = tensor_table(model)

    def bad(tp: int) -> tuple[str, int] | None:
        for t in sorted(table.values(), key=lambda r: r.name):
            if t.name in quantized:
                width = t.shape[1] // tp if t.split == ROW else t.shape[1]
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
