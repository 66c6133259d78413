"""Tensor bytes as numpy arrays: the build's data path needs no torch.

A build only maps source tensors, slices them and casts them; numpy does that with ml_dtypes
supplying bfloat16 and float8_e4m3fn, and imports in a fraction of torch's import time, which
would be a large part of a build's budget (docs/performance.md §2). ml_dtypes casts round to
nearest even, like torch, and release the GIL, so the per-rank writer threads run them in
parallel. Quantization is numba (compiler/kernels.py); the runtime and verify's device checks use
torch, and ``to_torch``/``from_torch`` cross over without copying.
"""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np

from ..layout.dtypes import DTYPES

NP_DTYPES: dict[str, Any] = {
    n: np.dtype(getattr(np, d.torch, None) or getattr(ml_dtypes, d.torch)) for n, d in DTYPES.items()
}
# torch knows bf16 and fp8 but not ml_dtypes' versions: cross over through same-width integers
_SAME_WIDTH_INT = {2: np.int16, 1: np.uint8, 4: np.int32, 8: np.int64}


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

    dtype = getattr(torch, DTYPES[dtype_name(a.dtype)].torch)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(a.view(_SAME_WIDTH_INT[a.itemsize])).view(dtype)


def from_torch(t) -> np.ndarray:
    """A numpy array sharing the CPU tensor's memory."""
    import torch

    name = next(k for k, v in DTYPES.items() if getattr(torch, v.torch) == t.dtype)
    width = getattr(torch, np.dtype(_SAME_WIDTH_INT[t.element_size()]).name)
    return t.view(width).numpy().view(NP_DTYPES[name])
