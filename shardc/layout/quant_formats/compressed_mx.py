"""compressed-tensors' microscaled float formats (``quant_method: compressed-tensors``), as
llm-compressor writes them with compressed-tensors 0.20 (``compressors/nvfp4``, ``mxfp4``, ``mxfp8``):

- ``nvfp4-pack-quantized`` (NVFP4, strategy ``tensor_group``, group 16): ``X.weight_packed`` U8
  [out, in/2], two E2M1 values a byte, the first in the low nibble; ``X.weight_scale`` F8_E4M3
  [out, in/16]; ``X.weight_global_scale`` F32 [1], the divisor of every block scale. W4A4
  checkpoints also hold ``X.input_global_scale`` F32 [1] (the activations' static global scale).
- ``mxfp4-pack-quantized`` (MXFP4, strategy ``group``, group 32, ``scale_dtype`` uint8): the same
  packed values, ``X.weight_scale`` U8 [out, in/32], an E8M0 power of two (exponent + 127).
- ``mxfp8-quantized`` (MXFP8, group 32, uint8 scales): ``X.weight`` F8_E4M3 [out, in] and the E8M0
  ``X.weight_scale`` U8 [out, in/32].

The references are the compressors' ``decompress``: NVFP4 unpacks to bfloat16
(``unpack_fp4_from_uint8``), the fp8 scale to bfloat16, then ``_dequantize`` computes
``scale / global_scale`` and ``value * that`` in float32 and casts to bfloat16; MX formats compute
``value * 2^(e - 127)`` in bfloat16 (``decompress_mx_scale``). ``dequantize`` below gives float32
values already rounded to bfloat16, so any later cast gives what transformers holds. A dequantized
build leaves the activations' scheme with the weights' (W4A4's input scales are not copied): its
activations run in 16 bits, as for every quantized source shardc dequantizes.

Kept as stored (``dtype: source``), a TP cut must fall on whole blocks (16 or 32 values along the
input dimension; rows are free); the global scales are per tensor, so every rank holding part of a
weight holds its global scale (and its input scale). shardc never merges the global scales of a
fused module's parts (q/k/v, gate/up): each part keeps its own on every rank, and shardc's runtime
dequantizes each part with its own. vLLM fuses them at load time and uses one per fused layer, the
largest (``compressed_tensors_w4a4_nvfp4.py`` ``process_weights_after_loading``: a warning when
they differ, then ``weight_global_scale.max()``); with shardc's output that rule sees exactly the
source's scales. NaN block scales (E4M3 0x7F/0xFF, E8M0 0xFF) and global scales that are not
finite and positive are refused with one line naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from .compressed import KINDS, MICROSCALED, CompressedTensors, _refuse, _weights
from .format import Nibbles, Stored
from .mxfp4 import E2M1

if TYPE_CHECKING:
    import numpy as np


class CompressedMicroscaled(CompressedTensors):
    """NVFP4, MXFP4 and MXFP8 as compressed-tensors stores them (the module docstring)."""

    @classmethod
    def accepts(cls, block: dict[str, Any]) -> bool:
        """A block whose format (top-level, or its one group's) is one of these; the rest of the
        block is checked by compressed.py's reader, as for every compressed-tensors format."""
        groups = block.get("config_groups")
        group = next(iter(groups.values()), None) if isinstance(groups, dict) and len(groups) == 1 else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or block.get("format")
        return fmt in MICROSCALED

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> CompressedMicroscaled:
        fmt, w, where = _weights(block)
        (group,) = block["config_groups"].values()
        act = group.get("input_activations") or {}
        # NVFP4 W4A4 (dynamic "local": a static global scale, block scales per token) stores one
        return cls(block, fmt, w, where, input_scale=fmt == MICROSCALED[0] and act.get("dynamic") == "local")

    def __init__(self, block: dict[str, Any], fmt: str, w: dict[str, Any], where: str, input_scale: bool) -> None:
        # the base reads what every compressed-tensors block shares (ignore); format, grid and the
        # stored tensors are this module's
        super().__init__(block, "float-quantized", w | {"strategy": "tensor"}, "F32", where)
        self.fmt, self.bits = fmt, int(w.get("num_bits", 4))
        self.group = KINDS[fmt][3]
        self.strategy = KINDS[fmt][2]
        if fmt == "mxfp8-quantized":
            values: Stored = Stored("", ("F8_E4M3",), (1, 1))
        else:
            values = Nibbles("_packed", ("U8",), (1, 2))
        stored: tuple[Stored, ...]
        if fmt == "nvfp4-pack-quantized":
            stored = (values, Stored("_scale", ("F8_E4M3",), (1, self.group)),
                      Stored("_global_scale", ("F32",), (0, 0), flat=True))
            if input_scale:
                stored += (Stored("input_global_scale", ("F32",), (0, 0), flat=True, sibling=True),)
        else:
            stored = (values, Stored("_scale", ("U8",), (1, self.group)))
        self._stored = stored

    @property
    def label(self) -> str:
        return f"compressed-tensors {KINDS[self.fmt][5]}"

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every quantized weight's input dimension is whole blocks (compressed-tensors' group
        quantization needs it: the packed scales have in/group columns)."""
        for name, shape in sorted(shapes.items()):
            if shape[-1] % self.group:
                raise _refuse(f"{self.where}.group_size", f"is {self.group}, which does not divide the "
                              f"{shape[-1]} columns of weight {name} {list(shape)}",
                              "a checkpoint quantized with whole blocks on every row")

    def check_values(self, tensor: str, st: Stored, values: np.ndarray) -> None:
        check_scales(tensor, st, values)

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """float32, rounded to bfloat16 as the compressor's decompress leaves it (see the module
        docstring), computed a chunk of rows at a time."""
        import ml_dtypes
        import numpy as np

        values_st, scale_st = self._stored[0], self._stored[1]
        values, scale = np.asarray(read(values_st.tensor(name))), np.asarray(read(scale_st.tensor(name)))
        divisor = None
        if self.fmt == "nvfp4-pack-quantized":
            g = np.asarray(read(self._stored[2].tensor(name)), np.float32).reshape(-1)
            check_global(self._stored[2].tensor(name), g)
            divisor = g[:1]
        check_block_scales(scale_st.tensor(name), scale)
        rows_n, cols = shape
        out = np.empty(shape, np.float32)
        for rows in row_chunks(rows_n, cols):  # the values straight into the output, scaled in place
            dst = out[rows]
            if values_st.suffix:
                unpack_e2m1(values[rows], dst)
            else:
                dst[...] = values[rows]
            if divisor is not None:  # fp8 scale (exact in bf16, so in f32) / global scale, in float32
                s = scale[rows].astype(np.float32) / divisor
            else:
                s = e8m0(scale[rows])
            dst.reshape(dst.shape[0], -1, self.group)[...] *= s[:, :, None]
            dst[...] = dst.astype(ml_dtypes.bfloat16)  # the reference's bfloat16 result
        return out


def row_chunks(rows: int, cols: int) -> list[slice]:
    """Rows a chunk of about 1 Mi elements (4 MiB of float32), whatever the weight's size: the
    temporaries of a dequantization stay that small, so memory does not grow with the model."""
    step = max(1, (1 << 20) // max(1, cols))
    return [slice(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


def unpack_e2m1(packed: np.ndarray, out: np.ndarray) -> None:
    """[rows, n/2] U8 -> ``out`` [rows, n] float32 E2M1 values, the low nibble first."""
    import numpy as np

    lut = np.asarray(E2M1, np.float32)
    np.take(lut, packed & 0x0F, out=out[:, 0::2])
    np.take(lut, packed >> 4, out=out[:, 1::2])


def e8m0(scale: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(e - 127) (exact; 2^-127 is a float32 subnormal)."""
    import numpy as np

    out: np.ndarray = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32)
    return out


def check_scales(tensor: str, st: Stored, values: np.ndarray) -> None:
    """A stored scale as a build reads it: a per-tensor one finite and positive, block scales not NaN."""
    if st.flat:
        check_global(tensor, values.reshape(-1).astype("float32"))
    elif st.suffix == "_scale":
        check_block_scales(tensor, values)


def check_block_scales(tensor: str, scale: np.ndarray) -> None:
    """No NaN block scale: E8M0 0xFF and E4M3 0x7F / 0xFF are NaN, which no weight can hold."""
    import numpy as np

    raw = scale.view(np.uint8)
    bad = raw == 0xFF if scale.dtype == np.uint8 else (raw & 0x7F) == 0x7F
    if bad.any():
        at = [int(i) for i in np.argwhere(bad)[0]]
        raise QuantizationError(f"holds a NaN block scale at {at}", key=f"source tensor {tensor}",
                                hint="the checkpoint is damaged: download it again, or requantize it")


def check_global(tensor: str, g: np.ndarray) -> None:
    """A global scale that is a finite positive number (it divides, or multiplies, every block scale)."""
    import numpy as np

    if g.size != 1 or not np.isfinite(g).all() or not (g > 0).all():
        raise QuantizationError(f"is {g.tolist()}; a global scale must be one finite positive number",
                                key=f"source tensor {tensor}",
                                hint="the checkpoint is damaged or was not written by its quantizer")
