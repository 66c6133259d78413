"""MXFP4 (``quant_method: mxfp4``): gpt-oss as OpenAI publishes it.

Each layer's stacked experts ``mlp.experts.gate_up_proj`` / ``down_proj`` (weights [E, in, out],
layout/families/gpt_oss.py) are stored transposed and packed: ``X_blocks`` U8 [E, out, in/32, 16],
two E2M1 values per byte (low nibble first), and ``X_scales`` U8 [E, out, in/32], one E8M0 power
of two per 32-value block (exponent + 127). Everything else (attention, router, norms, the expert
biases, embeddings) is 16-bit. The reference is transformers' ``convert_moe_packed_tensors``
(integrations/mxfp4.py): the E2M1 table value times 2^(scale - 127) in float32 (torch.ldexp), then
the cast to the model dtype and the transpose back to [E, in, out]; the test checks every
(byte, scale) pair against it bit for bit.

Kept as stored (``dtype: source``), blocks and scales are plain slices of the source's, cut where
vLLM cuts them (vllm/model_executor/models/gpt_oss.py, ``GptOssModel._load_weights_mxfp4``):

- expert parallelism: whole experts, the rank's block of dim 0;
- TP: each expert's intermediate dimension on whole 32-value blocks. vLLM gives rank r the
  intermediate values [r·p, min((r+1)·p, I)), p = ceil((I/32) / tp)·32; gate_up (gate and up
  interleaved along its 2·I outputs) takes stored rows [2·r·p, 2·(r+1)·p) of dim 1 of blocks and
  scales, down stored block columns [r·p/32, (r+1)·p/32) of dim 2. Where I/tp is whole blocks that
  is the Layout's own even cut of the weights (layout/cuts.py: gate_up's dim 2 = blocks' dim 1,
  down's dim 1 = blocks' dim 2 over 32), which ``PackedExperts`` maps onto the stored dimensions.
  Where it is not (gpt-oss-120b's 2,880 = 90 blocks at tp = 4: 22.5 blocks a rank) vLLM makes the
  last ranks short and pads every rank's parameters with zeros
  (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py,
  ``mxfp4_round_up_hidden_size_and_intermediate_size``); shardc's ranks are equal, so such a tp
  is refused before anything is written, in words (``MXFP4.cut_words``; ``dtype: bf16``
  dequantizes instead).
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

    from ..cuts import Cut
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
    [E, out, in/32, 16] or ``_scales`` [E, out, in/32]. Whole experts (dim 0) and any outputs
    (weight dim 2: stored rows, dim 1) can be cut; inputs (weight dim 1: stored block columns,
    dim 2) only between blocks."""

    def shape(self, weight: tuple[int, ...]) -> tuple[int, ...]:
        e, n_in, n_out = weight
        groups = -(-n_in // BLOCK)
        return (e, n_out, groups, BLOCK // 2) if self.suffix == "_blocks" else (e, n_out, groups)

    def stored_dim(self, dim: int) -> int:
        """Weight [E, in, out] -> stored [E, out, in/32, ...]: experts stay, in and out swap."""
        return (0, 2, 1)[dim]

    def cut(self, dim: int, start: int, stop: int, extent: int) -> tuple[int, int] | None:
        """Weight elements [start, stop) along ``dim`` as stored rows (experts, outputs) or block
        columns (inputs, whole blocks only: a partial last block would leave the rank's input
        size to guess, ``weight_shape``)."""
        if dim != 1:
            return start, stop
        if start % BLOCK or stop % BLOCK:
            return None
        return start // BLOCK, stop // BLOCK

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

    def cut_words(self, name: str, full: tuple[int, ...], cut: Cut) -> str | None:
        """A TP cut of an expert's inputs inside a block, in words. The stacked experts' inputs are
        cut only in down_proj [E, inter, hidden] (row-parallel), so they are the intermediate
        size; gate_up is cut along its outputs, which any row boundary keeps whole."""
        if cut.dim != 1 or cut.start is None or cut.stop is None or cut.stop <= cut.start:
            return None
        n, per, leaf = full[1], cut.stop - cut.start, name.rpartition(".")[2]
        blocks = -(-n // BLOCK)
        return (f"tensor {name} {list(full)}: each expert's intermediate size {n} is {blocks} "
                f"32-value mxfp4 block{'s' if blocks != 1 else ''} ({leaf}_blocks, {leaf}_scales), cut only "
                "between blocks (vLLM pads a cut inside one with zeros into ranks of unequal size, which shardc "
                f"does not make), and each rank would hold {per} values, {per / BLOCK:g} blocks")

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
