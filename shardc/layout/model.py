"""Model description: the numbers from a Hugging Face config.json that sharding needs.

The numbers every decoder has (sizes, heads, rope) are read here; which family a config belongs to,
the keys only that family reads, and its tensors are the family module's (layout/families/).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelError, ShardcError
from .dtypes import SOURCE_DTYPES, from_torch_name
from .families import BY_ARCHITECTURE, BY_NAME, FAMILIES, Family, Forward
from .families.family import BOUNDS, above, short
from .readfile import CONFIG_LIMIT, read_regular_file

ARCHITECTURES = BY_ARCHITECTURE  # every architecture a family module declares -> its family

# Built-in presets (so plans validate and plan without downloading anything), from the families.
# A preset published quantized carries its quantization_config, as its config.json does.
PRESETS: dict[str, dict[str, Any]] = {
    k: p.config if p.quantization is None else {**p.config, "quantization_config": p.quantization}
    for f in FAMILIES for k, p in f.presets.items()}
# Hub repos whose config equals a preset (lets `hf://org/repo` plans validate offline), lower case.
HUB_PRESETS: dict[str, str] = {r.lower(): k for f in FAMILIES for k, p in f.presets.items()
                               for r in p.repos}
PRESET_SOURCES: dict[str, str] = {k: f"hf://{p.repos[0]}" for f in FAMILIES
                                  for k, p in f.presets.items() if p.repos}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model, as sharding sees it; ``family`` and ``options`` are its family
    module's (layout/families/), which lists its tensors and the forward the runtime computes."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    torch_dtype: str
    config: dict[str, Any] = field(compare=False, repr=False, hash=False)
    family: str = "llama"
    options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def spec(self) -> Family:
        """The family module's declaration (tensor table, forward)."""
        return BY_NAME[self.family]

    @property
    def forward(self) -> Forward:
        return self.spec.forward(self)

    @property
    def source_dtype(self) -> str:
        """safetensors dtype name of the checkpoint, per its config (F16, BF16 or F32)."""
        name = from_torch_name(self.torch_dtype)
        return name if name in SOURCE_DTYPES else "BF16"

    def summary(self) -> dict[str, Any]:
        """Plain-data description recorded in manifests and used by the runtime."""
        return {
            "architecture": self.architecture,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "torch_dtype": self.torch_dtype,
        } | ({} if self.family == "llama" else {"family": self.family})


# summary() field -> the config.json key a user knows (the one home of the renames summary() makes)
_CONFIG_KEY = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "architecture": "architectures",
               "qkv_bias": "attention_bias", "o_bias": "attention_bias"}


def config_key(field: str) -> str:
    """The config.json key behind a ``ModelSpec.summary()`` field, for messages a user acts on."""
    return _CONFIG_KEY.get(field, field)


# The numbers every decoder has, with the upper bounds they are checked against before anything is
# sized from a config (a manifest's config too: formats/manifest.py reads this table):
# ``num_hidden_layers: 1000000000`` would otherwise allocate per-layer tables until MemoryError.
# One table holds these and every count a family reads (families/family.py ``BOUNDS``, each bound
# with the published models it is far above).
LIMITS: dict[str, int] = {key: BOUNDS[key][1] for key in (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings")}
_HINT = "pass the config.json of a Hugging Face checkpoint of a supported family (README: Supported models)"


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"config.json {key} must be a positive integer, found {value!r}", hint=_HINT, key=key)
    if value > LIMITS[key]:
        raise above(key, value, LIMITS[key])
    return value


def _float(cfg: dict[str, Any], key: str, default: float, *, below: float | None = None) -> float:
    """A finite positive number (below ``below`` when given)."""
    value = cfg.get(key, default)
    if value is None:
        value = default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0 or (below is not None and value >= below)):
        bound = f" below {below}" if below is not None else ""
        raise ModelError(f"config.json {key} must be a finite positive number{bound}, found {value!r}",
                         hint=_HINT, key=key)
    return float(value)


def _flag(cfg: dict[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise ModelError(f"config.json {key} must be true or false, found {value!r}", hint=_HINT, key=key)
    return bool(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling, from either spelling of config.json.

    transformers 4 writes ``rope_theta`` and ``rope_scaling``; transformers 5 writes one
    ``rope_parameters`` object holding the theta, ``rope_type`` (``default``: no scaling) and the
    scaling's factors. Reading only the old keys ran a transformers 5 config at the default theta
    (a silently different model), so both are read; when both are present they must agree. The
    result is in the old form: what manifests record, so an old config's bytes are unchanged."""
    params = cfg.get("rope_parameters")
    old_theta = cfg.get("rope_theta")
    old_scaling = cfg.get("rope_scaling")
    if old_scaling is not None and not isinstance(old_scaling, dict):
        raise ModelError(f"config.json rope_scaling must be an object or null, found {old_scaling!r}",
                         hint=_HINT, key="rope_scaling")
    if params is None:
        return _float(cfg, "rope_theta", 10000.0), copy.deepcopy(old_scaling)
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ModelError(f"config.json rope_parameters must be one object of rope settings, found "
                         f"{short(params)}", key="rope_parameters",
                         hint="per-layer-type rope_parameters belong to families shardc does not build")
    key = "rope_parameters.rope_theta"
    theta = _float({key: params.get("rope_theta")}, key, 10000.0 if old_theta is None else old_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" and set(params) <= {"rope_theta", "rope_type", "type"} else {
        k: copy.deepcopy(v) for k, v in params.items() if k != "rope_theta"}
    if old_theta is not None and _float(cfg, "rope_theta", 10000.0) != theta:
        raise ModelError(f"config.json rope_theta={old_theta!r} disagrees with "
                         f"rope_parameters.rope_theta={theta!r}", key="rope_parameters",
                         hint="keep one spelling (transformers 5 writes rope_parameters only)")
    if old_scaling is not None and _rope_kind(old_scaling) != _rope_kind(scaling or {}):
        raise ModelError(f"config.json rope_scaling {short(old_scaling)} disagrees with "
                         f"rope_parameters {short(params)}", key="rope_parameters",
                         hint="keep one spelling (transformers 5 writes rope_parameters only)")
    return theta, scaling


def _rope_kind(scaling: dict[str, Any]) -> dict[str, Any]:
    """A scaling dict with ``type`` spelled ``rope_type`` and the theta left out, for comparing."""
    out = {("rope_type" if k == "type" else k): v for k, v in scaling.items() if k != "rope_theta"}
    return {} if out in ({}, {"rope_type": "default"}) else out


# transformers' model_type of every architecture shardc knows -> that architecture
MODEL_TYPES: dict[str, str] = {t: a for f in FAMILIES for a, t in f.model_types.items()}


def _architecture(cfg: dict[str, Any]) -> str:
    """The one architecture config.json names, known to shardc and not contradicted by its
    model_type. transformers builds a checkpoint by ``model_type`` (AutoConfig's classes), vLLM by
    ``architectures``, so a config naming two architectures, or whose model_type is another
    known architecture's (Llama's tensors read as Qwen2's, with q/k/v biases), is two models at
    once and refused. A model_type shardc does not know stays accepted: the architecture decides
    (Kimi-K2 ships ``kimi_k2`` over DeepseekV3ForCausalLM)."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, list) and len(archs) > 1:
        raise ModelError(f"config.json architectures names {len(archs)} architectures, {short(archs)}; "
                         "transformers and vLLM may each build a different one", key="architectures",
                         hint="list the one architecture whose tensors the checkpoint holds")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {short(arch)}",
            hint=f"supported: {', '.join(sorted(ARCHITECTURES))} (README: Supported models)",
            key="architectures",
        )
    kind = cfg.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise ModelError(f"config.json model_type must be a string, found {short(kind)}", key="model_type",
                         hint=f"{ARCHITECTURES[arch].model_types[arch]!r}, transformers' model_type of {arch}")
    if kind in MODEL_TYPES and MODEL_TYPES[kind] != arch:
        raise ModelError(f"config.json model_type={kind!r} is {MODEL_TYPES[kind]}'s, but architectures names "
                         f"{arch} (transformers builds by model_type, vLLM by architectures)", key="model_type",
                         hint=f"model_type {ARCHITECTURES[arch].model_types[arch]!r} for {arch}, or architectures "
                              f"[{MODEL_TYPES[kind]!r}]: whichever the checkpoint's tensors are")
    return arch


def model_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """Validate a Hugging Face config dict and turn it into a ModelSpec."""
    if not isinstance(cfg, dict):
        raise ModelError("config.json is not a JSON object", hint="pass a Hugging Face config.json")
    arch = _architecture(cfg)
    family = ARCHITECTURES[arch]
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
    if head_dim < 1:
        raise ModelError(f"hidden_size={hidden} is smaller than num_attention_heads={heads}", key="hidden_size")
    rope_theta, rope_scaling = family.rope(cfg, _rope) if family.rope is not None else _rope(cfg)
    if heads % kv:
        raise ModelError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
            key="num_key_value_heads",
        )
    layers = _int(cfg, "num_hidden_layers")  # bounded before a family sizes per-layer tables by it
    options = family.read(cfg)
    tied = options.pop("tie_word_embeddings", False)  # the family's default when the key is absent
    attention_bias = _flag(cfg, "attention_bias")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if not isinstance(dtype, str):
        raise ModelError(f"config.json torch_dtype must be a string, found {dtype!r}", hint=_HINT, key="torch_dtype")
    return ModelSpec(
        architecture=arch,
        hidden_size=hidden,
        # a family whose config has none (Qwen3.5-MoE: every layer routed) gives its own, read by count()
        intermediate_size=options.pop("intermediate_size", None) or _int(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size"),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings") if "tie_word_embeddings" in cfg else tied,
        qkv_bias=options.pop("qkv_bias", False) or attention_bias,
        o_bias=options.pop("o_bias", False) or attention_bias,
        mlp_bias=_flag(cfg, "mlp_bias"),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6, below=1.0),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        torch_dtype=dtype,
        config=copy.deepcopy(cfg),
        family=family.name,
        options=options,
    )


def load_model(ref: str | Path) -> ModelSpec:
    """A preset name, a config.json path, or a directory holding config.json."""
    key = str(ref).lower()
    if key in PRESETS:
        return model_from_config(PRESETS[key])
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelError(
            f"no model preset or config.json at {ref!r}",
            hint=f"use a preset ({', '.join(sorted(PRESETS))}), a config.json or a checkpoint directory",
            key="model",
        )
    return model_from_config(read_config(path, ModelError))


def _no_constant(name: str) -> Any:
    # NaN / Infinity parse in Python but are not JSON: the config is copied into manifest.json
    raise ValueError(f"{name} is not a JSON number")


def read_config(path: Path, error: type[ShardcError] = ModelError) -> dict[str, Any]:
    """A config.json (bounded regular file, JSON object); anything else is one ``error``."""
    data = read_regular_file(path, limit=CONFIG_LIMIT, what="config file", error=error)
    try:
        cfg = json.loads(data, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise error(f"cannot read {path}: {exc}", key="model", hint=_HINT) from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to be a config.json", key="model", hint=_HINT) from None
    if not isinstance(cfg, dict):
        raise error(f"{path} is not a JSON object", key="model", hint=_HINT)
    legacy = path.parent / LEGACY_QUANT
    if path.name == "config.json" and "quantization_config" not in cfg and legacy.exists():  # ModelOpt: older exports
        cfg["quantization_config"] = legacy_block(legacy, read_config(legacy, error), error)
    return cfg


LEGACY_QUANT = "hf_quant_config.json"  # beside a ModelOpt export's config.json, read as its quantization_config


def legacy_block(path: Path, hf_quant: dict[str, Any], error: type[ShardcError] = ModelError) -> dict[str, Any]:
    """``hf_quant_config.json`` (ModelOpt's older exports: ``{"producer", "quantization": {quant_algo,
    kv_cache_quant_algo, group_size, exclude_modules}}``, config.json without a quantization_config)
    as the quantization_config vLLM reads from config.json: its keys, ``exclude_modules`` as
    ``ignore`` (vLLM's flat form reads that key), so a ``dtype: source`` build's config.json serves."""
    quant = hf_quant.get("quantization")
    if not isinstance(quant, dict):
        raise error(f"{path} has no quantization mapping", key="quantization",
                                hint="an hf_quant_config.json as ModelOpt exports it, or remove the file")
    block = {k: v for k, v in quant.items() if k != "exclude_modules"} | {"quant_method": "modelopt"}
    if "exclude_modules" in quant:
        block["ignore"] = quant["exclude_modules"]
    if "producer" in hf_quant:
        block["producer"] = hf_quant["producer"]
    return block


def model_for_source(source: str, override: str | None = None) -> ModelSpec:
    """The model a plan's source implies, without reading weights: ``override`` (preset or
    config), a local directory's config.json, or the preset of a known hub repo (offline)."""
    if override:
        return load_model(override)
    if source.startswith("hf://"):
        repo = source.removeprefix("hf://").split("@", 1)[0].lower()
        if repo in HUB_PRESETS:
            return load_model(HUB_PRESETS[repo])
        raise ModelError(
            f"no built-in preset for {source}",
            hint=f"give `model` a preset ({', '.join(sorted(PRESETS))}) or a config.json",
        )
    return load_model(source.removeprefix("file://"))
