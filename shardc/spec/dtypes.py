"""Tensor bytes as numpy arrays: the build's data path needs no torch.

A 16-bit build only maps source tensors, slices them and casts 16-bit floats; numpy does that
with ml_dtypes supplying bfloat16 and float8_e4m3fn, and imports in 0.1 s where torch takes 1-2 s
(on a 10 s build, that is most of the margin). ml_dtypes casts round to nearest even, like torch,
and release the GIL, so the per-rank writer threads run them in parallel. Quantization still runs
in torch; ``to_torch``/``from_torch`` cross over without copying.
"""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np

NP_DTYPES: dict[str, Any] = {
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
# torch knows bf16 and fp8 but not ml_dtypes' versions: cross over through same-width integers
_SAME_WIDTH_INT = {2: np.int16, 1: np.uint8, 4: np.int32, 8: np.int64}
_TORCH_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "I8": "int8",
                "F8_E4M3": "float8_e4m3fn", "I32": "int32", "I64": "int64"}


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a safetensors dtype name (F16, BF16, F32, I8, F8_E4M3)."""
    return NP_DTYPES[name]


def dtype_name(dtype: np.dtype) -> str:
    return next(k for k, v in NP_DTYPES.items() if v == dtype)


def as_bytes(a: np.ndarray) -> np.ndarray:
    """The array's bytes, flat (a view when it is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def to_torch(a: np.ndarray):
    """A torch tensor sharing ``a``'s memory (read-only arrays included: never write to it)."""
    import torch

    dtype = getattr(torch, _TORCH_NAMES[dtype_name(a.dtype)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(a.view(_SAME_WIDTH_INT[a.itemsize])).view(dtype)


def from_torch(t) -> np.ndarray:
    """A numpy array sharing the CPU tensor's memory."""
    import torch

    name = next(k for k, v in _TORCH_NAMES.items() if getattr(torch, v) == t.dtype)
    width = {2: torch.int16, 1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).numpy().view(NP_DTYPES[name])
