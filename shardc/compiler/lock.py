"""The build lock: one writer at a time per output directory (build, reshard, export).

An empty file, ``.shardc-build.lock``, held with ``flock`` for the whole run, so the kernel drops
it whatever kills the process. It is never truncated, and a link planted at its name is refused
rather than followed (``O_NOFOLLOW``): the lock file is only ever an empty file of ours.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import OutputError, ShardcError

LOCK = ".shardc-build.lock"


def take_lock(out: Path, *, busy: str, busy_hint: str, open_hint: str) -> int:
    """Hold ``out``'s build lock; returns the descriptor (closing it releases the lock). ``busy``
    is the error's message when another run holds it (exit 2, nothing touched)."""
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputError(f"cannot open the build lock {out / LOCK}: {exc.strerror}", hint=open_hint) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ShardcError(busy, hint=busy_hint) from None
    return fd
