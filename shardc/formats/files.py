"""File helpers every writer and reader shares: hashing, temp files, atomic writes, safe names,
byte counts for people.

One temp-file scheme for everything shardc writes outside object storage: ``.<final name>.<random>.tmp``
in the target's own directory (so the rename into place never crosses a filesystem), created
exclusively (``O_EXCL | O_NOFOLLOW``: never someone else's file or a planted symlink). A leftover
of a killed run is recognisable by name (``is_temp``) and removed by the next run.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import secrets
from pathlib import Path

from ..errors import ManifestError
from ..layout.plan import SAFE_FILE_NAME

HASH_BLOCK = 16 << 20
TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.[0-9a-f]{16}\.tmp\Z")


def sha256_file(path: str | Path, block: int = HASH_BLOCK) -> str:
    """Hex sha256 of a file, read in large blocks (hashlib releases the GIL on them)."""
    h = hashlib.sha256()
    buf = bytearray(block)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


MAP_WINDOW = 8 << 20  # sha256_mapped maps this much at a time: mapped pages count in the RSS


def sha256_mapped(path: str | Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file hashed straight from mappings of it, a window at a time: no copy out of
    the page cache (about 18% less CPU than ``sha256_file`` here), and the RSS grows by one window
    at most. Only for a file the caller maps anyway: a file truncated meanwhile is SIGBUS, as it is
    for the caller's own mapping."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for start in range(0, size, MAP_WINDOW):
            n = min(MAP_WINDOW, size - start)
            with mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ, offset=start) as m, memoryview(m) as mv:
                for i in range(0, n, block):
                    h.update(mv[i : i + block])
    return h.hexdigest()


def create_temp(final: str | Path, flags: int = 0, mode: int = 0o644) -> tuple[int, Path]:
    """Create the temp file for ``final`` and return (write-only fd, its path).

    ``flags`` adds open flags (``O_DIRECT`` and the like are set later by the caller)."""
    final = Path(final)
    while True:
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, mode)
        except FileExistsError:  # pragma: no cover - 64 random bits
            continue
        return fd, tmp


def is_temp(path: str | Path) -> bool:
    """Whether ``path`` is a temp file of this scheme (a leftover when no writer holds it)."""
    return _TEMP_NAME.match(Path(path).name) is not None


def final_name(path: str | Path) -> str:
    """The file a temp file was to become (its own name for anything else)."""
    m = _TEMP_NAME.match(Path(path).name)
    return m.group("final") if m else Path(path).name


def temp_files(directory: str | Path) -> list[Path]:
    """Temp files of this scheme in ``directory`` (for cleanup and free-space accounting)."""
    return sorted(p for p in Path(directory).glob(f".*{TEMP_SUFFIX}") if is_temp(p))


def write_atomic(path: str | Path, data: bytes) -> None:
    """temp file + fsync + rename: the file is either the old one or the new one, never half."""
    path = Path(path)
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_temp(final: str | Path, data: bytes) -> Path:
    """``data`` durably (fsynced) at a new temp file for ``final``, not renamed: a rebuild stages
    files this way and switches them in later (compiler/switch.py). Removed again on failure."""
    fd, tmp = create_temp(final)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    """Copy ``src`` to ``dst`` through a temp file: ``dst`` is never half a copy."""
    fd, tmp = create_temp(dst)
    try:
        with open(fd, "wb") as out, open(src, "rb") as f:
            while chunk := f.read(HASH_BLOCK):
                out.write(chunk)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: str | Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse a directory fd)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_name(name: str, what: str = "file name") -> str:
    """A name read from a file (manifest, index) may never escape its directory."""
    # fullmatch: "$" alone would let a trailing newline through
    if not isinstance(name, str) or not SAFE_FILE_NAME.fullmatch(name) or name in (".", ".."):
        raise ManifestError(
            f"unsafe {what} {name!r}", hint="names must be plain file names without directories"
        )
    return name


def human_size(n: int) -> str:
    """GiB with 3 decimals from 256 MiB up, MiB with 2 below (so small test models read right)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"
