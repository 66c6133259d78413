"""What a build writes besides the shards, and what it reads back to resume: config.json,
tokenizer files, resume records, the up-to-date check, the disk-space check."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import OutputError, ShardcError
from ..formats import chunk_digests as chunks
from ..formats.files import (
    copy_atomic,
    create_temp,
    human_size,
    sha256_file,
    temp_files,
    write_atomic,
    write_temp,
)
from ..formats.manifest import FileEntry, Manifest, SourceRecord, loads
from ..formats.safetensors import read_header, shard_metadata
from ..layout.dtypes import torch_name
from ..layout.plan import Plan
from ..layout.ranks import Layout, RankLayout, TensorSpec
from ..version import __version__
from .source import Source


def output_config(layout: Layout) -> dict[str, Any]:
    """config.json next to the shards: the model config plus quantization_config when quantized."""
    from ..layout.quantization import base_dtype

    cfg = json.loads(json.dumps(layout.model.config))
    cfg["torch_dtype"] = torch_name(base_dtype(layout.model, layout.plan))
    if layout.plan.dtype != "source":  # a quantized source's block describes weights no longer held
        cfg.pop("quantization_config", None)
    elif "quantization_config" in cfg:  # kept: the source's block, less what the build does not hold
        from ..layout.quant_formats import detect_source

        source_format = detect_source(cfg)
        if source_format is not None:
            cfg["quantization_config"] = json.loads(json.dumps(source_format.kept_block()))
    if layout.plan.quantized:
        from ..layout.quantization import quantizable
        from .quantize import quantization_config

        specs = [t for rank_layout in layout.ranks for t in rank_layout.tensors]
        quantized = {t.source for t in specs if t.quant}
        linear = {t.source for t in specs} & quantizable(layout.model)
        # compressed-tensors lists modules left in 16 bits: lm_head and any plan-ignored projection
        head = layout.model.forward.names.lm_head.removesuffix(".weight")
        ignored = sorted(n.removesuffix(".weight") for n in linear - quantized) + [head]
        cfg["quantization_config"] = quantization_config(layout.plan.dtype, ignored)
    return cfg


INDEX = "model.safetensors.index.json"  # HF's sharded-checkpoint index, for a build transformers loads
# Bumped when the bytes a plan produces change (int8 became pack-quantized): a resume record of
# an older layout is not trusted.
LAYOUT_REVISION = 2


def hf_checkpoint_problem(layout: Layout) -> str | None:
    """Why the build directory is not a Hugging Face checkpoint transformers loads as it is, or
    None when it is. The one rule, asked by the index writer, verify, inspect and the gate's
    transformers reference: tp = 1, and every tensor name holds the same tensor in every file that
    has it. Pipeline stages split the layers, attention data-parallel groups repeat identical
    tensors and Mixtral-style experts have names of their own: all load (tests/compiler/
    test_hf_claims.py). tp > 1 cuts tensors under their full names, and so do stacked experts
    (gpt-oss, MXFP4 blocks included) placed over several ranks of a stage, each holding its block
    of the expert dimension: transformers would read one block as the whole tensor."""
    if layout.plan.tp != 1:
        return f"it is split tp={layout.plan.tp}: each rank holds a slice of the same tensor names"
    seen: dict[str, tuple[str, TensorSpec]] = {}
    for rank_layout in layout.ranks:
        for t in rank_layout.tensors:
            file, first = seen.setdefault(t.name, (rank_layout.file, t))
            if first != t:
                return (f"{file} and {rank_layout.file} hold different parts of {t.name} ({_part(first)} and "
                        f"{_part(t)}) under that one name")
    return None


def _part(t: TensorSpec) -> str:
    """Which part of its source a tensor spec holds, for a message: 'dim 0 [0:2]' or 'whole'."""
    return "whole" if t.dim is None else f"dim {t.dim} [{t.start}:{t.stop}]"


def index_json(layout: Layout) -> dict[str, Any]:
    """model.safetensors.index.json: every tensor name -> the file holding it, and the total bytes
    of tensor data in its metadata (HF's format), for a build ``hf_checkpoint_problem`` passes:
    the build directory is then a Hugging Face checkpoint that transformers and vLLM's default
    loader read as it is. A name repeated by data-parallel groups maps to one of its (identical)
    copies; ``total_size`` counts every file, as written."""
    problem = hf_checkpoint_problem(layout)
    if problem is not None:
        raise ValueError(f"no HF index for this build: {problem}")
    weight_map = {t.name: rank_layout.file for rank_layout in layout.ranks for t in rank_layout.tensors}
    return {"metadata": {"total_size": sum(rank_layout.nbytes for rank_layout in layout.ranks)},
            "weight_map": dict(sorted(weight_map.items()))}


def side_files(layout: Layout) -> dict[str, bytes]:
    """The files build derives from the Layout alone (verify recomputes and compares them)."""
    out = {"config.json": (json.dumps(output_config(layout), indent=1, sort_keys=True) + "\n").encode()}
    if hf_checkpoint_problem(layout) is None:
        out[INDEX] = (json.dumps(index_json(layout), indent=2) + "\n").encode()
    return out


def done_path(out_dir: Path, file: str) -> Path:
    return out_dir / f".{file}.done.json"


def stage_done(out_dir: Path, layout: Layout, rank_layout: RankLayout,
               key: dict) -> tuple[int, str, int, tuple[str, ...]] | None:
    """A shard finished by an earlier run of the same build: kept only if its record matches this
    build (plan, source fingerprint, versions), its bytes still hash to the record, and its header
    is this rank's (metadata, tensor names, dtypes, shapes), so a foreign shard next to a forged
    record is rebuilt, not blessed. Returns (size, sha256, chunk size, chunk digests): the one
    read that checks the sha256 also cuts the chunk digests for the manifest."""
    done, path = done_path(out_dir, rank_layout.file), out_dir / rank_layout.file
    try:
        rec = json.loads(done.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("key") != key or not path.is_file() \
            or path.stat().st_size != rec.get("size"):
        return None
    try:
        tensors, meta, _ = read_header(path)
    except ShardcError:
        return None
    want = {t.name: (t.dtype, list(t.shape)) for t in rank_layout.tensors}
    if meta != shard_metadata(layout, rank_layout) or {n: (e["dtype"], e["shape"]) for n, e in tensors.items()} != want:
        return None
    try:
        with open(path, "rb", buffering=0) as f:
            sha, digests = chunks.digest_file(f.fileno(), rec["size"], chunks.CHUNK_SIZE, layout.plan.chunk_digest)
    except OSError:
        return None
    if sha != rec.get("sha256"):
        return None
    return rec["size"], rec["sha256"], chunks.CHUNK_SIZE, tuple(digests)


def up_to_date(out_dir: Path, plan: Plan, layout: Layout, identity: SourceRecord) -> Manifest | None:
    mpath = out_dir / "manifest.json"
    try:
        m = loads(mpath.read_bytes(), str(mpath))
    except (OSError, ShardcError):
        return None
    if (m.plan_sha256 != plan.sha256 or m.effective_sha256 != plan.effective_sha256
            or m.overrides != plan.overrides or m.source != identity or m.shardc_version != __version__
            or any(s.chunk_size != chunks.CHUNK_SIZE for s in m.shards)):  # an older build: no chunk digests
        return None
    listed = {f.name: f.sha256 for f in m.files}
    for name, data in side_files(layout).items():  # an older shardc's config or layout
        if listed.get(name) != hashlib.sha256(data).hexdigest():
            return None
    for name, size in [(s.file, s.size) for s in m.shards] + [(f.name, f.size) for f in m.files]:
        p = out_dir / name
        if not p.is_file() or p.stat().st_size != size:
            return None
    return m


def check_space(out: Path, layout: Layout, replacing: bool = False) -> None:
    """Refuse up front a build the disk cannot hold (leftovers of a killed run count as free, and
    so do files it overwrites unless ``replacing``: a complete build that must stay until the new
    one is written)."""
    need = 0
    for rank_layout in layout.ranks:
        p = out / rank_layout.file
        need += rank_layout.nbytes - (p.stat().st_size if p.is_file() and not replacing else 0)
    free = shutil.disk_usage(out).free + sum(p.lstat().st_size for p in temp_files(out) if not p.is_dir())
    if need > free:
        kept = "; the build already there stays until the new one is complete" if replacing else ""
        raise OutputError(
            f"{out} has {human_size(free)} free but this plan's shards need {human_size(need)} more{kept}",
            hint="free space, or build elsewhere (`out`)",
        )


def remove_files(paths: list[Path]) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass  # not removable (a directory?): the rename into place reports it


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")
# Every file a build writes besides its shards (and manifest.json): pull writes nothing else.
SIDE_FILES = ("config.json", INDEX, *TOKENIZER_FILES)


def tokenizer_files(source: Source) -> list[str]:
    return [n for n in TOKENIZER_FILES if (source.directory / n).is_file()]


def copy_tokenizer(source: Source, out: Path) -> None:
    """Tokenizer files travel with the shards so the runtime and gate need no source."""
    for n in tokenizer_files(source):
        copy_atomic(source.directory / n, out / n)


def file_entry(out: Path, name: str) -> FileEntry:
    p = out / name
    return FileEntry(name, p.stat().st_size, sha256_file(p))


def write_side_files(layout: Layout, source: Source, out: Path) -> list[FileEntry]:
    """config.json (+ the HF index where transformers loads the build) and the tokenizer files
    next to the shards, with their manifest entries."""
    generated = side_files(layout)
    for name, data in generated.items():
        write_atomic(out / name, data)
    if INDEX not in generated:
        (out / INDEX).unlink(missing_ok=True)  # a build without one where a loadable build was
    copy_tokenizer(source, out)
    return [file_entry(out, n) for n in generated] + [file_entry(out, n) for n in tokenizer_files(source)]


def stage_side_files(layout: Layout, source: Source, out: Path) -> dict[Path, Path]:
    """config.json (+ index) and the tokenizer files written durably at exclusive temp names next
    to their final ones, for a rebuild that switches every file at once: {final: temp}."""
    staged: dict[Path, Path] = {}
    try:
        for name, data in side_files(layout).items():
            staged[out / name] = write_temp(out / name, data)
        for name in tokenizer_files(source):
            fd, tmp = create_temp(out / name)
            staged[out / name] = tmp
            with open(fd, "wb") as f, open(source.directory / name, "rb") as src:
                shutil.copyfileobj(src, f)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        remove_files(list(staged.values()))
        raise
    return staged


def copy_manifest(manifest: Manifest, manifests_dir: str | Path | None) -> None:
    """The rollout record: a copy of the manifest named after its plan."""
    if manifests_dir is None:
        return
    d = Path(manifests_dir)
    d.mkdir(parents=True, exist_ok=True)
    manifest.save(d / f"{manifest.name}.json")
