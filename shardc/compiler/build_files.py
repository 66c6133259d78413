"""An existing build as input: its manifest, and its files on local disk, checked before use.

``reshard`` and ``export`` read a build instead of a Hugging Face checkpoint. They reach its files
through :class:`BuildInput`: ``schedule`` says in which order files will be needed (checks start
in the background, in that order), ``prepare`` blocks until the named files are local and their
sha256 matches the input manifest. A local build is hashed where it lies; a build in object
storage is fetched by the store layer (``shardc.store.reshard_input``), which hashes while it
downloads, so every input byte is checked exactly once. A shard whose manifest entry has chunk
digests (format_version 3, docs/architecture.md §3.3) is checked chunk by chunk on every core
(``formats/chunk_digests.py``), and a damaged chunk is named with the tensors in it; other files by their
sha256, one core each.

``ready`` is the speculative form reshard uses for a local input: it blocks only until a file is
there with the manifest's size (so a mapping cannot fault), and its sha256 is checked on another
core while its bytes are being resharded. Nothing derived from a file is committed before its
check has passed (the compiler calls ``confirm`` before a stage's shards are renamed into place
and before the manifest), so a corrupted input still leaves nothing in the output; only the CPU
time spent on it is lost. This is what lets reshard take about as long as build on two cores,
instead of hashing first and working after.

Every input shard also passes the checks ``verify`` makes of its header (``shard_problems``, which
verify itself calls) before a byte of it is mapped: a file whose header points two tensors at the
same bytes, or past the end of the file, is refused even when the manifest was re-hashed to match.
Side files (config, tokenizer) are copied into a private :class:`Spool` while they are hashed, never
through a link, and only those the input manifest lists: what the output copies is what was hashed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import ManifestError, OutputError, ShardFormatError, VerifyMismatch
from ..formats import chunk_digests as chunks
from ..formats.files import HASH_BLOCK, safe_name, sha256_file, sha256_mapped
from ..formats.manifest import FileEntry, Manifest, ShardEntry, load
from ..formats.safetensors import extent_problem, read_header, shard_metadata
from ..layout.ranks import Layout, RankLayout

# sha256 is one core per file, and every input byte is hashed while reshard works on it: as many
# threads as cores, up to one per file of a tp8 input.
HASH_WORKERS = max(1, min(8, os.cpu_count() or 1))
SPOOL_PREFIX = ".shardc-input-"  # private temporary directories of reshard / export inputs
_METADATA_KEYS = ("shardc.plan_sha256", "shardc.tp_degree", "shardc.pp_degree", "shardc.tp_rank",
                  "shardc.pp_stage", "shardc.rank")
# written only by expert-parallel / data-parallel plans: absent on both sides elsewhere
_OPTIONAL_KEYS = ("shardc.experts", "shardc.dp_degree", "shardc.dp_rank")


def shard_problems(path: Path, layout: Layout, rank_layout: RankLayout, checks: list[str] | None = None) -> list[str]:
    """What is wrong with a shard file's header for rank ``rank_layout`` of ``layout`` (empty: nothing): it
    parses, its metadata names this plan and rank, it holds exactly the Layout's tensors with their
    dtypes and shapes, and its data layout is the one the safetensors library accepts
    (``extent_problem``). ``verify`` reports these; reshard and export refuse a file that has any,
    so a build verify rejects is never read as good. ``checks`` collects the names of the checks
    made (verify's report)."""
    try:
        header, meta, start = read_header(path)
        size = path.stat().st_size
    except OSError as exc:
        return [f"safetensors header does not parse ({exc.strerror})"]
    except ShardFormatError as exc:
        return [f"safetensors header does not parse ({exc.message})"]
    return header_problems(header, meta, size - start, layout, rank_layout, checks)


def header_problems(header: dict[str, Any], meta: dict[str, str], data_length: int, layout: Layout,
                    rank_layout: RankLayout, checks: list[str] | None = None) -> list[str]:
    """``shard_problems`` of a header already parsed (``load_shard`` parses it from the bytes it
    hashes), whose data section is ``data_length`` bytes."""
    checks = [] if checks is None else checks
    checks.append("header")
    problems = []
    want_meta = shard_metadata(layout, rank_layout)
    for key in _METADATA_KEYS + _OPTIONAL_KEYS:
        if meta.get(key) != want_meta.get(key):
            problems.append(f"metadata {key} is {meta.get(key)!r}, expected {want_meta.get(key)!r} "
                            f"(a shard of another plan or rank?)")
    checks.append("metadata")
    want = {t.name: t for t in rank_layout.tensors}
    problems += [f"missing tensor {name}" for name in sorted(set(want) - set(header))]
    problems += [f"unexpected tensor {name}" for name in sorted(set(header) - set(want))]
    checks.append("tensor-set")
    for name in sorted(set(want) & set(header)):
        t, h = want[name], header[name]
        if h.get("dtype") != t.dtype or list(h.get("shape", [])) != list(t.shape):
            problems.append(f"tensor {name}: expected {t.dtype}{list(t.shape)}, found "
                            f"{h.get('dtype')}{h.get('shape')}")
    checks.append("dtype-shape")
    if problem := extent_problem(header, data_length):
        problems.append(f"safetensors data layout: {problem}")
    checks.append("extent")
    return problems


class Spool:
    """A private temporary directory (``SPOOL_PREFIX``...) for one reshard or export input: the
    copies it reads. The directory is locked (``flock`` on the directory itself) for as long as it
    is in use; the kernel drops the lock of a process that dies, however it dies. So creating a
    spool first removes every unlocked spool in the same parent (what a killed run left) and never
    one a running command still holds."""

    def __init__(self, parent: str | Path | None = None) -> None:
        self.parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            remove_dead_spools(self.parent)
            self.path, self._fd = _locked_dir(self.parent)
        except OSError as exc:
            raise OutputError(f"cannot create a temporary directory for the input in {self.parent}: "
                              f"{exc.strerror or exc}", hint="free space or pick a writable `out`") from None

    def close(self) -> None:
        """Remove the directory (still holding its lock, so no other run sees it half gone)."""
        if self._fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1


def _locked_dir(parent: Path) -> tuple[Path, int]:
    """A new spool directory and its locked fd. Between ``mkdtemp`` and ``flock`` another run may
    take the empty directory for a dead one and remove it: then this run makes another."""
    while True:
        path = Path(tempfile.mkdtemp(prefix=SPOOL_PREFIX, dir=parent))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return path, fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)


def remove_dead_spools(parent: Path) -> list[Path]:
    """Remove the spools in ``parent`` that no process holds (left by killed runs); returns them."""
    removed = []
    for p in sorted(parent.glob(SPOOL_PREFIX + "*")):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # not a directory of ours (a link, a file), or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: a reshard or export in progress
        try:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        finally:
            os.close(fd)
    return removed


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

    def side_directory(self) -> Path:
        """A directory holding exactly the side files the manifest lists, each with the bytes its
        sha256 was checked on (what a reshard or export copies from; a file the manifest does not
        list, or a link, is never there)."""
        self.prepare(self.side_files())
        return self.directory

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

    def __init__(self, manifest_path: str | Path, uri: str | None = None,
                 spool_parent: str | Path | None = None) -> None:
        path = Path(manifest_path)
        self.manifest = load(path)
        self.uri = uri or str(manifest_path)
        self.directory = path.parent
        self.spool_parent = spool_parent  # where side_directory's copies go (None: the temp dir)
        self._spool: Spool | None = None
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
        shard = self.manifest.shard(name)
        if shard is not None and shard.chunk_size is not None:  # its chunks, on every core
            _check_chunks(path, shard)
            return
        # shards are mapped by the reader anyway: hash them from the mapping (no copy)
        digest = (sha256_mapped if shard else sha256_file)(path)
        entry = self.entry(safe_name(name))
        if digest != entry.sha256:
            raise VerifyMismatch(f"input file {path} is corrupted: sha256 {digest[:16]}..., the input "
                                 f"manifest says {entry.sha256[:16]}...",
                                 hint="restore the file (shardc pull) or rebuild the input")

    def side_directory(self) -> Path:
        """The listed side files copied into a spool, hashed on the way (see the base class)."""
        if self._spool is None:
            spool = Spool(self.spool_parent)
            try:
                for name in self.side_files():
                    self._copy_checked(name, spool.path / safe_name(name))
            except BaseException:
                spool.close()
                raise
            self._spool = spool
        return self._spool.path

    def _copy_checked(self, name: str, dst: Path) -> None:
        """Copy a side file without following a link, hashing the bytes that are written."""
        path = self._check_size(name)
        entry = self.entry(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise VerifyMismatch(f"input file {path} cannot be read: {exc.strerror}",
                                 hint="the input build is damaged; run shardc verify on it") from None
        h = hashlib.sha256()
        with open(fd, "rb") as src, open(dst, "xb") as out:
            while chunk := src.read(HASH_BLOCK):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != entry.sha256 or dst.stat().st_size != entry.size:
            raise VerifyMismatch(f"input file {path} is corrupted: sha256 {h.hexdigest()[:16]}..., the input "
                                 f"manifest says {entry.sha256[:16]}...",
                                 hint="restore the file (shardc pull) or rebuild the input")

    def _check_size(self, name: str) -> Path:
        entry = self.entry(safe_name(name))
        path = self.directory / name
        try:
            st = os.lstat(path)
        except OSError:
            raise VerifyMismatch(f"input file {path} is missing", hint="the input build is incomplete; "
                                 "run shardc verify on it") from None
        if not stat.S_ISREG(st.st_mode):  # a link is never followed: it could point anywhere
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise VerifyMismatch(f"input file {path} is {what}",
                                 hint="a build's files are regular files; restore it (shardc pull) or rebuild it")
        size = st.st_size
        if size != entry.size:
            raise VerifyMismatch(f"input file {path} has {size} bytes, the input manifest says {entry.size}",
                                 hint="the input build is damaged; run shardc verify on it")
        return path

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._spool is not None:
            self._spool.close()


def _check_chunks(path: Path, entry: ShardEntry) -> None:
    """A shard input with chunk digests (format_version 3): every chunk hashed in parallel
    (one whole-file sha256 is one core's worth); a damaged one is named with its tensors."""
    assert entry.chunk_size is not None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise VerifyMismatch(f"input file {path} cannot be read: {exc.strerror}",
                             hint="the input build is damaged; run shardc verify on it") from None
    with open(fd, "rb", buffering=0):
        bad = chunks.check_chunks(fd, entry.size, entry.chunk_size, entry.chunks, digest=entry.chunk_digest)
    if bad:
        try:
            tensors, _, start = read_header(path)
        except ShardFormatError:
            tensors, start = {}, 0
        line = chunks.chunk_problem(bad, entry.size, entry.chunk_size,
                                    lambda lo, hi: chunks.tensors_in(tensors, start, lo, hi),
                                    digest=entry.chunk_digest)
        raise VerifyMismatch(f"input file {path} is corrupted: {line}",
                             hint="restore the file (shardc pull) or rebuild the input")


def open_local_input(ref: str | Path, spool_parent: str | Path | None = None) -> LocalBuildInput:
    """A manifest path, ``file://`` URI or build directory."""
    path = Path(str(ref).removeprefix("file://"))
    if path.is_dir():
        path = path / "manifest.json"
    return LocalBuildInput(path, uri=str(ref), spool_parent=spool_parent)
