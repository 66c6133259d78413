"""An existing build as input: its manifest, and its files on local disk, checked before use.

``reshard`` and ``export`` read a build instead of a Hugging Face checkpoint. They reach its files
through :class:`BuildInput`: ``schedule`` says in which order files will be needed (checks start
in the background, in that order), ``prepare`` blocks until the named files are local and their
sha256 matches the input manifest. A local build is hashed where it lies; a build in object
storage is fetched by the store layer (``shardc.store.reshard_input``), which hashes while it
downloads, so every input byte is checked exactly once.

``ready`` is the speculative form reshard uses for a local input: it blocks only until a file is
there with the manifest's size (so a mapping cannot fault), and its sha256 is checked on another
core while its bytes are being resharded. Nothing derived from a file is committed before its
check has passed (the compiler calls ``confirm`` before a stage's shards are renamed into place
and before the manifest), so a corrupted input still leaves nothing in the output; only the CPU
time spent on it is lost. This is what lets reshard take about as long as build on two cores,
instead of hashing first and working after.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

from ..errors import ManifestError, VerifyMismatch
from ..formats.files import safe_name, sha256_file, sha256_mapped
from ..formats.manifest import FileEntry, Manifest, ShardEntry, read

# sha256 is one core per file, and every input byte is hashed while reshard works on it: as many
# threads as cores, up to one per file of a tp8 input.
HASH_WORKERS = max(1, min(8, os.cpu_count() or 1))


class BuildInput:
    """The interface reshard reads through. ``directory`` holds the files once prepared."""

    uri: str
    manifest: Manifest
    directory: Path

    @cached_property
    def manifest_sha256(self) -> str:
        """sha256 of the manifest as its build wrote it (canonical JSON, compression records of a
        push stripped), so a local build and its pushed copy have the same identity."""
        return hashlib.sha256(self.manifest.dumps()).hexdigest()

    def entry(self, name: str) -> ShardEntry | FileEntry:
        entry = self.manifest.shard(name) or self.manifest.file(name)
        if entry is None:
            raise ManifestError(f"the input manifest names no file {name!r}")
        return entry

    def side_files(self) -> list[str]:
        """config.json, tokenizer files: what the manifest lists besides shards."""
        return sorted(f.name for f in self.manifest.files)

    def schedule(self, files: list[str]) -> None:
        """Start checking (or fetching) ``files`` in this order, in the background."""

    def prepare(self, files: list[str]) -> None:
        """Block until ``files`` are in ``directory`` with the manifest's sha256 (VerifyMismatch
        naming the first bad file otherwise)."""
        raise NotImplementedError

    def ready(self, files: list[str]) -> None:
        """Block until ``files`` can be read (their checks may still run: see ``confirm``)."""
        self.prepare(files)

    def confirm(self) -> None:
        """Block until every file passed to ``ready`` so far has passed its check."""

    def close(self) -> None:
        """Stop background work and drop temporary copies."""


class LocalBuildInput(BuildInput):
    """A build directory on local disk: files are hashed in place, a few threads at a time."""

    def __init__(self, manifest_path: str | Path, uri: str | None = None) -> None:
        path = Path(manifest_path)
        self.manifest = read(path)
        self.uri = uri or str(manifest_path)
        self.directory = path.parent
        self._pool = ThreadPoolExecutor(HASH_WORKERS, thread_name_prefix="shardc-inhash")
        self._checks: dict[str, Future] = {}
        self._sized: set[str] = set()  # sizes checked: safe to map
        self._lock = threading.Lock()

    def schedule(self, files: list[str]) -> None:
        with self._lock:
            for f in files:
                if f not in self._checks:
                    self._checks[f] = self._pool.submit(self._check, f)

    def prepare(self, files: list[str]) -> None:
        self.schedule(files)
        for f in files:
            self._checks[f].result()

    def ready(self, files: list[str]) -> None:
        self.schedule(files)
        for f in files:
            if f not in self._sized:
                self._check_size(f)
                with self._lock:
                    self._sized.add(f)

    def confirm(self) -> None:
        with self._lock:
            pending = [self._checks[f] for f in sorted(self._sized)]
        for fut in pending:
            fut.result()

    def _check(self, name: str) -> None:
        path = self._check_size(name)
        # shards are mapped by the reader anyway: hash them from the mapping (no copy)
        digest = (sha256_mapped if self.manifest.shard(name) else sha256_file)(path)
        entry = self.entry(safe_name(name))
        if digest != entry.sha256:
            raise VerifyMismatch(f"input file {path} is corrupted: sha256 {digest[:16]}..., the input "
                                 f"manifest says {entry.sha256[:16]}...",
                                 hint="restore the file (shardc pull) or rebuild the input")

    def _check_size(self, name: str) -> Path:
        entry = self.entry(safe_name(name))
        path = self.directory / name
        try:
            size = path.stat().st_size
        except OSError:
            raise VerifyMismatch(f"input file {path} is missing", hint="the input build is incomplete; "
                                 "run shardc verify on it") from None
        if size != entry.size:
            raise VerifyMismatch(f"input file {path} has {size} bytes, the input manifest says {entry.size}",
                                 hint="the input build is damaged; run shardc verify on it")
        return path

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def open_local_input(ref: str | Path) -> LocalBuildInput:
    """A manifest path, ``file://`` URI or build directory."""
    path = Path(str(ref).removeprefix("file://"))
    if path.is_dir():
        path = path / "manifest.json"
    return LocalBuildInput(path, uri=str(ref))
