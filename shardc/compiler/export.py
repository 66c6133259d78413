"""Export: a build back to one Hugging Face checkpoint (tp=1, pp=1, HF file naming).

It is reshard to one rank, through the same BuildSource and the same Layout, only written the way
``save_pretrained`` shards a model: ``model-0000i-of-0000n.safetensors`` files of at most
``max_shard_size`` bytes each (a larger tensor gets a file of its own), tensors in name order,
``model.safetensors.index.json`` (the commit point), config.json and the tokenizer.
A 16-bit export holds the build's tensors bit for bit; a quantized one keeps the build's
quantized values and scales as they are, in compressed-tensors' form (int8 pack-quantized: the
tensors a tp=1 build of the same dtype holds; config.json carries the quantization_config).
The tensors are produced by the build's own Materializer, so an export is what ``shardc build``
would write for the checkpoint at tp=1, only named and grouped into files the HF way.

Like a rebuild, an export never destroys what it replaces: it holds the build lock of the output
directory for its whole run (so two exports, or an export and a build, never write one directory
at once), removes what a killed earlier run left at temp names, writes every new file durably at
a temp name (``formats/files.py`` ``create_temp``) and only then switches them in: the old index
goes first, the files are renamed into place, stale files of the old export are removed, and the
new index is renamed last. A failure before the switch leaves the old export byte for byte; a
kill during it leaves no index (never one that names missing or other files), and a rerun writes
the export again. compiler/switch.py's journal is not used: its commit point is a shardc manifest,
which an HF checkpoint does not have, and export needs no roll-forward (a rerun is the recovery).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, OutputError, PlanError, VerifyMismatch
from ..formats.files import fsync_dir, safe_name, temp_files, write_temp
from ..formats.manifest import SWITCH_JOURNAL, Manifest
from ..formats.safetensors import ShardWriter
from ..layout.model import model_from_config
from ..layout.plan import plan_from_dict
from ..layout.ranks import TensorSpec, build_layout
from ..layout.readfile import read_regular_file
from .build_files import BuildInput
from .build_tensors import BuildSource
from .lock import LOCK, take_lock
from .materialize import Materializer, stream_region
from .outdir import HF_FILE, check_export_dir
from .outputs import INDEX, TOKENIZER_FILES, output_config
from .source import Source


def export_plan(manifest: Manifest):
    """The input's plan at tp=1, pp=1: same dtype, quantization ignore list and base dtype. The
    input's own plan is checked first, so an edited one is one line naming the manifest's plan."""
    try:
        plan_from_dict(json.loads(json.dumps(manifest.plan)))
    except PlanError as exc:
        raise ManifestError(f"the input manifest's plan is not a valid plan: {exc.one_line()}",
                            key="plan", hint="rebuild the input, or restore its manifest.json") from None
    data = json.loads(json.dumps(manifest.plan))
    rg = data["replica_group"]
    rg.update(tp_degree=1, pp_degree=1, gpus_per_replica=1)
    for key in ("dp_degree", "expert_parallel"):  # one rank holds every expert
        rg.pop(key, None)
    rg.get("checkpoint", {}).pop("shard_prefix", None)
    data["model"].pop("pp_layers", None)
    return plan_from_dict(data)


def _groups(specs: tuple[TensorSpec, ...], limit: int) -> list[list[TensorSpec]]:
    """Tensors in name order, a new file whenever the next one would cross the limit."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in specs:
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


@dataclass(frozen=True)
class ExportedFile:
    """A weights file of the export (``tensors``: how many it holds) with the chunk digests its
    writer cut while writing (``chunk_size``, ``chunks``: a loader checks them on every core)."""

    name: str
    size: int
    sha256: str
    tensors: int
    chunk_size: int
    chunks: tuple[str, ...]


@dataclass(frozen=True)
class ExportSource:
    """The input build: where it was read from and its manifest's sha256."""

    uri: str
    manifest_sha256: str


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote (``shardc export --json`` is its ``results.to_json`` form)."""

    out_dir: str
    index: str
    files: tuple[ExportedFile, ...]
    total_bytes: int
    dtype: str
    source: ExportSource
    seconds: float


def export(inp: BuildInput, out_dir: str | Path, *, max_shard_size: int = 5 * 10**9,
           replace: bool = False) -> ExportResult:
    """Write the input build as one Hugging Face checkpoint in ``out_dir``. Bad input is found
    before the output directory is touched; any later failure leaves the export that was there
    (if any) as it was, and removes what this run created. A directory holding files an export
    does not write is refused, and an export of another model or dtype is replaced only with
    ``replace`` (``compiler/outdir.py``)."""
    t0 = time.perf_counter()
    try:
        if max_shard_size < 1:
            raise PlanError(f"must be at least 1 byte, found {max_shard_size}", key="max_shard_size",
                            hint="5GB is 5 * 10**9, transformers' default")
        plan = export_plan(inp.manifest)
        layout = build_layout(model_from_config(inp.manifest.config), plan)
        build_source = BuildSource(inp, layout)
        out = Path(out_dir)
        _refuse_input_dir(out, inp)
        config = _config_bytes(layout)
        check_export_dir(out, config, replace=replace)  # before the lock file is made
        inp.side_directory()  # config and tokenizer files checked (and copied) first: small
        build_source.schedule(layout)
        with _locked(out):
            check_export_dir(out, config, replace=replace)  # what the lock now holds still
            files, total = _export_locked(inp, build_source.as_source(), layout, out, max_shard_size)
    finally:
        inp.close()
    return ExportResult(str(out), str(out / INDEX), tuple(ExportedFile(**f) for f in files), total,
                        layout.plan.dtype, ExportSource(inp.uri, inp.manifest_sha256),
                        round(time.perf_counter() - t0, 3))


def _refuse_input_dir(out: Path, inp: BuildInput) -> None:
    """The export would overwrite the input's config.json and index (a tp=1 build has both):
    refused however the directory is spelled (``..``, a symlink, a bind mount)."""
    try:
        same = out.resolve() == inp.directory.resolve()
    except (OSError, RuntimeError):  # a symlink loop: not the input (creating it says what it is)
        same = False
    if not same and out.exists():
        try:
            same = os.path.samefile(out, inp.directory)
        except OSError:
            pass
    if same:
        raise PlanError(f"the output directory {out} is the input build's own directory",
                        key="out", hint="export into another directory")


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Create ``out`` if needed and hold its build lock (the one ``shardc build`` takes) for the
    block: a second export or build into ``out`` is refused at once and touches nothing. On a
    failure, a directory this call created is removed again (if nothing else appeared in it)."""
    created = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the output directory {out}: {exc.strerror or exc}",
                          hint="export into a writable directory (`out`)") from None
    try:
        lock = take_lock(out, busy=f"another shardc export or build is writing to {out}",
                         busy_hint="wait for it to finish, or export into another directory",
                         open_hint="export into a writable directory you own (--out DIR)")
    except OutputError:
        _remove_created(out, created)
        raise
    try:
        yield
    except BaseException:
        _remove_created(out, created)
        raise
    finally:
        os.close(lock)


def _remove_created(out: Path, created: bool) -> None:
    """Undo this run's mkdir: its lock file and the directory, when nothing else is in it."""
    if not created:
        return
    (out / LOCK).unlink(missing_ok=True)
    try:
        out.rmdir()
    except OSError:
        pass  # something else is in it now: left as it is


def _export_locked(inp: BuildInput, source: Source, layout, out: Path,
                   limit: int) -> tuple[list[dict[str, Any]], int]:
    """The export under the lock: clean up, stage every file, switch them in. Returns the weights
    files written and their total bytes."""
    if os.path.lexists(out / "manifest.json") or os.path.lexists(out / SWITCH_JOURNAL):
        raise PlanError(f"the output directory {out} holds a shardc build, which the export would break",
                        key="out", hint="export into another directory")
    try:
        for stale in temp_files(out):  # left by a killed run (the lock says none is running)
            if stale.is_symlink() or not stale.is_dir():  # a directory is not one of our files
                stale.unlink(missing_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot remove what a killed export left in {out}: {exc.strerror or exc}",
                          hint="fix the directory's permissions, then rerun") from None
    staged: list[tuple[Path, str]] = []  # (durable temp file, final name), the index last
    try:
        files = _stage(inp, source, layout, out, limit, staged)
    except BaseException as exc:
        _unlink([tmp for tmp, _ in staged])
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write the export in {out}: {exc.strerror or exc}",
                              hint="free space or fix the disk, then rerun") from None
        raise
    try:
        _switch(out, staged, [n for _, n in staged])
    except OutputError:
        _unlink([tmp for tmp, _ in staged])
        raise
    except OSError as exc:
        _unlink([tmp for tmp, _ in staged])
        raise OutputError(f"cannot switch the export into {out}: {exc.strerror or exc}; it has no "
                          f"index now", hint="fix the disk, then rerun the export") from None
    return files, sum(t.nbytes for t in layout.ranks[0].tensors)


def _stage(inp: BuildInput, source: Source, layout, out: Path, limit: int,
           staged: list[tuple[Path, str]]) -> list[dict[str, Any]]:
    """Every file of the export, durably at its temp name (appended to ``staged`` as it is
    made, so the caller can remove them on failure): shards, config.json, tokenizer, index."""
    rank_layout = layout.ranks[0]
    groups = _groups(rank_layout.tensors, limit)
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    meta = {"format": "pt", "shardc.export_of": inp.manifest_sha256}
    weight_map, files = {}, []
    mat = Materializer(source, layout)  # int8 packed again, X.weight_shape from the Layout
    for fname, group in zip(names, groups, strict=True):
        w = ShardWriter(out / fname, [(t.name, t.dtype, t.shape) for t in group], meta)
        try:
            for t in group:
                stream_region(w, mat.full(t), t)
                weight_map[t.name] = fname
                if len(weight_map) == 1:
                    _fault("stage:0")  # one tensor of the first file written, the file unfinished
            size, sha = w.commit(rename=False)
        except BaseException:
            w.abort()
            raise
        staged.append((w.tmp, fname))
        # the writer cut its chunk digests (#30) while writing: a loader of the export checks
        # chunks on every core with them, as it does a build's
        files.append({"name": fname, "size": size, "sha256": sha, "tensors": len(group),
                      "chunk_size": w.chunk_size, "chunks": tuple(w.chunks)})
        _fault(f"stage:{len(staged)}")
    _stage_bytes(out, "config.json", _config_bytes(layout), staged)
    for name in sorted(set(TOKENIZER_FILES) & set(inp.side_files())):
        _stage_bytes(out, name, _side_file(inp, name), staged)
    index = {"metadata": {"total_size": sum(t.nbytes for t in rank_layout.tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    _stage_bytes(out, INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), staged)
    return files


def _config_bytes(layout) -> bytes:
    """The export's config.json (build's, byte for byte)."""
    return (json.dumps(output_config(layout), indent=1, sort_keys=True) + "\n").encode()


def _stage_bytes(out: Path, name: str, data: bytes, staged: list[tuple[Path, str]]) -> None:
    staged.append((write_temp(out / name, data), name))
    _fault(f"stage:{len(staged)}")


def _side_file(inp: BuildInput, name: str) -> bytes:
    """A tokenizer file the input manifest lists, from ``BuildInput.side_directory``: the copies
    whose bytes were hashed against the manifest as they were made, never through a link (the one
    place reshard's build copies them from too)."""
    return read_regular_file(inp.side_directory() / safe_name(name), limit=inp.entry(name).size,
                             what="input file", error=VerifyMismatch, follow_links=False)


def _switch(out: Path, staged: list[tuple[Path, str]], new: list[str]) -> None:
    """Rename the staged files into place, the index last. From the old index's removal to the
    new one's rename the directory has no index: a reader never sees one naming other files.
    A final name a rename cannot replace (a directory) is found first, with nothing touched."""
    for _, name in staged:
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise OutputError(f"cannot switch the export into {out}: {out / name} is a directory",
                              key=name, hint="remove it, then rerun the export")
    (out / INDEX).unlink(missing_ok=True)
    fsync_dir(out)
    _fault("switch:0")
    for i, (tmp, name) in enumerate(staged[:-1], 1):
        os.replace(tmp, out / name)
        _fault(f"switch:{i}")
    _unlink([p for p in out.glob("model-*-of-*.safetensors")  # a directory there is not ours
             if HF_FILE.match(p.name) and p.name not in new and (p.is_symlink() or not p.is_dir())])
    fsync_dir(out)  # every file in place before the index says so
    tmp, name = staged[-1]
    os.replace(tmp, out / name)  # the commit point
    fsync_dir(out)
    _fault(f"switch:{len(staged)}")


def _unlink(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _fault(point: str) -> None:
    """Fault injection for the export tests: SHARDC_FAULT='export:stage:N' kills this process
    (SIGKILL) once N files are staged at their temp names (0: the first tensor is written, its
    file is not finished), 'export:switch:N' once the old index is removed and N files renamed
    (the number of files: the new index is in place). A ':stop' suffix stops it there instead
    (SIGSTOP, the lock held: the concurrency tests). Read only here, at these points."""
    spec = os.environ.get("SHARDC_FAULT")
    if spec == f"export:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec == f"export:{point}:stop":
        os.kill(os.getpid(), signal.SIGSTOP)
