"""Cold-start verification: is the local shard the right shard, with the right bytes?

The expected tensors come from the Layout recomputed from the plan and model config, never from
the manifest's own tensor list, so "a valid file of the wrong plan" (a TP=8 shard under a TP=4
plan) is caught. Checks run cheapest-first per rank; hashing runs in parallel threads (hashlib
releases the GIL) in large blocks: a shard with chunk digests (format_version 3) is checked chunk by
chunk on every core, and a mismatch names the chunks and the tensors in them; an older manifest's
shards are hashed whole, one thread per file. Shape checks read only the safetensors header.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ShardcError, VerifyMismatch
from ..formats import chunk_digests as chunks
from ..formats.files import human_size, sha256_file
from ..formats.manifest import Manifest, ShardEntry
from ..formats.manifest_checks import size_problem
from ..layout.plan import Plan
from ..layout.ranks import Layout, RankLayout
from ..loader.devices import resolve_device
from ..loader.rank_checks import check_manifest_against_layout
from .deep import deep_check, open_deep
from .report import PlanCheck, RankVerdict, VerifyReport

if TYPE_CHECKING:
    from ..compiler.source import Source


@dataclass(frozen=True)
class BadChunks:
    """What a chunk check found: the indices of the chunks whose digest differs (none: all match)."""

    indices: tuple[int, ...]


def check_chunked(path: Path, entry: ShardEntry, pool: ThreadPoolExecutor | None = None) -> BadChunks:
    """Every chunk of a shard file with chunk digests, hashed on all cores."""
    assert entry.chunk_size is not None
    with open(path, "rb", buffering=0) as f:
        bad = chunks.check_chunks(f.fileno(), entry.size, entry.chunk_size, entry.chunks, pool=pool,
                                  digest=entry.chunk_digest)
    return BadChunks(tuple(bad))


def bad_chunks_line(path: Path, entry: ShardEntry, bad: BadChunks) -> str:
    """The problem line for damaged chunks: which, where, and which tensors they hold (from the
    file's own header, when it still parses)."""
    from ..formats.safetensors import read_header

    assert entry.chunk_size is not None
    try:
        tensors, _, start = read_header(path)
    except (ShardcError, OSError):  # a damaged header: name no tensor
        tensors, start = {}, 0
    return chunks.chunk_problem(bad.indices, entry.size, entry.chunk_size,
                                lambda lo, hi: chunks.tensors_in(tensors, start, lo, hi), digest=entry.chunk_digest)


@dataclass
class RankResult:
    file: str
    tp_rank: int
    pp_stage: int
    rank: int
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(f"{self.file}: {msg}")

    def verdict(self) -> RankVerdict:
        """What the checks found, frozen: the form that leaves the package."""
        return RankVerdict(self.file, self.tp_rank, self.pp_stage, self.rank, self.ok,
                           tuple(self.problems), tuple(self.warnings), tuple(self.checks))


def plan_check(manifest: Manifest, plan: Plan, plan_file: str) -> PlanCheck:
    """Is the manifest of exactly the plan this node expects, as applied (``plan`` carries the
    ``--source`` verify was given, if any)? The effective plans' hashes are compared, so a build
    made with ``build --source`` is of its plan only together with that source. ``ok``, the hashes
    and overrides on both sides, and ``problem`` (one line) when it is not."""
    same = plan.effective_sha256 == manifest.effective_sha256
    return PlanCheck(same, plan_file, plan.effective_sha256, dict(plan.overrides), manifest.effective_sha256,
                     dict(manifest.overrides), None if same else _plan_problem(manifest, plan, plan_file))


def plan_mismatch(manifest: Manifest, plan: Plan, plan_file: str) -> str | None:
    """Why the manifest is not of the plan this node expects (another plan's file, or the plan
    built from another source, is a mismatch, exit 1, not bad input), or None when it is."""
    return plan_check(manifest, plan, plan_file).problem


def _plan_problem(manifest: Manifest, plan: Plan, plan_file: str) -> str:
    if plan.sha256 != manifest.plan_sha256:
        return (f"the manifest is of plan {manifest.name!r} (sha256 {manifest.plan_sha256[:12]}), not of "
                f"{plan_file} (plan {plan.name!r}, sha256 {plan.sha256[:12]}); pass the manifest built "
                "from this plan")
    # The same plan file, applied to another source than the one this node expects.
    own = plan.data["model"]["source"]
    built = manifest.overrides.get("model.source")
    wanted = plan.overrides.get("model.source")
    accept = f"`shardc verify --plan {shlex.quote(plan_file)}"
    if built is None:
        how = (f"resharded from {manifest.source.uri} under the plan's own source `{own}`"
               if manifest.source.reshard_of is not None else f"built from the plan's own source `{own}`")
        return f"{how}, not from `--source {wanted}`; {accept}` (without --source) accepts it"
    accept += f" --source {shlex.quote(built)}` accepts that source"
    if wanted is None:
        return f"built from `--source {built}` instead of the plan's `{own}`; {accept}"
    if wanted != built:
        return f"built from `--source {built}`, not `--source {wanted}` (the plan's own is `{own}`); {accept}"
    return (f"the manifest's effective_plan_sha256 {manifest.effective_sha256[:12]} is not that of {plan_file} "
            f"with --source {built} ({plan.effective_sha256[:12]}); the manifest was edited")


def check_side_files(manifest: Manifest, layout: Layout, directory: Path) -> list[str]:
    """config.json and (where transformers loads the build: ``hf_checkpoint_problem``)
    model.safetensors.index.json are derived from the Layout: the manifest must list exactly
    those, with the bytes this plan's build writes, and the files in the directory must be those
    bytes (an index naming the wrong file sends a client astray; one listed for a build
    transformers cannot load, as an older shardc wrote for stacked experts over DP ranks, claims
    a checkpoint that is not one)."""
    import hashlib

    from ..compiler.outputs import INDEX, hf_checkpoint_problem, side_files

    problems = []
    expected = side_files(layout)
    listed = {f.name: f for f in manifest.files}
    if INDEX in listed and INDEX not in expected:
        if layout.plan.tp != 1:
            problems.append(f"manifest lists {INDEX}, which a tp={layout.plan.tp} build does not have")
        else:
            problems.append(f"manifest lists {INDEX}, but transformers cannot load this build as a "
                            f"checkpoint: {hf_checkpoint_problem(layout)} (an older shardc, or edited)")
    for name, data in expected.items():
        entry = listed.get(name)
        if entry is None:
            problems.append(f"manifest does not list {name}")
            continue
        if entry.sha256 != hashlib.sha256(data).hexdigest() or entry.size != len(data):
            problems.append(f"manifest's {name} is not the one this plan's build writes "
                            f"(an older shardc, or edited)")
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing (expected at {path})")
        elif path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            problems.append(f"{name}: size or sha256 differs from the manifest")
    return problems


def _digest(path: Path, entry: ShardEntry, pool: ThreadPoolExecutor | None = None) -> str | BadChunks:
    """The check of a shard's bytes: its chunks when the manifest has their digests, else its
    whole sha256."""
    return check_chunked(path, entry, pool) if entry.chunk_size is not None else sha256_file(path)


def _oversize(manifest: Manifest, layout: Layout, rank_layout: RankLayout, entry: ShardEntry) -> str | None:
    """A recorded size above the one the Layout gives the shard (a smaller one is a file the
    header and extent checks name: a tensor missing, a file cut short)."""
    problem = size_problem(entry, layout, rank_layout, manifest.shardc_version, larger_only=True)
    return None if problem is None else f"shards.{rank_layout.file}.size {problem}"


def _check_header(res: RankResult, path: Path, rank_layout: RankLayout, layout: Layout) -> None:
    """The header checks, shared with every command that reads a build (``shard_problems``)."""
    from ..compiler.build_files import shard_problems

    for problem in shard_problems(path, layout, rank_layout, res.checks):
        res.fail(problem)


def _load_on_device(res: RankResult, path: Path, device: str, entry: ShardEntry) -> str | BadChunks:
    """One read of the file: hash it, land its data on ``device`` and check finiteness (min/max
    per tensor, no fp32 copies): load_shard's read (loader/local.py ``load_for_verify``). Returns
    the damaged chunks, or for a shard without chunk digests (upgraded on read) its sha256."""
    from ..loader.local import load_for_verify
    from ..loader.tensors import tensors_of

    raw = load_for_verify(path, entry, device)
    if isinstance(raw, tuple):
        return BadChunks(raw)
    digest: str | BadChunks = BadChunks(()) if entry.chunk_size is not None else raw.sha256
    if raw.header is None:
        return digest
    try:
        tensors_of(raw)
    except VerifyMismatch as exc:
        res.fail(exc.message)
        return digest
    for name in raw.nonfinite:
        res.fail(f"tensor {name} holds NaN or Inf on {device}")
    res.checks.append(f"load:{device}")
    return digest


def _device_room(res: RankResult, rank_layout: RankLayout, layout: Layout, device: str) -> None:
    kv = (layout.plan.kv_cache_cap_gb or 0) * 2**30
    need = rank_layout.nbytes + kv
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(idx).total_memory
        where = f"{device} ({human_size(total)})"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = f"host memory ({human_size(total)})"
    if need > total:
        res.warnings.append(
            # kv is a float (a cap in GB can be fractional): human_size formats any number of bytes,
            # its ``int`` annotation (formats/files.py) is narrower than that
            f"weights {human_size(rank_layout.nbytes)} + KV cap {human_size(kv)} exceed {where}"  # type: ignore[arg-type]
        )


def verify_rank(
    manifest: Manifest, directory: Path, layout: Layout, rank_layout: RankLayout, *,
    device: str | None = None, deep: str | Source | None = None, hashed: str | BadChunks | None = None,
) -> RankResult:
    """All checks for one rank, in order; stops at the first failing stage that makes later ones moot.
    ``deep``: the reference's URI, or the Source ``verify/deep.py`` ``open_deep`` opened from it."""
    res = RankResult(rank_layout.file, rank_layout.tp_rank, rank_layout.pp_stage, rank_layout.rank)
    if isinstance(deep, str):
        deep = open_deep(deep, layout)
        if isinstance(deep, str):  # another model's reference: the one line, no tensor compared
            res.fail(deep)
            deep = None
    entry = manifest.shard(rank_layout.file)
    path = Path(directory) / rank_layout.file
    if entry is None:
        res.fail("not in the manifest")
        return res
    if not path.is_file():
        res.fail(f"missing (expected at {path})")
        return res
    res.checks.append("present")
    size = path.stat().st_size
    if size != entry.size:
        res.fail(f"size {size} bytes, expected {entry.size} (truncated or replaced?)")
        return res
    res.checks.append("size")
    if (over := _oversize(manifest, layout, rank_layout, entry)) is not None:
        res.fail(over)  # not hashed by a claim beyond the plan's shard; the header says what the file holds
        _check_header(res, path, rank_layout, layout)
        return res
    loaded = None
    if device:  # hash while loading: each byte is read once (chunks on every core when recorded)
        loaded = RankResult(rank_layout.file, rank_layout.tp_rank, rank_layout.pp_stage, rank_layout.rank)
        digest = _load_on_device(loaded, path, device, entry)
    else:
        digest = hashed if hashed is not None else _digest(path, entry)
    if isinstance(digest, BadChunks):
        if digest.indices:
            res.fail(bad_chunks_line(path, entry, digest))
        else:
            res.checks.append("sha256")
    elif digest != entry.sha256:
        res.fail(f"sha256 {digest[:16]}..., expected {entry.sha256[:16]}... (corrupted bytes)")
    else:
        res.checks.append("sha256")
    before = len(res.problems)
    _check_header(res, path, rank_layout, layout)
    if not res.ok:
        # corrupted bytes under a sound header: --deep still says which tensors they are in
        if deep is not None and len(res.problems) == before:
            deep_check(res, path, rank_layout, layout, deep)
        return res
    if loaded is not None:
        res.problems += loaded.problems
        res.ok = res.ok and loaded.ok
        res.checks += loaded.checks
        assert device is not None
        _device_room(res, rank_layout, layout, device)
    if deep is not None:
        deep_check(res, path, rank_layout, layout, deep)
    return res


def verify_build(
    manifest: Manifest, directory: str | Path, ranks: list[RankLayout] | None = None, *,
    device: str | None = None, deep: str | None = None, jobs: int | None = None,
    hashed: Mapping[str, str] | None = None,
) -> VerifyReport:
    """Verify ranks (default: all): the manifest against the Layout, then each rank's file.

    Returns the verdict (``ok``, ``plan``, ``plan_sha256``, ``problems``, ``ranks``); never raises for mismatches
    (the caller maps ok=False to exit code 1). ``hashed`` gives sha256s already computed (by
    file name, e.g. while a pull downloaded them): those files are not read again."""
    layout = manifest.to_layout()
    ranks = list(layout.ranks) if ranks is None else ranks
    directory = Path(directory)
    problems = check_manifest_against_layout(manifest, layout) + check_side_files(manifest, layout, directory)
    reference = None
    if deep:  # opened once for every rank; another model's is one problem, and no rank compares
        reference = open_deep(deep, layout)
        if isinstance(reference, str):
            problems.append(reference)
            reference = None
    if device:  # verify_rank hashes while it loads each rank onto the device
        device = resolve_device(device)

    def digest(rank_layout: RankLayout) -> str | BadChunks | None:
        if device:
            return None
        if hashed is not None and rank_layout.file in hashed:
            return hashed[rank_layout.file]
        p = directory / rank_layout.file
        e = manifest.shard(rank_layout.file)
        if e is None or not p.is_file() or p.stat().st_size != e.size or _oversize(manifest, layout, rank_layout, e):
            return None
        return _digest(p, e, chunk_pool)

    workers = jobs or min(len(ranks), os.cpu_count() or 1, 8)
    # chunks of every rank share one pool of all cores (one rank alone is checked on all of them)
    with ThreadPoolExecutor(max(1, workers)) as pool, \
            ThreadPoolExecutor(jobs or chunks.workers(), thread_name_prefix="shardc-chunk") as chunk_pool:
        digests = list(pool.map(digest, ranks))
    results = [
        verify_rank(manifest, directory, layout, rank_layout, device=device, deep=reference, hashed=d)
        for rank_layout, d in zip(ranks, digests, strict=True)
    ]
    return VerifyReport.of(layout.plan.name, layout.plan.sha256, problems, [r.verdict() for r in results])
