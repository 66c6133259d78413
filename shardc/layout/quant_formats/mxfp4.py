"""MXFP4 (``quant_method: mxfp4``): gpt-oss as OpenAI publishes it.

Each layer's stacked experts ``mlp.experts.gate_up_proj`` / ``down_proj`` (weights [E, in, out],
layout/families/gpt_oss.py) are stored transposed and packed: ``X_blocks`` U8 [E, out, in/32, 16],
two E2M1 values per byte (low nibble first), and ``X_scales`` U8 [E, out, in/32], one E8M0 power
of two per 32-value block (exponent + 127). Everything else (attention, router, norms, the expert
biases, embeddings) is 16-bit. The reference is transformers' ``convert_moe_packed_tensors``
(integrations/mxfp4.py): the E2M1 table value times 2^(scale - 127) in float32 (torch.ldexp), then
the cast to the model dtype and the transpose back to [E, in, out]; the test checks every
(byte, scale) pair against it bit for bit.

Kept as stored (``dtype: source``), blocks and scales are cut only along the expert dimension:
whole experts per rank (``expert_parallel``) or every expert on every rank (tp = 1). A TP cut
inside an expert is refused before anything is written (``dtype: bf16`` dequantizes instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from ..families.family import STACKED
from .format import SourceQuantization, Stored

if TYPE_CHECKING:
    import numpy as np

    from ..model import ModelSpec

BLOCK = 32  # values per E8M0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Mxfp4Config keys that do not change the weights' math
_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def _module_matches(entry: str, name: str) -> bool:
    """transformers' modules_to_not_convert entry (``*`` one name segment, e.g.
    ``model.layers.*.self_attn``) against a tensor name, segment-aligned."""
    want, parts = entry.split("."), name.split(".")
    return any(all(w in ("*", p) for w, p in zip(want, parts[i : i + len(want)], strict=True))
               for i in range(len(parts) - len(want) + 1))


@dataclass(frozen=True)
class PackedExperts(Stored):
    """A stacked expert weight [E, in, out] stored transposed in 32-value blocks: ``_blocks``
    [E, out, in/32, 16] or ``_scales`` [E, out, in/32]. Only whole experts (dim 0) can be cut."""

    def shape(self, weight: tuple[int, ...]) -> tuple[int, ...]:
        e, n_in, n_out = weight
        groups = -(-n_in // BLOCK)
        return (e, n_out, groups, BLOCK // 2) if self.suffix == "_blocks" else (e, n_out, groups)

    def cut(self, dim: int, start: int, stop: int, extent: int) -> tuple[int, int] | None:
        return (start, stop) if dim == 0 else None

    def weight_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The [E, in, out] weight a stored ``_blocks`` tensor of this shape holds."""
        e, n_out, groups = stored[:3]
        return (e, groups * BLOCK, n_out)


class MXFP4(SourceQuantization):
    methods = ("mxfp4",)
    applies = "stacked MoE expert weights, as gpt-oss stores them"

    def __init__(self, block: dict[str, Any], keep: tuple[str, ...]) -> None:
        super().__init__(block)
        self.keep = keep
        self._stored = (PackedExperts("_blocks", ("U8",), (1, 0)), PackedExperts("_scales", ("U8",), (1, 0)))

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> MXFP4:
        for key in sorted(set(block) - _KEYS):
            raise QuantizationError("is a key of this mxfp4 config that shardc does not implement",
                                    key=f"quantization_config.{key}",
                                    hint="start from a checkpoint without it, or from a bf16 copy")
        keep = block.get("modules_to_not_convert") or []
        if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
            raise QuantizationError(f"is {keep!r}; it must be a list of module names",
                                    key="quantization_config.modules_to_not_convert",
                                    hint="modules_to_not_convert: [model.layers.*.self_attn, lm_head]")
        return cls(block, tuple(keep))

    @property
    def label(self) -> str:
        return "mxfp4 (e2m1, 32-value blocks)"

    def quantized(self, model: ModelSpec) -> set[str]:
        """The stacked expert matrices (not their biases), unless modules_to_not_convert names them."""
        return {r.name for r in model.spec.tensors(model) if r.split == STACKED and len(r.shape) == 3
                and not any(_module_matches(k, r.name) for k in self.keep)}

    def stored(self, name: str) -> tuple[Stored, ...]:
        return self._stored

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """float32 [E, in, out] (a transposed view), transformers' products exactly."""
        import numpy as np

        blocks, scales = np.asarray(read(name + "_blocks")), np.asarray(read(name + "_scales"))
        e, n_in, n_out = shape
        lut = np.asarray(E2M1, np.float32)
        values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
        values[..., 0::2] = lut[blocks & 0x0F]
        values[..., 1::2] = lut[blocks >> 4]
        with np.errstate(over="ignore", invalid="ignore"):  # scale 255: inf/NaN, as torch.ldexp
            np.ldexp(values, (scales.astype(np.int32) - 127)[..., None], out=values)
        out: np.ndarray = values.reshape(e, n_out, -1)[:, :, :n_in].transpose(0, 2, 1)
        return out
