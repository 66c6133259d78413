"""Block-scaled FP8 (``quant_method: fp8``): DeepSeek-V3/R1, Kimi-K2, Qwen3 "-FP8".

``X.weight`` is F8_E4M3 [out, in]; ``X.weight_scale_inv`` holds one multiplier per
``weight_block_size`` block ([ceil(out/b0), ceil(in/b1)], a partial last block included). The
reference is transformers' FineGrainedFP8 dequantization (``integrations/finegrained_fp8.py``
``Fp8Dequantize``): float32 values times float32 scales, then the cast to the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from ..quantization import _ignore_matches, quantizable
from .format import SourceQuantization, Stored

if TYPE_CHECKING:
    import numpy as np

    from ..model import ModelSpec

SCALES = ("F32", "BF16", "F16")  # float scales, read as float32 (E8M0 bytes are not read)
# keys of transformers' FineGrainedFP8Config that do not change the weights' math
_IRRELEVANT = {"quant_method", "fmt", "dequantize", "modules_to_not_convert", "weight_block_size",
               "activation_scheme", "scale_fmt", "expert_dtype", "modules_to_convert"}


def _refuse(key: str, message: str, hint: str) -> QuantizationError:
    return QuantizationError(message, key=f"quantization_config.{key}", hint=hint)


class BlockFP8(SourceQuantization):
    methods = ("fp8",)
    applies = "the decoder's linear projections not in modules_to_not_convert"

    def __init__(self, block: dict[str, Any], grid: tuple[int, int], keep: tuple[str, ...]) -> None:
        super().__init__(block)
        self.grid, self.keep = grid, keep
        self._stored = (Stored("", ("F8_E4M3",), (1, 1)), Stored("_scale_inv", SCALES, grid))

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> BlockFP8:
        for key in sorted(set(block) - _IRRELEVANT):
            raise _refuse(key, "is a key of this fp8 config that shardc does not implement",
                          "start from a checkpoint without it, or from the unquantized checkpoint")
        size = block.get("weight_block_size")
        if size is None:
            raise _refuse("weight_block_size", "is missing: per-tensor fp8 is not read, only block-scaled",
                          "use a block-scaled fp8 checkpoint (weight_block_size: [128, 128])")
        if (not isinstance(size, list) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in size)):
            raise _refuse("weight_block_size", f"is {size!r}; it must be two positive integers",
                          "weight_block_size: [128, 128]")
        if block.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse("activation_scheme", f"is {block.get('activation_scheme')!r}: static input scales "
                          "are not read", "use a checkpoint with activation_scheme: dynamic")
        if block.get("expert_dtype", "fp8") != "fp8":
            raise _refuse("expert_dtype", f"is {block.get('expert_dtype')!r}: fp4 experts are not read",
                          "use a checkpoint whose experts are fp8")
        if block.get("scale_fmt", "float") not in ("float", "ue8m0"):
            raise _refuse("scale_fmt", f"is {block.get('scale_fmt')!r}", "scale_fmt: float or ue8m0")
        if block.get("modules_to_convert"):
            raise _refuse("modules_to_convert", "is set: only modules_to_not_convert is read",
                          "list the modules kept in 16 bits under modules_to_not_convert")
        keep = block.get("modules_to_not_convert") or []
        if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
            raise _refuse("modules_to_not_convert", f"is {keep!r}; it must be a list of module names",
                          "modules_to_not_convert: [lm_head]")
        return cls(block, (size[0], size[1]), tuple(keep))

    @property
    def label(self) -> str:
        return f"fp8 block {self.grid[0]}x{self.grid[1]}"

    def quantized(self, model: ModelSpec) -> set[str]:
        return {n for n in quantizable(model)
                if not any(_ignore_matches(k, n.removesuffix(".weight")) for k in self.keep)}

    def stored(self, name: str) -> tuple[Stored, ...]:
        return self._stored

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """q (float32) x scale (float32), one block row at a time: only the output is
        weight-sized (transformers: ``q.reshape(-1, R, b0, C, b1) * s``, the same products). The
        F8 values become float32 through a 256-entry table (exact, and a gather instead of a
        per-element conversion)."""
        import numpy as np

        q, s = np.asarray(read(name)), np.asarray(read(name + "_scale_inv")).astype(np.float32)
        lut = np.arange(256, dtype=np.uint8).view(q.dtype).astype(np.float32)
        b0, b1 = self.grid
        rows_n, cols = shape
        full = cols // b1
        out = np.empty(shape, np.float32)
        for i in range(s.shape[0]):
            rows = slice(i * b0, min((i + 1) * b0, rows_n))
            dst = out[rows]
            np.take(lut, q[rows].view(np.uint8), out=dst)
            if full:
                blocks = dst[:, : full * b1]
                blocks.shape = (blocks.shape[0], full, b1)  # a view: raises rather than copy
                blocks *= s[i, :full, None]
            if cols > full * b1:  # a partial last block column
                dst[:, full * b1 :] *= s[i, full]
        return out
