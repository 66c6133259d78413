"""Checks that span a whole manifest rather than one record: nesting depth before anything walks
it, chunk digests in every shard or none (by format version), the shard count and tensor records
a plan of that size needs (before a Layout is sized from it), the overrides and the effective
plan's hash that come with them. Each failure is one ManifestError naming the key. And, once the
Layout is built, each shard's size against it (``size_problem``: the loader raises it as a
VerifyMismatch, verify reports it, as they do the manifest's tensor records against the Layout)."""

from __future__ import annotations

import json
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import ManifestError
from ..layout.plan import OVERRIDABLE
from ..layout.ranks import Layout, RankLayout
from .manifest_records import MAX_DEGREE, REBUILD, FieldReader, ShardEntry

# Levels of objects and arrays: a real manifest has under ten (a tensor record's stats, an HF
# config's rope_scaling); a few thousand would end in RecursionError in whatever recursed first.
MAX_NESTING = 64


def read_source_quantization(r: FieldReader) -> dict[str, str] | None:
    source_quantization = r.optional_sub("source_quantization")
    if source_quantization is None:
        return None
    source_quantization.only("format", "quant_method", "applied", "kv_cache")
    out = {k: source_quantization.get(k, str) for k in ("format", "quant_method", "applied")}
    kv = source_quantization.get("kv_cache", str, optional=True)  # ModelOpt's FP8 KV cache left out
    return out if kv is None else out | {"kv_cache": kv}


def check_depth(m: dict[str, Any], origin: str) -> None:
    """At most MAX_NESTING levels of objects and arrays, walked level by level without recursion
    (the data is a tree: it came from JSON), so a manifest nested thousands deep is one
    ManifestError rather than a RecursionError wherever it is first walked (``==``, ``json.dumps``)."""
    level: list[tuple[Any, str]] = [(m, "")]
    for _ in range(MAX_NESTING):
        deeper: list[tuple[Any, str]] = []
        for value, where in level:
            pairs = value.items() if isinstance(value, dict) else enumerate(value)
            deeper += [(v, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]")
                       for k, v in pairs if isinstance(v, (dict, list))]
        if not deeper:
            return
        level = deeper
    raise plain_error(origin, level[0][1], f"is nested deeper than {MAX_NESTING} levels")


def as_json(m: Any, origin: str) -> Any:
    """A caller's manifest data as JSON would give it (a copy): a value that is not JSON, a cycle,
    a key that cannot be a string or nesting beyond the encoder's limit is one ManifestError."""
    try:
        return json.loads(json.dumps(m))
    except RecursionError:
        raise plain_error(origin, "", f"is nested deeper than {MAX_NESTING} levels") from None
    except (TypeError, ValueError) as exc:
        raise plain_error(origin, "", f"is not plain JSON data ({exc})") from None


def plain_error(origin: str, where: str, msg: str) -> ManifestError:
    where = where.lstrip(".") or "manifest"
    return ManifestError(f"{origin}: {msg}", key=where if len(where) <= 60 else where[:60] + "...", hint=REBUILD)


def check_chunked(r: FieldReader, version: int, shards: list[ShardEntry]) -> None:
    """Versions 3 and 4 have chunk digests in every shard entry, version 2 in none (an older
    shardc, which refuses unknown keys, then reads it); version 1 is the plain-dict form and may
    have either, but not a mix. Only version 4 names a chunk digest other than sha256."""
    have = [s.chunk_size is not None for s in shards]
    if version >= 3 and not all(have):
        raise r.error(f"is missing (format_version {version} records chunk digests for every shard)",
                      f"shards.{shards[have.index(False)].file}.chunk_size")
    if version == 2 and any(have):
        raise r.error("is not a format_version 2 key (chunk digests are format_version 3)",
                      f"shards.{shards[have.index(True)].file}.chunks")
    if version == 1 and any(have) and not all(have):
        raise r.error("is missing (another shard has chunk digests: every shard has them or none)",
                      f"shards.{shards[have.index(False)].file}.chunk_size")
    other = [s for s in shards if s.chunk_digest != DEFAULT_CHUNK_DIGEST]
    if version < 4 and other:
        raise r.error(f"is not a format_version {version} key (chunk digests other than sha256 are "
                      "format_version 4)", f"shards.{other[0].file}.chunk_digest")


def check_extent(r: FieldReader, rg: FieldReader, config: FieldReader, shards: list[ShardEntry]) -> None:
    """Before a Layout is built from the plan (a record per tensor per rank: tp x layers x about
    ten; a 2 KB file declaring tp=128 and 2000 layers would cost half a minute and 1.5 GB), the
    manifest must describe it: exactly tp x pp shard entries, and at least one tensor record per
    layer per TP rank (every layer puts its norms on every rank). The Layout's size is then bounded
    by the manifest's own records, a small factor each; the exact comparison (verify's
    ``check_manifest_against_layout``) follows once the Layout is built. Degrees that are not
    integers in range are left to the plan's own check."""
    degrees: list[Any] = [rg.data.get("tp_degree"), rg.data.get("pp_degree"), rg.data.get("dp_degree", 1)]
    if not all(type(x) is int and 1 <= x <= MAX_DEGREE for x in degrees):
        return
    tp, pp, dp = degrees
    if len(shards) != tp * pp * dp:
        dps = f", dp_degree={dp}" if dp > 1 else ""
        raise r.error(f"lists {len(shards)} shard(s); its plan (tp_degree={tp}, pp_degree={pp}{dps}) has "
                      f"{tp * pp * dp}", "shards")
    layers = config.data.get("num_hidden_layers")
    records = sum(len(s.tensors) for s in shards)
    if type(layers) is int and records < tp * layers:
        raise r.error(f"lists {records} tensor record(s) in all; {layers} layers on {tp} TP rank(s) "
                      f"need at least {tp * layers}", "shards")


def read_overrides(r: FieldReader) -> tuple[dict[str, str], str | None]:
    """``overrides`` and ``effective_plan_sha256`` come together or not at all (absent: the
    effective plan is the plan); only the keys a command line can override, as strings."""
    if ("overrides" in r.data) != ("effective_plan_sha256" in r.data):
        missing = "effective_plan_sha256" if "overrides" in r.data else "overrides"
        raise r.error("is missing (overrides and effective_plan_sha256 come together)", missing)
    if "overrides" not in r.data:
        return {}, None
    overrides = r.get("overrides", dict)
    r.sub("plan").sub("model").get("source", str)  # what the override replaces
    if not overrides:
        raise r.error("is empty (a build without overrides records neither key)", "overrides")
    for key, value in overrides.items():
        if key not in OVERRIDABLE:
            raise r.error(f"has key {key!r}; only {', '.join(OVERRIDABLE)} can be overridden", "overrides")
        if not isinstance(value, str) or not value:
            raise r.error(f"is {value!r}, expected a non-empty string", f"overrides.{key}")
    return dict(overrides), r.sha256("effective_plan_sha256")



def shard_size(layout: Layout, rank_layout: RankLayout, shardc_version: str) -> tuple[int, int]:
    """A rank's shard file as its build wrote it: (header bytes with their length prefix, tensor
    bytes). Both follow from the Layout alone: the header is deterministic (formats/safetensors.py
    ``header_bytes`` of the rank's tensors and ``shard_metadata``, whose one free value, the
    shardc version, is the manifest's own ``shardc_version``: build writes both from one
    ``__version__``, and a kept shard of another version is rebuilt)."""
    from .safetensors import header_bytes, shard_metadata

    meta = shard_metadata(layout, rank_layout) | {"shardc.version": shardc_version}
    return len(header_bytes([(t.name, t.dtype, t.shape) for t in rank_layout.tensors], meta)), rank_layout.nbytes


SIZE_HINT = "the manifest does not describe what its plan builds (edited or damaged); rebuild, or pull the build again"


def size_problem(entry: ShardEntry, layout: Layout, rank_layout: RankLayout, shardc_version: str,
                 larger_only: bool = False) -> str | None:
    """What is wrong with the entry's ``size`` against the exact size the Layout gives the rank's
    shard (None: nothing; with ``larger_only``, only a size above it is a problem). The chunk count
    follows: the reader checked ``chunks`` against ``size``.

    Why, before any byte is read: every reader sizes its work by ``size`` (the loader's buffer and
    chunk reads, verify's hashing), so a forged entry claiming 4 GiB for a shard of 76 KB (a sparse
    file, every chunk digest forged) was read and held until the first chunk's digest failed. The
    Layout is the plan's truth; ``size`` is only a claim. The line gives the figure, for the key
    ``shards.<file>.size``: ``is N bytes; the plan's Layout gives this rank's shard M bytes (...)``."""
    head, data = shard_size(layout, rank_layout, shardc_version)
    if entry.size == head + data or (larger_only and entry.size < head + data):
        return None
    return (f"is {entry.size} bytes; the plan's Layout gives this rank's shard "
            f"{head + data} bytes ({head} of header, {data} of tensors)")
