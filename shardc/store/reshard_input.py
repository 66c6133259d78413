"""A build in object storage as the input of ``shardc reshard`` / ``shardc export``.

Only the store's public pull interface is used: the manifest comes from ``fetch_manifest``, and
the shards of one input pipeline stage at a time from ``pull_build`` (parallel ranged GETs, every
file hashed on the way and renamed into place only when it matches the manifest; a shard with
chunk digests is checked chunk by chunk on every core as its chunks arrive, store/ranged.py). A
file is fetched whole before any tensor of it is used; each input byte is fetched once. A background thread fetches stages in the order the output needs
them, so downloading overlaps writing; the copies live in a locked temporary directory next to the
output (``build.inputs.Spool``), removed at the end, or by the next run if this one is killed.

The manifest is read once, and that is the build the output records and is made of: each pull
reads the manifest again, and a pull that found another one (a push to the same prefix while the
reshard ran) is refused, so no file verified against another manifest is ever used.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from ..compiler.build_files import BuildInput, Spool
from ..errors import OutputError, ShardcError, StoreError, VerifyMismatch
from .object_store import MANIFEST_NAME
from .pull import fetch_manifest, pull_build


class RemoteBuildInput(BuildInput):
    """``s3://bucket/prefix/manifest.json`` (or any URI pull understands) as a BuildInput."""

    def __init__(self, manifest_uri: str, *, endpoint_url: str | None = None,
                 spool_parent: str | Path | None = None) -> None:
        self.uri = manifest_uri
        self.endpoint_url = endpoint_url
        self.manifest = fetch_manifest(manifest_uri, endpoint_url=endpoint_url)
        self._manifest_bytes = self.manifest.dumps()  # what each pull must find again
        try:
            self._spool = Spool(spool_parent)  # first removes the spools of killed runs
        except OutputError as exc:
            raise StoreError(exc.message, hint=exc.hint) from None
        self.directory = self._spool.path
        self.bytes_fetched = 0  # bytes of files downloaded (what the benchmark compares)
        self._rank = {s.file: s.rank for s in self.manifest.shards}
        self._stage = {s.file: s.pp_stage for s in self.manifest.shards}
        self._done: dict[str, threading.Event] = {}
        self._errors: dict[str, BaseException] = {}
        self._queue: list[list[str]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._fetch_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def schedule(self, files: list[str]) -> None:
        """Fetch in this order, one input stage per pull, on a background thread."""
        groups: dict[int, list[str]] = {}
        for f in files:
            if f in self._rank:
                groups.setdefault(self._stage[f], []).append(f)
        with self._cond:
            for group in groups.values():
                todo = [f for f in group if f not in self._done]
                for f in todo:
                    self._done[f] = threading.Event()
                if todo:
                    self._queue.append(todo)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardc-input-fetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def prepare(self, files: list[str]) -> None:
        shards = [f for f in files if f in self._rank]
        if len(shards) < len(files):  # side files (config, tokenizer): pulled along with no ranks
            self._pull([])
        self.schedule(shards)
        for f in shards:
            self._done[f].wait()
            if f in self._errors:
                raise self._errors[f]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                group = self._queue.pop(0)
            try:
                self._pull(group)
            except BaseException as exc:  # noqa: BLE001 - whoever waits for these files raises it
                for f in group:
                    self._errors[f] = exc if isinstance(exc, ShardcError) else StoreError(str(exc))
            for f in group:
                self._done[f].set()

    def _pull(self, files: list[str]) -> None:
        with self._fetch_lock:
            report = pull_build(self.uri, self.directory, global_ranks=[self._rank[f] for f in files],
                                endpoint_url=self.endpoint_url)
            # each pull reads the manifest again: counted too
            self.bytes_fetched += report.bytes_downloaded + len(self._manifest_bytes)
            self._check_same_manifest()

    def _check_same_manifest(self) -> None:
        """The pull verified its files against the manifest it read (and wrote next to them): it
        must be the one this input read first, or the files are of another build."""
        try:
            pulled = (self.directory / MANIFEST_NAME).read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read the pulled manifest in {self.directory}: {exc.strerror}") from None
        if pulled != self._manifest_bytes:
            raise VerifyMismatch(
                f"the input manifest {self.uri} changed while it was read (sha256 "
                f"{hashlib.sha256(pulled).hexdigest()[:16]}..., first read as {self.manifest_sha256[:16]}...)",
                hint="another push replaced the build; rerun once it has finished")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._spool.close()


def open_input(ref: str, *, endpoint_url: str | None = None, spool_parent: str | Path | None = None) -> BuildInput:
    """A local manifest/build directory, or a manifest URI in a store. ``spool_parent`` is where a
    store's files are downloaded to (next to the output: they can be as large as the input); a
    local input copies only its small side files, into the system's temporary directory."""
    if "://" in ref and not ref.startswith("file://"):
        return RemoteBuildInput(ref, endpoint_url=endpoint_url, spool_parent=spool_parent)
    from ..compiler.build_files import open_local_input

    return open_local_input(ref)
