"""The one dtype table: every name a dtype goes by, in safetensors headers, plans, Hugging Face
configs (``torch_dtype``), torch and numpy.

Pure data (no numpy or torch import), so the planner and the CLI can read it for free; the
numpy/torch crossover lives in ``shardc.compiler.arrays``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # safetensors header name: "BF16"
    itemsize: int  # bytes per element
    torch: str  # torch attribute = HF config torch_dtype = numpy/ml_dtypes type name: "bfloat16"
    plan: str | None = None  # the plan's word for it ("bf16"); None: never a plan's output dtype


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("F32", 4, "float32"),
    DType("F16", 2, "float16", "fp16"),
    DType("BF16", 2, "bfloat16", "bf16"),
    DType("I8", 1, "int8", "int8"),
    DType("F8_E4M3", 1, "float8_e4m3fn", "fp8"),
    DType("I32", 4, "int32"),  # compressed-tensors' packed int8 (four values per element)
    DType("I64", 8, "int64"),  # compressed-tensors' weight_shape
    DType("U8", 1, "uint8"),  # MXFP4's packed E2M1 pairs and E8M0 scales (gpt-oss)
)}
DTYPE_BYTES: dict[str, int] = {n: d.itemsize for n, d in DTYPES.items()}
PLAN_DTYPE: dict[str, str] = {d.plan: n for n, d in DTYPES.items() if d.plan}
SOURCE_DTYPES = ("F16", "BF16", "F32")  # what a source checkpoint may hold
_BY_TORCH = {d.torch: n for n, d in DTYPES.items()}


def from_torch_name(torch_name: str) -> str | None:
    """Safetensors name for a torch / HF ``torch_dtype`` name ("bfloat16" -> "BF16"), else None."""
    return _BY_TORCH.get(torch_name.removeprefix("torch."))


def torch_name(name: str) -> str:
    """torch / HF config name for a safetensors dtype ("BF16" -> "bfloat16")."""
    return DTYPES[name].torch
