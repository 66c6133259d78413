"""The records a manifest is made of (its files, shards, source and layout at a glance) and the
reader every one of them validates itself with: each failure is one ManifestError naming the key
path (``shards.model-tp00-pp00.safetensors.size``). The whole document is formats/manifest.py;
the checks that span several records are formats/manifest_checks.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..digests import CHUNK_DIGESTS, DEFAULT_CHUNK_DIGEST
from ..errors import ManifestError
from ..layout.model import LIMITS
from ..layout.plan import MAX_TP
from .chunk_digests import chunk_count, chunk_size_problem
from .files import safe_name

REBUILD = "the manifest is damaged; rebuild, or pass the manifest.json that shardc build wrote"
# Sizes a real model never exceeds: a manifest claiming more is damaged or hostile, and is refused
# before a Layout (one record per layer and rank) is sized from it. Degrees and layers are the
# plan's and the model config's own limits (a manifest holds a plan and a config).
MAX_DEGREE = MAX_TP
MAX_LAYERS = LIMITS["num_hidden_layers"]
MAX_BYTES = 1 << 50
MAX_EXPERTS = 1 << 16  # routed experts per layer (DeepSeek-V3: 256)


def is_sha256(value: Any) -> bool:
    """A sha256 as the manifest records it: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and not value.strip("0123456789abcdef")


class FieldReader:
    """Typed access to one JSON object of the manifest; every failure names the key path."""

    def __init__(self, data: Any, path: str, origin: str) -> None:
        self.path, self.origin = path, origin
        if not isinstance(data, dict):
            raise self.error(f"is {type(data).__name__}, expected an object")
        self.data: dict[str, Any] = data

    def error(self, msg: str, key: str | None = None) -> ManifestError:
        where = ".".join(p for p in (self.path, key) if p) or "manifest"
        return ManifestError(f"{self.origin}: {msg}", key=where, hint=REBUILD)

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
        value: int = self.get(key, int)
        if not low <= value <= high:
            raise self.error(f"is {value}, outside {low}..{high}", key)
        return value

    def sha256(self, key: str) -> str:
        value: str = self.get(key, str)
        if not is_sha256(value):
            raise self.error(f"is {value!r}, expected 64 hex digits", key)
        return value

    def sub(self, key: str) -> FieldReader:
        """The object under ``key`` (an error when it is missing or not an object)."""
        return FieldReader(self.get(key, dict), f"{self.path}.{key}".lstrip("."), self.origin)

    def optional_sub(self, key: str) -> FieldReader | None:
        """The object under ``key``, None when it is missing or null."""
        return None if self.get(key, dict, optional=True) is None else self.sub(key)

    def items(self, key: str) -> list[FieldReader]:
        return [FieldReader(v, f"{self.path}.{key}[{i}]".lstrip("."), self.origin)
                for i, v in enumerate(self.get(key, list))]

    def entries(self, key: str) -> list[tuple[str, FieldReader]]:
        return [(k, FieldReader(v, f"{self.path}.{key}.{k}".lstrip("."), self.origin))
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
    def read(cls, r: FieldReader, what: str = "file name") -> FileEntry:
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
    # The file cut every ``chunk_size`` bytes and each piece's digest (format_version 3; None and
    # empty in an older manifest, whose readers check the whole-file sha256 instead), of the kind
    # ``chunk_digest`` names (recorded only when it is not sha256: format_version 4)
    chunk_size: int | None = None
    chunks: tuple[str, ...] = ()
    chunk_digest: str = DEFAULT_CHUNK_DIGEST

    @classmethod
    def read(cls, r: FieldReader, file: str | None = None) -> ShardEntry:
        """One entry; ``file`` is its key (version 2) or None when it names itself (version 1)."""
        r.only(*(("file",) if file is None else ()), "tp_rank", "pp_stage", "rank", "layers", "size",
               "sha256", "tensors", "compressed", "experts", "dp_rank", "chunk_size", "chunks", "chunk_digest")
        file = safe_name(r.get("file", str) if file is None else file, "shard file name")
        size = r.number("size", MAX_BYTES)
        layers = r.get("layers", list)
        if len(layers) != 2 or not all(type(x) is int and 0 <= x <= MAX_LAYERS
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
        digest = r.get("chunk_digest", str) if "chunk_digest" in r.data else None  # null is no kind
        if digest is not None and (digest not in CHUNK_DIGESTS or chunk_size is None):
            raise r.error(f"is {digest!r}; chunk digests are one of {', '.join(CHUNK_DIGESTS)}, "
                          "beside chunk_size and chunks", "chunk_digest")
        return cls(file, r.number("tp_rank", MAX_DEGREE),
                   r.number("pp_stage", MAX_DEGREE), r.number("rank", MAX_DEGREE * MAX_DEGREE),
                   (layers[0], layers[1]), size, r.sha256("sha256"), tensors,
                   r.get("compressed", dict, optional=True), tuple(experts),
                   r.number("dp_rank", MAX_DEGREE) if "dp_rank" in r.data else None, chunk_size, chunks,
                   digest or DEFAULT_CHUNK_DIGEST)

    def to_dict(self) -> dict[str, Any]:
        """The entry as the manifest keys it under its file name (versions 2 and 3)."""
        out: dict[str, Any] = {"tp_rank": self.tp_rank, "pp_stage": self.pp_stage, "rank": self.rank,
                               "layers": list(self.layers), "size": self.size, "sha256": self.sha256,
                               "tensors": self.tensors}
        if self.compressed is not None:
            out["compressed"] = self.compressed
        if self.experts:
            out["experts"] = list(self.experts)
        if self.dp_rank is not None:
            out["dp_rank"] = self.dp_rank
        if self.chunk_size is not None:
            out["chunk_size"], out["chunks"] = self.chunk_size, list(self.chunks)
            if self.chunk_digest != DEFAULT_CHUNK_DIGEST:
                out["chunk_digest"] = self.chunk_digest
        return out


def _read_chunks(r: FieldReader, size: int) -> tuple[int | None, tuple[str, ...]]:
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
        if not is_sha256(d):
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
    def read(cls, r: FieldReader) -> ReshardRecord:
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
    def read(cls, r: FieldReader) -> SourceRecord:
        r.only("uri", "revision", "files", "reshard_of")
        of = r.optional_sub("reshard_of")
        return cls(r.get("uri", str), r.get("revision", str, optional=True),
                   [FileEntry.read(f, "source file name") for f in r.items("files")],
                   None if of is None else ReshardRecord.read(of))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uri": self.uri, "revision": self.revision, "files": [f.to_dict() for f in self.files]}
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
    def read(cls, r: FieldReader) -> LayoutRecord:
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

