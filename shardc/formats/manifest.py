"""The manifest: the one record of a build. Canonical JSON (sorted keys, no timestamps).

Schema (format_version 3; 2 is the same without ``chunk_size``/``chunks``; 4 the same as 3 with
``chunk_digest`` in the shard entries whose chunks are not sha256)::

    {
      "format": "shardc-manifest", "format_version": 3, "shardc_version": "0.1.0",
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
                  "chunk_digest": "blake3" (version 4 only: what ``chunks`` are, when not sha256),
                  "tensors": {name: TensorSpec.record() (+ "stats" for quantized weights)}}, ...}
    }

``plan`` is the plan file's (its hash is in every shard's metadata); the effective plan is ``plan``
with ``overrides`` applied, and without them it is ``plan`` itself (so a build without override,
and every manifest written before overrides were recorded, has no such keys and the same bytes).

``manifest["shards"][file]["sha256"]`` is all a loader needs to check a shard; ``chunks`` lets it
check the file on every core and name a damaged chunk (formats/chunk_digests.py). Version 2 (still read,
and still written for a manifest whose shards have no chunk digests, so its bytes stay) has no
chunk digests; version 1 (still read, written as the current version) listed the shards instead,
each entry naming its ``"file"``.

One typed API, paired as safetensors' is: ``load(path)`` / ``loads(bytes)`` are the one reader
(the schema is checked on read, numbers against sane bounds before anything is sized from them)
and return a ``Manifest``; ``Manifest.save(path)`` / ``Manifest.dumps()`` are the one writer.
``Manifest.from_dict`` / ``to_dict`` are the same pair on JSON data (a test planting a fault).
The records it is made of are formats/manifest_records.py; checks across them,
formats/manifest_checks.py.

File names in ``shards`` and ``files`` are relative to the manifest's own directory (or prefix).

A manifest pushed with ``--compress zstd`` adds to each compressed entry ``"compressed": {"codec":
"zstd", "size": int, "sha256": hex, "object": "<file>.zst"}`` (the stored object); the entry's own
size and sha256 stay those of the uncompressed file. ``shardc pull`` strips the key again, so a
pulled manifest.json is byte-identical to the build's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import ManifestError
from ..layout.model import LIMITS, model_from_config
from ..layout.plan import apply_overrides, canonical_json, plan_from_dict
from ..layout.quantization import base_dtype
from ..layout.ranks import Layout, build_layout
from ..layout.readfile import MANIFEST_LIMIT, read_regular_file
from ..version import __version__
from .files import write_atomic
from .manifest_checks import (
    MAX_NESTING,
    as_json,
    check_chunked,
    check_depth,
    check_extent,
    plain_error,
    read_overrides,
    read_source_quantization,
)
from .manifest_raw import decode
from .manifest_records import (
    FieldReader,
    FileEntry,
    LayoutRecord,
    ReshardRecord,
    ShardEntry,
    SourceRecord,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "READS", "SWITCH_JOURNAL", "TOKENIZER", "FileEntry", "LayoutRecord",
           "Manifest", "ReshardRecord", "ShardEntry", "SourceRecord", "interrupted_switch", "load", "loads",
           "new_manifest", "source_quantization_record"]

FORMAT = "shardc-manifest"
FORMAT_VERSION = 4  # 4: chunk digests may be blake3 (``chunk_digest``); 3: every shard has sha256 chunk digests
READS = (1, 2, 3, 4)  # versions this shardc reads; it writes 3 or 4 (below), 2 for a manifest without chunk digests
TOKENIZER = "tokenizer.json"


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
    # to_layout's last answer, keyed by the canonical JSON of what it was computed from
    _layout: tuple[bytes, Layout] | None = field(default=None, init=False, repr=False, compare=False)

    # -- reading --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The plan's name (replica_group.name): names the build and its manifests/ record."""
        name: str = self.plan["replica_group"]["name"]  # a string: checked on read
        return name

    @property
    def config(self) -> dict[str, Any]:
        """The model's Hugging Face config.json, as the build recorded it."""
        config: dict[str, Any] = self.model["config"]  # an object: checked on read
        return config

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
        """Recompute the Layout from the manifest's plan and model config: the independent truth.
        Computed once per content (a DeepSeek-V3-sized Layout takes ~4 s, and a load asks for it in
        more than one place, vLLM's load format first); the key is the canonical JSON of the
        config and plan, so an edited manifest gets its own. The Layout is immutable: sharing it is
        safe."""
        key = canonical_json([self.config, self.plan])
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, build_layout(model_from_config(self.config), plan_from_dict(self.plan)))
        return self._layout[1]

    # -- writing --------------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The version this manifest is written in: 4 when a shard's chunk digests are not sha256
        (a shardc that reads only 3 refuses it by its version, rather than read blake3 digests as
        corrupted sha256 ones), 3 when its shards carry chunk digests, else 2 (an older build's
        manifest, pulled or passed through, keeps its bytes)."""
        if not self.shards or any(s.chunk_size is None for s in self.shards):
            return 2
        return FORMAT_VERSION if any(s.chunk_digest != DEFAULT_CHUNK_DIGEST for s in self.shards) else 3

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, in ``format_version`` (``from_dict`` reads it back: tests plant faults in
        it, store/ edits a remote copy's entries)."""
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "shardc_version": self.shardc_version,
            "plan": self.plan,
            "plan_sha256": self.plan_sha256,
            **({"overrides": dict(self.overrides), "effective_plan_sha256": self.effective_sha256}
               if self.overrides else {}),
            "model": self.model,
            "layout": self.layout.to_dict(),
            "source": self.source.to_dict(),
            "files": [f.to_dict() for f in self.files],
            "shards": {s.file: s.to_dict() for s in self.shards},
            **({"source_quantization": dict(self.source_quantization)} if self.source_quantization else {}),
        }

    def dumps(self) -> bytes:
        """The one writer: canonical JSON (sorted keys), the same bytes for the same build."""
        return canonical_json(self.to_dict())

    def save(self, path: str | Path) -> None:
        """``dumps`` written atomically (temp file, fsync, rename): a reader sees all or nothing."""
        write_atomic(path, self.dumps())

    @classmethod
    def from_dict(cls, m: Any, origin: str = "manifest") -> Manifest:
        """Validate a manifest held as data and type it (ManifestError names the failing key). The
        data is copied through JSON first: a caller's dict may hold anything."""
        return cls._from_json(as_json(m, origin), origin)

    @classmethod
    def _from_json(cls, m: Any, origin: str) -> Manifest:
        """Validate a parsed manifest (a tree of JSON values) and type it."""
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ManifestError(f"{origin} is not a shardc manifest", hint="pass the manifest.json that shardc build wrote")
        check_depth(m, origin)
        version = m.get("format_version")
        if version not in READS or isinstance(version, bool):
            raise ManifestError(
                f"{origin} has format_version {version!r}; this shardc reads "
                f"{', '.join(map(str, READS[:-1]))} and {READS[-1]}",
                hint="use the shardc version that wrote it",
            )
        r = FieldReader(m, "", origin)
        r.only("format", "format_version", "shardc_version", "plan", "plan_sha256", "overrides",
               "effective_plan_sha256", "model", "layout", "source", "files", "shards", "source_quantization")
        plan = r.get("plan", dict)
        rg = r.sub("plan").sub("replica_group")
        rg.get("name", str)
        model = r.sub("model")
        config = model.sub("config")
        for key, high in LIMITS.items():  # before anything is sized from them
            if key in config.data and config.data[key] is not None:
                config.number(key, high, 1)
        layout = LayoutRecord.read(r.sub("layout"))
        if version == 1:
            shards = [ShardEntry.read(s) for s in r.items("shards")]
        else:
            shards = sorted((ShardEntry.read(s, file) for file, s in r.entries("shards")), key=lambda s: s.rank)
        check_chunked(r, version, shards)
        check_extent(r, rg, config, shards)
        overrides, effective = read_overrides(r)
        return cls(plan=plan, plan_sha256=r.sha256("plan_sha256"), model=model.data, layout=layout,
                   source=SourceRecord.read(r.sub("source")),
                   files=[FileEntry.read(f) for f in r.items("files")], shards=shards,
                   shardc_version=r.get("shardc_version", str), overrides=overrides,
                   effective_plan_sha256=effective, source_quantization=read_source_quantization(r))



def new_manifest(layout: Layout, source: SourceRecord, shards: list[ShardEntry],
                 files: list[FileEntry]) -> Manifest:
    """The manifest of a finished build (files sorted by name, shards by rank)."""
    plan, model = layout.plan, layout.model
    return Manifest(
        plan=plan.data,
        plan_sha256=plan.sha256,
        model={**model.summary(), "padded_vocab_size": layout.padded_vocab, "config": model.config},
        layout=LayoutRecord(plan.tp, plan.pp, list(layout.stages), base_dtype(model, plan), plan.dtype,
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
    the error stats then measured against the dequantized source); ``kv_cache`` where the source's
    KV-cache quantization was left out (ModelOpt's FP8 KV scales)."""
    from ..layout.quant_formats import detect_source

    source_format = detect_source(config)
    if source_format is None:
        return None
    applied = {"source": "kept as stored", "fp16": "dequantized", "bf16": "dequantized"}.get(
        dtype, f"dequantized, then quantized to {dtype} per channel")
    return {**source_format.record(), "applied": applied}


def loads(data: bytes | str, origin: str = "manifest") -> Manifest:
    """The one reader: JSON bytes -> validated Manifest (ManifestError names what is wrong)."""
    try:
        m = decode(data, origin)
    except RecursionError:  # the decoder's own limit (about 1000 levels): deeper than MAX_NESTING
        raise plain_error(origin, "", f"is nested deeper than {MAX_NESTING} levels") from None
    return Manifest._from_json(m, origin)


def load(path: str | Path) -> Manifest:
    """Read and validate a manifest file (``loads`` of its bytes; a bounded read of a regular file)."""
    path = Path(path)
    if not os.path.lexists(path) and (err := interrupted_switch(path.parent)) is not None:
        raise err
    data = read_regular_file(path, limit=MANIFEST_LIMIT, what="manifest", error=ManifestError)
    return loads(data, str(path))


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
                         hint=f"rerun a build into it (any plan, `out` {directory}): it finishes the switch first")
