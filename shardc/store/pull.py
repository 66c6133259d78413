"""``pull_build``: fetch some ranks of a build from a store, every file verified before it gets
its final name (the protocol: :mod:`shardc.store.transfer`)."""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import ManifestError, ShardcError, StoreError, VerifyMismatch
from ..formats.chunk_digests import check_chunks
from ..formats.files import fsync_dir, safe_name, sha256_file, write_atomic
from ..formats.manifest import Manifest, ShardEntry, interrupted_switch, loads
from ..verify.report import VerifyReport
from .codec import CODECS, VerifiedSink, remove_stale_partials, zstd_module
from .local import LocalStore
from .object_store import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    GetItem,
    S3Settings,
    Store,
    env_flag,
)
from .transfer import entries, os_errors, progress_bar, strip_compressed
from .transfers import FileAction, PulledFile, PulledRank, PullResult
from .uri import open_store, split_object_uri


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A file the pull needs: its manifest size/sha256, and the stored .zst object if compressed."""

    name: str
    size: int
    sha256: str
    compressed: dict[str, Any] | None = None
    chunk_size: int | None = None  # a shard's chunk digests (format_version 3), and their kind
    chunks: tuple[str, ...] = ()
    chunk_digest: str = DEFAULT_CHUNK_DIGEST

    @property
    def object(self) -> str:
        return self.compressed["object"] if self.compressed else self.name

    @property
    def stored_size(self) -> int:
        return self.compressed["size"] if self.compressed else self.size


def fsync_downloads_from_env() -> bool:
    """SHARDC_FSYNC_DOWNLOADS=1: fsync each pulled file before its rename. Off by default: pulled
    files get their final name only after their sha256 matched, and every later pull and verify
    re-hashes them, so a file torn by a power loss is fetched again, never used; the fsync costs
    about half of pull's throughput (docs/performance.md §2)."""
    return env_flag(os.environ.get("SHARDC_FSYNC_DOWNLOADS", ""))


@os_errors
def fetch_manifest(manifest_uri: str, *, endpoint_url: str | None = None) -> Manifest:
    """A manifest straight from a store (for ``shardc verify --manifest s3://...``), as the build
    wrote it (the store's compression records stripped)."""
    return strip_compressed(_fetch(manifest_uri, endpoint_url, S3Settings.from_env())[1])


def open_manifest(manifest_uri: str, *, endpoint_url: str | None = None,
                  settings: S3Settings | None = None) -> tuple[Store, Manifest]:
    """The store a manifest URI names and the manifest as stored (its compression records kept:
    a reader of the stored objects needs them)."""
    return _fetch(manifest_uri, endpoint_url, settings or S3Settings.from_env())


@os_errors
def pull_build(
    manifest_uri: str,
    dest_dir: Path,
    *,
    ranks: list[tuple[int, int]] | None = None,
    endpoint_url: str | None = None,
    progress: bool = False,
    global_ranks: list[int] | None = None,
    settings: S3Settings | None = None,
    fsync_downloads: bool | None = None,
) -> PullResult:
    """Fetch the manifest and the requested ranks' shards (default: all) plus the side files into
    ``dest_dir``, every file verified before it gets its final name; then verify the ranks.
    ``fsync_downloads`` None: from SHARDC_FSYNC_DOWNLOADS."""
    t0 = time.perf_counter()
    fsync = fsync_downloads_from_env() if fsync_downloads is None else fsync_downloads
    store, remote = _fetch(manifest_uri, endpoint_url, settings or S3Settings.from_env())
    check_names(remote, store.object_uri(split_object_uri(manifest_uri)[1]))
    shards = _select(remote, ranks, global_ranks)
    wanted = _wanted(remote, shards)
    if any(w.compressed for w in wanted):
        zstd_module()  # before any byte moves: the store holds .zst objects
    local = strip_compressed(remote)
    local_bytes = local.dumps()

    dest = Path(dest_dir)
    _prepare(dest, local_bytes, wanted)
    digests, todo = _find_present(dest, wanted)
    total = sum(w.stored_size for w in todo)
    digests.update(_download(store, dest, todo, total, fsync, progress))
    write_atomic(dest / MANIFEST_NAME, local_bytes)
    report = verify_pulled(local, dest, shards, digests)
    if not report.ok:
        raise VerifyMismatch(report.problems[0], hint="run shardc verify for the full report")
    fetched = {w.name for w in todo}
    files = [PulledFile(w.name, w.size, FileAction.DOWNLOADED if w.name in fetched else FileAction.PRESENT)
             for w in wanted]
    return PullResult(
        manifest_uri=manifest_uri, dest=str(dest), manifest=str(dest / MANIFEST_NAME),
        ranks=tuple(PulledRank(s.file, s.tp_rank, s.pp_stage, s.rank) for s in shards),
        files=tuple(sorted(files, key=lambda f: f.name)), downloaded=len(todo),
        present=len(wanted) - len(todo), bytes_downloaded=total,
        seconds=round(time.perf_counter() - t0, 3), verify=report,
    )


# --- steps --------------------------------------------------------------------------------------

def _fetch(manifest_uri: str, endpoint_url: str | None, settings: S3Settings) -> tuple[Store, Manifest]:
    root, name = split_object_uri(manifest_uri)
    store = open_store(root, endpoint_url=endpoint_url, settings=settings)
    data = store.get_bytes(name, MAX_MANIFEST_BYTES)
    if data is None:
        if isinstance(store, LocalStore) and (err := interrupted_switch(store.root)):
            raise err  # a local build directory in the middle of a rebuild's switch
        raise StoreError(f"no manifest at {store.object_uri(name)}",
                         hint="check the URI; a build is visible only once shardc push has finished")
    return store, loads(data, store.object_uri(name))


def check_names(manifest: Manifest, where: str) -> None:
    """Refuse a manifest that names a file a build never writes, before anything is written: pull
    writes only what the manifest lists, so a manifest listing ``authorized_keys`` (or a shard under
    a name its plan does not give its rank) would otherwise plant that file in ``dest`` and pass
    verify. Allowed: the build's side files (``build.outputs.SIDE_FILES``) and, per rank, the shard
    name the manifest's own plan's ``shard_prefix`` gives it."""
    from ..compiler.outputs import SIDE_FILES
    from ..layout.plan import plan_from_dict

    for f in manifest.files:
        if f.name not in SIDE_FILES:
            raise ManifestError(f"{where} lists {f.name}, which is not a file a build writes",
                                hint=f"a build's side files are {', '.join(SIDE_FILES)}; "
                                     f"pull only manifests shardc wrote")
    plan = plan_from_dict(manifest.plan)
    for s in manifest.shards:
        want = plan.shard_name(s.tp_rank, s.pp_stage, s.dp_rank or 0)
        if s.file != want:
            raise ManifestError(f"{where} lists {s.file} for tp_rank={s.tp_rank} pp_stage={s.pp_stage}, "
                                f"whose shard its plan names {want}",
                                hint="pull only manifests shardc wrote")


def _select(manifest: Manifest, ranks: list[tuple[int, int]] | None,
            global_ranks: list[int] | None) -> list[ShardEntry]:
    """The shard entries of the requested ranks (by (tp_rank, pp_stage) or global rank), by rank."""
    shards = manifest.shards
    if ranks is None and global_ranks is None:
        return list(shards)
    # looked up by tuple(pair): any length, as the caller's pairs come
    by_pair: dict[tuple[int, ...], ShardEntry] = {(s.tp_rank, s.pp_stage): s for s in shards}
    by_rank = {s.rank: s for s in shards}
    tp, pp, dp = manifest.layout.tp_degree, manifest.layout.pp_degree, manifest.layout.dp_degree or 1
    world = tp * pp * dp
    if ranks and dp > 1:  # a pair names one shard in each DP group: which one is the caller's
        raise ManifestError(f"tp_rank={ranks[0][0]} pp_stage={ranks[0][1]} names {dp} shards of this build "
                            f"(dp_degree={dp})", key="rank", hint=f"give `rank` one of 0..{world - 1}")
    out: list[ShardEntry] = []
    for pair in ranks or []:
        if tuple(pair) not in by_pair:
            raise ManifestError(f"tp_rank={pair[0]} pp_stage={pair[1]} is outside this build "
                                f"(tp_degree={tp}, pp_degree={pp})",
                                hint=f"tp ranks 0..{tp - 1}, pp stages 0..{pp - 1}")
        out.append(by_pair[tuple(pair)])
    for r in global_ranks or []:
        if r not in by_rank:
            raise ManifestError(f"rank {r} is outside this build (world size {world})",
                                hint=f"ranks 0..{world - 1}")
        out.append(by_rank[r])
    unique = {s.file: s for s in out}
    return sorted(unique.values(), key=lambda s: s.rank)


def _wanted(remote: Manifest, shards: list[ShardEntry]) -> list[Wanted]:
    """The side files and the selected shards, each with its checked ``compressed`` record."""
    selected = {s.file for s in shards}
    return [Wanted(name, e.size, e.sha256, _compressed(e.compressed, name),
                   *((e.chunk_size, e.chunks, e.chunk_digest) if isinstance(e, ShardEntry) else ()))
            for name, e in entries(remote) if not isinstance(e, ShardEntry) or name in selected]


def _compressed(comp: dict[str, Any] | None, fname: str) -> dict[str, Any] | None:
    """An entry's ``compressed`` record, checked: names from a manifest never escape ``dest``."""
    if comp is None:
        return None
    if (not isinstance(comp, dict) or comp.get("codec") not in CODECS
            or not isinstance(comp.get("size"), int) or not isinstance(comp.get("sha256"), str)):
        raise ManifestError(f"the manifest's compressed record of {fname} is malformed or uses an "
                            f"unknown codec", hint="push the build again with this shardc version")
    # whatever the manifest holds: safe_name refuses a non-str too, though typed for a str
    safe_name(comp.get("object"), "compressed object name")  # type: ignore[arg-type]
    return comp


def _prepare(dest: Path, local_bytes: bytes, wanted: list[Wanted]) -> None:
    """Create ``dest``; drop a manifest that no longer describes it; sweep dead writers' partials."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        old = dest / MANIFEST_NAME
        if old.is_file() and old.read_bytes() != local_bytes:
            old.unlink()  # it no longer describes the directory once files start changing
    except OSError as exc:
        raise StoreError(f"cannot prepare {dest}: {exc.strerror}") from None
    for w in wanted:
        remove_stale_partials(dest, w.name)


def _present(path: Path, w: Wanted) -> str | None:
    """The sha256 of a file already at its destination, if it is the right one (a shard with chunk
    digests: every chunk checked, on all cores; then the manifest's sha256 stands for them)."""
    if path.is_file() and path.stat().st_size == w.size:
        if w.chunk_size is not None:
            with open(path, "rb", buffering=0) as f:
                bad = check_chunks(f.fileno(), w.size, w.chunk_size, w.chunks, digest=w.chunk_digest)
                return None if bad else w.sha256
        sha = sha256_file(path)
        if sha == w.sha256:
            return sha
    return None


def _find_present(dest: Path, wanted: list[Wanted]) -> tuple[dict[str, str], list[Wanted]]:
    """({name: sha256} of the files already right, the ones to download)."""
    with ThreadPoolExecutor(4, thread_name_prefix="shardc-hash") as pool:
        found = list(pool.map(lambda w: _present(dest / w.name, w), wanted))
    digests = {w.name: sha for w, sha in zip(wanted, found, strict=True) if sha is not None}
    return digests, [w for w in wanted if w.name not in digests]


def _download(store: Store, dest: Path, todo: list[Wanted], total: int, fsync: bool,
              progress: bool) -> dict[str, str]:
    """Fetch ``todo`` through verified sinks; return {name: sha256} of the committed files. The
    first mismatch wins over other errors (exit 1: the store's data is wrong)."""
    items: list[GetItem] = []
    bar = None
    digests: dict[str, str] = {}
    ranged = [w for w in todo if _ranged(store, w)]
    if ranged:  # shards with chunk digests: parallel ranged GETs, checked in memory (store/ranged.py)
        from .ranged import download_chunked

        bar = progress_bar(progress, f"pull {store.uri}", total)
        try:
            for w in ranged:
                assert w.chunk_size is not None
                download_chunked(store, dest / w.name, w.size, w.chunk_size, w.chunks, fsync, bar.update,  # type: ignore[arg-type]
                                 digest=w.chunk_digest)
                digests[w.name] = w.sha256
        finally:
            bar.close()
        todo = [w for w in todo if w not in ranged]
        bar = None
    try:
        for w in todo:
            items.append(GetItem(w.object, VerifiedSink(dest / w.name, w.size, w.sha256, w.compressed, fsync)))
        bar = progress_bar(progress, f"pull {store.uri}", total)
        errors = store.get_files(items, bar.update)
    except BaseException:
        for i in items:
            i.sink.abort()
        raise
    finally:
        if bar is not None:
            bar.close()

    mismatches: list[ShardcError] = []
    other: list[ShardcError] = []
    for w, item, err in zip(todo, items, errors, strict=True):
        if err is None:
            try:
                digests[w.name] = item.sink.commit()
                continue
            except VerifyMismatch as exc:
                err = exc
            except OSError as exc:
                err = StoreError(f"cannot write {dest / w.name}: {exc.strerror}",
                                 hint="check free space, permissions and what is at that path")
        item.sink.abort()
        target = mismatches if isinstance(err, VerifyMismatch) else other
        target.append(err if isinstance(err, ShardcError) else StoreError(str(err)))
    if fsync:
        fsync_dir(dest)
    if mismatches:
        first = mismatches[0]
        more = f" (and {len(mismatches) - 1} more file(s))" if len(mismatches) > 1 else ""
        raise VerifyMismatch(first.message + more, hint=first.hint)
    if other:
        raise other[0]
    return digests


def _ranged(store: Store, w: Wanted) -> bool:
    """Whether ``w`` is pulled by chunked ranged GETs: a shard with chunk digests, stored as built,
    in S3 (a local store's files are copied as before)."""
    from .s3 import S3Store

    return isinstance(store, S3Store) and w.chunk_size is not None and w.compressed is None


def verify_pulled(manifest: Manifest, dest: Path, shards: list[ShardEntry],
                  digests: dict[str, str]) -> VerifyReport:
    """The checks of ``shardc verify`` for the pulled ranks, without hashing their shards again:
    each was hashed while it was downloaded (or found present), and ``digests`` holds those
    sha256s, so re-reading every byte is spared."""
    from ..verify.checks import verify_build

    layout = manifest.to_layout()
    return verify_build(manifest, dest, [layout.rank(s.tp_rank, s.pp_stage, s.dp_rank or 0) for s in shards],
                        hashed=digests)
