"""Plan files: the deployment config of one replica group, validated strictly before any work.

The schema is data (``_SCHEMA``): every key with its type, whether it is required, and a check. An
unknown key anywhere is an error that names it. Model-dependent checks (heads divisible by tp, ...)
live in ranks.py (the Layout), because they need the model too. The document is read with bounds
first (plan_document.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..digests import CHUNK_DIGESTS, DEFAULT_CHUNK_DIGEST
from ..errors import PlanError
from .dtypes import PLAN_DTYPE
from .plan_document import check_plain, read_plan_yaml

# The plan's words for an output dtype (the dtype table's, layout/dtypes.py), and "source": a
# quantized source kept as stored.
PLAN_DTYPES = (*PLAN_DTYPE, "source")
QUANTIZED_DTYPES = ("int8", "fp8")
DEFAULT_SHARD_PREFIX = "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"
# with attention data parallelism (dp_degree > 1) each DP group's ranks hold their own experts
DP_SHARD_PREFIX = "model-dp{dp_rank:02d}-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"
DEFAULT_IGNORE = ("lm_head", "embed_tokens")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A plain file name, the one pattern for every name shardc writes or reads back from a manifest or an
# index (formats/files.py ``safe_name``): no directory, no leading dot. A plan's shard names are
# also at most MAX_FILE_NAME characters.
SAFE_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
MAX_FILE_NAME = 200
# Bounds that keep a hostile plan from costing memory or time before it is refused.
MAX_TP = 4096
MAX_PP = 4096
MAX_WORLD = 65536
_SPEC_RE = re.compile(r"0?[1-9]?d?")


def _positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "must be a positive integer"
    return None


def _bounded_int(limit: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if _positive_int(value):
            return "must be a positive integer"
        return None if value <= limit else f"must be at most {limit}"

    return check


def _positive_number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return "must be a positive number"
    if not math.isfinite(value):
        return "must be a finite positive number"
    return None


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _name(value: Any) -> str | None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):  # fullmatch: `$` would let "name\n" through
        return "must be 1-128 characters of letters, digits, '.', '_' or '-' (it names a directory)"
    return None


def _shard_prefix(value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    try:
        parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        return f"is not a valid format string ({exc})"
    if {f for f, _, _ in parsed} not in ({"tp_rank", "pp_stage"}, {"tp_rank", "pp_stage", "dp_rank"}):
        return "must use exactly the fields {tp_rank} and {pp_stage} (and {dp_rank} with dp_degree > 1)"
    for _, spec, conv in parsed:  # a width of 10**9 would build a 1 GB name
        if conv or not _SPEC_RE.fullmatch(spec or ""):
            return f"may format a rank only as an integer (like {{tp_rank:02d}}), found {{...:{spec}}}"
    for tp_rank, pp_stage in ((0, 0), (1, 0), (0, 1), (MAX_TP - 1, MAX_PP - 1)):
        try:
            sample = value.format(tp_rank=tp_rank, pp_stage=pp_stage, dp_rank=tp_rank)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return f"is not a valid format string ({exc})"
        if not sample.endswith(".safetensors") or not SAFE_FILE_NAME.fullmatch(sample) or len(sample) > MAX_FILE_NAME:
            return ("must give plain file names ending in .safetensors: letters, digits, '.', '_', "
                    "'-', not starting with '.' (no directories, no spaces)")
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
        "tp_degree": (True, _bounded_int(MAX_TP)),
        "pp_degree": (True, _bounded_int(MAX_PP)),
        "dtype": (True, _one_of(*PLAN_DTYPES)),
        "gpus_per_replica": (True, _bounded_int(MAX_WORLD)),
        "nvlink_domain": (False, _string),
        "kv_cache_cap_gb": (False, _positive_number),
        "max_concurrent_sequences": (False, _positive_int),
        "expert_parallel": (False, _bool),
        "dp_degree": (False, _bounded_int(MAX_TP)),
        "checkpoint": {
            "manifest_uri": (False, _string),
            "shard_prefix": (False, _shard_prefix),
            "chunk_digest": (False, _one_of(*CHUNK_DIGESTS)),
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
    # whole routed experts placed on the TP ranks of a stage (docs/architecture.md §4); recorded
    # in ``data`` only when the plan says it, so other plans hash as before
    expert_parallel: bool = False
    dp: int = 1  # attention data-parallel groups of tp ranks per stage (expert_parallel plans)
    source_label: str | None = None  # the source as written, when ``source`` was resolved from it
    # Plan keys the command line replaced (``build --source``: {"model.source": "<as typed>"}).
    # ``data`` stays the plan file's, so shard metadata does not depend on where the weights lie;
    # the manifest records these and the effective plan's hash (docs/architecture.md §3.3).
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    # what each chunk of a shard is hashed with in the manifest (replica_group.checkpoint.chunk_digest)
    chunk_digest: str = DEFAULT_CHUNK_DIGEST

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def sha256(self) -> str:
        return data_sha256(self.data)

    @property
    def effective_data(self) -> dict[str, Any]:
        """The plan as this build applies it: ``data`` with the command-line overrides."""
        return apply_overrides(self.data, self.overrides)

    @property
    def effective_sha256(self) -> str:
        """What the manifest records as ``effective_plan_sha256`` (the plan's own hash when
        nothing was overridden)."""
        return data_sha256(self.effective_data) if self.overrides else self.sha256

    def shard_name(self, tp_rank: int, pp_stage: int, dp_rank: int = 0) -> str:
        return self.shard_prefix.format(tp_rank=tp_rank, pp_stage=pp_stage, dp_rank=dp_rank)

    def with_source(self, source: str) -> Plan:
        """The same plan reading weights from ``source`` (``--source``, as the user typed it).

        The recorded plan (and so its sha256 and the shard metadata) keeps ``model.source`` as
        written, so the same plan file gives the same shard bytes wherever the weights live; the
        override is kept in ``overrides``, so the manifest says which source the build was made
        from and ``verify --plan`` can insist on it. An override in the plan's own words changes
        nothing and is not recorded.
        """
        overrides = dict(self.overrides)
        if source == self.data["model"]["source"]:
            overrides.pop("model.source", None)
        else:
            overrides["model.source"] = source
        return dataclasses.replace(self, source=source, source_label=None, overrides=overrides)

    @property
    def source_uri(self) -> str:
        """What the manifest records: the plan's own words unless overridden (no absolute
        checkout paths, so the record is the same in every clone)."""
        return self.source_label or self.source


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, fixed separators, UTF-8: same object, same bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def data_sha256(data: dict[str, Any]) -> str:
    """The sha256 of a normalized plan: of its canonical JSON."""
    return hashlib.sha256(canonical_json(data)).hexdigest()


# Plan keys a command line may override (dotted paths into the plan): `shardc build --source`.
OVERRIDABLE = ("model.source",)


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted key set to its override (``data`` is not changed)."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    for dotted, value in overrides.items():
        if dotted not in OVERRIDABLE:
            raise PlanError(f"cannot be overridden (only {', '.join(OVERRIDABLE)})", key=dotted)
        *sections, key = dotted.split(".")
        node = out
        for sec in sections:
            node = node.setdefault(sec, {})
        node[key] = value
    return out


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
    check_plain(raw)
    _validate(raw, _SCHEMA, "")
    rg = raw["replica_group"]
    tp, pp, dp = rg["tp_degree"], rg["pp_degree"], rg.get("dp_degree", 1)
    if dp > 1 and not rg.get("expert_parallel"):
        raise PlanError(f"is {dp}, but attention data parallelism serves the experts of a "
                        "mixture-of-experts model spread over every rank, which needs expert_parallel",
                        key="replica_group.dp_degree",
                        hint="add expert_parallel: true (an MoE model), or use dp_degree: 1 and more replicas")
    if rg["gpus_per_replica"] != tp * pp * dp:
        what = f"tp_degree * pp_degree = {tp} * {pp}" if dp == 1 else \
            f"tp_degree * pp_degree * dp_degree = {tp} * {pp} * {dp}"
        raise PlanError(
            f"is {rg['gpus_per_replica']} but {what} = {tp * pp * dp}",
            key="replica_group.gpus_per_replica",
            hint=f"set gpus_per_replica: {tp * pp * dp}",
        )
    default_prefix = DEFAULT_SHARD_PREFIX if dp == 1 else DP_SHARD_PREFIX
    prefix = (rg.get("checkpoint") or {}).get("shard_prefix") or default_prefix
    if len({prefix.format(tp_rank=t, pp_stage=s, dp_rank=d) for t in range(tp) for s in range(pp)
            for d in range(dp)}) != tp * pp * dp:
        raise PlanError(f"gives two ranks the same file name ({prefix!r})",
                        key="replica_group.checkpoint.shard_prefix",
                        hint="use {tp_rank:02d} and {pp_stage:02d}" + (" and {dp_rank:02d}" if dp > 1 else ""))
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
    for key, default in (("ignore", list(DEFAULT_IGNORE)), ("base_dtype", None)):
        # the source's quantization_config decides (the default ignore list: what a manifest records)
        if rg["dtype"] == "source" and quant.get(key, default) != default:
            raise PlanError("applies to int8/fp8 plans; dtype: source keeps the source's quantization as "
                            "it is (its config's own ignore list)", key=f"quantization.{key}",
                            hint="drop it, or use dtype bf16/int8/fp8 to dequantize (and requantize)")
    data = json.loads(json.dumps(raw))  # plain JSON types only; copies
    data.setdefault("replica_group", {}).setdefault("checkpoint", {})
    data["replica_group"]["checkpoint"].setdefault("shard_prefix", default_prefix)
    data.setdefault("quantization", {}).setdefault("ignore", list(DEFAULT_IGNORE))
    return Plan(
        name=rg["name"],
        tp=tp,
        pp=pp,
        dtype=rg["dtype"],
        source=model["source"],
        pp_layers=tuple(pp_layers) if pp_layers else None,
        shard_prefix=ckpt.get("shard_prefix", default_prefix),
        manifest_uri=ckpt.get("manifest_uri"),
        quant_ignore=tuple(quant.get("ignore", DEFAULT_IGNORE)),
        base_dtype=quant.get("base_dtype"),
        kv_cache_cap_gb=rg.get("kv_cache_cap_gb"),
        data=data,
        expert_parallel=bool(rg.get("expert_parallel", False)),
        dp=dp,
        chunk_digest=ckpt.get("chunk_digest", DEFAULT_CHUNK_DIGEST),
    )


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file. A relative local ``model.source`` is relative to the plan file."""
    path = Path(path)
    raw = read_plan_yaml(path)
    plan = plan_from_dict(raw)
    src = plan.source
    if "://" not in src and not Path(src).is_absolute():
        plan = dataclasses.replace(plan, source=str((path.parent / src).resolve()), source_label=src)
    return plan
