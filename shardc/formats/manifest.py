"""The manifest: the one record of a build. Canonical JSON (sorted keys, no timestamps).

Schema (format_version 3; 2 is the same without ``chunk_size``/``chunks``)::

    {
      "format": "shardc-manifest", "format_version": 2, "shardc_version": "0.1.0",
      "plan": {...normalized plan...}, "plan_sha256": "<hex>",
      "overrides": {"model.source": str}, "effective_plan_sha256": "<hex>"
                   (both only when the build overrode the plan: ``build --source``),
      "model": {...ModelSpec.summary()..., "padded_vocab_size": int, "config": {HF config.json}},
      "layout": {"tp_degree": int, "pp_degree": int, "stages": [[start, stop], ...],
                 "base_dtype": "BF16", "dtype": "fp16|bf16|int8|fp8"},
      "source": {"uri": str, "revision": str|null,
                 "files": [{"name": str, "size": int, "sha256": hex}, ...],
                 "reshard_of": {...}  (only a reshard's: ReshardRecord)},
      "files": [{"name": "config.json", "size": int, "sha256": hex}],
      "shards": {"model-tp00-pp00.safetensors": {"tp_rank": 0, "pp_stage": 0, "rank": 0,
                  "layers": [start, stop], "size": int, "sha256": hex,
                  "chunk_size": int, "chunks": [hex, ...] (the sha256 of every chunk_size bytes),
                  "tensors": {name: TensorSpec.record() (+ "stats" for quantized weights)}}, ...}
    }

``plan`` is the plan file's (its hash is in every shard's metadata); the effective plan is ``plan``
with ``overrides`` applied, and without them it is ``plan`` itself (so a build without override,
and every manifest written before overrides were recorded, has no such keys and the same bytes).

``manifest["shards"][file]["sha256"]`` is all a loader needs to check a shard; ``chunks`` lets it
check the file on every core and name a damaged chunk (formats/chunks.py). Version 2 (still read,
and still written for a manifest whose shards have no chunk digests, so its bytes stay) has no
chunk digests; version 1 (still read) listed the shards instead, each entry naming its ``"file"``.

``Manifest`` is the typed form: ``read_manifest``/``loads`` are the one reader (the schema is
checked on read, numbers against sane bounds before anything is sized from them) and
``Manifest.dumps`` the one writer.

File names in ``shards`` and ``files`` are relative to the manifest's own directory (or prefix).

A manifest pushed with ``--compress zstd`` adds to each compressed entry ``"compressed": {"codec":
"zstd", "size": int, "sha256": hex, "object": "<file>.zst"}`` (the stored object); the entry's own
size and sha256 stay those of the uncompressed file. ``shardc pull`` strips the key again, so a
pulled manifest.json is byte-identical to the build's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..layout.model import model_from_config
from ..layout.plan import OVERRIDABLE, apply_overrides, canonical_json, plan_from_dict
from ..layout.ranks import Layout, base_dtype, build_layout
from ..layout.readfile import MANIFEST_LIMIT, read_regular_file
from ..version import __version__
from .chunks import chunk_count, chunk_size_problem
from .files import fsync_dir, safe_name, write_atomic  # noqa: F401 - fsync_dir: store imports it here

FORMAT = "shardc-manifest"
FORMAT_VERSION = 3  # 3: every shard entry carries chunk digests (formats/chunks.py)
READS = (1, 2, 3)  # versions this shardc reads; it writes 3, or 2 for a manifest without chunk digests
TOKENIZER = "tokenizer.json"
_REBUILD = "the manifest is damaged; rebuild, or pass the manifest.json that shardc build wrote"
# Sizes a real model never exceeds: a manifest claiming more is damaged or hostile, and is refused
# before a Layout (one record per layer and rank) is sized from it.
MAX_DEGREE = 4096
MAX_BYTES = 1 << 50
MAX_EXPERTS = 1 << 16  # routed experts per layer (DeepSeek-V3: 256)
# Levels of objects and arrays: a real manifest has under ten (a tensor record's stats, an HF
# config's rope_scaling); a few thousand would end in RecursionError in whatever recursed first.
MAX_NESTING = 64
CONFIG_BOUNDS = {
    "num_hidden_layers": 10_000, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "head_dim": 1 << 14,
    "vocab_size": 1 << 24, "max_position_embeddings": 1 << 28,
}


class _Reader:
    """Typed access to one JSON object of the manifest; every failure names the key path."""

    def __init__(self, data: Any, path: str, origin: str) -> None:
        self.path, self.origin = path, origin
        if not isinstance(data, dict):
            raise self.error(f"is {type(data).__name__}, expected an object")
        self.data = data

    def error(self, msg: str, key: str | None = None) -> ManifestError:
        where = ".".join(p for p in (self.path, key) if p) or "manifest"
        return ManifestError(f"{self.origin}: {msg}", key=where, hint=_REBUILD)

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise self.error("is missing", key)
        value = self.data[key]
        if value is None and optional:
            return None
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise self.error(f"is {value!r}, expected {getattr(kind, '__name__', kind)}", key)
        return value

    def number(self, key: str, high: int, low: int = 0) -> int:
        value = self.get(key, int)
        if not low <= value <= high:
            raise self.error(f"is {value}, outside {low}..{high}", key)
        return value

    def sha256(self, key: str) -> str:
        value = self.get(key, str)
        if len(value) != 64 or value.strip("0123456789abcdef"):
            raise self.error(f"is {value!r}, expected 64 hex digits", key)
        return value

    def sub(self, key: str, optional: bool = False) -> _Reader | None:
        value = self.get(key, dict, optional)
        return None if value is None else _Reader(value, f"{self.path}.{key}".lstrip("."), self.origin)

    def items(self, key: str) -> list[_Reader]:
        return [_Reader(v, f"{self.path}.{key}[{i}]".lstrip("."), self.origin)
                for i, v in enumerate(self.get(key, list))]

    def entries(self, key: str) -> list[tuple[str, _Reader]]:
        return [(k, _Reader(v, f"{self.path}.{key}.{k}".lstrip("."), self.origin))
                for k, v in self.get(key, dict).items()]

    def only(self, *keys: str) -> None:
        extra = sorted(set(self.data) - set(keys))
        if extra:
            raise self.error(f"has unknown key {extra[0]!r}")


@dataclass
class FileEntry:
    """A file of the build (config, tokenizer) or of its source: name, size, sha256."""

    name: str
    size: int
    sha256: str
    compressed: dict[str, Any] | None = None  # the stored object, when pushed with --compress

    @classmethod
    def read(cls, r: _Reader, what: str = "file name") -> FileEntry:
        r.only("name", "size", "sha256", "compressed")
        return cls(safe_name(r.get("name", str), what), r.number("size", MAX_BYTES), r.sha256("sha256"),
                   r.get("compressed", dict, optional=True))

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "size": self.size, "sha256": self.sha256}
        if self.compressed is not None:
            out["compressed"] = self.compressed
        return out


@dataclass
class ShardEntry:
    """One rank's shard file: where it sits in the plan, its bytes, its tensors' records."""

    file: str
    tp_rank: int
    pp_stage: int
    rank: int
    layers: tuple[int, int]
    size: int
    sha256: str
    tensors: dict[str, dict[str, Any]]
    compressed: dict[str, Any] | None = None
    experts: tuple[int, ...] = ()  # routed expert ids held whole (expert_parallel plans)
    dp_rank: int | None = None  # its attention data-parallel group (recorded when dp_degree > 1)
    # The file cut every ``chunk_size`` bytes and each piece's sha256 (format_version 3; None and
    # empty in an older manifest, whose readers check the whole-file sha256 instead)
    chunk_size: int | None = None
    chunks: tuple[str, ...] = ()

    @classmethod
    def read(cls, r: _Reader, file: str | None = None) -> ShardEntry:
        """One entry; ``file`` is its key (version 2) or None when it names itself (version 1)."""
        r.only(*(("file",) if file is None else ()), "tp_rank", "pp_stage", "rank", "layers", "size",
               "sha256", "tensors", "compressed", "experts", "dp_rank", "chunk_size", "chunks")
        file = safe_name(r.get("file", str) if file is None else file, "shard file name")
        size = r.number("size", MAX_BYTES)
        layers = r.get("layers", list)
        if len(layers) != 2 or not all(type(x) is int and 0 <= x <= CONFIG_BOUNDS["num_hidden_layers"]
                                        for x in layers):
            raise r.error(f"is {layers!r}, expected [start, stop]", "layers")
        tensors = r.get("tensors", dict)
        for name, rec in tensors.items():
            if not isinstance(rec, dict) or not isinstance(rec.get("dtype"), str) \
                    or not isinstance(rec.get("shape"), list):
                raise r.error("is not a tensor record with dtype and shape", f"tensors.{name}")
        experts = r.get("experts", list, optional=True) or []
        if not all(type(e) is int and 0 <= e < MAX_EXPERTS for e in experts) or experts != sorted(set(experts)):
            raise r.error(f"must be increasing expert ids below {MAX_EXPERTS}", "experts")
        chunk_size, chunks = _read_chunks(r, size)
        return cls(file, r.number("tp_rank", MAX_DEGREE),
                   r.number("pp_stage", MAX_DEGREE), r.number("rank", MAX_DEGREE * MAX_DEGREE),
                   (layers[0], layers[1]), size, r.sha256("sha256"), tensors,
                   r.get("compressed", dict, optional=True), tuple(experts),
                   r.number("dp_rank", MAX_DEGREE) if "dp_rank" in r.data else None, chunk_size, chunks)

    def to_dict(self, version: int = FORMAT_VERSION) -> dict[str, Any]:
        out = {"tp_rank": self.tp_rank, "pp_stage": self.pp_stage, "rank": self.rank,
               "layers": list(self.layers), "size": self.size, "sha256": self.sha256, "tensors": self.tensors}
        if self.compressed is not None:
            out["compressed"] = self.compressed
        if self.experts:
            out["experts"] = list(self.experts)
        if self.dp_rank is not None:
            out["dp_rank"] = self.dp_rank
        if self.chunk_size is not None:
            out["chunk_size"], out["chunks"] = self.chunk_size, list(self.chunks)
        return {"file": self.file, **out} if version == 1 else out


def _read_chunks(r: _Reader, size: int) -> tuple[int | None, tuple[str, ...]]:
    """A shard entry's ``chunk_size`` and ``chunks`` (both or neither): a valid size, and exactly
    one 64-hex-digit digest per chunk of the file's ``size`` bytes."""
    if "chunk_size" not in r.data and "chunks" not in r.data:
        return None, ()
    chunk_size = r.get("chunk_size", int)  # "is missing" when only chunks is there
    if (why := chunk_size_problem(chunk_size)) is not None:
        raise r.error(why, "chunk_size")
    chunks = r.get("chunks", list)
    want = chunk_count(size, chunk_size)
    if len(chunks) != want:
        raise r.error(f"lists {len(chunks)} digest(s); {size} bytes in chunks of {chunk_size} bytes are {want}",
                      "chunks")
    for i, d in enumerate(chunks):
        if not isinstance(d, str) or len(d) != 64 or d.strip("0123456789abcdef"):
            raise r.error(f"is {d!r}, expected 64 hex digits", f"chunks[{i}]")
    return chunk_size, tuple(chunks)


@dataclass
class ReshardRecord:
    """A resharded build's input, where a build names its checkpoint's files: which manifest (its
    canonical sha256), its plan and dtype, and the source tensors that were dequantized (lossy)."""

    manifest_sha256: str
    plan: str
    plan_sha256: str
    dtype: str
    dequantized: list[str]

    @classmethod
    def read(cls, r: _Reader) -> ReshardRecord:
        r.only("manifest_sha256", "plan", "plan_sha256", "dtype", "dequantized")
        lossy = r.get("dequantized", list)
        if not all(isinstance(n, str) for n in lossy):
            raise r.error(f"is {lossy!r}, expected a list of tensor names", "dequantized")
        return cls(r.sha256("manifest_sha256"), r.get("plan", str), r.sha256("plan_sha256"),
                   r.get("dtype", str), list(lossy))

    def to_dict(self) -> dict[str, Any]:
        return {"manifest_sha256": self.manifest_sha256, "plan": self.plan, "plan_sha256": self.plan_sha256,
                "dtype": self.dtype, "dequantized": list(self.dequantized)}


@dataclass
class SourceRecord:
    """What the build read: the source as the plan names it, its revision, every file's hash.
    A reshard's source is the input build: ``uri`` its manifest, ``reshard_of`` what it was (the
    key is absent from a build's manifest, whose bytes stay as they were)."""

    uri: str
    revision: str | None
    files: list[FileEntry]
    reshard_of: ReshardRecord | None = None

    @classmethod
    def read(cls, r: _Reader) -> SourceRecord:
        r.only("uri", "revision", "files", "reshard_of")
        of = r.sub("reshard_of", optional=True)
        return cls(r.get("uri", str), r.get("revision", str, optional=True),
                   [FileEntry.read(f, "source file name") for f in r.items("files")],
                   None if of is None else ReshardRecord.read(of))

    def to_dict(self) -> dict[str, Any]:
        out = {"uri": self.uri, "revision": self.revision, "files": [f.to_dict() for f in self.files]}
        if self.reshard_of is not None:
            out["reshard_of"] = self.reshard_of.to_dict()
        return out


@dataclass
class LayoutRecord:
    """The split at a glance (the full Layout is recomputed from plan and config: ``layout()``)."""

    tp_degree: int
    pp_degree: int
    stages: list[tuple[int, int]]
    base_dtype: str
    dtype: str
    dp_degree: int = 1  # recorded only when > 1 (attention data parallelism)

    @classmethod
    def read(cls, r: _Reader) -> LayoutRecord:
        r.only("tp_degree", "pp_degree", "stages", "base_dtype", "dtype", "dp_degree")
        tp, pp = r.number("tp_degree", MAX_DEGREE, 1), r.number("pp_degree", MAX_DEGREE, 1)
        stages = r.get("stages", list)
        if len(stages) != pp or not all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s)
                                        for s in stages):
            raise r.error(f"is not {pp} [start, stop] pairs", "stages")
        dp = r.number("dp_degree", MAX_DEGREE, 2) if "dp_degree" in r.data else 1
        return cls(tp, pp, [(a, b) for a, b in stages], r.get("base_dtype", str), r.get("dtype", str), dp)

    def to_dict(self) -> dict[str, Any]:
        return {"tp_degree": self.tp_degree, "pp_degree": self.pp_degree,
                "stages": [list(s) for s in self.stages], "base_dtype": self.base_dtype, "dtype": self.dtype,
                **({"dp_degree": self.dp_degree} if self.dp_degree > 1 else {})}


@dataclass
class Manifest:
    """The typed manifest. ``plan`` and ``model`` stay the plain data they are recorded as (the
    plan schema and ModelSpec validate them where they are used); everything else is typed."""

    plan: dict[str, Any]
    plan_sha256: str
    model: dict[str, Any]
    layout: LayoutRecord
    source: SourceRecord
    files: list[FileEntry]
    shards: list[ShardEntry]
    shardc_version: str = __version__
    # What the command line changed in the plan (``{"model.source": "/data/x"}``), and the hash
    # of the plan with those changes; both empty/None when nothing was overridden.
    overrides: dict[str, str] = field(default_factory=dict)
    # A quantized source (#31): its format, and what this build did with it (kept / dequantized /
    # dequantized then requantized); absent for a 16-bit source, so those manifests keep their bytes.
    source_quantization: dict[str, str] | None = None
    effective_plan_sha256: str | None = None
    _by_file: dict[str, ShardEntry] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- reading --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The plan's name (replica_group.name): names the build and its manifests/ record."""
        return self.plan["replica_group"]["name"]

    @property
    def config(self) -> dict[str, Any]:
        """The model's Hugging Face config.json, as the build recorded it."""
        return self.model["config"]

    @property
    def world_size(self) -> int:
        return self.layout.tp_degree * self.layout.pp_degree * self.layout.dp_degree

    @property
    def effective_sha256(self) -> str:
        """The hash of the plan the build applied: ``verify --plan`` compares this."""
        return self.effective_plan_sha256 or self.plan_sha256

    @property
    def effective_plan(self) -> dict[str, Any]:
        """The plan the build applied: ``plan`` with ``overrides``."""
        return apply_overrides(self.plan, self.overrides)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def shard(self, file: str) -> ShardEntry | None:
        """The entry of a shard file, by name (None when the manifest has none)."""
        if len(self._by_file) != len(self.shards):
            self._by_file = {s.file: s for s in self.shards}
        return self._by_file.get(file)

    def file(self, name: str) -> FileEntry | None:
        """The entry of a side file (config.json, tokenizer files) by name."""
        return next((f for f in self.files if f.name == name), None)

    @property
    def tokenizer_sha256(self) -> str | None:
        """sha256 of the build's tokenizer.json, None when the build carries none."""
        entry = self.file(TOKENIZER)
        return entry.sha256 if entry else None

    def to_layout(self) -> Layout:
        """Recompute the Layout from the manifest's plan and model config: the independent truth."""
        return build_layout(model_from_config(self.config), plan_from_dict(self.plan))

    # -- writing --------------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The version this manifest is written in: 3 when its shards carry chunk digests, else 2
        (an older build's manifest, pulled or passed through, keeps its bytes)."""
        return FORMAT_VERSION if self.shards and all(s.chunk_size is not None for s in self.shards) else 2

    def to_dict(self, version: int | None = None) -> dict[str, Any]:
        """The JSON form, in ``format_version``; ``version=1`` gives the old shard list (store/ and
        tests edit it as data; the chunk digests stay in its entries)."""
        version = self.format_version if version is None else version
        shards: Any = ([s.to_dict(1) for s in self.shards] if version == 1
                       else {s.file: s.to_dict(version) for s in self.shards})
        return {
            "format": FORMAT,
            "format_version": version,
            "shardc_version": self.shardc_version,
            "plan": self.plan,
            "plan_sha256": self.plan_sha256,
            **({"overrides": dict(self.overrides), "effective_plan_sha256": self.effective_sha256}
               if self.overrides else {}),
            "model": self.model,
            "layout": self.layout.to_dict(),
            "source": self.source.to_dict(),
            "files": [f.to_dict() for f in self.files],
            "shards": shards,
            **({"source_quantization": dict(self.source_quantization)} if self.source_quantization else {}),
        }

    def dumps(self) -> bytes:
        """The one writer: canonical JSON (sorted keys), the same bytes for the same build."""
        return canonical_json(self.to_dict())

    def write(self, path: str | Path) -> None:
        write_atomic(path, self.dumps())

    @classmethod
    def from_dict(cls, m: Any, origin: str = "manifest") -> Manifest:
        """Validate a manifest held as data and type it (ManifestError names the failing key). The
        data is copied through JSON first: a caller's dict may hold anything."""
        return cls._from_json(_as_json(m, origin), origin)

    @classmethod
    def _from_json(cls, m: Any, origin: str) -> Manifest:
        """Validate a parsed manifest (a tree of JSON values) and type it."""
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ManifestError(f"{origin} is not a shardc manifest", hint="pass the manifest.json that shardc build wrote")
        _check_depth(m, origin)
        version = m.get("format_version")
        if version not in READS or isinstance(version, bool):
            raise ManifestError(
                f"{origin} has format_version {version!r}; this shardc reads "
                f"{', '.join(map(str, READS[:-1]))} and {READS[-1]}",
                hint="use the shardc version that wrote it",
            )
        r = _Reader(m, "", origin)
        r.only("format", "format_version", "shardc_version", "plan", "plan_sha256", "overrides",
               "effective_plan_sha256", "model", "layout", "source", "files", "shards", "source_quantization")
        plan = r.get("plan", dict)
        rg = r.sub("plan").sub("replica_group")
        rg.get("name", str)
        model = r.sub("model")
        config = model.sub("config")
        for key, high in CONFIG_BOUNDS.items():  # before anything is sized from them
            if key in config.data and config.data[key] is not None:
                config.number(key, high, 1)
        layout = LayoutRecord.read(r.sub("layout"))
        if version == 1:
            shards = [ShardEntry.read(s) for s in r.items("shards")]
        else:
            shards = sorted((ShardEntry.read(s, file) for file, s in r.entries("shards")), key=lambda s: s.rank)
        _check_chunked(r, version, shards)
        _check_extent(r, rg, config, shards)
        overrides, effective = _read_overrides(r)
        return cls(plan=plan, plan_sha256=r.sha256("plan_sha256"), model=model.data, layout=layout,
                   source=SourceRecord.read(r.sub("source")),
                   files=[FileEntry.read(f) for f in r.items("files")], shards=shards,
                   shardc_version=r.get("shardc_version", str), overrides=overrides,
                   effective_plan_sha256=effective, source_quantization=_read_source_quantization(r))


def _read_source_quantization(r: _Reader) -> dict[str, str] | None:
    sq = r.sub("source_quantization", optional=True)
    if sq is None:
        return None
    sq.only("format", "quant_method", "applied")
    return {k: sq.get(k, str) for k in ("format", "quant_method", "applied")}


def _check_depth(m: dict[str, Any], origin: str) -> None:
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
    raise _plain_error(origin, level[0][1], f"is nested deeper than {MAX_NESTING} levels")


def _as_json(m: Any, origin: str) -> Any:
    """A caller's manifest data as JSON would give it (a copy): a value that is not JSON, a cycle,
    a key that cannot be a string or nesting beyond the encoder's limit is one ManifestError."""
    try:
        return json.loads(json.dumps(m))
    except RecursionError:
        raise _plain_error(origin, "", f"is nested deeper than {MAX_NESTING} levels") from None
    except (TypeError, ValueError) as exc:
        raise _plain_error(origin, "", f"is not plain JSON data ({exc})") from None


def _plain_error(origin: str, where: str, msg: str) -> ManifestError:
    where = where.lstrip(".") or "manifest"
    return ManifestError(f"{origin}: {msg}", key=where if len(where) <= 60 else where[:60] + "...", hint=_REBUILD)


def _check_chunked(r: _Reader, version: int, shards: list[ShardEntry]) -> None:
    """Version 3 has chunk digests in every shard entry, version 2 in none (an older shardc, which
    refuses unknown keys, then reads it); version 1 is the plain-dict form and may have either, but
    not a mix."""
    have = [s.chunk_size is not None for s in shards]
    if version == 3 and not all(have):
        raise r.error("is missing (format_version 3 records chunk digests for every shard)",
                      f"shards.{shards[have.index(False)].file}.chunk_size")
    if version == 2 and any(have):
        raise r.error("is not a format_version 2 key (chunk digests are format_version 3)",
                      f"shards.{shards[have.index(True)].file}.chunks")
    if version == 1 and any(have) and not all(have):
        raise r.error("is missing (another shard has chunk digests: every shard has them or none)",
                      f"shards.{shards[have.index(False)].file}.chunk_size")


def _check_extent(r: _Reader, rg: _Reader, config: _Reader, shards: list[ShardEntry]) -> None:
    """Before a Layout is built from the plan (a record per tensor per rank: tp x layers x about
    ten; a 2 KB file declaring tp=128 and 2000 layers would cost half a minute and 1.5 GB), the
    manifest must describe it: exactly tp x pp shard entries, and at least one tensor record per
    layer per TP rank (every layer puts its norms on every rank). The Layout's size is then bounded
    by the manifest's own records, a small factor each; the exact comparison (verify's
    ``check_manifest_against_layout``) follows once the Layout is built. Degrees that are not
    integers in range are left to the plan's own check."""
    tp, pp, dp = rg.data.get("tp_degree"), rg.data.get("pp_degree"), rg.data.get("dp_degree", 1)
    if not all(type(x) is int and 1 <= x <= MAX_DEGREE for x in (tp, pp, dp)):
        return
    if len(shards) != tp * pp * dp:
        dps = f", dp_degree={dp}" if dp > 1 else ""
        raise r.error(f"lists {len(shards)} shard(s); its plan (tp_degree={tp}, pp_degree={pp}{dps}) has "
                      f"{tp * pp * dp}", "shards")
    layers = config.data.get("num_hidden_layers")
    records = sum(len(s.tensors) for s in shards)
    if type(layers) is int and records < tp * layers:
        raise r.error(f"lists {records} tensor record(s) in all; {layers} layers on {tp} TP rank(s) "
                      f"need at least {tp * layers}", "shards")


def _read_overrides(r: _Reader) -> tuple[dict[str, str], str | None]:
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


def new_manifest(layout: Layout, source: SourceRecord, shards: list[ShardEntry],
                 files: list[FileEntry]) -> Manifest:
    """The manifest of a finished build (files sorted by name, shards by rank)."""
    plan, model = layout.plan, layout.model
    return Manifest(
        plan=plan.data,
        plan_sha256=plan.sha256,
        model={**model.summary(), "padded_vocab_size": layout.padded_vocab, "config": model.config},
        layout=LayoutRecord(plan.tp, plan.pp, [tuple(s) for s in layout.stages], base_dtype(model, plan), plan.dtype,
                            plan.dp),
        source=source,
        files=sorted(files, key=lambda f: f.name),
        shards=sorted(shards, key=lambda s: s.rank),
        overrides=dict(plan.overrides),
        effective_plan_sha256=plan.effective_sha256 if plan.overrides else None,
        source_quantization=source_quantization_record(model.config, plan.dtype),
    )


def source_quantization_record(config: dict[str, Any], dtype: str) -> dict[str, str] | None:
    """What a build did with a quantized source: kept it (``dtype: source``), dequantized it to
    16 bits as the format's reference does, or dequantized then requantized (int8/fp8 per channel,
    the error stats then measured against the dequantized source)."""
    from ..layout.sourcequant import detect_source

    sq = detect_source(config)
    if sq is None:
        return None
    applied = {"source": "kept as stored", "fp16": "dequantized", "bf16": "dequantized"}.get(
        dtype, f"dequantized, then quantized to {dtype} per channel")
    return {**sq.record(), "applied": applied}



def typed(manifest: Manifest | dict[str, Any]) -> Manifest:
    """A Manifest from either form (callers that still hold the plain dict: store/)."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)


def parse(data: bytes | str, origin: str = "manifest") -> Manifest:
    """The one reader: JSON bytes -> validated Manifest (ManifestError names what is wrong)."""
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ManifestError(f"{origin} is not JSON", hint="pass the manifest.json that shardc build wrote") from None
    except RecursionError:  # the decoder's own limit (about 1000 levels): deeper than MAX_NESTING
        raise _plain_error(origin, "", f"is nested deeper than {MAX_NESTING} levels") from None
    return Manifest._from_json(m, origin)


# Written by a rebuild while it switches its files into place (compiler/switch.py); a directory
# holding it and no manifest.json is a build being switched, which the next build finishes.
SWITCH_JOURNAL = ".shardc-switch.json"


def interrupted_switch(directory: str | Path) -> ManifestError | None:
    """The error for a missing manifest.json in ``directory`` when a rebuild's switch journal says
    why it is missing (None otherwise): every reader of a build directory reports it the same way."""
    directory = Path(directory)
    if os.path.lexists(directory / "manifest.json") or not os.path.lexists(directory / SWITCH_JOURNAL):
        return None
    return ManifestError(f"{directory} has no manifest.json: a rebuild was interrupted while switching its files in",
                         hint=f"rerun the build into it (any shardc build --out {directory}): it finishes the switch first")


def read(path: str | Path) -> Manifest:
    """Read and validate a manifest file."""
    path = Path(path)
    if not os.path.lexists(path) and (err := interrupted_switch(path.parent)) is not None:
        raise err
    data = read_regular_file(path, limit=MANIFEST_LIMIT, what="manifest", error=ManifestError)
    return parse(data, str(path))


def dumps(manifest: Manifest | dict[str, Any]) -> bytes:
    """Canonical bytes of a manifest, always in the current format (a plain dict of either
    version, store/'s remote copies included, goes through the reader first)."""
    return typed(manifest).dumps()


# The plain-dict form (version 1's shard list), validated by the same reader, for callers that
# edit a manifest as data (tests planting faults); ``dumps`` turns it back into current bytes.
def loads(data: bytes | str, origin: str = "manifest") -> dict[str, Any]:
    return parse(data, origin).to_dict(version=1)


def read_manifest(path: str | Path) -> dict[str, Any]:
    return read(path).to_dict(version=1)


def layout_of(manifest: Manifest | dict[str, Any]) -> Layout:
    """Recompute the Layout from the manifest's plan and model config: the independent truth."""
    return typed(manifest).to_layout()
