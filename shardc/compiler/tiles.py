"""A tensor held as pieces side by side: a reshard's input ranks, read where they are mapped.

Resharding tp8 to tp4 would otherwise put every tensor together whole (a copy of every input
byte) only for the writers to cut it apart again. With :class:`Tiles` a writer fills each chunk
of its slice straight from the input pieces the chunk spans: one copy, the one into the output
file's buffer, as ``build`` makes from a checkpoint. Anything that needs the whole tensor (the
quantizer, ``verify --deep``) gets it from ``np.asarray``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tiles:
    """``parts`` are (start, stop, array) along ``dim``, sorted, covering ``[0, shape[dim])``
    exactly; each array has the full extent in every other dimension."""

    shape: tuple[int, ...]
    dtype: np.dtype
    dim: int
    parts: tuple[tuple[int, int, np.ndarray], ...]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.fill(out, (0,) * len(self.shape))
        return out if dtype is None else out.astype(dtype)

    def fill(self, dst: np.ndarray, origin: tuple[int, ...], cast=np.copyto) -> None:
        """``dst[...] = self[origin : origin + dst.shape]``, piece by piece (``cast(to, from)``
        does each copy, so a writer casts to the output dtype on the way)."""
        d = self.dim
        lo, hi = origin[d], origin[d] + dst.shape[d]
        rest = tuple(slice(o, o + n) for o, n in zip(origin, dst.shape, strict=True))
        for start, stop, a in self.parts:
            x, y = max(start, lo), min(stop, hi)
            if x >= y:
                continue
            to = [slice(None)] * dst.ndim
            to[d] = slice(x - lo, y - lo)
            frm = list(rest)
            frm[d] = slice(x - start, y - start)
            cast(dst[tuple(to)], a[tuple(frm)])
