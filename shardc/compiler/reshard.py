"""Reshard: an existing build becomes the Source of an ordinary build for another plan.

The input is read through ``BuildSource`` (compiler/build_tensors.py), so the compiler, unchanged,
cuts the output exactly as ``build`` cuts a checkpoint: whenever the path is lossless
``reshard(build(src, A), B)`` is byte-identical to ``build(src, B)`` by construction. Here: the
checks of the plan against the input's model, the run itself, and what a failed run leaves
(nothing of its own in a directory it created; the input's corruption named as the cause).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import ModelError, OutputError, PlanError, ShardcError, VerifyMismatch
from ..formats.files import temp_files
from ..layout.model import ModelSpec, config_key, model_for_source, model_from_config
from ..layout.plan import Plan
from .build_files import BuildInput
from .build_tensors import BuildSource
from .outdir import OccupiedOutput


def check_model(plan: Plan, model: ModelSpec) -> None:
    """A plan whose own model.source resolves to a config must describe the build's model."""
    try:
        theirs = model_for_source(plan.source)
    except ModelError:
        return  # the plan's source is not at hand (a hub repo without preset, a path elsewhere)
    a, b = theirs.summary(), model.summary()
    for key in a:
        if a[key] != b[key]:
            field = config_key(key)
            raise PlanError(
                f"the plan's model ({plan.source}) has {field}={a[key]!r} but the input build's "
                f"model has {field}={b[key]!r}",
                key=field,
                hint="reshard with a plan for the same model as the input build",
            )


def reshard(
    inp: BuildInput,
    plan: Plan,
    out_dir: str | Path | None = None,
    *,
    dequantize: bool = False,
    force: bool = False,
    progress: bool = False,
    manifests_dir: str | Path | None = None,
    replace: bool = False,
):
    """Build ``plan`` from the input build instead of a checkpoint (into ``out_dir`` as build
    writes one: another plan's build there, or its record, replaced only with ``replace``). Everything that can be
    checked before writing is (model, degrees, dtype rules); a failure later (a corrupted input
    file, replicas that differ) leaves no file of this run behind."""
    from ..layout.ranks import build_layout
    from .compile import build
    from .lock import LOCK

    try:
        model = model_from_config(inp.manifest.config)
        check_model(plan, model)
        layout = build_layout(model, plan)
        out = Path(out_dir) if out_dir else Path("build") / plan.name
        if out.resolve() == inp.directory.resolve():
            raise PlanError(f"the output directory {out} is the input build's own directory",
                            key="out", hint="reshard into another directory")
        existed = out.exists()
        source = BuildSource(inp, layout, dequantize=dequantize, speculative=True)
        # config and tokenizer files: only those the input lists, copied as they were hashed (small:
        # first); the build copies the tokenizer files from there
        source.directory = inp.side_directory()
        source.schedule(layout)
        try:
            return build(plan, out, force=force, progress=progress, manifests_dir=manifests_dir,
                         source=source.as_source(), replace=replace)
        except OccupiedOutput:
            raise  # refused before anything was written: the input is not the cause
        except ShardcError as exc:
            # build removed this run's shards (bad input); a disk failure keeps them to resume
            if not isinstance(exc, OutputError):
                if not existed:
                    _remove_new_output(out, LOCK)
                _raise_corruption(inp)
            raise
    finally:
        inp.close()


def _remove_new_output(out: Path, lock_name: str) -> None:
    """After a failed run into a directory that did not exist: remove what a run leaves there
    (temp files, resume records) and the directory once nothing else is in it; only while holding
    the build lock. A run that lost the lock to another (or whose directory another run took over
    since) touches nothing: every file there is the other run's."""
    try:
        fd = os.open(out / lock_name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no lock file: this run never got as far as the directory
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another run holds it
        for p in [*temp_files(out), *out.glob(".*.done.json")]:
            p.unlink(missing_ok=True)
        if [p.name for p in out.iterdir()] == [lock_name]:
            (out / lock_name).unlink()
            out.rmdir()
    except OSError:
        pass  # best effort: what stays is a directory without a manifest, which no reader uses
    finally:
        os.close(fd)


def _raise_corruption(inp: BuildInput) -> None:
    """Bytes are used while their hashes are checked (``BuildInput.ready``): whatever went wrong
    on the way (replicas that differ, a bad header, NaN), a corrupted input file read so far is
    the root cause to report; raise its mismatch if there is one."""
    try:
        inp.confirm()
    except VerifyMismatch as corrupt:
        raise corrupt from None
