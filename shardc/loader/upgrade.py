"""Format_version 2 shards (manifests without chunk digests) upgraded on read: one pass over the
open shard works out its chunk digests (sha256, ``CHUNK_SIZE`` chunks, what a build records) in
memory and, in the same pass, the whole file's sha256, which is checked against the manifest's.
The shard is then read and checked by the one chunk engine (loader/sinks.py) against those
digests, as a format_version 3 shard is: there is no second engine for older manifests.

Why the digests are as good as recorded ones: they are the digests of the bytes whose whole-file
sha256 matched the manifest, read through the same descriptor as the load. A chunk that differs
on the load's read changed between the two reads: the load says the file changed while it was read
(``ChunkReads.derived``). Costs a second read of a version 2 shard (the first is one core's
sha256 chain, as before); rebuilding writes a version 3 manifest and needs none.
"""

from __future__ import annotations

import hashlib
import os

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import VerifyMismatch
from ..formats.chunk_digests import CHUNK_SIZE, ChunkHasher
from ..formats.chunk_digests import pread_full as read_piece  # a name the fault tests hook

PIECE = 1 << 20  # bytes per read and hash step (stays in the CPU's cache between the two)


def digest_pass(fd: int, size: int, where: str) -> tuple[str, tuple[str, ...]]:
    """(whole-file sha256, chunk digests) of the ``size`` bytes of the open shard ``fd``, in one
    read. A file that is not ``size`` bytes by the end of it (shorter, or with bytes after them)
    raises, naming it as ``where``."""
    whole, chunks = hashlib.sha256(), ChunkHasher(CHUNK_SIZE, DEFAULT_CHUNK_DIGEST)
    buf = memoryview(bytearray(min(PIECE, max(size, 1))))
    pos = 0
    while pos < size:
        k = read_piece(fd, buf[: min(len(buf), size - pos)], pos)
        piece = buf[:k]
        whole.update(piece)
        chunks.update(piece)
        pos += k
        if k < min(len(buf), size - pos + k):
            break
    # cut short, or longer than it was (one byte more to read: a size its fstat may not show, procfs)
    if pos != size or os.fstat(fd).st_size != size or read_piece(fd, memoryview(bytearray(1)), size):
        raise VerifyMismatch(f"{where}: file changed size while it was read", hint="is something rewriting it?")
    return whole.hexdigest(), tuple(chunks.finish())
