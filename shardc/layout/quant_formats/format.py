"""The interface every quantized source format implements (see the package docstring).

A format stores each of its quantized weights ``X.weight`` [out, in] as a few tensors
(``Stored``): the quantized values and their scales, each covering a grid of the weight's
elements. Slicing a weight for a TP rank slices each stored tensor along the same dimension at
the cut divided by its grid, which is only possible when the cut falls on a grid line: that is
the one rule the Layout applies (``cut``), and a TP degree that breaks it is refused before
anything is written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

    from ..cuts import Cut
    from ..model import ModelSpec


@dataclass(frozen=True)
class Stored:
    """One tensor a quantized weight is stored as: ``X.weight`` + ``suffix``."""

    suffix: str  # "" (the values under the weight's own name), "_scale_inv", "_packed", ...
    dtypes: tuple[str, ...]  # the safetensors dtypes a source may hold it in; [0] is what shardc writes
    grid: tuple[int, int]  # weight elements per stored element along dim 0 and 1 (0: the whole dim)
    value: bool = False  # holds the weight's [out, in] itself (compressed-tensors' X.weight_shape)
    flat: bool = False  # one element for the whole weight, stored as shape [1] (a per-tensor scale)
    scalar: bool = False  # a flat one stored with shape [] (ModelOpt's weight_scale_2, input_scale)
    sibling: bool = False  # ``suffix`` names a tensor of the weight's module: X.input_global_scale

    def tensor(self, weight: str) -> str:
        """The stored tensor's name for weight ``weight`` ("X.weight")."""
        return weight.removesuffix("weight") + self.suffix if self.sibling else weight + self.suffix

    def shape(self, weight: tuple[int, ...]) -> tuple[int, ...]:
        """Its shape for a weight (or a rank's slice of one) of shape ``weight``."""
        if self.value:
            return (len(weight),)
        if self.flat:
            return () if self.scalar else (1,)
        return tuple(1 if g == 0 else -(-n // g) for n, g in zip(weight, self.grid, strict=True))

    def weight_shape(self, stored: tuple[int, ...]) -> tuple[int, ...] | None:
        """The weight a stored tensor of this shape belongs to, where the stored shape alone says
        it (None: the values' or X.weight_shape's spec says it)."""
        return None

    def stored_dim(self, dim: int) -> int:
        """The dimension of the stored tensor that holds the weight's dimension ``dim`` (the same
        one, unless the format stores the weight transposed: MXFP4's experts)."""
        return dim

    def cut(self, dim: int, start: int, stop: int, extent: int) -> tuple[int, int] | None:
        """The stored rows/columns [a, b) holding weight elements [start, stop) of ``extent``
        along ``dim``; None when the cut is not on a grid line (a partial last block is the last
        rank's). Grid 0: one element covers the whole dim, so every rank holds it (a per-channel
        scale under a row-parallel cut)."""
        g = self.grid[dim]
        if g == 0:
            return 0, 1
        if start % g or (stop % g and stop != extent):
            return None
        return start // g, -(-stop // g)


@dataclass(frozen=True)
class Nibbles(Stored):
    """4-bit values two to a byte along the input dimension (E2M1: NVFP4, MXFP4), stored under the
    weight's own name or ``_packed``, [out, in/2] U8: the stored shape says the weight's."""

    def weight_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (stored[0], stored[1] * 2)


class SourceQuantization(ABC):
    """One quantized source format, as read from its config.json ``quantization_config``."""

    methods: ClassVar[tuple[str, ...]]  # the quant_method values it takes
    applies: ClassVar[str]  # which weights it can quantize, for the refusal of a family with none

    def __init__(self, block: dict[str, Any]) -> None:
        self.block = block  # kept verbatim in a ``dtype: source`` build's config.json

    @classmethod
    def accepts(cls, block: dict[str, Any]) -> bool:
        """Whether this format reads a block of one of its ``methods`` (a method several formats
        share, compressed-tensors, is told apart by the block's ``format``)."""
        return True

    @classmethod
    @abstractmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> SourceQuantization:
        """Read and check the block (``config``: the whole config.json it is part of); a key that
        changes the math and is not implemented is a QuantizationError naming it (never ignored)."""

    @property
    @abstractmethod
    def label(self) -> str:
        """What the manifest and messages call it ("fp8 block 128x128")."""

    @abstractmethod
    def quantized(self, model: ModelSpec) -> set[str]:
        """The family table's weights the source stores quantized."""

    def applied(self, model: ModelSpec) -> set[str]:
        """``quantized(model)``, which must not be empty: a config that quantizes none of the
        family's weights describes some other checkpoint (an mxfp4 config on a Llama would
        otherwise build as a 16-bit copy whose config.json still claims mxfp4)."""
        from ...errors import QuantizationError

        names = self.quantized(model)
        if not names:
            method = self.block.get("quant_method")
            raise QuantizationError(f"is {method!r}, but {self.label} quantizes none of {model.architecture}'s "
                                    f"weights (it applies to {self.applies})", key="quantization_config.quant_method",
                                    hint="a checkpoint whose weights are 16-bit has no quantization_config: "
                                         "remove it from config.json, or start from the checkpoint it describes")
        return names

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse a parameter that does not fit the quantized weights' shapes (``shapes``: name
        -> [out, in]) before any work proportional to it; a format without one checks nothing."""
        return None  # noqa: B027 (optional: most formats have no size parameter)

    def cut_words(self, name: str, full: tuple[int, ...], cut: Cut) -> str | None:
        """Why a rank's ``cut`` of weight ``name`` (shape ``full``) cannot keep its stored tensors
        whole, in the format's own words, for the TP refusal (slicing.py ``cut_problem``); None:
        the generic line (the cut and the grid cell it falls inside)."""
        return None

    def kv_cache_dtype(self) -> str | None:
        """The KV-cache dtype the checkpoint asks its server for ("fp8"), None: the model's."""
        return None

    def unbuilt(self, name: str) -> bool:
        """A checkpoint tensor of the format that is not a weight and that no build carries (FP8
        KV-cache scales): accepted in the source (``check_stored``), in no Layout."""
        return False

    def kept_block(self) -> dict[str, Any]:
        """The quantization_config a ``dtype: source`` build's config.json carries: the source's,
        less what the build does not hold (compiler/outputs.py ``output_config``)."""
        return self.block

    def check_values(self, tensor: str, st: Stored, values: np.ndarray) -> None:
        """Refuse a stored tensor whose values the format forbids (a NaN block scale), read as a
        build copies or dequantizes it; a format whose every value is valid checks nothing."""
        return None  # noqa: B027 (optional)

    @abstractmethod
    def stored(self, name: str) -> tuple[Stored, ...]:
        """The tensors quantized weight ``name`` is stored as, the values first."""

    @abstractmethod
    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """The weight in float32, exactly as the format's reference library computes it before
        its cast to the model dtype. ``read(tensor name)`` gives a stored tensor."""

    def record(self) -> dict[str, Any]:
        """The manifest's note of the source's quantization."""
        return {"format": self.label, "quant_method": self.block.get("quant_method")}

