"""Plan files: the deployment config of one replica group, validated strictly before any work.

The schema is data (``_SCHEMA``): every key with its type, whether it is required, and a check. An
unknown key anywhere is an error that names it. Model-dependent checks (heads divisible by tp, ...)
live in layout.py, because they need the model too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..errors import PlanError

DTYPES = ("fp16", "bf16", "int8", "fp8")
QUANTIZED_DTYPES = ("int8", "fp8")
DEFAULT_SHARD_PREFIX = "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"
DEFAULT_IGNORE = ("lm_head", "embed_tokens")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "must be a positive integer"
    return None


def _positive_number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return "must be a positive number"
    return None


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _name(value: Any) -> str | None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        return "must be 1-128 characters of letters, digits, '.', '_' or '-' (it names a directory)"
    return None


def _shard_prefix(value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    fields = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
    if fields != {"tp_rank", "pp_stage"}:
        return "must use exactly the fields {tp_rank} and {pp_stage}"
    try:
        sample = value.format(tp_rank=0, pp_stage=0)
    except (ValueError, KeyError) as exc:
        return f"is not a valid format string ({exc})"
    if "/" in sample or "\\" in sample or sample.startswith(".") or not sample.endswith(".safetensors"):
        return "must be a plain file name ending in .safetensors (no directories)"
    return None


def _layer_list(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "must be a list of positive integers, one per pipeline stage"
    if any(_positive_int(v) for v in value):
        return "must be a list of positive integers, one per pipeline stage"
    return None


def _string_list(value: Any) -> str | None:
    if not isinstance(value, list) or any(not isinstance(v, str) or not v for v in value):
        return "must be a list of non-empty strings"
    return None


def _any(value: Any) -> str | None:
    return None


# key -> (required, check). Nested dicts are sections.
_SCHEMA: dict[str, Any] = {
    "replica_group": {
        "name": (True, _name),
        "tp_degree": (True, _positive_int),
        "pp_degree": (True, _positive_int),
        "dtype": (True, _one_of(*DTYPES)),
        "gpus_per_replica": (True, _positive_int),
        "nvlink_domain": (False, _string),
        "kv_cache_cap_gb": (False, _positive_number),
        "max_concurrent_sequences": (False, _positive_int),
        "checkpoint": {
            "manifest_uri": (False, _string),
            "shard_prefix": (False, _shard_prefix),
        },
    },
    "model": {
        "source": (True, _string),
        "pp_layers": (False, _layer_list),
    },
    "quantization": {
        "ignore": (False, _string_list),
        "base_dtype": (False, _one_of("fp16", "bf16")),
    },
    "autoscaling": (False, _any),
}
_REQUIRED_SECTIONS = ("replica_group", "model")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated plan. ``data`` is the normalized dict that is hashed and recorded."""

    name: str
    tp: int
    pp: int
    dtype: str
    source: str
    pp_layers: tuple[int, ...] | None
    shard_prefix: str
    manifest_uri: str | None
    quant_ignore: tuple[str, ...]
    base_dtype: str | None
    kv_cache_cap_gb: float | None
    data: dict[str, Any]
    source_label: str | None = None  # the source as written, when ``source`` was resolved from it

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.data)).hexdigest()

    def shard_name(self, tp_rank: int, pp_stage: int) -> str:
        return self.shard_prefix.format(tp_rank=tp_rank, pp_stage=pp_stage)

    def with_source(self, source: str) -> Plan:
        """The same plan reading weights from ``source``.

        The recorded plan (and so its sha256) keeps ``model.source`` as written, so the same plan
        file gives the same shard bytes wherever the checkout or the weights live.
        """
        return dataclasses.replace(self, source=source, source_label=None)

    @property
    def source_uri(self) -> str:
        """What the manifest records: the plan's own words unless overridden (no absolute
        checkout paths, so the record is the same in every clone)."""
        return self.source_label or self.source


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, fixed separators, UTF-8: same object, same bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def _validate(section: dict[str, Any], schema: dict[str, Any], path: str) -> None:
    for key in section:
        if key not in schema:
            where = f"{path}.{key}" if path else key
            allowed = ", ".join(schema)
            raise PlanError(f"unknown key (allowed here: {allowed})", key=where)
    for key, rule in schema.items():
        where = f"{path}.{key}" if path else key
        if isinstance(rule, dict):
            value = section.get(key)
            if value is None:
                if key in _REQUIRED_SECTIONS and not path:
                    raise PlanError("missing section", key=where, hint=_example_hint())
                continue
            if not isinstance(value, dict):
                raise PlanError(f"must be a mapping, found {type(value).__name__}", key=where)
            _validate(value, rule, where)
            continue
        required, check = rule
        if key not in section or section[key] is None:
            if required:
                raise PlanError("missing required key", key=where, hint=_example_hint())
            continue
        problem = check(section[key])
        if problem:
            raise PlanError(f"{problem}, found {section[key]!r}", key=where)


def _example_hint() -> str:
    return "see plans/tp4pp2-fp16.yaml for a complete example"


def plan_from_dict(raw: Any) -> Plan:
    """Validate a plan dict (as parsed from YAML) and normalize it."""
    if not isinstance(raw, dict):
        raise PlanError("a plan must be a YAML mapping with replica_group and model sections")
    _validate(raw, _SCHEMA, "")
    rg = raw["replica_group"]
    tp, pp = rg["tp_degree"], rg["pp_degree"]
    if rg["gpus_per_replica"] != tp * pp:
        raise PlanError(
            f"is {rg['gpus_per_replica']} but tp_degree * pp_degree = {tp} * {pp} = {tp * pp}",
            key="replica_group.gpus_per_replica",
            hint=f"set gpus_per_replica: {tp * pp}",
        )
    model = raw["model"]
    pp_layers = model.get("pp_layers")
    if pp_layers is not None and len(pp_layers) != pp:
        raise PlanError(
            f"has {len(pp_layers)} entries but pp_degree is {pp}",
            key="model.pp_layers",
            hint="give one layer count per pipeline stage, or drop pp_layers for an even split",
        )
    ckpt = rg.get("checkpoint") or {}
    quant = raw.get("quantization") or {}
    data = json.loads(json.dumps(raw))  # plain JSON types only; copies
    data.setdefault("replica_group", {}).setdefault("checkpoint", {})
    data["replica_group"]["checkpoint"].setdefault("shard_prefix", DEFAULT_SHARD_PREFIX)
    data.setdefault("quantization", {}).setdefault("ignore", list(DEFAULT_IGNORE))
    return Plan(
        name=rg["name"],
        tp=tp,
        pp=pp,
        dtype=rg["dtype"],
        source=model["source"],
        pp_layers=tuple(pp_layers) if pp_layers else None,
        shard_prefix=ckpt.get("shard_prefix", DEFAULT_SHARD_PREFIX),
        manifest_uri=ckpt.get("manifest_uri"),
        quant_ignore=tuple(quant.get("ignore", DEFAULT_IGNORE)),
        base_dtype=quant.get("base_dtype"),
        kv_cache_cap_gb=rg.get("kv_cache_cap_gb"),
        data=data,
    )


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file. A relative local ``model.source`` is relative to the plan file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read plan file {path}: {exc.strerror}", hint="check the path") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PlanError(f"{path} is not valid YAML{where}", hint="fix the YAML syntax") from None
    plan = plan_from_dict(raw)
    src = plan.source
    if "://" not in src and not Path(src).is_absolute():
        plan = dataclasses.replace(plan, source=str((path.parent / src).resolve()), source_label=src)
    return plan
