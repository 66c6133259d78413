"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), as llm-compressor writes
them: weight-only or dynamic-activation schemes of one config group targeting ``Linear``.

Formats read (compressed-tensors 0.20, ``compressors/``):
- ``pack-quantized``: int4 / int8 values + 2^(b-1), packed little-endian into int32 along the input
  dimension (``X.weight_packed`` [out, ceil(in·b/32)]), ``X.weight_shape`` the unpacked [out, in];
- ``int-quantized``: ``X.weight`` I8; ``float-quantized``: ``X.weight`` F8_E4M3;
each with ``X.weight_scale`` per output channel [out, 1], per group [out, in/group] or (float)
per tensor [1]. The reference is compressed-tensors' ``dequantize``: the values cast to the
scale's dtype, times the scale, in that dtype (``forward_helpers._dequantize``). Zero points,
activation ordering with g_idx, static activation scales, KV-cache schemes, sparsity and
transforms change the math and are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from ..dtypes import from_torch_name
from ..quantization import _ignore_matches, quantizable
from .base import SourceQuantization, Stored

if TYPE_CHECKING:
    import numpy as np

    from ..model import ModelSpec

SCALES = ("BF16", "F16", "F32")
FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
# QuantizationConfig keys that do not change the weights' math (the others are checked below)
_TOP = {"quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
        "global_compression_ratio", "sparsity_config", "transform_config", "version"}
_WEIGHTS_IRRELEVANT = {"observer", "observer_kwargs", "dynamic", "scale_dtype", "zp_dtype"}


def _refuse(key: str, message: str, hint: str = "use a symmetric weight scheme (W4A16, W8A16, FP8)") -> QuantizationError:
    return QuantizationError(message, key=f"quantization_config.{key}", hint=hint)


def _weights(block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one config group's format and weight arguments, every math-changing key checked."""
    for key in sorted(set(block) - _TOP):
        raise _refuse(key, "is a compressed-tensors key shardc does not implement")
    for key in ("kv_cache_scheme", "transform_config"):
        if block.get(key):
            raise _refuse(key, "is set: it changes the model's math and is not read")
    if block.get("sparsity_config"):
        raise _refuse("sparsity_config", "is set: sparse compressed weights are not read", "use a dense checkpoint")
    if block.get("quantization_status", "compressed") != "compressed":
        raise _refuse("quantization_status", f"is {block.get('quantization_status')!r}: only compressed "
                      "weights are read", "save the model compressed (save_compressed=True)")
    groups = block.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("config_groups", f"has {len(groups) if isinstance(groups, dict) else 'no'} groups; "
                      "one group is read", "quantize every Linear with one scheme")
    (gname, group), = groups.items()
    where = f"config_groups.{gname}"
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise _refuse(f"{where}.targets", f"is {group.get('targets') if isinstance(group, dict) else group!r}; "
                      "only [Linear] is read", "targets: [Linear], with ignore for the layers kept")
    for key, fmt in (("format", block.get("format")), (f"{where}.format", group.get("format"))):
        if fmt is not None and fmt not in FORMATS:
            raise _refuse(key, f"is {fmt!r}; shardc reads {', '.join(FORMATS)}")
    fmt = group.get("format") or block.get("format")
    if fmt is None or block.get("format", fmt) != fmt:
        raise _refuse("format", f"is {block.get('format')!r} but the group's is {group.get('format')!r}",
                      "one format for the checkpoint")
    for key in ("output_activations",):
        if group.get(key):
            raise _refuse(f"{where}.{key}", "is set: output quantization is not read")
    act = group.get("input_activations")
    if act and not act.get("dynamic"):
        raise _refuse(f"{where}.input_activations", "are static: their scales are not read",
                      "use dynamic activation quantization or a weight-only scheme")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(f"{where}.weights", "is missing")
    for key in sorted(set(w) - _WEIGHTS_IRRELEVANT - {"num_bits", "type", "symmetric", "strategy",
                                                      "group_size", "actorder", "block_structure"}):
        raise _refuse(f"{where}.weights.{key}", "is a weight argument shardc does not implement")
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", "is set: dynamic weights have no stored scales")
    if not w.get("symmetric", True):
        raise _refuse(f"{where}.weights.symmetric", "is false: zero points are not read")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise _refuse(f"{where}.weights.actorder", f"is {w.get('actorder')!r}: g_idx reordering is not read",
                      "use actorder: weight (or none)")
    kind = (w.get("type", "int"), w.get("num_bits", 8), fmt)
    if kind not in {("int", 4, "pack-quantized"), ("int", 8, "pack-quantized"), ("int", 8, "int-quantized"),
                    ("float", 8, "float-quantized")}:
        raise _refuse(f"{where}.weights", f"type {kind[0]} with {kind[1]} bits in {fmt} is not read",
                      "int4/int8 pack-quantized, int8 int-quantized or fp8 float-quantized")
    strategy = w.get("strategy")
    if strategy not in ("channel", "group", "tensor") or (strategy == "tensor" and kind[0] == "int"):
        raise _refuse(f"{where}.weights.strategy", f"is {strategy!r}; read: channel, group, tensor (fp8)")
    size = w.get("group_size")
    if strategy == "group" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise _refuse(f"{where}.weights.group_size", f"is {size!r}; a group strategy needs a positive size")
    return fmt, w


class CompressedTensors(SourceQuantization):
    methods = ("compressed-tensors",)

    def __init__(self, block: dict[str, Any], fmt: str, w: dict[str, Any], scale_dtype: str) -> None:
        super().__init__(block)
        self.fmt, self.bits, self.strategy = fmt, int(w.get("num_bits", 8)), w.get("strategy")
        self.group = int(w["group_size"]) if self.strategy == "group" else 0
        # the config's scale dtype first (what a dtype: source build writes; compiler/sourcequant.py
        # refuses a source whose scales it could not copy exactly), any float scale read
        others = tuple(d for d in SCALES if d != scale_dtype)
        scale = Stored("_scale", (scale_dtype, *others), (1, self.group), flat=self.strategy == "tensor")
        if fmt == "pack-quantized":
            values = Stored("_packed", ("I32",), (1, 32 // self.bits))
            self._stored: tuple[Stored, ...] = (values, scale, Stored("_shape", ("I64",), (0, 0), value=True))
        else:
            self._stored = (Stored("", ("I8",) if fmt == "int-quantized" else ("F8_E4M3",), (1, 1)), scale)
        ignore = block.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise _refuse("ignore", f"is {ignore!r}; it must be a list of module names or re: patterns")
        self.ignore = tuple(ignore)

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> CompressedTensors:
        """Scales are stored in ``weights.scale_dtype`` when given, else the model's dtype
        (compressed-tensors keeps them in the dtype of the weight they were computed from)."""
        fmt, w = _weights(block)
        name = w.get("scale_dtype") or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        scale = from_torch_name(str(name))
        if scale not in SCALES:
            raise _refuse("config_groups.weights.scale_dtype", f"is {name!r}; scales are read in "
                          "bfloat16, float16 or float32")
        return cls(block, fmt, w, scale)

    @property
    def label(self) -> str:
        scheme = {"pack-quantized": f"int{self.bits} packed", "int-quantized": "int8", "float-quantized": "fp8"}
        per = f"group {self.group}" if self.group else self.strategy
        return f"compressed-tensors {scheme[self.fmt]} per {per}"

    def _ignored(self, module: str) -> bool:
        return any(re.match(i[3:], module) if i.startswith("re:") else _ignore_matches(i, module)
                   for i in self.ignore)

    def quantized(self, model: ModelSpec) -> set[str]:
        return {n for n in quantizable(model) if not self._ignored(n.removesuffix(".weight"))}

    def stored(self, name: str) -> tuple[Stored, ...]:
        return self._stored

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """q (unpacked) x scale, rounded to the scale's dtype as compressed-tensors computes it."""
        import numpy as np

        values, scale = self._stored[0], self._stored[1]
        packed, s = np.asarray(read(name + values.suffix)), np.asarray(read(name + scale.suffix))
        out = np.empty(shape, np.float32)
        step = max(1, (1 << 22) // max(1, shape[1]))  # rows per chunk: temporaries of ~16 MiB
        for r0 in range(0, shape[0], step):
            rows = slice(r0, min(r0 + step, shape[0]))
            q = unpack(packed[rows], self.bits, shape[1]) if self.fmt == "pack-quantized" else packed[rows]
            s32 = s.astype(np.float32).reshape(1, 1) if scale.flat else s[rows].astype(np.float32)
            if self.group:
                s32 = np.repeat(s32, self.group, axis=1)[:, : shape[1]]
            np.multiply(q.astype(np.float32), s32, out=out[rows])
            if s.dtype != np.float32:  # the product in the scale's 16-bit dtype (exact in float32 first)
                out[rows] = out[rows].astype(s.dtype)
        return out


def unpack(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """compressed-tensors' ``unpack_from_int32`` for 4 and 8 bits: values + 2^(b-1) in a
    little-endian bit stream, the first value in the lowest bits."""
    import numpy as np

    u = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(packed.shape[0], -1)
    if bits == 4:
        u = np.stack((u & 0xF, u >> 4), axis=-1).reshape(packed.shape[0], -1)
    return (u[:, :cols].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
