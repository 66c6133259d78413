"""Every key a compressed-tensors ``quantization_config`` may hold, classified by what shardc does
with it, so that a key is refused only when its value would change the math.

The tables list every field of compressed-tensors' ``QuantizationConfig``, ``QuantizationScheme``
and ``QuantizationArgs`` (0.20, pydantic models) and the keys ``ModelCompressor.update_config``
adds beside them (``version``, ``sparsity_config``, ``transform_config``); the test
(tests/compiler/test_quant_source_ct_keys.py) introspects the installed models and fails when a
release adds a field not listed here. A key in no table is refused by name.

- READ: shardc reads it; a value it does not implement is refused by name (compressed.py).
- INERT: no value changes the stored weights or their dequantization (bookkeeping, calibration
  settings: ``observer``; ``zp_dtype``, which only zero points use, and those are refused).
- UNSET: accepted only at a value that changes nothing (null, ``{}``, ``[]``: what the library
  writes when the feature is off); any other value is refused with the reason below.
"""

from __future__ import annotations

from typing import Any

from ...errors import QuantizationError

READ, INERT, UNSET = "read", "inert", "unset"

CONFIG = {
    "config_groups": READ, "quant_method": READ, "format": READ, "quantization_status": READ, "ignore": READ,
    "kv_cache_scheme": UNSET, "global_compression_ratio": INERT, "moe_sparsity_config": UNSET,
    # written by ModelCompressor.update_config beside the QuantizationConfig's own fields
    "version": INERT, "sparsity_config": UNSET, "transform_config": UNSET,
}
SCHEME = {"targets": READ, "weights": READ, "input_activations": READ, "output_activations": UNSET, "format": READ}
ARGS = {
    "num_bits": READ, "type": READ, "symmetric": READ, "group_size": READ, "strategy": READ, "dynamic": READ,
    "actorder": READ, "scale_dtype": READ, "block_structure": UNSET,
    "zp_dtype": INERT, "observer": INERT, "observer_kwargs": INERT,
}

# why a set UNSET key is refused: (message, hint)
_WHY = {
    "kv_cache_scheme": ("is set: it quantizes the KV cache, which changes the model's math and is not read",
                        "use a checkpoint without KV-cache quantization"),
    "moe_sparsity_config": ("is set: pruned or merged experts change the model and are not read",
                            "use a checkpoint with every expert"),
    "sparsity_config": ("is set: sparse compressed weights are not read", "use a dense checkpoint"),
    "transform_config": ("is set: it changes the model's math and is not read",
                         "use a checkpoint quantized without transforms"),
    "output_activations": ("is set: output quantization is not read", "use a weight-only or W8A8 scheme"),
    "block_structure": ("is set: block-scaled compressed-tensors weights are not read",
                        "use a channel or group strategy"),
}


def unset(key: str, value: Any) -> bool:
    """Whether ``value`` of UNSET key ``key`` leaves the math alone: null, empty, a sparsity
    config whose format is ``dense`` (weights stored as they are; older llm-compressor wrote one),
    or a transform config without groups (no transform applied)."""
    if value is None or value == {} or value == []:
        return True
    if key == "sparsity_config":
        return isinstance(value, dict) and value.get("format") == "dense"
    return key == "transform_config" and isinstance(value, dict) and value.keys() == {"config_groups"} \
        and value["config_groups"] in ({}, None)


def check_keys(block: dict[str, Any], table: dict[str, str], where: str) -> None:
    """Every key of ``block`` classified by ``table``, each UNSET one at a value that changes
    nothing; else a QuantizationError naming ``quantization_config.<where><key>``."""
    for key in sorted(block):
        kind = table.get(key)
        name = f"quantization_config.{where}{key}"
        if kind is None:
            raise QuantizationError("is a compressed-tensors key shardc does not implement", key=name,
                                    hint="start from a checkpoint without it, or from the unquantized checkpoint")
        if kind == UNSET and not unset(key, block[key]):
            message, hint = _WHY[key]
            raise QuantizationError(message, key=name, hint=hint)
