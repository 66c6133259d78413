"""What the shardc runtime's forward implements, checked before any rank starts.

The runtime is one decoder (``runtime/decoder.py``) that computes what each family module's
``Forward`` declares; a family module refuses, when it reads a config, any value of its own keys
it cannot honour. What is left is checked here: a config key whose value the decoder does not
compute must never run as something else (a ``gelu`` model as SiLU, a yarn rope as the default
one): every value the forward implements is listed here, and ``check_supported`` refuses the rest
with one line naming the key and the value. Pure data and arithmetic: no torch.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ModelError
from ..layout.families.family import short
from ..layout.model import ModelSpec

# config.json hidden_act -> (torch.nn.functional function, keyword arguments): transformers'
# ACT2FN names whose function is exactly that (gelu_new and gelu_fast are the tanh approximation
# written out; gelu is the exact erf form).
ACTIVATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "silu": ("silu", {}),
    "swish": ("silu", {}),
    "gelu": ("gelu", {}),
    "gelu_pytorch_tanh": ("gelu", {"approximate": "tanh"}),
    "gelu_new": ("gelu", {"approximate": "tanh"}),
    "gelu_fast": ("gelu", {"approximate": "tanh"}),
    "relu": ("relu", {}),
}
# rope_type -> the fields its formula reads (transformers' modeling_rope_utils)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# rope types only some families' forward takes (Forward.yarn: DeepSeek-V3)
YARN: dict[str, tuple[str, ...]] = {"yarn": ("factor",)}
_HINT = "the shardc runtime does not compute this model; serve the build with an engine that does"


def activation_fn(name: Any, key: str = "hidden_act") -> tuple[str, dict[str, Any]]:
    """The torch function of a config's MLP activation (``key`` names where it was read)."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ModelError(f"config.json {key}={name!r} is not implemented by the shardc runtime",
                         key=key, hint=f"implemented: {', '.join(ACTIVATIONS)}; {_HINT}")
    return ACTIVATIONS[name]


def check_supported(model: ModelSpec) -> None:
    """Refuse, with one line naming the key and value, any setting the forward would get wrong."""
    fwd = model.forward
    activation_fn(fwd.activation, "hidden_activation" if "hidden_activation" in model.config
                  and "hidden_act" not in model.config else "hidden_act")
    scaling = model.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    key = "rope_parameters" if model.config.get("rope_parameters") is not None else "rope_scaling"
    types = ROPE_TYPES | (YARN if fwd.yarn else {})
    if not isinstance(kind, str) or kind not in types:
        raise ModelError(f"config.json {key} rope_type={kind!r} is not implemented by the shardc runtime",
                         key=key, hint=f"implemented: {', '.join(types)}; {_HINT}")
    for field in types[kind]:
        value = scaling.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            raise ModelError(f"config.json {key}.{field} must be a positive number for rope_type "
                             f"{kind!r}, found {value!r}", key=f"{key}.{field}", hint=_HINT)
    if kind == "yarn":
        for field in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                      "original_max_position_embeddings"):
            value = scaling.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ModelError(f"config.json {key}.{field} must be a number >= 0 for rope_type 'yarn', "
                                 f"found {value!r}", key=f"{key}.{field}", hint=_HINT)
        if not isinstance(scaling.get("truncate", True), bool):
            raise ModelError(f"config.json {key}.truncate must be true or false, found {scaling['truncate']!r}",
                             key=f"{key}.truncate", hint=_HINT)
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ModelError(f"config.json {key}: low_freq_factor must be below high_freq_factor, found "
                         f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}", key=key, hint=_HINT)
    # transformers 4 writes it at the top level, transformers 5 (Phi-3) inside rope_parameters; a family
    # whose forward turns part of each head (Forward.rotary_dim: MiniMax-M2) takes the factor giving that
    # part, as transformers truncates it (its reader checked each spelling), and no other
    for where, block in (("", model.config), (key + ".", scaling)):
        partial = block.get("partial_rotary_factor", 1.0)
        if fwd.rotary_dim is not None and isinstance(partial, (int, float)) and not isinstance(partial, bool) \
                and int(model.head_dim * partial) == fwd.rotary_dim:
            continue
        if partial not in (None, 1, 1.0):
            raise ModelError(f"config.json {where}partial_rotary_factor={partial!r} is not implemented by "
                             "the shardc runtime (it rotates every dimension)",
                             key=f"{where}partial_rotary_factor", hint=_HINT)


def check_stages(model: ModelSpec, starts: set[int]) -> None:
    """DSA (GLM-5.x ``indexer_types``): a pipeline stage may not begin on a "shared" layer, which
    reuses the top-k of an earlier layer on another stage: the runtime passes only hidden states."""
    mla = model.forward.mla
    if mla is None or mla.indexer is None:
        return
    bad = sorted(s for s in starts if not mla.indexer.own[s])
    if bad:
        full = [i for i, own in enumerate(mla.indexer.own) if own]
        raise ModelError(f"a pipeline stage begins at layer {bad[0]}, whose indexer_types entry is 'shared' "
                         "(it reuses an earlier stage's top-k, which the shardc runtime does not pass between "
                         "stages)", key="indexer_types",
                         hint=f"a pp degree whose stages begin on full layers (of {short(full)}), or pp = 1")
