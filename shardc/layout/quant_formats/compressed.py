"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), as llm-compressor writes
them: weight-only or dynamic-activation schemes of one config group targeting ``Linear``.

Formats read (compressed-tensors 0.20, ``compressors/``):
- ``pack-quantized``: int4 / int8 values + 2^(b-1), packed little-endian into int32 along the input
  dimension (``X.weight_packed`` [out, ceil(in·b/32)]), ``X.weight_shape`` the unpacked [out, in];
- ``int-quantized``: ``X.weight`` I8; ``float-quantized``: ``X.weight`` F8_E4M3;
each with ``X.weight_scale`` per output channel [out, 1], per group [out, in/group] or (float)
per tensor [1]. The reference is compressed-tensors' ``dequantize``: the values cast to the
scale's dtype, times the scale, in that dtype (``forward_helpers._dequantize``). Zero points,
activation ordering with g_idx, static activation scales, KV-cache schemes, sparsity, expert
sparsity and transforms change the math and are refused by name; every key of the config is
classified in ct_keys.py, and one that cannot change the math (null, empty, inert) is read. The
group size is bounded before any work: 2^24 at most, and no longer than a quantized weight's row.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from ..dtypes import from_torch_name
from ..quantization import _ignore_matches, quantizable
from .ct_keys import ARGS, CONFIG, SCHEME, check_keys
from .format import SourceQuantization, Stored

if TYPE_CHECKING:
    import numpy as np

    from ..model import ModelSpec

SCALES = ("BF16", "F16", "F32")
FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
MICROSCALED = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")  # compressed_mx.py

# format: (value type, bits, strategy, group size, scale dtype as config.json names it, label)
KINDS = {
    "nvfp4-pack-quantized": ("float", 4, "tensor_group", 16, "torch.float8_e4m3fn", "nvfp4 (e2m1, fp8 scale per 16)"),
    "mxfp4-pack-quantized": ("float", 4, "group", 32, "torch.uint8", "mxfp4 (e2m1, e8m0 scale per 32)"),
    "mxfp8-quantized": ("float", 8, "group", 32, "torch.uint8", "mxfp8 (e4m3, e8m0 scale per 32)"),
}


def check_args(fmt: str, w: dict[str, Any], where: str) -> None:
    """The weights' arguments are the ones the format's compressor writes (its preset's)."""
    _, _, strategy, group, scale, _ = KINDS[fmt]
    if w.get("strategy") != strategy:
        raise _refuse(f"{where}.strategy", f"is {w.get('strategy')!r}; {fmt} stores strategy {strategy}",
                      f"strategy: {strategy}, as compressed-tensors' preset writes it")
    if w.get("group_size") != group:
        raise _refuse(f"{where}.group_size", f"is {w.get('group_size')!r}; {fmt} stores one scale per {group} values",
                      f"group_size: {group}")
    if w.get("scale_dtype") not in (None, scale):
        raise _refuse(f"{where}.scale_dtype", f"is {w.get('scale_dtype')!r}; {fmt} stores scales as {scale}",
                      f"scale_dtype: {scale}")
MAX_GROUP = 1 << 24  # a group size beyond any weight's input dimension (checked per weight as well)


def _refuse(key: str, message: str, hint: str = "use a symmetric weight scheme (W4A16, W8A16, FP8)") -> QuantizationError:
    return QuantizationError(message, key=f"quantization_config.{key}", hint=hint)


def _strategy(w: dict[str, Any]) -> Any:
    """The weights' strategy; unset, compressed-tensors infers it from group_size
    (``QuantizationArgs.validate_model_after``): none -> tensor, positive -> group, -1 -> channel."""
    strategy, size = w.get("strategy"), w.get("group_size")
    if strategy is not None:
        return strategy
    return {None: "tensor", -1: "channel"}.get(size, "group") if isinstance(size, int) or size is None else None


def _weights(block: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """The one config group's format, weight arguments and key path, every key classified (ct_keys.py) and
    every value that changes the math checked."""
    check_keys(block, CONFIG, "")
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
    check_keys(group, SCHEME, f"{where}.")
    for key, fmt in (("format", block.get("format")), (f"{where}.format", group.get("format"))):
        if fmt is not None and fmt not in FORMATS + MICROSCALED:
            raise _refuse(key, f"is {fmt!r}; shardc reads {', '.join(FORMATS + MICROSCALED)}")
    fmt = group.get("format") or block.get("format")
    if fmt is None or block.get("format", fmt) != fmt:
        raise _refuse("format", f"is {block.get('format')!r} but the group's is {group.get('format')!r}",
                      "one format for the checkpoint")
    act = group.get("input_activations")
    if act is not None:
        if not isinstance(act, dict):
            raise _refuse(f"{where}.input_activations", f"is {act!r}; a mapping of quantization arguments")
        check_keys(act, ARGS, f"{where}.input_activations.")
        if not act.get("dynamic"):
            raise _refuse(f"{where}.input_activations", "are static: their scales are not read",
                          "use dynamic activation quantization or a weight-only scheme")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(f"{where}.weights", "is missing")
    check_keys(w, ARGS, f"{where}.weights.")
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", "is set: dynamic weights have no stored scales")
    symmetric = w.get("symmetric", True)
    if symmetric is not True:  # pydantic would read "false" as False: only true itself is symmetric
        raise _refuse(f"{where}.weights.symmetric", f"is {'false' if symmetric is False else repr(symmetric)}: "
                      "zero points are not read")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise _refuse(f"{where}.weights.actorder", f"is {w.get('actorder')!r}: g_idx reordering is not read",
                      "use actorder: weight (or none)")
    kind = (w.get("type", "int"), w.get("num_bits", 8), fmt)
    if fmt in MICROSCALED:
        if kind != (*KINDS[fmt][:2], fmt):
            raise _refuse(f"{where}.weights", f"type {kind[0]} with {kind[1]} bits in {fmt} is not read",
                          f"{fmt} stores {KINDS[fmt][0]} {KINDS[fmt][1]}-bit weights")
        check_args(fmt, w, f"{where}.weights")
        return fmt, w, f"{where}.weights"
    if kind not in {("int", 4, "pack-quantized"), ("int", 8, "pack-quantized"), ("int", 8, "int-quantized"),
                    ("float", 8, "float-quantized")}:
        raise _refuse(f"{where}.weights", f"type {kind[0]} with {kind[1]} bits in {fmt} is not read",
                      "int4/int8 pack-quantized, int8 int-quantized or fp8 float-quantized")
    strategy = _strategy(w)
    if strategy not in ("channel", "group", "tensor") or (strategy == "tensor" and kind[0] == "int"):
        raise _refuse(f"{where}.weights.strategy", f"is {strategy!r}; read: channel, group, tensor (fp8)")
    size = w.get("group_size")
    if strategy == "group" and (not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_GROUP):
        raise _refuse(f"{where}.weights.group_size", f"is {size!r}; a group strategy needs a positive size "
                      "no larger than the weights' input dimension", "group_size: 128")
    return fmt, w | {"strategy": strategy}, f"{where}.weights"


class CompressedTensors(SourceQuantization):
    methods = ("compressed-tensors",)
    applies = "the decoder's linear projections not in its ignore list"

    def __init__(self, block: dict[str, Any], fmt: str, w: dict[str, Any], scale_dtype: str,
                 where: str = "config_groups.group_0.weights") -> None:
        super().__init__(block)
        self.where = where  # the weights' key path, for messages
        self.fmt, self.bits, self.strategy = fmt, int(w.get("num_bits", 8)), w.get("strategy")
        self.group = int(w["group_size"]) if self.strategy == "group" else 0
        # the config's scale dtype first (what a dtype: source build writes; compiler/quantized.py
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
        self._patterns: list[re.Pattern[str]] = []  # the re: entries, compiled once
        for entry in ignore:
            if entry.startswith("re:"):
                try:
                    self._patterns.append(re.compile(entry[3:]))
                except re.error as exc:
                    raise _refuse("ignore", f"entry {entry!r} is not a regular expression ({exc})",
                                  "fix the pattern after re:") from None

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> CompressedTensors:
        """Scales are stored in ``weights.scale_dtype`` when given, else the model's dtype
        (compressed-tensors keeps them in the dtype of the weight they were computed from)."""
        fmt, w, where = _weights(block)
        assert fmt not in MICROSCALED  # compressed_mx.py's CompressedMicroscaled.accepts takes those blocks
        name = w.get("scale_dtype") or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        scale = from_torch_name(str(name))
        if scale not in SCALES:
            raise _refuse(f"{where}.scale_dtype", f"is {name!r}; scales are read in "
                          "bfloat16, float16 or float32")
        return cls(block, fmt, w, scale, where)

    @property
    def label(self) -> str:
        scheme = {"pack-quantized": f"int{self.bits} packed", "int-quantized": "int8", "float-quantized": "fp8"}
        per = f"group {self.group}" if self.group else self.strategy
        return f"compressed-tensors {scheme[self.fmt]} per {per}"

    def _ignored(self, module: str) -> bool:
        return (any(p.match(module) for p in self._patterns)
                or any(_ignore_matches(i, module) for i in self.ignore if not i.startswith("re:")))

    def quantized(self, model: ModelSpec) -> set[str]:
        return {n for n in quantizable(model) if not self._ignored(n.removesuffix(".weight"))}

    def stored(self, name: str) -> tuple[Stored, ...]:
        return self._stored

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """A group no longer than every quantized weight's input dimension (compressed-tensors
        itself cannot dequantize a weight whose row is shorter than one group)."""
        for name, shape in sorted(shapes.items()):
            if self.group > shape[-1]:
                raise _refuse(f"{self.where}.group_size", f"is {self.group}, longer than a row of weight {name} "
                              f"{list(shape)}", f"a group_size that divides {shape[-1]} (128, 64, 32)")

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """q (unpacked) x scale, rounded to the scale's dtype as compressed-tensors computes it
        (``_dequantize``: ``q.to(scale.dtype) * scale``: the product of a value and a 16-bit scale
        is exact in float32, so one rounding to the scale's dtype gives torch's result). Each
        scale multiplies its group in place through a [rows, groups, group] view: nothing but the
        output and a chunk of rows (~16 MiB of temporaries) is allocated, whatever the group size."""
        import numpy as np

        values, scale = self._stored[0], self._stored[1]
        packed, s = np.asarray(read(name + values.suffix)), np.asarray(read(name + scale.suffix))
        rows_n, cols = shape
        g = self.group or cols  # channel: one group a row (a per-tensor scale is flat)
        full = cols // g
        out = np.empty(shape, np.float32)
        step = max(1, (1 << 22) // max(1, cols))  # rows per chunk
        for r0 in range(0, rows_n, step):
            rows = slice(r0, min(r0 + step, rows_n))
            dst = out[rows]
            dst[...] = unpack(packed[rows], self.bits, cols) if self.fmt == "pack-quantized" else packed[rows]
            if scale.flat:
                dst *= s.reshape(-1)[:1].astype(np.float32)
            else:
                s32 = s[rows].astype(np.float32)
                if full:
                    np.reshape(dst[:, : full * g], (dst.shape[0], full, g), copy=False)[...] *= s32[:, :full, None]
                if cols > full * g:  # a partial last group
                    dst[:, full * g :] *= s32[:, full : full + 1]
            if s.dtype != np.float32:  # the product in the scale's 16-bit dtype
                dst[...] = dst.astype(s.dtype)
        return out


def unpack(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """compressed-tensors' ``unpack_from_int32`` for 4 and 8 bits: values + 2^(b-1) in a
    little-endian bit stream, the first value in the lowest bits."""
    import numpy as np

    u = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(packed.shape[0], -1)
    if bits == 4:
        u = np.stack((u & 0xF, u >> 4), axis=-1).reshape(packed.shape[0], -1)
    return (u[:, :cols].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
