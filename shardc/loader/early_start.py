"""The loader's early start: a local rank's shard starts coming off the disk before the modules that
check it are imported.

Why: on a cold start the imports behind ``load_shard``'s checks (the plan schema, the model
families, the manifest reader, verify) and the manifest's validation take 70 ms, a seventh of the
whole load of a 1 GB shard on a fast disk, and the disk sits idle through them. So the facade
(shardc/__init__.py) calls ``start`` first: it picks the rank's entry out of the manifest's JSON
(formats/manifest_raw.py: decoded as the checked reader decodes it, no validation: nothing here is
trusted), opens the file as the loader would and queues the first chunks' reads into the host buffer (loader/sources.py ``HostReads``: the same reads, the same
digests), then the heavy modules are imported and the manifest is validated while those run.

Only a window is read before the manifest is checked (``WINDOW``, 256 MiB: 16 of the builds'
16 MiB chunks, one per read slot): the entry's size is a claim until the loader has held it
against the plan's Layout, and a forged entry (4 GiB claimed over a sparse file, every digest
forged) must not be read into memory by the claim. 256 MiB is what a 3.8 GB/s disk delivers in
the checks' 70 ms (session 13's fast disk read 2.7 GB/s), so a real load should lose little (not
re-measured: scripts/bench_loader.py would say); the rest is queued when the loader takes the
reads (``take``), after the entry matched. The buffer is
allocated at the claimed size (untouched address space, not memory: see ``HostReads``), and only
when the host could hold it at all.

Nothing is taken on trust: loader/local.py uses the reads only when the validated entry and the
rank's file name agree with what was started, field by field (file path, size, chunk size,
digest kind, every chunk digest); otherwise they are stopped and the file is read as usual. The
digests are compared, the header checked and the rest of the checks done exactly as without an
early start, and nothing is returned before they pass. Any surprise here (a manifest that is not
a plain file of JSON, an entry of the wrong shape, a missing or odd file) just means no early start:
the checked path then says what is wrong. CPU only (a GPU load goes through pinned staging).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import ShardcError
from ..formats.manifest_raw import rank_entry, read_unchecked
from .sources import FileChunkReads, HostReads

WINDOW = 256 << 20  # bytes read before the manifest is checked (above; a larger chunk: no early start)


class EarlyRead:
    """A rank's shard being read since ``start``: its path, its descriptor (owned here until
    ``take``n) and the reads under way."""

    def __init__(self, path: Path, fd: int, reads: HostReads) -> None:
        self.path, self.fd, self.reads = path, fd, reads
        self.source: FileChunkReads = reads.source  # type: ignore[assignment]

    def matches(self, path: Path, size: int, chunk_size: int | None, chunks: tuple[str, ...], digest: str) -> bool:
        """Whether these reads are the ones the validated entry asks for, field by field."""
        s = self.source
        return (self.fd >= 0 and path == self.path and size == s.size and chunk_size == s.chunk_size
                and digest == s.digest and tuple(chunks) == tuple(s.digests))

    def take(self) -> int:
        """The descriptor, now the caller's to close, once the checked entry ``matches``: the
        chunks held back until then are queued now (the reads stay under way on it)."""
        self.reads.more()
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        """Stop the reads (what is queued is dropped, what is in flight finishes) and close the
        descriptor unless it was taken."""
        if self.fd >= 0:
            self.reads.close()
            fd, self.fd = self.fd, -1
            os.close(fd)


def start(manifest: Any, directory: Any, tp_rank: Any, pp_stage: Any, dp_rank: Any, device: Any) -> EarlyRead | None:
    """The rank's chunk reads started, or None where there is nothing to start early (not a local
    manifest path, not the CPU, no chunk digests, anything unexpected)."""
    try:
        return _start(manifest, directory, tp_rank, pp_stage, dp_rank, device)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, MemoryError, ShardcError,
            RuntimeError):  # RecursionError; torch's failed allocation
        return None


def _start(manifest: Any, directory: Any, tp_rank: Any, pp_stage: Any, dp_rank: Any, device: Any) -> EarlyRead | None:
    if device != "cpu" or not all(type(x) is int for x in (tp_rank, pp_stage, dp_rank)):
        return None
    if not isinstance(manifest, (str, os.PathLike)) or not isinstance(directory, (str, os.PathLike, type(None))):
        return None
    text = os.fspath(manifest)
    if not isinstance(text, str) or text.startswith("s3://") or "\0" in text:
        return None
    path = Path(text.removeprefix("file://"))
    path = path / "manifest.json" if path.is_dir() else path
    found = rank_entry(read_unchecked(path), tp_rank, pp_stage, dp_rank)
    if found is None:
        return None
    name, size, chunk_size, chunks, digest = found
    if chunk_size > WINDOW or size > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        return None  # no window to read; a size no host holds (the checked path refuses it)
    file = (path.parent if directory is None else Path(directory)) / name  # as loader/local.py names it
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise ValueError("not the recorded file")
        reads = HostReads(FileChunkReads(fd, name, size, chunk_size, chunks, digest), WINDOW // chunk_size)
    except BaseException:
        os.close(fd)
        raise
    return EarlyRead(file, fd, reads)
