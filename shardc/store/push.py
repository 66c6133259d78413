"""``push_build``: upload a build to a store, manifest last (the protocol: :mod:`shardc.store.transfer`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import ShardcError, StoreError, VerifyMismatch
from ..formats.files import safe_name, sha256_file
from ..formats.manifest import Manifest, ShardEntry, load, loads
from .codec import CODECS, ZSTD_LEVEL, compress_file, zstd_module
from .object_store import MANIFEST_NAME, MAX_MANIFEST_BYTES, ObjectInfo, PutItem, S3Settings, Store
from .transfer import entries, os_errors, progress_bar, strip_compressed
from .transfers import ManifestState, ObjectAction, PushedObject, PushResult
from .uri import open_store, parse_uri, split_object_uri


@dataclasses.dataclass
class Upload:
    """One file of the build and the object it becomes."""

    file: str  # name in the build (and in the manifest)
    object: str  # name in the store: ``<file>.zst`` when compressed
    size: int  # the manifest's size and sha256 of the file itself
    sha256: str
    local: Path
    codec: str | None
    stored: ObjectInfo | None = None  # what the store holds (present) or will hold (uploaded)
    action: ObjectAction = ObjectAction.UPLOADED

    def matches(self, info: ObjectInfo) -> bool:
        """Whether a stored object already is this file (recorded hashes, not just the size)."""
        if self.codec:
            md = info.metadata
            return (md.get("codec") == self.codec and md.get("content-sha256") == self.sha256
                    and md.get("content-size") == str(self.size) and bool(info.sha256))
        return info.size == self.size and info.sha256 == self.sha256


@os_errors
def push_build(
    manifest_path: Path,
    dest_uri: str | None = None,
    *,
    endpoint_url: str | None = None,
    compress: str | None = None,
    progress: bool = False,
    build_dir: Path | None = None,
    settings: S3Settings | None = None,
    replace: bool = False,
) -> PushResult:
    """Upload a build (shards, side files, manifest last). Idempotent: a rerun resumes.

    A destination holding another plan's build (or the same plan built from another source) is
    refused before anything changes, unless ``replace``: then, once the new manifest is in place,
    the objects the old manifest named and the new one does not are removed (nothing else)."""
    t0 = time.perf_counter()
    manifest_path = Path(manifest_path)
    # A manifest in the store's form (copied from a store) names .zst objects of that store: this
    # push records only what it stores itself.
    manifest = strip_compressed(load(manifest_path))
    _check_codec(compress)
    src = _build_dir(manifest_path, manifest, build_dir)
    root, manifest_name = _destination(manifest, dest_uri)
    store = open_store(root, endpoint_url=endpoint_url, settings=settings)
    uploads = _plan_uploads(manifest, src, compress)

    old = store.get_bytes(manifest_name, MAX_MANIFEST_BYTES)  # also the first contact: bucket, creds
    stale = _replaced_objects(store.object_uri(manifest_name), old, manifest, replace)
    todo = _find_missing(store, uploads)
    if todo and old is not None:
        store.delete(manifest_name)  # un-commit: its objects are about to change
    _upload(store, todo, progress)
    _check_stored(store, uploads)
    data = _remote_manifest(manifest, uploads).dumps()
    state = ManifestState.UNCHANGED
    if data != old or todo:
        store.put_bytes(manifest_name, data, {"sha256": hashlib.sha256(data).hexdigest()})
        state = ManifestState.UPLOADED
    removed = sorted(stale - {u.object for u in uploads} - {manifest_name})
    for name in removed:  # after the new manifest: a reader never sees one whose objects are gone
        store.delete(name)
    return PushResult(
        dest=store.uri, manifest_uri=store.object_uri(manifest_name), manifest=state, compress=compress,
        objects=tuple(PushedObject(u.file, u.object, _stored(u).size, u.action) for u in uploads),
        uploaded=sum(u.action == ObjectAction.UPLOADED for u in uploads),
        present=sum(u.action == ObjectAction.PRESENT for u in uploads),
        bytes_uploaded=sum(_stored(u).size for u in todo), bytes_total=sum(_stored(u).size for u in uploads),
        removed=tuple(removed), seconds=round(time.perf_counter() - t0, 3),
    )


# --- steps --------------------------------------------------------------------------------------

def same_build(old: Manifest, new: Manifest) -> bool:
    """Whether ``new`` is a rebuild of what ``old`` describes: the same effective plan (plan plus
    command-line overrides) read from the same source (uri, revision, every file's sha256)."""
    return (old.effective_sha256 == new.effective_sha256
            and old.source.to_dict() == new.source.to_dict())


def _replaced_objects(where: str, old: bytes | None, new: Manifest, replace: bool) -> set[str]:
    """The objects of the build at the destination, when ``new`` replaces it (``replace``); empty
    for a re-push of the same build. Another build there without ``replace`` is refused: its
    manifest is what nodes pull at cold start, so swapping it must be asked for."""
    if old is None:
        return set()
    try:
        prev = loads(old, where)
    except ShardcError as exc:
        if not replace:
            raise StoreError(f"{where} is not a manifest shardc can read ({exc.message}); refusing to "
                             f"replace it with plan {new.name}",
                             hint="use `replace` to overwrite it (no other object is removed)") from None
        return set()
    if same_build(prev, new):
        return set()
    if not replace:
        raise StoreError(f"{where} holds {_describe(prev)}, not {_describe(new)}",
                         hint="use `replace` to replace it (the old build's objects are removed), "
                              "or push to another prefix")
    return _objects(prev)


def _describe(m: Manifest) -> str:
    return f"plan {m.name} (sha256 {m.effective_sha256[:12]}, source {m.source.uri})"


def _objects(m: Manifest) -> set[str]:
    """The store objects a manifest (in the store's form) names: plain names only, so a hostile
    manifest cannot make a replacing push delete anything outside the prefix."""
    names = set()
    for name, e in entries(m):
        obj = e.compressed.get("object") if isinstance(e.compressed, dict) else None
        names.add(obj if isinstance(obj, str) else name)  # a compressed entry is stored as its object
    out = set()
    for n in sorted(names):
        try:
            out.add(safe_name(n, "object name"))
        except ShardcError:
            continue
    return out


def _check_codec(compress: str | None) -> None:
    """Before anything is touched: a known codec whose library is installed."""
    if compress is None:
        return
    if compress not in CODECS:
        raise StoreError(f"unknown compression {compress!r}", hint=f"use one of: {', '.join(CODECS)}")
    zstd_module()


def _build_dir(manifest_path: Path, manifest: Manifest, build_dir: Path | None) -> Path:
    """Where the shards are: next to the manifest, or (for a copy in manifests/) build/<plan name>."""
    names = [n for n, _ in entries(manifest)]
    name = manifest.name
    candidates = [Path(build_dir)] if build_dir else [
        manifest_path.parent, Path("build") / name, manifest_path.parent.parent / "build" / name]
    for c in candidates:
        if all((c / n).is_file() for n in names):
            return c
    missing = next(n for n in names if not (candidates[0] / n).is_file())
    raise StoreError(f"the build's files are not next to {manifest_path} (missing {missing})",
                     hint="give the manifest.json inside the build directory, or `build_dir`")


def _destination(manifest: Manifest, dest_uri: str | None) -> tuple[str, str]:
    """(store root URI, manifest object name): ``dest_uri``, else the plan's checkpoint URI."""
    if dest_uri:
        if dest_uri.endswith(".json"):
            return split_object_uri(dest_uri)
        parse_uri(dest_uri)
        return dest_uri.rstrip("/") or "/", MANIFEST_NAME
    uri = ((manifest.plan.get("replica_group") or {}).get("checkpoint") or {}).get("manifest_uri")
    if not uri:
        raise StoreError("no destination: the plan has no replica_group.checkpoint.manifest_uri",
                         hint="give `dest_uri` (a local directory, file:// or s3://bucket/prefix)")
    return split_object_uri(uri)


def _plan_uploads(manifest: Manifest, src: Path, compress: str | None) -> list[Upload]:
    """One Upload per file (only shards are compressed); a local file whose size already differs
    from the manifest stops here."""
    uploads = []
    for name, entry in entries(manifest):
        local = src / name
        if local.stat().st_size != entry.size:
            raise VerifyMismatch(f"{local}: {local.stat().st_size} bytes, the manifest says {entry.size}",
                                 hint="the build directory changed after the build; rebuild")
        codec = compress if isinstance(entry, ShardEntry) else None
        uploads.append(Upload(name, name + ".zst" if codec else name, entry.size, entry.sha256, local, codec))
    return uploads


def _find_missing(store: Store, uploads: list[Upload]) -> list[Upload]:
    """Mark what the store already holds as present; return the rest. Partial uploads of these
    objects left by a killed push are cleaned up first."""
    store.abort_incomplete([u.object for u in uploads])
    todo = []
    for u in uploads:
        info = store.head(u.object)
        if info is not None and info.sha256 is None and (u.codec or info.size == u.size):
            info = store.head(u.object, digest=True)  # a backend without recorded hashes
        if info is not None and u.matches(info):
            u.stored, u.action = info, ObjectAction.PRESENT
        else:
            u.action = ObjectAction.UPLOADED
            todo.append(u)
    return todo


def _upload(store: Store, todo: list[Upload], progress: bool) -> None:
    bar = progress_bar(progress, f"push {store.uri}", 0)
    hashers = ThreadPoolExecutor(2, thread_name_prefix="shardc-hash")
    try:
        store.put_files(_prepared(todo, bar, hashers), bar.update)
    finally:
        hashers.shutdown(wait=True, cancel_futures=True)
        bar.close()


def _prepared(todo: list[Upload], bar: Any, hashers: ThreadPoolExecutor) -> Iterator[PutItem]:
    """The uploads, each checked against the manifest before its object may appear.

    Plain files start uploading at once while a hashing thread re-reads them; the backend holds
    back the object's completion until the hash matched (``PutItem.verified``), so hashing
    overlaps the transfer and a shard that rotted on disk is still never published. Compressed
    files are hashed while they are compressed, before the upload. A generator: the backend pulls
    the next item while earlier ones transfer.
    """
    for u in todo:
        verified: Future[None] | None = None
        if u.codec:
            tmp, sha, meta = compress_file(u.local, ZSTD_LEVEL)
            if sha != u.sha256:
                tmp.unlink(missing_ok=True)
                raise _rotted(u, sha)
            size, path = tmp.stat().st_size, tmp
            cleanup: Callable[[], None] = functools.partial(tmp.unlink, missing_ok=True)  # this item's tmp
        else:
            verified = hashers.submit(_check_local, u)
            size, path, meta = u.size, u.local, {"sha256": u.sha256}
            cleanup = lambda: None  # noqa: E731
        u.stored = ObjectInfo(size, meta["sha256"], meta)
        bar.total = (bar.total or 0) + size
        bar.refresh()
        ctype = "application/json" if u.file.endswith(".json") else "application/octet-stream"
        yield PutItem(u.object, path, size, meta, ctype, cleanup, verified)


def _check_local(u: Upload) -> None:
    sha = sha256_file(u.local)
    if sha != u.sha256:
        raise _rotted(u, sha)


def _rotted(u: Upload, sha: str) -> VerifyMismatch:
    return VerifyMismatch(f"{u.local}: sha256 {sha[:16]}... does not match the manifest's "
                          f"{u.sha256[:16]}...", hint="the file changed after the build; rebuild")


def _stored(u: Upload) -> ObjectInfo:
    assert u.stored is not None, f"{u.file} was neither found nor uploaded"
    return u.stored


def _check_stored(store: Store, uploads: list[Upload]) -> None:
    """Every object there, with the right size, before the manifest."""
    for u in uploads:
        info, want = store.head(u.object), _stored(u).size
        if info is None or info.size != want:
            raise StoreError(f"after upload, {store.object_uri(u.object)} is "
                             f"{'missing' if info is None else f'{info.size} bytes, expected {want}'}",
                             hint="another writer changed the store during the push; rerun")


def _remote_manifest(manifest: Manifest, uploads: list[Upload]) -> Manifest:
    """The build manifest plus, for compressed objects, what was stored."""
    stored = {u.file: u for u in uploads if u.codec}
    if not stored:
        return manifest

    def record(name: str) -> dict[str, Any] | None:
        u = stored.get(name)
        if u is None:
            return None
        s = _stored(u)
        return {"codec": u.codec, "size": s.size, "sha256": s.sha256, "object": u.object}

    return dataclasses.replace(
        manifest,
        files=[dataclasses.replace(f, compressed=record(f.name)) for f in manifest.files],
        shards=[dataclasses.replace(s, compressed=record(s.file)) for s in manifest.shards])
