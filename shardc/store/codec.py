"""Bytes on their way in and out of a store: zstd, the hashing writer, the verified sink, and the
partial files they live in until they are checked.

Partial files are created next to their final name, exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``)
under a random name, like :func:`shardc.formats.files.create_temp`'s temp files, plus the writer's
pid: a transfer runs for minutes, two pulls may share a destination, and the next run must tell a
dead writer's partial (removed) from a live one's (kept). Small files (the manifest) go through
:func:`shardc.formats.files.write_atomic`.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import StoreError, VerifyMismatch
from ..formats.files import sha256_file

CODECS = ("zstd",)
# zstd saves little on weights (random-like mantissas do not compress) and runs slower per core
# than a datacenter link to S3, so it is off unless asked for; level 1 compresses weights as well
# as 3, faster. Figures: docs/performance.md §2 (scripts/bench_store.py --zstd).
DEFAULT_COMPRESS: str | None = None
ZSTD_LEVEL = 1
BLOCK = 16 << 20


# --- partial files ------------------------------------------------------------------------------

def partial_name(final: Path, suffix: str = "") -> Path:
    """``.<name>.partial-<pid>.<random>``: unguessable, and tells which process wrote it."""
    return final.with_name(f".{final.name}.partial-{os.getpid()}.{secrets.token_hex(8)}{suffix}")


def create_exclusive(path: Path) -> BinaryIO:
    """Open a new file for writing; fails if anything (a file, a symlink) is already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def new_partial(final: Path, suffix: str = "") -> tuple[Path, BinaryIO]:
    """A fresh partial file next to ``final``, open for writing (never an existing path)."""
    for _ in range(8):
        path = partial_name(final, suffix)
        try:
            return path, create_exclusive(path)
        except FileExistsError:  # 64 random bits: something was planted there
            continue
    raise FileExistsError(f"cannot create a partial file next to {final}")


def remove_stale_partials(directory: Path, name: str) -> int:
    """Partial files of killed processes (their pid is gone) are removed; live ones are left alone."""
    n = 0
    for p in directory.glob(f".{name}.partial-*"):
        pid = p.name[len(f".{name}.partial-"):].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        p.unlink(missing_ok=True)
        n += 1
    return n


# --- zstd and hashing ---------------------------------------------------------------------------

def zstd_module() -> Any:
    """The zstandard module, or one clear StoreError (it is an optional dependency)."""
    try:
        import zstandard
    except ImportError:
        raise StoreError("zstd compression needs the zstandard package",
                         hint="pip install 'shardc[zstd]'") from None
    return zstandard


class HashWriter:
    """Counts and hashes what is written to it; optionally passes it on."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self.h, self.n, self.out = hashlib.sha256(), 0, out

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    def flush(self) -> None:
        if self.out is not None:
            self.out.flush()


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


def compress_file(src: Path, level: int = ZSTD_LEVEL) -> tuple[Path, str, dict[str, str]]:
    """Compress to a private temp file (mkstemp), hashing input and output on the way.
    Returns (temp path, sha256 of the content, the object's metadata)."""
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


def zstd_file_digests(path: Path) -> dict[str, str]:
    """Metadata of a stored .zst file, recomputed: its own sha256 and its content's size/sha256."""
    zstd = zstd_module()
    raw, content = hashlib.sha256(), HashWriter()
    try:
        with open(path, "rb") as f, zstd.ZstdDecompressor().stream_writer(
                content, write_size=BLOCK, closefd=False) as w:
            while chunk := f.read(BLOCK):
                raw.update(chunk)
                w.write(chunk)
    except zstd.ZstdError:
        return {"sha256": sha256_file(path)}  # not a valid stream: never matches a manifest
    return {"sha256": raw.hexdigest(), "codec": "zstd", "content-size": str(content.n),
            "content-sha256": content.h.hexdigest()}


# --- the verified sink of a download ------------------------------------------------------------

class VerifiedSink:
    """Receives a file's bytes (at any offset: parts arrive in parallel), into a partial file next
    to ``final``; on commit hashes it (a zstd object is first checked, then decompressed as a
    stream into a second partial file) and renames into place only if size and sha256 match.

    Seekable on purpose: s3transfer's in-order path for non-seekable targets stalled for good on
    multi-GB objects (10 parts written, then nothing), and random-access writes need no buffering.
    The hash costs one read of the file back from the page cache.

    No fsync before the rename unless ``fsync``: a killed process never leaves a partial file under
    the final name (the page cache outlives it), and after a power loss every reader of a pulled
    file hashes it first (pull's present check, verify, the runtime's checked load), so a torn
    file is re-downloaded, never used.
    """

    def __init__(self, final: Path, size: int, sha256: str, compressed: dict[str, Any] | None,
                 fsync: bool = False) -> None:
        self.final, self.size, self.sha256 = final, size, sha256
        self.compressed, self.fsync = compressed, fsync
        # what the store sends: the file itself, or its .zst object (decompressed at commit)
        self.download, self._f = new_partial(final, ".zst" if compressed else "")
        self.tmp: Path | None = None if compressed else self.download
        self.limit = compressed["size"] if compressed else size

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
        problems: list[str] = []
        try:
            self._f.close()
            if self.compressed is not None:
                c = self.compressed
                size, digest = self.download.stat().st_size, sha256_file(self.download)
                if size != c.get("size") or digest != c.get("sha256"):
                    problems.append(f"compressed object {c.get('object')}: {size} bytes, sha256 "
                                    f"{digest[:16]}..., expected {c.get('size')} bytes, "
                                    f"{str(c.get('sha256'))[:16]}...")
                else:
                    self._decompress()
            if not problems:
                assert self.tmp is not None
                size, sha = self.tmp.stat().st_size, sha256_file(self.tmp)
                if size != self.size or sha != self.sha256:
                    problems.append(f"{size} bytes, sha256 {sha[:16]}..., expected "
                                    f"{self.size} bytes, {self.sha256[:16]}...")
            if problems:
                self.abort()
                raise VerifyMismatch(f"{self.final.name}: downloaded data does not match the manifest: "
                                     + "; ".join(problems),
                                     hint="the object was corrupted or replaced in the store; push the build again")
            assert self.tmp is not None
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
            self.tmp, out = new_partial(self.final)
            with open(self.download, "rb") as src, out:
                dec = zstd.ZstdDecompressor().stream_writer(
                    _Bounded(HashWriter(out), self.size, self.final.name),
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
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        self.download.unlink(missing_ok=True)
