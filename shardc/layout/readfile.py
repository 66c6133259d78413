"""Reading small input files (plans, config.json, index files, manifests) without trusting them.

A path given by a user may name a FIFO (``open`` blocks forever), a device (``/dev/zero`` never
ends) or a file far larger than any real plan or config. Only a regular file up to ``limit``
bytes is read; anything else is one ShardcError naming the file. It lives in ``layout`` (the lowest
layer) because the plan and config readers are here; formats, build and verify use it too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import ShardcError

PLAN_LIMIT = 1 << 20  # a plan is a few hundred bytes
CONFIG_LIMIT = 16 << 20  # config.json / safetensors index: a 405B index is ~100 KiB
MANIFEST_LIMIT = 256 << 20  # a manifest file, local or fetched from a store (store/object_store.py)


def read_regular_file(
    path: str | Path, *, limit: int, what: str, error: type[ShardcError] = ShardcError,
    follow_links: bool = True,
) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes, else ``error``.

    The file is opened non-blocking so a FIFO is refused instead of waiting for a writer, and
    at most ``limit + 1`` bytes are read, so a file that grows while it is read stays bounded.
    ``follow_links=False``: a symlink at ``path`` is refused (a file shardc itself wrote there)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW))
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}", hint="check the path") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file", hint="pass the file itself, not a pipe or device")
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size} bytes, more than the limit of {limit}",
                        hint=f"a real {what} is far smaller; check the path")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise error(f"{what} {path} grew past the limit of {limit} bytes while being read")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}", hint="check the path") from None
    finally:
        os.close(fd)


def decode_text(data: bytes, path: str | Path, *, what: str, error: type[ShardcError] = ShardcError) -> str:
    """UTF-8 text of a file read above; a binary file is one error, not a UnicodeDecodeError."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start})",
                    hint=f"pass the {what} itself, not a binary file") from None
