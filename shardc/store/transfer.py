"""What push and pull share: the protocol, the store's form of a manifest, and the error boundary.

Push protocol (:mod:`shardc.store.push`; manifest last, so a reader that finds a manifest can
fetch everything it names):

1. objects already in the store with the right size and recorded sha256 are skipped (resume);
2. if anything must be (re)written and the store holds a different manifest under the same name,
   that manifest is deleted first: no reader may see it while its objects change;
3. every other file is uploaded, in parallel, with its sha256 as object metadata, while it is
   hashed against the local manifest; an object is only completed once its hash matched (a shard
   that rotted on disk is never published);
4. every object is checked to exist with the right size;
5. the manifest is written last.

With ``compress="zstd"`` shards are stored as ``<file>.zst`` and the manifest pushed to the store
gets, in each such shard entry, ``"compressed": {"codec": "zstd", "size": int, "sha256": hex,
"object": "<file>.zst"}`` next to the uncompressed size and sha256 (config.json and other small
files stay plain). The local build manifest is unchanged; pull strips the key again, so the pulled
``manifest.json`` is byte-identical to the build's.

Pull (:mod:`shardc.store.pull`): fetch the manifest, then only the requested shards plus the side
files. Each download is streamed into an exclusive partial file next to its destination, hashed
(and decompressed, checking both hashes) on the way, and renamed into place only when it matches;
files already present and matching are kept. The local manifest is written after the files, then
the ranks are verified like ``shardc verify`` does, reusing the digests taken while downloading.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import StoreError
from ..formats.manifest import FileEntry, Manifest, ShardEntry

T = TypeVar("T")


def entries(manifest: Manifest) -> list[tuple[str, FileEntry | ShardEntry]]:
    """(file name, manifest entry) for every file a build consists of, manifest aside: the side
    files first, then the shards (a ShardEntry)."""
    return [(f.name, f) for f in manifest.files] + [(s.file, s) for s in manifest.shards]


def strip_compressed(manifest: Manifest) -> Manifest:
    """The build's own manifest from the store's form (the ``compressed`` records removed)."""
    return dataclasses.replace(
        manifest,
        files=[dataclasses.replace(f, compressed=None) for f in manifest.files],
        shards=[dataclasses.replace(s, compressed=None) for s in manifest.shards])


def progress_bar(progress: bool, desc: str, total: int) -> Any:
    from ..progress import bar

    return bar(total, desc, enabled=progress)


def os_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """A full disk or a read-only directory is an environment problem: one line, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise StoreError(f"{where}{exc.strerror or exc}", hint="check free space and permissions") from None

    return wrapper
