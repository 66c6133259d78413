"""NVIDIA ModelOpt's NVFP4 (``quant_method: modelopt``, ``quant_algo: NVFP4``), as its Hugging Face
export writes it (NVIDIA's published ``-NVFP4`` checkpoints: DeepSeek, Qwen3.5, GLM-5.x, Kimi-K2.x,
MiniMax-M2.x, Nemotron 3).

Tensors of each quantized linear ``X`` (ModelOpt ``modelopt/torch/export``; the same names vLLM's
``ModelOptNvFp4LinearMethod`` registers, vllm/model_executor/layers/quantization/modelopt.py):
- ``X.weight`` U8 [out, in/2]: two E2M1 values a byte, the first in the low nibble
  (``NVFP4QTensor.quantize``: ``(q[..., 1::2] << 4) | q[..., 0::2]``);
- ``X.weight_scale`` F8_E4M3 [out, in/16]: one scale per 16 values;
- ``X.weight_scale_2`` F32 [] (a scalar): the per-tensor scale, amax / (6 * 448), a multiplier
  (compressed-tensors stores its reciprocal as ``weight_global_scale``: its ModelOpt converter,
  compressed_tensors/entrypoints/convert/converters/modelopt_nvfp4.py);
- ``X.input_scale`` F32 []: the activations' static per-tensor scale, present when the config's
  group quantizes input activations (W4A4, every published NVFP4 checkpoint).

The reference (``NVFP4QTensor.dequantize``, modelopt/torch/quantization/qtensor/nvfp4_tensor.py,
the non-fused path): ``per_block_scale = weight_scale.to(float32) * weight_scale_2`` (float32), then
``e2m1 * per_block_scale`` in float32, then ``.to(dtype)``: ``dequantize`` returns that float32.

The config: the form NVIDIA's config.json files carry (``quant_algo``, ``config_groups``,
``ignore``, ``kv_cache_scheme``, ``producer``) and the legacy keys of ``hf_quant_config.json``
(``group_size``, ``exclude_modules``, ``kv_cache_quant_algo``). A module is excluded as vLLM's
``ModelOptQuantConfigBase.is_layer_excluded`` decides: the entry equal to the module's name,
contained in it, or matching it as an fnmatch wildcard. Any other algorithm and a group size other
than 16 are refused by key.

FP8 KV-cache quantization (``kv_cache_scheme`` {type float, num_bits 8, dynamic false}, or
``kv_cache_quant_algo: FP8``, as every NVIDIA -NVFP4 release sets it) is read, and its calibrated
scales (``*.self_attn.*.k_scale`` / ``v_scale``, ModelOpt's names in vLLM's
``maybe_remap_kv_scale_name``; which layers hold them is the checkpoint's) are accepted but not
built: they are not weights, and the Layout, recomputed from config.json alone, cannot know them.
Every build's KV cache is therefore 16-bit: a ``dtype: source`` build's config.json carries the
block without its KV-cache keys (``kept_block``: with them, vLLM's ``--kv-cache-dtype auto`` would
run FP8 on scales of 1), and the manifest's ``source_quantization`` says so (``kv_cache``).

Kept as stored, cuts fall on whole 16-value blocks, and the per-tensor scales go to every rank; a
fused module's parts keep their own ``weight_scale_2`` (vLLM uses the largest of a fused layer's
and warns when they differ: ``process_weights_after_loading``). NaN block scales and per-tensor
scales that are not finite and positive are refused naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from ...errors import QuantizationError
from ..quantization import quantizable
from .compressed_mx import check_block_scales, check_global, check_scales, row_chunks, unpack_e2m1
from .format import Nibbles, SourceQuantization, Stored

if TYPE_CHECKING:
    import numpy as np

    from ..model import ModelSpec

BLOCK = 16
_READ = {"quant_method", "quant_algo", "group_size", "ignore", "exclude_modules", "config_groups"}
_INERT = {"producer"}
_KV = {"kv_cache_scheme", "kv_cache_quant_algo"}  # FP8 or null
_KV_SCALE = re.compile(r"model\.layers\.\d+\.self_attn\.(?:\w+\.)*[kv]_scale")  # ModelOpt's KV-cache scales


def _kv_fp8(key: str, value: Any) -> bool:
    """Whether a KV-cache key says FP8 (vLLM's reading); null is no KV quantization; else refused."""
    if value in (None, {}):
        return False
    fp8 = value.upper() == "FP8" if isinstance(value, str) else isinstance(value, dict) and (
        value.get("type") == "float" and value.get("num_bits") == 8 and value.get("dynamic") is False
        and set(value) <= {"type", "num_bits", "dynamic", "symmetric", "strategy"})
    if not fp8:
        raise _refuse(key, f"is {value!r}; shardc reads an FP8 KV cache (or none)",
                      "start from a checkpoint whose KV cache is FP8 or 16-bit")
    return True


def _refuse(key: str, message: str, hint: str) -> QuantizationError:
    return QuantizationError(message, key=f"quantization_config.{key}", hint=hint)


def _group(block: dict[str, Any]) -> bool:
    """The config group's arguments checked; whether it quantizes input activations."""
    groups = block.get("config_groups")
    if groups is None:
        return True  # the legacy form: NVFP4 is W4A4
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("config_groups", f"has {len(groups) if isinstance(groups, dict) else 'no'} groups; one is read",
                      "an NVFP4 checkpoint as ModelOpt exports it")
    (name, group), = groups.items()
    where = f"config_groups.{name}"
    want = {"num_bits": 4, "type": "float", "group_size": BLOCK}
    for part in ("weights", "input_activations"):
        args = group.get(part) if isinstance(group, dict) else None
        if args is None and part == "input_activations":
            return False
        if not isinstance(args, dict):
            raise _refuse(f"{where}.{part}", f"is {args!r}; NVFP4 arguments are read", "num_bits 4, type float, group_size 16")
        for key in sorted(set(args) - {*want, "dynamic"}):
            raise _refuse(f"{where}.{part}.{key}", "is a key shardc does not implement for ModelOpt NVFP4",
                          "an NVFP4 checkpoint as ModelOpt exports it")
        for key, value in want.items():
            if args.get(key) != value:
                raise _refuse(f"{where}.{part}.{key}", f"is {args.get(key)!r}; ModelOpt NVFP4 has {value}",
                              "an NVFP4 checkpoint as ModelOpt exports it")
        if part == "weights" and args.get("dynamic"):
            raise _refuse(f"{where}.weights.dynamic", "is set: dynamic weights have no stored scales",
                          "an NVFP4 checkpoint as ModelOpt exports it")
    return True


class ModelOptNVFP4(SourceQuantization):
    methods = ("modelopt",)
    applies = "the decoder's linear projections not in its ignore list"

    def __init__(self, block: dict[str, Any], exclude: tuple[str, ...], inputs: bool, kv_fp8: bool = False) -> None:
        super().__init__(block)
        self.exclude, self.inputs, self.kv_fp8 = exclude, inputs, kv_fp8
        stored: tuple[Stored, ...] = (Nibbles("", ("U8",), (1, 2)), Stored("_scale", ("F8_E4M3",), (1, BLOCK)),
                                      Stored("_scale_2", ("F32",), (0, 0), flat=True, scalar=True))
        if inputs:
            stored += (Stored("input_scale", ("F32",), (0, 0), flat=True, scalar=True, sibling=True),)
        self._stored = stored

    @classmethod
    def from_config(cls, block: dict[str, Any], config: dict[str, Any]) -> ModelOptNVFP4:
        for key in sorted(block):
            if key not in _READ | _INERT | _KV:
                raise _refuse(key, "is a ModelOpt key shardc does not implement",
                              "start from a checkpoint without it, or from the unquantized checkpoint")
        kv_fp8 = any([_kv_fp8(k, block[k]) for k in sorted(_KV & set(block))])  # each key checked
        algo = block.get("quant_algo")
        if not isinstance(algo, str) or algo.upper() != "NVFP4":
            raise _refuse("quant_algo", f"is {algo!r}; shardc reads ModelOpt's NVFP4",
                          "start from the unquantized checkpoint")
        if block.get("group_size", BLOCK) != BLOCK:
            raise _refuse("group_size", f"is {block.get('group_size')!r}; NVFP4 stores one scale per {BLOCK} values",
                          f"group_size: {BLOCK}")
        if "ignore" in block and "exclude_modules" in block:
            raise _refuse("exclude_modules", "is given beside ignore; one list of excluded modules is read",
                          "keep ignore (config.json's key)")
        exclude = block.get("ignore", block.get("exclude_modules")) or []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise _refuse("ignore", f"is {exclude!r}; it must be a list of module names or wildcards",
                          "ignore: [lm_head, 'model.layers.*.self_attn*']")
        return cls(block, tuple(exclude), _group(block), kv_fp8)

    @property
    def label(self) -> str:
        return "modelopt nvfp4 (e2m1, fp8 scale per 16)"

    def kv_cache_dtype(self) -> str | None:
        return "fp8" if self.kv_fp8 else None

    def unbuilt(self, name: str) -> bool:
        return self.kv_fp8 and _KV_SCALE.fullmatch(name) is not None

    def kept_block(self) -> dict[str, Any]:
        """The source's block without its KV-cache keys: the build holds no KV scales, so vLLM
        must not run an FP8 KV cache on scales of 1 (its ``auto`` then gives the model's dtype)."""
        return {k: v for k, v in self.block.items() if k not in _KV} if self.kv_fp8 else self.block

    def record(self) -> dict[str, Any]:
        note = {"kv_cache": "the source's FP8 KV-cache scales are left out: the build's KV cache is 16-bit"}
        return super().record() | (note if self.kv_fp8 else {})

    def excluded(self, module: str) -> bool:
        """vLLM's rule (``is_layer_excluded``): equal, contained, or an fnmatch wildcard."""
        return any(e == module or e in module or fnmatch(module, e) for e in self.exclude)

    def quantized(self, model: ModelSpec) -> set[str]:
        return {n for n in quantizable(model) if not self.excluded(n.removesuffix(".weight"))}

    def stored(self, name: str) -> tuple[Stored, ...]:
        return self._stored

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        for name, shape in sorted(shapes.items()):
            if shape[-1] % BLOCK:
                raise _refuse("group_size", f"is {BLOCK}, which does not divide the {shape[-1]} columns of "
                              f"weight {name} {list(shape)}", "a checkpoint quantized with whole blocks on every row")

    def check_values(self, tensor: str, st: Stored, values: np.ndarray) -> None:
        check_scales(tensor, st, values)

    def dequantize(self, name: str, shape: tuple[int, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
        """float32: e2m1 * (float32(weight_scale) * weight_scale_2), ModelOpt's products."""
        import numpy as np

        values_st, scale_st, second = self._stored[:3]
        values, scale = np.asarray(read(values_st.tensor(name))), np.asarray(read(scale_st.tensor(name)))
        s2 = np.asarray(read(second.tensor(name)), np.float32).reshape(-1)
        check_global(second.tensor(name), s2)
        check_block_scales(scale_st.tensor(name), scale)
        rows_n, cols = shape
        out = np.empty(shape, np.float32)
        for rows in row_chunks(rows_n, cols):  # the values straight into the output, scaled in place
            dst = out[rows]
            unpack_e2m1(values[rows], dst)
            dst.reshape(dst.shape[0], -1, BLOCK)[...] *= (scale[rows].astype(np.float32) * s2[0])[:, :, None]
        return out
