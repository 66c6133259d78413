"""The compiler: stream source tensors -> (quantize) -> slice per rank -> write + hash -> manifest.

Plan first, execute second: the Layout lists every rank's tensors before a byte is read. Execution
goes stage by stage; inside a stage every source tensor is read once and each TP rank's slice is
handed to that rank's writer thread, which appends it to the rank's file (tensors in name order,
so the bytes are deterministic) and hashes it on the way. Each finished shard is renamed into place
and gets a small ``.done`` record so a killed build resumes; manifest.json is written last.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OutputError, ShardcError, SourceError
from ..formats.files import final_name, temp_files
from ..formats.manifest import Manifest, ShardEntry, new_manifest
from ..formats.safetensors import ShardWriter
from ..layout.model import model_from_config
from ..layout.plan import Plan
from ..layout.quantization import SCALE_SUFFIX
from ..layout.ranks import Layout, RankLayout, build_layout
from ..version import __version__
from .checkpoint import open_source
from .commit import Committer, choose_committer, output_error
from .lock import take_lock
from .materialize import Materializer
from .outdir import check_build_dir, check_record
from .outputs import (
    LAYOUT_REVISION,
    check_space,
    copy_manifest,
    remove_files,
    stage_done,
    up_to_date,
)
from .quantized import check_kept, with_quantization
from .source import Source
from .stages import stage_order, write_stage
from .switch import finish_switch


@dataclass
class BuildResult:
    out_dir: Path
    manifest_path: Path
    manifest: Manifest | None
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    up_to_date: bool = False
    seconds: float = 0.0
    finished_switch: bool = False  # an interrupted rebuild's switch was finished first

    def summary(self) -> dict[str, Any]:
        """Machine-readable summary for --json."""
        m = self.manifest
        assert m is not None  # set by the time a build returns its result
        return {
            "plan": m.name,
            "plan_sha256": m.plan_sha256,
            "effective_plan_sha256": m.effective_sha256,
            "overrides": dict(m.overrides),
            "out_dir": str(self.out_dir),
            "manifest": str(self.manifest_path),
            "up_to_date": self.up_to_date,
            "finished_switch": self.finished_switch,
            "built": self.built,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "shards": [
                {"file": s.file, "tp_rank": s.tp_rank, "pp_stage": s.pp_stage, "rank": s.rank,
                 "layers": list(s.layers), "size": s.size, "sha256": s.sha256}
                for s in m.shards
            ],
            "total_bytes": m.total_bytes,
        }


@dataclass
class BuildRun:
    """One build in progress: its inputs, where it writes, and what it has produced so far."""

    plan: Plan
    layout: Layout
    source: Source
    out: Path
    force: bool
    progress: bool
    manifests_dir: str | Path | None
    t0: float
    # shard file -> (size, sha256, chunk size, chunk digests)
    hashes: dict[str, tuple[int, str, int, tuple[str, ...]]] = field(default_factory=dict)
    key: dict[str, Any] = field(default_factory=dict)  # what a resume record must match
    bar: Any = None
    commit: Committer | None = None  # fresh or switch (compiler/commit.py), chosen once

    def __post_init__(self) -> None:
        self.result = BuildResult(self.out, self.out / "manifest.json", None)


def build(
    plan: Plan,
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
    manifests_dir: str | Path | None = None,
    source: Source | None = None,
    replace: bool = False,
) -> BuildResult:
    """Compile ``plan`` into shard files. Validates everything before writing anything, the output
    directory and the record included (``compiler/outdir.py``): another plan's build there, or its
    record in ``manifests_dir``, is replaced only with ``replace``; files that are not a build never."""
    t0 = time.perf_counter()
    if source is None:  # reshard passes an input build as the source
        checkpoint = open_source(plan.source, allow_pickle=allow_pickle)
        checkpoint.uri = plan.source_uri
        model = model_from_config(checkpoint.config)
        source = with_quantization(checkpoint, model)  # a quantized checkpoint: read by its format
    else:
        model = model_from_config(source.config)
    layout = build_layout(model, plan)
    source.check(model)
    check_kept(source, layout)  # a quantized source kept as stored: every tensor copied exactly

    out = Path(out_dir) if out_dir else Path("build") / plan.name
    files = {rank_layout.file for rank_layout in layout.ranks}
    check_build_dir(out, plan.name, files, replace=replace)  # before the lock file is made
    check_record(manifests_dir, out, plan.name, plan.effective_sha256, source.identity, replace=replace)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(f"cannot create output directory {out}: {exc.strerror}") from None
    lock = take_lock(out, busy=f"another shardc build is writing to {out}", busy_hint="wait for it to finish",
                     open_hint="build into a writable directory you own (--out DIR)")  # for the whole build
    try:
        # A rebuild killed while switching its files in left a journal: finish that switch before
        # anything looks at the directory (up-to-date check, temp cleanup), whatever this plan is.
        finished = finish_switch(out)
        check_build_dir(out, plan.name, files, replace=replace)  # what the lock now holds still
        with source.guard():  # another process cutting a mapped source file: an error, not SIGBUS
            run = BuildRun(plan, layout, source, out, force, progress, manifests_dir, t0)
            run.result.finished_switch = finished
            return _run(run)
    finally:
        os.close(lock)


def _run(run: BuildRun) -> BuildResult:
    """The build's steps, in order; each is a function below."""
    # Source hashes are computed in the background while the shards are written (or come from
    # the cache when size and mtime are unchanged); they are awaited only where needed.
    run.source.start_hashing()
    if not run.force and (m := _current_manifest(run)) is not None:
        # Nothing to build, but a killed run (a --force rebuild over this complete build) may have
        # left its staged shards at temp names: they go now, not at the next build that writes.
        _remove_leftovers(run.out)
        run.result.manifest, run.result.up_to_date = m, True
        run.result.skipped = [s.file for s in m.shards]
        return _finish(run)
    _prepare_output(run)
    mat = Materializer(run.source, run.layout)
    try:
        stages = _stages_to_write(run)
        mat.start_queue([(t.source, t.quant) for todo in stages for t in stage_order(todo) if t.quant])
        _write_stages(run, stages, mat)
    finally:
        mat.close()
        if run.bar is not None:
            run.bar.close()
    run.result.manifest = _write_manifest(run, mat)
    return _finish(run)


def _current_manifest(run: BuildRun) -> Manifest | None:
    """The existing manifest, when it describes exactly this build and its files are in place."""
    if not (run.out / "manifest.json").is_file():
        return None
    return up_to_date(run.out, run.plan, run.layout, run.source.identity())


def _prepare_output(run: BuildRun) -> None:
    run.key = {"plan_sha256": run.plan.sha256, "source": run.source.fingerprint(), "shardc_version": __version__,
               "layout_revision": LAYOUT_REVISION}
    run.commit = choose_committer(run.out, run.key)
    # Before anything is touched: a refused build loses nothing.
    check_space(run.out, run.layout, replacing=run.commit.replacing)
    _remove_leftovers(run.out)
    if run.progress:
        from ..progress import bar

        run.bar = bar(sum(rank_layout.nbytes for rank_layout in run.layout.ranks), f"build {run.plan.name}", leave=True)


def _remove_leftovers(out: Path) -> None:
    """Temp files a killed run left in ``out``; the caller holds the build lock, so no running
    build's temp file is among them. Only our own kind of file goes: a directory or other
    non-file that merely has a temp-looking name is left alone."""
    for stale in temp_files(out):
        if not stale.is_dir() or stale.is_symlink():
            stale.unlink(missing_ok=True)


def _stages_to_write(run: BuildRun) -> list[list[RankLayout]]:
    """The ranks to write, stage by stage; shards finished by an earlier run (resume) are kept."""
    plan, stages = run.plan, []
    for stage in range(plan.pp):
        todo = []
        for rank_layout in run.layout.stage(stage):
            done = None if run.force else stage_done(run.out, run.layout, rank_layout, run.key)
            if done:
                run.hashes[rank_layout.file] = done
                run.result.skipped.append(rank_layout.file)
                if run.bar is not None:
                    run.bar.update(rank_layout.nbytes)
            else:
                todo.append(rank_layout)
        if todo:
            stages.append(todo)
    return stages


def _commit(run: BuildRun, todo: list[RankLayout],
            writers: dict[str, ShardWriter]) -> dict[str, tuple[int, str, int, tuple[str, ...]]]:
    """Make a written stage's shards durable as the committer does (renamed into place with a
    resume record, or kept at their temp names for the switch)."""
    done = {}
    assert run.commit is not None
    try:
        run.source.confirm()  # nothing derived from an unchecked input byte is committed
        for rank_layout in todo:
            w = writers[rank_layout.file]
            size, sha = run.commit.shard(rank_layout, w)
            done[rank_layout.file] = (size, sha, w.chunk_size, tuple(w.chunks))
    except BaseException:
        for w in writers.values():
            w.abort()  # the ones not committed yet: no temp file stays behind
        raise
    if run.bar is not None:
        run.bar.set_postfix_str(f"stage {todo[0].pp_stage + 1}/{run.plan.pp} committed")
    return done


def _write_stages(run: BuildRun, stages: list[list[RankLayout]], mat: Materializer) -> None:
    """Write the stages in order. A stage's shards are committed (fsync, rename, resume record)
    on a background thread while the next stage is written: the fsync waits for the disk, not
    for the CPU."""
    out, commit = run.out, run.commit
    assert commit is not None
    committer = ThreadPoolExecutor(1, thread_name_prefix="shardc-commit")
    commits: list[tuple[list[RankLayout], Future]] = []
    try:
        for todo in stages:
            # Old files in the way are deleted on the commit thread while the stage is written
            # (slow on a filesystem mounted with discard), before its renames.
            if old := commit.in_the_way(todo):
                committer.submit(remove_files, old)
            writers = write_stage(run.layout, todo, out, mat, run.bar)
            commits.append((todo, committer.submit(_commit, run, todo, writers)))
        for todo, fut in commits:
            written = fut.result()
            for rank_layout in todo:
                run.hashes[rank_layout.file] = written[rank_layout.file]
                run.result.built.append(rank_layout.file)
    except ShardcError:
        # Bad input found mid-build (NaN in a late layer): leave nothing of this run behind.
        committer.shutdown(wait=True)
        commit.discard([rank_layout.file for todo, _ in commits for rank_layout in todo])
        raise
    except OSError as exc:
        # The disk, not the input: keep the committed stages, a rerun resumes from them; when
        # replacing a build, drop this run's files instead: the old build is still complete.
        committer.shutdown(wait=True)
        what = final_name(exc.filename2 or exc.filename) if exc.filename else "the shards"
        commit.disk_failed()
        raise OutputError(f"cannot write {what} in {out}: {exc.strerror or exc}", hint=commit.disk_hint) from None
    finally:
        committer.shutdown(wait=True)


def _write_manifest(run: BuildRun, mat: Materializer) -> Manifest:
    """Side files, then the manifest: the commit point of the build (when replacing a build, both
    are staged too and everything switches in at once: ``compiler/commit.py``)."""
    layout, commit = run.layout, run.commit
    assert commit is not None
    # A resumed build skipped some tensors; recompute their error stats so the manifest is
    # identical to an uninterrupted build's.
    if run.plan.quantized:
        for name in sorted({t.source for rank_layout in layout.ranks for t in rank_layout.tensors if t.quant}):
            if name not in mat.stats:
                mat.quantize(name, run.plan.dtype)
    run.source.confirm()  # every input byte behind the manifest (committed stages were confirmed)
    try:
        side = commit.side_files(layout, run.source)
    except OSError as exc:
        raise output_error(run.out, exc, "config.json and the tokenizer files") from None
    shards = []
    for rank_layout in layout.ranks:
        size, sha, chunk_size, chunks = run.hashes[rank_layout.file]
        tensors = {}
        for t in rank_layout.tensors:
            rec = t.record()
            if t.quant and not t.scale_of and t.value is None:  # the values, not their companions
                rec["stats"] = mat.stats[t.source]
                rec["scale"] = t.source + SCALE_SUFFIX
            tensors[t.name] = rec
        shards.append(ShardEntry(rank_layout.file, rank_layout.tp_rank, rank_layout.pp_stage,
                                 rank_layout.rank, rank_layout.layers, size, sha, tensors,
                                 experts=rank_layout.experts,
                                 dp_rank=rank_layout.dp_rank if layout.plan.dp > 1 else None,
                                 chunk_size=chunk_size, chunks=chunks, chunk_digest=layout.plan.chunk_digest))
    manifest = new_manifest(layout, run.source.identity(), shards, side)
    commit.manifest(manifest, layout)
    return manifest


def _finish(run: BuildRun) -> BuildResult:
    assert run.result.manifest is not None  # written (or found up to date) before the finish
    copy_manifest(run.result.manifest, run.manifests_dir)
    run.result.seconds = time.perf_counter() - run.t0
    return run.result
