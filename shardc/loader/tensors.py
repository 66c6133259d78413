"""A shard read into memory and what is made of it: ``RawShard`` (its parsed header and its data
section as one uint8 tensor on the device the chunks landed on, loader/sinks.py), ``tensors_of``
(a view per header entry, every entry checked against the data first) and ``nonfinite`` (the float
tensors holding NaN or Inf, for ``verify --device``). Importing it does not import torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import VerifyMismatch
from ..layout.dtypes import DTYPES

FINITE_CHUNK = 1 << 22  # elements per finite-check step of fp8 tensors (bounds the temporaries)
# (header with its "__metadata__", or None; why it does not parse, or None; data section bytes)
HeaderCheck = Callable[[dict[str, Any] | None, str | None, int], None]


@dataclass
class RawShard:
    """What a shard's read yields: a digest (empty for a chunked read: its chunks were checked), its
    parsed header (None when it does not parse) and its data section as one uint8 tensor on the
    target device."""

    sha256: str
    header: dict[str, Any] | None
    data: Any  # torch.Tensor (uint8)
    header_error: str | None = None
    nonfinite: list[str] = field(default_factory=list)  # with finite=True: tensors with NaN / Inf


def tensors_of(raw: RawShard) -> dict[str, Any]:
    """Views of the data buffer, one per header entry (a misaligned tensor is copied instead)."""
    import torch

    assert raw.header is not None
    out = {}
    length = raw.data.numel()
    for name, info in raw.header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, DTYPES[info["dtype"]].torch)
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise VerifyMismatch(f"tensor {name}: malformed header entry {str(info)[:200]}",
                                 hint="rebuild the shard") from None
        item = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= start <= end <= length or end - start != numel * item:
            raise VerifyMismatch(f"tensor {name}: data_offsets {info['data_offsets']} do not fit "
                                 f"{info['dtype']}{shape} in the file", hint="rebuild the shard")
        part = raw.data[start:end]
        if start % item:
            part = part.clone()
        out[name] = part.view(dtype).reshape(shape)
    return out


def nonfinite(tensors: dict[str, Any], dtypes: dict[str, str | None]) -> list[str]:
    """Names of the float tensors holding NaN or Inf, without fp32 copies: a 16/32-bit float tensor's
    min and max (one reduction pass, no temporaries; NaN propagates into both) are finite exactly when
    all of it is; fp8 has no min/max kernel and is tested by its bits (e4m3fn's only non-finite
    values are the NaNs S.1111.111), in bounded chunks. Flags stay on the device until one final
    transfer (on CUDA: one host sync for the whole shard)."""
    import torch

    names, flags = [], []
    for name, t in tensors.items():
        dtype = dtypes.get(name, "")
        if t.numel() == 0 or dtype not in ("BF16", "F16", "F32", "F8_E4M3"):
            continue
        flat = t.reshape(-1)
        if dtype == "F8_E4M3":
            bits = flat.view(torch.uint8)
            parts = [(c & 0x7F).amax() == 0x7F for c in bits.split(FINITE_CHUNK)]
            bad = torch.stack(parts).any()
        else:
            lo, hi = torch.aminmax(flat)
            bad = ~torch.isfinite(torch.stack((lo, hi))).all()
        names.append(name)
        flags.append(bad)
    if not flags:
        return []
    hit = torch.stack(flags).cpu().tolist()
    return [n for n, bad in zip(names, hit, strict=True) if bad]
