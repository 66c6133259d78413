"""Test helper: which compressed-tensors configs vLLM's loader accepts, as a small rule table.

vLLM does not run on these machines, so its rules were read in its source and are restated here,
each with the lines it comes from. Source: the vLLM 0.33.0 release (sdist on PyPI, also found with
the code search in vllm-project/vllm), directory
``vllm/model_executor/layers/quantization/compressed_tensors/``:

* ``compressed_tensors.py`` 305-385 ``_quantization_scheme_map_from_config``: a group's own
  ``format`` wins over the top-level one (349-356); when that format is an "activation
  quantization format" and the group has no ``input_activations``, it asserts the weights are
  FLOAT (360-370, the assert at 366): weight-only INT under ``int-quantized`` fails to load (AssertionError).
* ``utils.py`` 43-50 ``is_activation_quantization_format``: naive-quantized, int-quantized,
  float-quantized, nvfp4-pack-quantized.
* ``compressed_tensors.py`` 783-949 ``_get_scheme_from_parts`` (format: the group's, else the
  top-level one, 792). Weight-only INT: 698-708 ``_is_wNa16_group_channel`` (strategy channel or
  group, no input activations, static) AND format ``pack-quantized`` (865-867) select
  ``CompressedTensorsWNA16`` (868-874) for num_bits in ``WNA16_SUPPORTED_BITS``
  (``schemes/compressed_tensors_wNa16.py`` 41-59: 2..8). Weight-only FLOAT: under an activation
  format (876-877), ``_is_fp8_w8a16`` (672-696: symmetric, static, strategy tensor/channel/block)
  selects ``CompressedTensorsW8A16Fp8`` (915-920). Anything else: NotImplementedError (946-949).
* Tensors the schemes register, per linear layer: WNA16 (``schemes/compressed_tensors_wNa16.py``
  116-240) ``weight_packed`` int32 [out, ceil(in * bits / 32)], ``weight_scale`` [out, 1] for
  channel, ``weight_shape`` int64 [2]; W8A16Fp8 (``schemes/compressed_tensors_w8a16_fp8.py``
  57-102) ``weight`` fp8 [out, in] and ``weight_scale`` [out, 1] for channel.
"""

from __future__ import annotations

import math

ACTIVATION_FORMATS = {"naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized"}
WNA16_BITS = range(2, 9)


class Rejected(Exception):
    """vLLM would refuse this config (assertion or NotImplementedError at load)."""


def vllm_scheme(block: dict) -> str:
    """The vLLM scheme class every config group of ``block`` selects (they must agree here)."""
    schemes = set()
    for group in block["config_groups"].values():
        w, act = group["weights"], group.get("input_activations")
        fmt = group.get("format") or block.get("format")
        if fmt in ACTIVATION_FORMATS and not act and w["type"] != "float":
            raise Rejected(f"weight-only {w['type']} under {fmt}: the loader asserts FLOAT weights")
        static = not w.get("dynamic", False)
        if (act is None and static and w["strategy"] in ("channel", "group")
                and fmt == "pack-quantized" and w["type"] == "int" and w["num_bits"] in WNA16_BITS):
            schemes.add("CompressedTensorsWNA16")
        elif (fmt in ACTIVATION_FORMATS and act is None and w["type"] == "float" and w["symmetric"]
              and static and w["strategy"] in ("tensor", "channel", "block")):
            schemes.add("CompressedTensorsW8A16Fp8")
        else:
            raise Rejected(f"no compressed-tensors scheme for {w} with format {fmt}")
    if len(schemes) != 1:
        raise Rejected(f"groups select different schemes {sorted(schemes)}")
    return schemes.pop()


def vllm_tensors(scheme: str, out_f: int, in_f: int, bits: int = 8) -> dict[str, tuple[str, list[int]]]:
    """suffix -> (safetensors dtype, shape) of what the scheme loads for one [out, in] linear."""
    if scheme == "CompressedTensorsWNA16":
        return {"weight_packed": ("I32", [out_f, math.ceil(in_f * bits / 32)]),
                "weight_scale": (None, [out_f, 1]), "weight_shape": ("I64", [2])}
    return {"weight": ("F8_E4M3", [out_f, in_f]), "weight_scale": (None, [out_f, 1])}
