"""Read leases on the source files while a build maps them (docs/architecture.md §6).

The build reads tensors through memory maps. If another process truncates a mapped file, the next
touch of a page past the new end is SIGBUS: Python cannot catch it, the process dies with exit 135
and no message, and its temp files stay. Checking the size before each mapping (``Source.view``)
narrows that window but cannot close it: a tensor may be copied for a second while it is cut.

A Linux read lease (``fcntl F_SETLEASE``) closes it: another process's truncate or open for
writing blocks until the lease holder lets go (or ``/proc/sys/fs/lease-break-time``, 45 s by
default, passes). The lease-break signal (SIGIO) is ignored; instead ``Source.view`` asks before
mapping each tensor whether its file's lease is being broken and raises a SourceError naming it.
An exception raised from a signal handler could land anywhere (inside a thread start, a writer's
constructor) and leave a writer thread reading a mapping after the leases are gone; checking at
that one point cannot. The build then cleans up while its mappings are still valid and releases
the leases on the way out, after which the other process proceeds. A build that has mapped its
last tensor finishes: what it read was read before the file changed. Where a lease is refused (a
file we do not own, one open for writing, NFS, a build off the main thread) the size check in
``Source.view`` is all there is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", None)


class Leases:
    """Read leases held on some files, by name."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def broken(self, name: str) -> bool:
        """Whether another process is waiting to truncate or write ``name``."""
        fd = self.fds.get(name)
        if fd is None or _F_GETLEASE is None:  # no lease taken (not Linux: none can be)
            return False
        try:
            return fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True


@contextlib.contextmanager
def read_leases(paths: list[Path]) -> Iterator[Leases]:
    """Hold a read lease on each path (where the kernel grants one) until the block exits."""
    leases = Leases()
    if _F_SETLEASE is None or threading.current_thread() is not threading.main_thread():
        yield leases
        return
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)  # its default action is to terminate
    if previous is None:  # installed outside Python: restore the default
        previous = signal.SIG_DFL
    try:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
            except OSError:
                os.close(fd)
                continue
            leases.fds[p.name] = fd
        yield leases
    finally:
        for fd in leases.fds.values():  # release first: SIGIO after the restore would kill us
            os.close(fd)
        leases.fds.clear()
        signal.signal(signal.SIGIO, previous)
