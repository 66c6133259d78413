"""O_DIRECT on an open descriptor: switched on where the filesystem takes it, off again where a read
or write refuses it, and whether a file is already in the page cache (then a cached read is the
faster one). The shard writer (formats/safetensors.py) and the loader's chunk reads
(loader/sources.py) share it."""

from __future__ import annotations

import fcntl
import os

from .chunk_digests import CHUNK_ALIGN

ALIGN = CHUNK_ALIGN  # O_DIRECT: buffer address, file offset and length in whole pages


def enable_direct(fd: int) -> bool:
    """Turn O_DIRECT on for ``fd`` where the filesystem takes it (False: it stays cached I/O);
    ``SHARDC_DIRECT_IO=0`` keeps it off. The writer (formats/safetensors.py) and the chunk
    reads share it."""
    if os.environ.get("SHARDC_DIRECT_IO", "1") == "0" or not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def disable_direct(fd: int) -> bool:
    """Back to cached I/O (a filesystem that took O_DIRECT at open and refuses it at a read or write)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def page_cached(fd: int, size: int, probes: int = 16) -> bool:
    """Whether the file looks resident in the page cache: one page at each of ``probes`` spread
    offsets read with ``RWF_NOWAIT`` (which fails rather than wait for the disk). False where the
    flag is missing."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or size <= 0:
        return False
    page = bytearray(ALIGN)
    for k in range(probes):
        offset = (size - 1) * k // max(1, probes - 1) // ALIGN * ALIGN
        try:
            if os.preadv(fd, [page], offset, flag) <= 0:
                return False
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the filesystem cannot say
            return False
    return True
