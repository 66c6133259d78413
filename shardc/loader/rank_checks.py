"""What is checked before a shard's byte is read, local or from object storage: the arguments'
types (``check_arguments``: a library call gets the CLI's one-line errors, not a TypeError from deep
inside), the rank's place in the plan, the node's GPUs, the manifest's records and the shard's
recorded size against the Layout recomputed from the plan (``rank_of``), and the check the shard's
header gets from the very bytes read, before its data is read (``header_check``). ``verify`` runs
``check_manifest_against_layout`` over a whole build too (verify/checks.py)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import DeviceError, LayoutError, ManifestError, VerifyMismatch
from ..formats.manifest import Manifest
from ..formats.safetensors import METADATA
from ..layout.plan import data_sha256
from ..layout.ranks import Layout, RankLayout
from .tensors import HeaderCheck

FULL = "run shardc verify for the full report"


def check_arguments(tp_rank: Any, pp_stage: Any, device: Any, directory: Any, dp_rank: Any = 0) -> None:
    """Ranks are ints (not bools, floats or strings), ``device`` a string, ``directory`` a path."""
    for key, value in (("tp_rank", tp_rank), ("pp_stage", pp_stage), ("dp_rank", dp_rank)):
        if type(value) is not int:
            raise LayoutError(f"is {value!r} ({type(value).__name__}), expected an int", key=key,
                              hint="load_shard(manifest, tp_rank, pp_stage) takes the ranks as ints")
    if not isinstance(device, str):
        raise DeviceError(f"is {device!r} ({type(device).__name__}), expected a string", key="device",
                          hint='device="cuda", "cuda:N" or "cpu"')
    if directory is not None and (not isinstance(directory, (str, os.PathLike))
                                  or not isinstance(os.fspath(directory), str) or "\0" in os.fspath(directory)):
        raise ManifestError(f"is {directory!r} ({type(directory).__name__}), expected a path", key="directory",
                            hint="pass the directory holding the shard files")


def rank_of(manifest: Manifest, tp_rank: int, pp_stage: int, device: str,
            dp_rank: int = 0) -> tuple[Manifest, Layout, RankLayout, str]:
    """Everything checked before a shard's byte is read: the node's GPUs, the rank inside the
    plan, the manifest's records against the Layout recomputed from its plan, the shard's recorded
    size against the size the Layout gives it (a forged size is never read by). Returns the
    manifest, that Layout, the rank's part of it and the resolved device (loader/remote.py's
    read from object storage checks the same)."""
    from ..formats.manifest_checks import SIZE_HINT, size_problem
    from .devices import check_gpus, resolve_device

    layout = manifest.to_layout()
    check_gpus(layout.plan.name, device, 1)
    dev = resolve_device(device)
    assert dev is not None
    rank_layout = layout.rank(tp_rank, pp_stage, dp_rank)
    problems = check_manifest_against_layout(manifest, layout)
    if problems:
        raise VerifyMismatch(problems[0], hint=FULL)
    entry = manifest.shard(rank_layout.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    if (problem := size_problem(entry, layout, rank_layout, manifest.shardc_version)) is not None:
        raise VerifyMismatch(problem, key=f"shards.{rank_layout.file}.size", hint=SIZE_HINT)
    return manifest, layout, rank_layout, dev


def header_check(rank_layout: RankLayout, layout: Layout) -> HeaderCheck:
    """The check a shard's parsed header gets before its data is read: metadata, tensor set,
    dtypes and shapes against the Layout (the first problem raised as a VerifyMismatch)."""
    from ..compiler.build_files import header_problems

    def check(header: dict[str, Any] | None, error: str | None, data_length: int) -> None:
        if header is None:
            problems = [f"safetensors header does not parse ({error})"]
        else:
            tensors = {k: v for k, v in header.items() if k != METADATA}
            problems = header_problems(tensors, header[METADATA], data_length, layout, rank_layout, [])
        if problems:
            raise VerifyMismatch(f"{rank_layout.file}: {problems[0]}", hint=FULL)

    return check


def check_manifest_against_layout(manifest: Manifest, layout: Layout) -> list[str]:
    """The manifest's own tensor records must be exactly what the Layout says (another plan's
    manifest, or an edited one, disagrees)."""
    problems = []
    if manifest.plan_sha256 != layout.plan.sha256:
        problems.append("manifest plan_sha256 does not match the hash of its own plan")
    if manifest.overrides:
        if manifest.effective_sha256 != data_sha256(manifest.effective_plan):
            problems.append("manifest effective_plan_sha256 does not match the hash of its plan with its overrides")
        src = manifest.overrides.get("model.source")
        if src is not None and manifest.source.reshard_of is None and src != manifest.source.uri:
            problems.append(f"manifest overrides model.source with {src!r} but its source record read "
                            f"{manifest.source.uri!r}")
    by_file = {s.file: s for s in manifest.shards}
    for rank_layout in layout.ranks:
        entry = by_file.get(rank_layout.file)
        if entry is None:
            problems.append(f"manifest lacks shard {rank_layout.file} that the plan requires")
            continue
        if (entry.tp_rank, entry.pp_stage, entry.rank) != (rank_layout.tp_rank, rank_layout.pp_stage, rank_layout.rank):
            problems.append(f"manifest entry {rank_layout.file} has the wrong ranks")
        if entry.dp_rank != (rank_layout.dp_rank if layout.plan.dp > 1 else None):
            problems.append(f"manifest entry {rank_layout.file} has the wrong dp_rank")
        if entry.experts != rank_layout.experts:
            problems.append(f"manifest entry {rank_layout.file} holds experts {list(entry.experts)}, the plan places "
                            f"{list(rank_layout.experts)} there")
        want = {t.name: t.record() for t in rank_layout.tensors}
        have = {n: {k: v for k, v in r.items() if k not in ("stats", "scale")}
                for n, r in entry.tensors.items()}
        for name in sorted(set(want) | set(have)):
            if name not in have:
                problems.append(f"manifest entry {rank_layout.file} lacks tensor {name}")
            elif name not in want:
                problems.append(f"manifest entry {rank_layout.file} lists unexpected tensor {name}")
            elif want[name] != have[name]:
                problems.append(f"manifest entry {rank_layout.file} tensor {name}: expected {want[name]}, found {have[name]}")
    extra = set(by_file) - {rank_layout.file for rank_layout in layout.ranks}
    problems += [f"manifest lists shard {f} that the plan does not have" for f in sorted(extra)]
    return problems
