"""Quantized sources: checkpoints published with a ``quantization_config`` (docs/architecture.md
§8, "A source format").

Each format is one module here defining a ``SourceQuantization`` (format.py): how config.json names
it (``detect``), which of the family table's weights it stores quantized and as which tensors
(``stored``: name suffix, dtype, and the grid of source elements each stored element covers, from
which the Layout slices every stored tensor per rank), and its reference dequantization
(``dequantize``). ``detect_source`` picks the format; a quantization_config no format takes is
refused with one line naming its method, never read as 16-bit weights.
"""

from __future__ import annotations

from typing import Any

from ...errors import QuantizationError
from .compressed import CompressedTensors
from .compressed_mx import CompressedMicroscaled
from .format import SourceQuantization, Stored
from .fp8_block import BlockFP8
from .modelopt import ModelOptNVFP4
from .mxfp4 import MXFP4

__all__ = ["FORMATS", "BlockFP8", "CompressedTensors", "MXFP4", "ModelOptNVFP4", "SourceQuantization", "Stored",
           "detect_source"]

# Formats shardc reads, tried in order.
FORMATS: tuple[type[SourceQuantization], ...] = (BlockFP8, CompressedMicroscaled, CompressedTensors, MXFP4, ModelOptNVFP4)


def detect_source(config: dict[str, Any]) -> SourceQuantization | None:
    """The source's quantization format from its config.json (None: a 16-bit source)."""
    block = config.get("quantization_config")
    if block is None:
        return None
    if not isinstance(block, dict):
        raise QuantizationError("must be a mapping", key="quantization_config",
                                hint="fix config.json, or start from the unquantized checkpoint")
    method = block.get("quant_method")
    for fmt in FORMATS:
        if method in fmt.methods and fmt.accepts(block):
            return fmt.from_config(block, config)
    known = ", ".join(dict.fromkeys(m for f in FORMATS for m in f.methods))
    raise QuantizationError(f"quant_method {method!r} is not a source format shardc reads "
                            f"(it reads {known})", key="quantization_config.quant_method",
                            hint="start from the unquantized checkpoint")
