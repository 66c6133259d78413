"""The compiler: stream source tensors -> (quantize) -> slice per rank -> write + hash -> manifest.

Plan first, execute second: the Layout lists every rank's tensors before a byte is read. Execution
goes stage by stage; inside a stage every source tensor is read once and each TP rank's slice is
handed to that rank's writer thread, which appends it to the rank's file (tensors in name order,
so the bytes are deterministic) and hashes it on the way. Each finished shard is renamed into place
and gets a small ``.done`` record so a killed build resumes; manifest.json is written last.
"""

from __future__ import annotations

import fcntl
import gc
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..errors import OutputError, ShardcError, SourceError
from ..formats.files import human_size
from ..formats.manifest import dumps, loads, new_manifest, write_atomic
from ..formats.safetensors import ShardWriter
from ..spec.dtypes import np_dtype
from ..spec.layout import DTYPE_BYTES, Layout, RankLayout, TensorSpec, build_layout
from ..spec.model import model_from_config
from ..spec.plan import Plan, canonical_json
from .quantize import quantize_array
from .quantqueue import QuantQueue
from .source import Source, open_source, sha256_file

LOCK = ".shardc-build.lock"
# Threads quantizing a tensor's row chunks: half the cores, at most 4. The numba kernels take
# ~1 ns per weight on one thread, so one thread quantizes a 70B layer (0.86G weights) in ~1 s,
# about what reading its 1.7 GB takes; the other cores hash and write. On 2 cores one thread
# measured the same wall time as two, for 0.8 s less CPU per 1.7G weights.
QUANT_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))


@dataclass
class BuildResult:
    out_dir: Path
    manifest_path: Path
    manifest: dict[str, Any]
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    up_to_date: bool = False
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Machine-readable summary for --json."""
        m = self.manifest
        return {
            "plan": m["plan"]["replica_group"]["name"],
            "plan_sha256": m["plan_sha256"],
            "out_dir": str(self.out_dir),
            "manifest": str(self.manifest_path),
            "up_to_date": self.up_to_date,
            "built": self.built,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "shards": [
                {k: s[k] for k in ("file", "tp_rank", "pp_stage", "rank", "layers", "size", "sha256")}
                for s in m["shards"]
            ],
            "total_bytes": sum(s["size"] for s in m["shards"]),
        }


def shard_metadata(layout: Layout, rl: RankLayout) -> dict[str, str]:
    """safetensors __metadata__: catches a file that strays into the wrong directory."""
    p = layout.plan
    return {
        "format": "pt",
        "shardc.version": __version__,
        "shardc.plan": p.name,
        "shardc.plan_sha256": p.sha256,
        "shardc.tp_degree": str(p.tp),
        "shardc.pp_degree": str(p.pp),
        "shardc.tp_rank": str(rl.tp_rank),
        "shardc.pp_stage": str(rl.pp_stage),
        "shardc.rank": str(rl.rank),
        "shardc.layers": f"{rl.layers[0]}:{rl.layers[1]}",
    }


def region(full: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The rank's slice of a full tensor (source or quantized) as a view: nothing is copied."""
    if spec.dim == 0:
        return full[spec.start : spec.stop]
    if spec.dim == 1:
        return full[:, spec.start : spec.stop]
    return full


def cut(full: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The rank's slice in the spec's dtype, as a contiguous array of its own. Pads are not
    included (they are written separately)."""
    part = region(full, spec)
    out = np.empty(part.shape, np_dtype(spec.dtype))
    _cast(out, part)
    return out


# Each writer thread streams its slices a chunk of rows at a time: the cast lands in cache, and
# the hash and the copy to disk read it from there.
CHUNK_BYTES = 1 << 20
_thread = threading.local()


def _chunk_buffer(nbytes: int) -> np.ndarray:
    """The writer thread's spare buffer (reused: fresh multi-MB allocations cost a zeroed page
    fault per 4 KiB)."""
    buf = getattr(_thread, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _thread.buf = np.empty(max(nbytes, CHUNK_BYTES), dtype=np.uint8)
    return buf[:nbytes]


def stream_region(writer: ShardWriter, full: np.ndarray, spec: TensorSpec) -> None:
    """Write the rank's slice of ``full`` in the spec's dtype, a few rows at a time.

    Each chunk of rows is sliced and cast straight into the writer's staging buffer (no
    intermediate copy, and the GIL is free meanwhile); only a chunk that straddles the end of a
    staging buffer goes through the thread's own buffer and a plain ``write``."""
    part = region(full, spec)
    dtype = np_dtype(spec.dtype)
    row_bytes = max(1, math.prod(part.shape[1:]) * dtype.itemsize)
    step = max(1, CHUNK_BYTES // row_bytes)
    r0 = 0
    while r0 < part.shape[0]:
        rows = min(step, part.shape[0] - r0, writer.room() // row_bytes) or 1
        piece = part[r0 : r0 + rows]
        n = piece.size * dtype.itemsize
        staged = writer.reserve(n)
        if staged is not None:
            _cast(np.frombuffer(staged, dtype=dtype).reshape(piece.shape), piece)
            writer.advance(n)
        else:
            out = _chunk_buffer(n).view(dtype).reshape(piece.shape)
            _cast(out, piece)
            writer.write(out.reshape(-1).view(np.uint8))
        r0 += rows


def _cast(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, rounding to nearest even. NaN, inf and overflow pass through as torch's
    casts do (a 16-bit plan copies the checkpoint as it is), so numpy's warnings are off."""
    with np.errstate(all="ignore"):
        np.copyto(dst, src, casting="unsafe")


class Materializer:
    """Reads a source tensor once and produces what the specs ask: the source view (sliced and
    cast later, per rank), or quantized values + scales (from the QuantQueue when one runs)."""

    def __init__(self, source: Source, layout: Layout) -> None:
        self.source, self.layout = source, layout
        self._key: tuple | None = None
        self._value: Any = None
        self.stats: dict[str, dict] = {}
        self.queue: QuantQueue | None = None

    def start_queue(self, keys: list[tuple[str, str]]) -> None:
        """Quantize ``keys`` ahead of the writers, on a thread, within a memory budget: half the
        largest source tensor (the 16-bit streaming that the quantizing overlaps holds at most
        about that much too), and at least the largest quantized tensor. Keys the source holds
        quantized already (a reshard's input build) are not quantized again."""
        keys = [k for k in keys if not self.source.holds_quantized(*k)]
        if not keys:
            return
        infos = self.source.tensors
        largest = max(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in infos.values())
        budget = max(largest // 2, max(math.prod(infos[n].shape) for n, _ in keys))
        self.queue = QuantQueue(keys, self.source.view, self.stats, budget, QUANT_WORKERS)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None

    def full(self, spec: TensorSpec) -> np.ndarray:
        key = (spec.source, spec.quant)
        if spec.quant and self.queue is not None and not self.source.holds_quantized(*key):
            q, scale = self.queue.get(key)
            return scale if spec.scale_of else q
        if key != self._key:
            self._value = None  # release the previous tensor before reading the next
            if spec.quant:
                self._value = self.quantize(spec.source, spec.quant)
            else:
                self._value = self.source.view(spec.source)
            self._key = key
        if spec.quant:
            return self._value[1] if spec.scale_of else self._value[0]
        return self._value

    def release(self, spec: TensorSpec) -> None:
        """The writers are done with this spec's quantized tensor."""
        if spec.quant and self.queue is not None:
            self.queue.release((spec.source, spec.quant))

    def quantize(self, name: str, scheme: str, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Quantized values and scales of a source tensor, here and now; records its error stats."""
        if self.source.holds_quantized(name, scheme):
            q, scale, self.stats[name] = self.source.quantized(name, scheme)
            return q, scale
        w = self.source.view(name) if w is None else w
        q, scale, self.stats[name] = quantize_array(name, w, scheme, QUANT_WORKERS)
        return q, scale


def _write_stage(
    layout: Layout, ranks: list[RankLayout], out_dir: Path, mat: Materializer, bar: Any
) -> dict[str, ShardWriter]:
    """Write the listed TP ranks of one stage together: each source tensor is read once and every
    rank's slice goes to that rank's writer thread. Returns the filled, uncommitted writers."""
    writers = {
        rl.file: ShardWriter(
            out_dir / rl.file, [(t.name, t.dtype, t.shape) for t in rl.tensors], shard_metadata(layout, rl)
        )
        for rl in ranks
    }
    pools = {rl.file: ThreadPoolExecutor(1, thread_name_prefix=f"shardc-w{rl.rank}") for rl in ranks}
    pending: list[list[Future]] = []
    try:
        specs = ranks[0].tensors
        # the last use of each quantized tensor (its weight, then its scale): once every rank has
        # written it, its buffer goes back to the quantizer (each rank writes in order)
        last = {(t.source, t.quant): i for i, t in enumerate(specs) if t.quant}
        for i, first in enumerate(specs):
            futures = []
            for rl in ranks:
                spec = rl.tensors[i]
                assert spec.name == first.name
                # slicing + cast run on the writer threads too: the main thread only hands out
                # source views and quantized tensors, so the per-rank work spreads over the cores
                futures.append(pools[rl.file].submit(_write_piece, writers[rl.file], mat.full(spec), spec, bar))
            if first.quant and last[(first.source, first.quant)] == i:
                _when_all(futures, lambda spec=first: mat.release(spec))
            pending.append(futures)
            if len(pending) > 1:  # at most two tensors in flight: memory stays bounded
                for f in pending.pop(0):
                    f.result()
        for fs in pending:
            for f in fs:
                f.result()
        return writers
    except BaseException:
        for p in pools.values():
            p.shutdown(wait=True, cancel_futures=True)
        for w in writers.values():
            w.abort()
        raise
    finally:
        for p in pools.values():
            p.shutdown(wait=True)


def _when_all(futures: list[Future], fn: Callable[[], None]) -> None:
    """Call ``fn`` once every future is done (on the thread that finishes the last one)."""
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for f in futures:
        f.add_done_callback(done)


def _write_piece(writer: ShardWriter, full, spec: TensorSpec, bar: Any) -> None:
    stream_region(writer, full, spec)
    if spec.pad_rows:
        row = spec.nbytes // spec.shape[0]
        writer.write(bytes(spec.pad_rows * row))
    if bar is not None:
        bar.update(spec.nbytes)


def output_config(layout: Layout) -> dict[str, Any]:
    """config.json next to the shards: the model config plus quantization_config when quantized."""
    from ..spec.layout import base_dtype

    cfg = json.loads(json.dumps(layout.model.config))
    cfg["torch_dtype"] = {"F16": "float16", "BF16": "bfloat16"}[base_dtype(layout.model, layout.plan)]
    if layout.plan.quantized:
        from ..spec.layout import QUANTIZABLE
        from .quantize import quantization_config

        specs = [t for rl in layout.ranks for t in rl.tensors]
        quantized = {t.source for t in specs if t.quant}
        linear = {t.source for t in specs if QUANTIZABLE.fullmatch(t.source)}
        # compressed-tensors lists modules left in 16 bits: lm_head and any plan-ignored projection
        ignored = sorted(n.removesuffix(".weight") for n in linear - quantized) + ["lm_head"]
        cfg["quantization_config"] = quantization_config(layout.plan.dtype, ignored)
    return cfg


def _done_path(out_dir: Path, file: str) -> Path:
    return out_dir / f".{file}.done.json"


def _stage_done(out_dir: Path, rl: RankLayout, key: dict) -> tuple[int, str] | None:
    """A shard finished by an earlier run of the same build, if its bytes still hash right."""
    done, path = _done_path(out_dir, rl.file), out_dir / rl.file
    try:
        rec = json.loads(done.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("key") != key or not path.is_file() or path.stat().st_size != rec.get("size"):
        return None
    if sha256_file(path) != rec.get("sha256"):
        return None
    return rec["size"], rec["sha256"]


def _up_to_date(out_dir: Path, plan: Plan, identity: dict) -> dict | None:
    mpath = out_dir / "manifest.json"
    try:
        m = loads(mpath.read_bytes(), str(mpath))
    except (OSError, ShardcError):
        return None
    if m["plan_sha256"] != plan.sha256 or m["source"] != identity or m["shardc_version"] != __version__:
        return None
    for s in m["shards"] + m["files"]:
        p = out_dir / s.get("file", s.get("name"))
        if not p.is_file() or p.stat().st_size != s["size"]:
            return None
    return m


def build(
    plan: Plan,
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
    manifests_dir: str | Path | None = None,
    source: Source | None = None,
) -> BuildResult:
    """Compile ``plan`` into shard files. Validates everything before writing anything.
    ``source`` replaces the plan's own (reshard passes an input build)."""
    t0 = time.perf_counter()
    if source is None:
        source = open_source(plan.source, allow_pickle=allow_pickle)
        source.uri = plan.source_uri
    model = model_from_config(source.config)
    layout = build_layout(model, plan)
    source.check(model)

    out = Path(out_dir) if out_dir else Path("build") / plan.name
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(f"cannot create output directory {out}: {exc.strerror}") from None
    lock = open(out / LOCK, "w")  # noqa: SIM115 - held for the whole build
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ShardcError(f"another shardc build is writing to {out}", hint="wait for it to finish") from None
    # The cyclic garbage collector finds next to nothing in a build (checked: 0-600 objects), yet
    # ran ~200 times (~70 ms) in a quantized demo build, mostly while numba loads: it waits.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_locked(plan, layout, source, out, force, progress, manifests_dir, t0)
    finally:
        if gc_was_enabled:
            gc.enable()
        lock.close()


def _build_locked(plan, layout, source, out, force, progress, manifests_dir, t0) -> BuildResult:
    # Source hashes are computed in the background while the shards are written (or come from
    # the cache when size and mtime are unchanged); they are awaited only where needed.
    source.start_hashing()
    result = BuildResult(out, out / "manifest.json", {})

    if not force and (out / "manifest.json").is_file():
        identity = source.identity()
        if (m := _up_to_date(out, plan, identity)) is not None:
            result.manifest, result.up_to_date = m, True
            result.skipped = [s["file"] for s in m["shards"]]
            _copy_manifest(result, manifests_dir)
            result.seconds = time.perf_counter() - t0
            return result

    _check_space(out, layout)  # before anything is touched: a refused build loses nothing
    # From here on the old manifest no longer describes the directory: remove it first.
    (out / "manifest.json").unlink(missing_ok=True)
    for stale in out.glob(".*.partial"):
        stale.unlink()
    key = {"plan_sha256": plan.sha256, "source": source.fingerprint(), "shardc_version": __version__}
    mat = Materializer(source, layout)
    hashes: dict[str, tuple[int, str]] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(rl.nbytes for rl in layout.ranks), unit="B", unit_scale=True,
                   unit_divisor=1024, desc=f"build {plan.name}")
    # A stage's shards are committed (fsync, rename, resume record) on a background thread while
    # the next stage is written: the fsync waits for the disk, not for the CPU.
    committer = ThreadPoolExecutor(1, thread_name_prefix="shardc-commit")
    commits: list[tuple[list[RankLayout], Future]] = []

    def commit(todo: list[RankLayout], writers: dict[str, ShardWriter]) -> dict[str, tuple[int, str]]:
        done = {}
        try:
            for rl in todo:
                size, sha = done[rl.file] = writers[rl.file].commit()
                write_atomic(_done_path(out, rl.file), canonical_json({"key": key, "size": size, "sha256": sha}))
        except BaseException:
            for w in writers.values():
                w.abort()  # the ones not committed yet: no temp file stays behind
            raise
        if bar is not None:
            bar.set_postfix_str(f"stage {todo[0].pp_stage + 1}/{plan.pp} committed")
        return done

    try:
        stages = []  # the ranks to write, stage by stage; finished ones (resume) are skipped
        for stage in range(plan.pp):
            todo = []
            for rl in layout.ranks[stage * plan.tp : (stage + 1) * plan.tp]:
                done = None if force else _stage_done(out, rl, key)
                if done:
                    hashes[rl.file] = done
                    result.skipped.append(rl.file)
                    if bar is not None:
                        bar.update(rl.nbytes)
                else:
                    todo.append(rl)
            if todo:
                stages.append(todo)
        mat.start_queue([(t.source, t.quant) for todo in stages for t in todo[0].tensors if t.quant])
        for todo in stages:
            # Old files in the way are deleted on the commit thread while the stage is written
            # (a GB takes ~0.4 s on a filesystem mounted with discard), before its renames.
            committer.submit(_remove, [out / rl.file for rl in todo if (out / rl.file).exists()])
            writers = _write_stage(layout, todo, out, mat, bar)
            commits.append((todo, committer.submit(commit, todo, writers)))
        for todo, fut in commits:
            written = fut.result()
            for rl in todo:
                hashes[rl.file] = written[rl.file]
                result.built.append(rl.file)
    except ShardcError:
        # Bad input found mid-build (NaN in a late layer): leave nothing of this run behind.
        committer.shutdown(wait=True)
        for todo, _ in commits:
            for rl in todo:
                (out / rl.file).unlink(missing_ok=True)
                _done_path(out, rl.file).unlink(missing_ok=True)
        raise
    except OSError as exc:
        # The disk, not the input: keep the committed stages, a rerun resumes from them.
        committer.shutdown(wait=True)
        what = Path(exc.filename2 or exc.filename).name.removeprefix(".").removesuffix(".partial") \
            if exc.filename else "the shards"
        raise OutputError(
            f"cannot write {what} in {out}: {exc.strerror or exc}",
            hint="free space or fix the disk, then rerun the same build: finished stages are kept",
        ) from None
    finally:
        mat.close()
        committer.shutdown(wait=True)
        if bar is not None:
            bar.close()

    # A resumed build skipped some tensors; recompute their error stats so the manifest is
    # identical to an uninterrupted build's.
    if plan.quantized:
        for name in sorted({t.source for rl in layout.ranks for t in rl.tensors if t.quant}):
            if name not in mat.stats:
                mat.quantize(name, plan.dtype)

    cfg_bytes = (json.dumps(output_config(layout), indent=1, sort_keys=True) + "\n").encode()
    write_atomic(out / "config.json", cfg_bytes)
    _copy_tokenizer(source, out)
    side = [_file_entry(out, "config.json")] + [_file_entry(out, n) for n in _tokenizer_files(source)]
    shards = []
    for rl in layout.ranks:
        size, sha = hashes[rl.file]
        tensors = {}
        for t in rl.tensors:
            rec = t.record()
            if t.quant and not t.scale_of:
                rec["stats"] = mat.stats[t.source]
                rec["scale"] = t.name + "_scale"
            tensors[t.name] = rec
        shards.append({
            "file": rl.file, "tp_rank": rl.tp_rank, "pp_stage": rl.pp_stage, "rank": rl.rank,
            "layers": list(rl.layers), "size": size, "sha256": sha, "tensors": tensors,
        })
    identity = source.identity()
    manifest = new_manifest(layout, identity, shards, side)
    write_atomic(out / "manifest.json", dumps(manifest))  # the commit point
    for rl in layout.ranks:
        _done_path(out, rl.file).unlink(missing_ok=True)
    result.manifest = manifest
    _copy_manifest(result, manifests_dir)
    result.seconds = time.perf_counter() - t0
    return result


def _check_space(out: Path, layout: Layout) -> None:
    """Refuse up front a build the disk cannot hold (files it replaces, and leftovers of a killed
    run, count as free)."""
    need = 0
    for rl in layout.ranks:
        p = out / rl.file
        need += rl.nbytes - (p.stat().st_size if p.is_file() else 0)
    free = shutil.disk_usage(out).free + sum(p.stat().st_size for p in out.glob(".*.partial"))
    if need > free:
        raise OutputError(
            f"{out} has {human_size(free)} free but this plan's shards need {human_size(need)} more",
            hint="free space, or build elsewhere with --out DIR",
        )


def _remove(paths: list[Path]) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass  # not removable (a directory?): the rename into place reports it


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")


def _tokenizer_files(source: Source) -> list[str]:
    return [n for n in TOKENIZER_FILES if (source.directory / n).is_file()]


def _copy_tokenizer(source: Source, out: Path) -> None:
    """Tokenizer files travel with the shards so the runtime and gate need no source."""
    for n in _tokenizer_files(source):
        tmp = out / f".{n}.tmp"
        shutil.copyfile(source.directory / n, tmp)
        os.replace(tmp, out / n)


def _file_entry(out: Path, name: str) -> dict[str, Any]:
    p = out / name
    return {"name": name, "size": p.stat().st_size, "sha256": sha256_file(p)}


def _copy_manifest(result: BuildResult, manifests_dir: str | Path | None) -> None:
    if manifests_dir is None:
        return
    d = Path(manifests_dir)
    d.mkdir(parents=True, exist_ok=True)
    name = result.manifest["plan"]["replica_group"]["name"]
    write_atomic(d / f"{name}.json", dumps(result.manifest))
