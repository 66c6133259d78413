"""Push a build to a store and pull (parts of) it back, verified.

Stores are named by URI: a plain path or ``file://`` (the default; no services needed) or
``s3://bucket/prefix`` (boto3, imported only then; see :mod:`shardc.store.s3`). Both sit behind
the small :class:`Store` interface, so push and pull hold the protocol and the backends hold the
I/O. What each promises under faults: docs/architecture.md §6.

Push protocol (manifest last, so a reader that finds a manifest can fetch everything it names):

1. objects already in the store with the right size and recorded sha256 are skipped (resume);
2. if anything must be (re)written and the store holds a different manifest under the same name,
   that manifest is deleted first: no reader may see it while its objects change;
3. every other file is uploaded, in parallel, with its sha256 as object metadata, while it is
   hashed against the local manifest; an object is only completed once its hash matched (a shard
   that rotted on disk is never published);
4. every object is checked to exist with the right size;
5. the manifest is written last.

With ``compress="zstd"`` shards are stored as ``<file>.zst`` and the manifest pushed to the store
gets, in each such shard entry, ``"compressed": {"codec": "zstd", "size": int, "sha256": hex,
"object": "<file>.zst"}`` next to the uncompressed size and sha256 (config.json and other small
files stay plain). The local build manifest is unchanged; pull strips the key again, so the pulled
``manifest.json`` is byte-identical to the build's.

Pull: fetch the manifest, then only the requested shards plus the side files. Each download is
streamed into a temp name next to its destination, hashed (and decompressed, checking both hashes)
on the way, and renamed into place only when it matches; files already present and matching are
kept. The local manifest is written after the files, then the ranks are verified like
``shardc verify`` does.

Object metadata (S3 ``x-amz-meta-*``): ``sha256`` of the stored bytes; for ``.zst`` objects also
``codec``, ``content-size`` and ``content-sha256`` of the uncompressed file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..build.source import sha256_file
from ..errors import ManifestError, ShardcError, StoreError, VerifyMismatch
from ..formats.manifest import dumps, fsync_dir, loads, read_manifest, write_atomic
from .base import (
    BLOCK,
    CODECS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ZSTD_LEVEL,
    GetItem,
    HashWriter,
    ObjectInfo,
    PutItem,
    Store,
    TransferSettings,
    open_store,
    parse_uri,
    partial_name,
    remove_stale_partials,
    split_object_uri,
    zstd_module,
)

# --- hashing, compression, verified sinks -------------------------------------------------------


class VerifiedSink:
    """Receives a file's bytes (at any offset: parts arrive in parallel), into a temp name next to
    ``final``; on commit hashes it (a zstd object is first checked, then decompressed as a stream
    into the temp file) and renames into place only if size and sha256 match the manifest.

    Seekable on purpose: s3transfer's in-order path for non-seekable targets stalled for good on
    multi-GB objects (10 parts written, then nothing), and random-access writes need no buffering.
    The hash costs one read of the file back from the page cache.

    No fsync before the rename unless ``fsync``: a killed process never leaves a partial file under
    the final name (the page cache outlives it), and after a power loss every reader of a pulled
    file hashes it first (pull's present check, verify, the runtime's checked load), so a torn
    file is re-downloaded, never used.
    """

    def __init__(self, final: Path, entry: dict[str, Any], compressed: dict[str, Any] | None,
                 fsync: bool = False) -> None:
        self.final, self.entry, self.compressed, self.fsync = final, entry, compressed, fsync
        self.tmp = partial_name(final)
        # what the store sends: the file itself, or its .zst object (decompressed at commit)
        self.download = self.tmp.with_name(self.tmp.name + ".zst") if compressed else self.tmp
        self.limit = (compressed or {}).get("size", entry["size"])
        self._f = open(self.download, "wb")  # noqa: SIM115 - closed in commit/abort

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def write(self, data: bytes) -> int:
        if self._f.tell() + len(data) > self.limit:
            raise VerifyMismatch(f"{self.final.name}: the stored object is larger than the "
                                 f"manifest's {self.limit} bytes", hint="push the build again")
        return self._f.write(data)

    def commit(self) -> str:
        """Check everything, then rename into place. Returns the sha256 of the file."""
        name, problems = self.final.name, []
        try:
            self._f.close()
            if self.compressed is not None:
                c = self.compressed
                size = self.download.stat().st_size
                digest = sha256_file(self.download)
                if size != c.get("size") or digest != c.get("sha256"):
                    problems.append(f"compressed object {c.get('object')}: {size} bytes, sha256 "
                                    f"{digest[:16]}..., expected {c.get('size')} bytes, "
                                    f"{str(c.get('sha256'))[:16]}...")
                else:
                    self._decompress()
            if not problems:
                size, sha = self.tmp.stat().st_size, sha256_file(self.tmp)
                if size != self.entry["size"] or sha != self.entry["sha256"]:
                    problems.append(f"{size} bytes, sha256 {sha[:16]}..., expected "
                                    f"{self.entry['size']} bytes, {self.entry['sha256'][:16]}...")
            if problems:
                self.abort()
                raise VerifyMismatch(f"{name}: downloaded data does not match the manifest: "
                                     + "; ".join(problems),
                                     hint="the object was corrupted or replaced in the store; push the build again")
            if self.fsync:
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(self.tmp, self.final)
        except OSError:
            self.abort()
            raise
        return sha

    def _decompress(self) -> None:
        zstd = zstd_module()
        try:
            with open(self.download, "rb") as src, open(self.tmp, "wb") as out:
                dec = zstd.ZstdDecompressor().stream_writer(
                    _Bounded(HashWriter(out), self.entry["size"], self.final.name),
                    write_size=BLOCK, closefd=False)
                while chunk := src.read(BLOCK):
                    dec.write(chunk)
                dec.flush()
        except zstd.ZstdError as exc:
            raise VerifyMismatch(f"{self.final.name}: the stored .zst object is not a valid zstd "
                                 f"stream ({exc})", hint="push the build again") from None
        finally:
            self.download.unlink(missing_ok=True)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
        self.download.unlink(missing_ok=True)


class _Bounded:
    """Stops a decompression stream that grows past the manifest's size (no zstd bombs)."""

    def __init__(self, out: HashWriter, limit: int, name: str) -> None:
        self.out, self.limit, self.name = out, limit, name

    def flush(self) -> None:
        self.out.flush()

    def write(self, data: bytes) -> int:
        if self.out.n + len(data) > self.limit:
            raise VerifyMismatch(f"{self.name}: the stored object decompresses to more than the "
                                 f"manifest's {self.limit} bytes", hint="push the build again")
        return self.out.write(data)


def _compress(src: Path, level: int) -> tuple[Path, str, dict[str, str]]:
    """Compress to a temp file, hashing input and output on the way. -> (tmp, content sha, metadata)."""
    zstd = zstd_module()
    fd, tmp_name = tempfile.mkstemp(prefix=f"shardc-{src.name}-", suffix=".zst")
    tmp = Path(tmp_name)
    content = HashWriter()
    try:
        with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
            packed = HashWriter(out)
            cctx = zstd.ZstdCompressor(level=level, threads=-1, write_checksum=True)
            with cctx.stream_writer(packed, size=src.stat().st_size, closefd=False) as w:
                while chunk := f.read(BLOCK):
                    content.write(chunk)
                    w.write(chunk)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {"sha256": packed.h.hexdigest(), "codec": "zstd", "content-size": str(content.n),
            "content-sha256": content.h.hexdigest()}
    return tmp, content.h.hexdigest(), meta


# --- push ---------------------------------------------------------------------------------------

def _entries(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(file name, manifest entry, is_shard) for every file a build consists of, manifest aside."""
    return [(f["name"], f, False) for f in manifest["files"]] + [(s["file"], s, True) for s in manifest["shards"]]


def _build_dir(manifest_path: Path, manifest: dict[str, Any], build_dir: Path | None) -> Path:
    """Where the shards are: next to the manifest, or (for a copy in manifests/) build/<plan name>."""
    names = [n for n, _, _ in _entries(manifest)]
    name = manifest["plan"]["replica_group"]["name"]
    candidates = [Path(build_dir)] if build_dir else [
        manifest_path.parent, Path("build") / name, manifest_path.parent.parent / "build" / name]
    for c in candidates:
        if all((c / n).is_file() for n in names):
            return c
    missing = next(n for n in names if not (candidates[0] / n).is_file())
    raise StoreError(f"the build's files are not next to {manifest_path} (missing {missing})",
                     hint="pass the manifest.json inside the build directory, or --build-dir DIR")


def _destination(manifest: dict[str, Any], dest_uri: str | None) -> tuple[str, str]:
    if dest_uri:
        if dest_uri.endswith(".json"):
            return split_object_uri(dest_uri)
        parse_uri(dest_uri)
        return dest_uri.rstrip("/") or "/", MANIFEST_NAME
    uri = ((manifest["plan"].get("replica_group") or {}).get("checkpoint") or {}).get("manifest_uri")
    if not uri:
        raise StoreError("no destination: the plan has no replica_group.checkpoint.manifest_uri",
                         hint="pass --to URI (a local directory, file:// or s3://bucket/prefix)")
    return split_object_uri(uri)


def _progress_bar(progress: bool, desc: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not progress, file=sys.stderr, leave=False)


def _os_errors(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A full disk or a read-only directory is an environment problem: one line, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise StoreError(f"{where}{exc.strerror or exc}", hint="check free space and permissions") from None

    return wrapper


@_os_errors
def push_build(
    manifest_path: Path,
    dest_uri: str | None = None,
    *,
    endpoint_url: str | None = None,
    compress: str | None = None,
    progress: bool = False,
    build_dir: Path | None = None,
    settings: TransferSettings | None = None,
) -> dict[str, Any]:
    """Upload a build (shards, side files, manifest last). Idempotent: a rerun resumes."""
    t0 = time.perf_counter()
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path)
    if compress is not None and compress not in CODECS:
        raise StoreError(f"unknown compression {compress!r}", hint=f"use one of: {', '.join(CODECS)}")
    src = _build_dir(manifest_path, manifest, build_dir)
    root, manifest_name = _destination(manifest, dest_uri)
    store = open_store(root, endpoint_url=endpoint_url, settings=settings)

    plan: list[dict[str, Any]] = []
    for name, entry, shard in _entries(manifest):
        local = src / name
        if local.stat().st_size != entry["size"]:
            raise VerifyMismatch(f"{local}: {local.stat().st_size} bytes, the manifest says {entry['size']}",
                                 hint="the build directory changed after the build; rebuild")
        obj = name + ".zst" if (compress and shard) else name
        plan.append({"file": name, "object": obj, "entry": entry, "local": local, "codec": compress if shard else None})

    old = store.get_bytes(manifest_name, MAX_MANIFEST_BYTES)  # also the first contact: bucket, creds
    store.abort_incomplete([p["object"] for p in plan])
    todo = []
    for p in plan:
        info = store.head(p["object"])
        if info is not None and info.sha256 is None and (p["codec"] or info.size == p["entry"]["size"]):
            info = store.head(p["object"], digest=True)  # a backend without recorded hashes
        if info is not None and _matches(info, p):
            p["stored"], p["action"] = info, "present"
        else:
            p["action"] = "uploaded"
            todo.append(p)
    if todo and old is not None:
        store.delete(manifest_name)  # un-commit: its objects are about to change

    bar = _progress_bar(progress, f"push {store.uri}", 0)
    hashers = ThreadPoolExecutor(2, thread_name_prefix="shardc-hash")
    try:
        store.put_files(_prepared(todo, bar, hashers), bar.update)
    finally:
        hashers.shutdown(wait=True, cancel_futures=True)
        bar.close()

    for p in plan:  # every object there, with the right size, before the manifest
        info = store.head(p["object"])
        want = p["stored"].size
        if info is None or info.size != want:
            raise StoreError(f"after upload, {store.object_uri(p['object'])} is "
                             f"{'missing' if info is None else f'{info.size} bytes, expected {want}'}",
                             hint="another writer changed the store during the push; rerun")
    remote = _remote_manifest(manifest, plan)
    data = dumps(remote)
    state = "unchanged"
    if data != old or todo:
        store.put_bytes(manifest_name, data, {"sha256": hashlib.sha256(data).hexdigest()})
        state = "uploaded"
    return {
        "dest": store.uri,
        "manifest_uri": store.object_uri(manifest_name),
        "manifest": state,
        "compress": compress,
        "objects": [{"file": p["file"], "object": p["object"], "size": p["stored"].size,
                     "action": p["action"]} for p in plan],
        "uploaded": sum(p["action"] == "uploaded" for p in plan),
        "present": sum(p["action"] == "present" for p in plan),
        "bytes_uploaded": sum(p["stored"].size for p in todo),
        "bytes_total": sum(p["stored"].size for p in plan),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _matches(info: ObjectInfo, p: dict[str, Any]) -> bool:
    e = p["entry"]
    if p["codec"]:
        md = info.metadata
        return (md.get("codec") == p["codec"] and md.get("content-sha256") == e["sha256"]
                and md.get("content-size") == str(e["size"]) and bool(info.sha256))
    return info.size == e["size"] and info.sha256 == e["sha256"]


def _prepared(todo: list[dict[str, Any]], bar: Any, hashers: ThreadPoolExecutor) -> Iterator[PutItem]:
    """The uploads, each checked against the manifest before its object may appear.

    Plain files start uploading at once while a hashing thread re-reads them; the backend holds
    back the object's completion until the hash matched (``PutItem.verified``), so hashing
    overlaps the transfer and a shard that rotted on disk is still never published. Compressed
    files are hashed while they are compressed, before the upload. A generator: the backend pulls
    the next item while earlier ones transfer.
    """
    for p in todo:
        e, local = p["entry"], p["local"]
        verified: Future[None] | None = None
        if p["codec"]:
            tmp, sha, meta = _compress(local, ZSTD_LEVEL)
            if sha != e["sha256"]:
                tmp.unlink(missing_ok=True)
                raise _rotted(local, sha, e)
            size, path = tmp.stat().st_size, tmp
            cleanup: Callable[[], None] = lambda t=tmp: t.unlink(missing_ok=True)  # noqa: E731
        else:
            verified = hashers.submit(_check_local, local, e)
            size, path, meta = e["size"], local, {"sha256": e["sha256"]}
            cleanup = lambda: None  # noqa: E731
        p["stored"] = ObjectInfo(size, meta["sha256"], meta)
        bar.total = (bar.total or 0) + size
        bar.refresh()
        ctype = "application/json" if p["file"].endswith(".json") else "application/octet-stream"
        yield PutItem(p["object"], path, size, meta, ctype, cleanup, verified)


def _check_local(local: Path, entry: dict[str, Any]) -> None:
    sha = sha256_file(local)
    if sha != entry["sha256"]:
        raise _rotted(local, sha, entry)


def _rotted(local: Path, sha: str, entry: dict[str, Any]) -> VerifyMismatch:
    return VerifyMismatch(f"{local}: sha256 {sha[:16]}... does not match the manifest's "
                          f"{entry['sha256'][:16]}...", hint="the file changed after the build; rebuild")


def _remote_manifest(manifest: dict[str, Any], plan: list[dict[str, Any]]) -> dict[str, Any]:
    """The build manifest plus, for compressed objects, what was stored."""
    if not any(p["codec"] for p in plan):
        return manifest
    remote = dict(manifest)
    stored = {p["file"]: p for p in plan if p["codec"]}

    def add(entry: dict[str, Any], name: str) -> dict[str, Any]:
        p = stored.get(name)
        if p is None:
            return entry
        s = p["stored"]
        return {**entry, "compressed": {"codec": p["codec"], "size": s.size, "sha256": s.sha256,
                                        "object": p["object"]}}

    remote["shards"] = [add(s, s["file"]) for s in manifest["shards"]]
    remote["files"] = [add(f, f["name"]) for f in manifest["files"]]
    return remote


def _strip_compressed(manifest: dict[str, Any]) -> dict[str, Any]:
    local = dict(manifest)
    local["shards"] = [{k: v for k, v in s.items() if k != "compressed"} for s in manifest["shards"]]
    local["files"] = [{k: v for k, v in f.items() if k != "compressed"} for f in manifest["files"]]
    return local


# --- pull ---------------------------------------------------------------------------------------

def _select(manifest: dict[str, Any], ranks: list[tuple[int, int]] | None,
            global_ranks: list[int] | None) -> list[dict[str, Any]]:
    shards = manifest["shards"]
    if ranks is None and global_ranks is None:
        return list(shards)
    by_pair = {(s["tp_rank"], s["pp_stage"]): s for s in shards}
    by_rank = {s["rank"]: s for s in shards}
    tp, pp = manifest["layout"]["tp_degree"], manifest["layout"]["pp_degree"]
    out: list[dict[str, Any]] = []
    for pair in ranks or []:
        if tuple(pair) not in by_pair:
            raise ManifestError(f"tp_rank={pair[0]} pp_stage={pair[1]} is outside this build "
                                f"(tp_degree={tp}, pp_degree={pp})",
                                hint=f"tp ranks 0..{tp - 1}, pp stages 0..{pp - 1}")
        out.append(by_pair[tuple(pair)])
    for r in global_ranks or []:
        if r not in by_rank:
            raise ManifestError(f"rank {r} is outside this build (world size {tp * pp})",
                                hint=f"ranks 0..{tp * pp - 1}")
        out.append(by_rank[r])
    unique = {s["file"]: s for s in out}
    return sorted(unique.values(), key=lambda s: s["rank"])


def _present(path: Path, entry: dict[str, Any]) -> str | None:
    """The sha256 of a file already at its destination, if it is the right one."""
    if path.is_file() and path.stat().st_size == entry["size"]:
        sha = sha256_file(path)
        if sha == entry["sha256"]:
            return sha
    return None


def _compressed(entry: dict[str, Any], fname: str) -> dict[str, Any] | None:
    """The entry's ``compressed`` record, checked: names from a manifest never escape ``dest``."""
    comp = entry.get("compressed")
    if comp is None:
        return None
    from ..formats.manifest import safe_name

    if (not isinstance(comp, dict) or comp.get("codec") not in CODECS
            or not isinstance(comp.get("size"), int) or not isinstance(comp.get("sha256"), str)):
        raise ManifestError(f"the manifest's compressed record of {fname} is malformed or uses an "
                            f"unknown codec", hint="push the build again with this shardc version")
    safe_name(comp.get("object"), "compressed object name")
    return comp


def _fetch(manifest_uri: str, endpoint_url: str | None, settings: TransferSettings) -> tuple[Store, dict]:
    root, name = split_object_uri(manifest_uri)
    store = open_store(root, endpoint_url=endpoint_url, settings=settings)
    data = store.get_bytes(name, MAX_MANIFEST_BYTES)
    if data is None:
        raise StoreError(f"no manifest at {store.object_uri(name)}",
                         hint="check the URI; a build is visible only once shardc push has finished")
    return store, loads(data, store.object_uri(name))


@_os_errors
def fetch_manifest(manifest_uri: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """A manifest straight from a store (for ``shardc verify --manifest s3://...``), as the build
    wrote it (the store's compression records stripped)."""
    return _strip_compressed(_fetch(manifest_uri, endpoint_url, TransferSettings.from_env())[1])


@_os_errors
def pull_build(
    manifest_uri: str,
    dest_dir: Path,
    *,
    ranks: list[tuple[int, int]] | None = None,
    endpoint_url: str | None = None,
    progress: bool = False,
    global_ranks: list[int] | None = None,
    settings: TransferSettings | None = None,
) -> dict[str, Any]:
    """Fetch the manifest and the requested ranks' shards (default: all) plus the side files into
    ``dest_dir``, every file verified before it gets its final name; then verify the ranks."""
    t0 = time.perf_counter()
    settings = settings or TransferSettings.from_env()
    store, remote = _fetch(manifest_uri, endpoint_url, settings)
    shards = _select(remote, ranks, global_ranks)
    wanted = [(f["name"], f) for f in remote["files"]] + [(s["file"], s) for s in shards]

    local = _strip_compressed(remote)
    local_bytes = dumps(local)
    comps = {fname: _compressed(entry, fname) for fname, entry in wanted}

    dest = Path(dest_dir)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        old = dest / MANIFEST_NAME
        if old.is_file() and old.read_bytes() != local_bytes:
            old.unlink()  # it no longer describes the directory once files start changing
    except OSError as exc:
        raise StoreError(f"cannot prepare {dest}: {exc.strerror}") from None
    for fname, _ in wanted:
        remove_stale_partials(dest, fname)
    digests: dict[str, str] = {}
    files, todo = [], []
    with ThreadPoolExecutor(4, thread_name_prefix="shardc-hash") as pool:
        present = list(pool.map(lambda w: _present(dest / w[0], w[1]), wanted))
    for (fname, entry), sha in zip(wanted, present, strict=True):
        if sha is not None:
            digests[fname] = sha
            files.append({"name": fname, "size": entry["size"], "action": "present"})
        else:
            todo.append((fname, entry))

    items: list[GetItem] = []
    total = 0
    bar = None
    try:
        for fname, entry in todo:
            comp = comps[fname]
            obj = comp["object"] if comp else fname
            items.append(GetItem(obj, VerifiedSink(dest / fname, entry, comp, settings.fsync_downloads)))
            total += comp["size"] if comp else entry["size"]
        bar = _progress_bar(progress, f"pull {store.uri}", total)
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
    for (fname, entry), item, err in zip(todo, items, errors, strict=True):
        if err is None:
            try:
                digests[fname] = item.sink.commit()
                files.append({"name": fname, "size": entry["size"], "action": "downloaded"})
                continue
            except VerifyMismatch as exc:
                err = exc
            except OSError as exc:
                err = StoreError(f"cannot write {dest / fname}: {exc.strerror}",
                                 hint="check free space, permissions and what is at that path")
        item.sink.abort()
        target = mismatches if isinstance(err, VerifyMismatch) else other
        target.append(err if isinstance(err, ShardcError) else StoreError(str(err)))
    if settings.fsync_downloads:
        fsync_dir(dest)
    if mismatches:
        first = mismatches[0]
        more = f" (and {len(mismatches) - 1} more file(s))" if len(mismatches) > 1 else ""
        raise VerifyMismatch(first.message + more, hint=first.hint)
    if other:
        raise other[0]

    write_atomic(dest / MANIFEST_NAME, local_bytes)
    report = verify_pulled(local, dest, shards, digests)
    if not report["ok"]:
        raise VerifyMismatch(report["problems"][0], hint="run shardc verify for the full report")
    return {
        "manifest_uri": manifest_uri,
        "dest": str(dest),
        "manifest": str(dest / MANIFEST_NAME),
        "ranks": [{k: s[k] for k in ("file", "tp_rank", "pp_stage", "rank")} for s in shards],
        "files": sorted(files, key=lambda f: f["name"]),
        "downloaded": sum(f["action"] == "downloaded" for f in files),
        "present": sum(f["action"] == "present" for f in files),
        "bytes_downloaded": total,
        "seconds": round(time.perf_counter() - t0, 3),
        "verify": report,
    }


def verify_pulled(manifest: dict[str, Any], dest: Path, shards: list[dict[str, Any]],
                  digests: dict[str, str]) -> dict[str, Any]:
    """The checks of ``shardc verify`` for the pulled ranks.

    The files were hashed while they were downloaded (or found present); passing those digests
    spares a second read of every byte. If verify_build grows a ``hashed`` argument this becomes a
    plain call of it; until then it is verify_build's own composition of the per-rank checks.
    """
    import inspect

    from ..formats.manifest import layout_of
    from ..verify import checks as verify

    layout = layout_of(manifest)
    rls = [layout.rank(s["tp_rank"], s["pp_stage"]) for s in shards]
    if "hashed" in inspect.signature(verify.verify_build).parameters:
        return verify.verify_build(manifest, dest, rls, hashed=digests)  # type: ignore[call-arg]
    problems = verify.check_manifest_against_layout(manifest, layout)
    results = [verify.verify_rank(manifest, dest, layout, rl, hashed=digests.get(rl.file)) for rl in rls]
    problems += [p for r in results for p in r.problems]
    return {"ok": not problems, "plan": layout.plan.name, "plan_sha256": layout.plan.sha256,
            "problems": problems, "ranks": [r.as_dict() for r in results]}

