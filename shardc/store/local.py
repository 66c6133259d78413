"""The local backend of :mod:`shardc.store`: a directory (a plain path or ``file://``).

Writes are atomic like the build's own files: an exclusive partial or temp file next to the
target, fsync, rename. No recorded hashes: :meth:`LocalStore.head` computes
them when the caller is about to compare.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ShardcError, StoreError, VerifyMismatch
from ..formats.files import fsync_dir, sha256_file, write_atomic
from .codec import BLOCK, new_partial, remove_stale_partials, zstd_file_digests
from .object_store import GetItem, ObjectInfo, PutItem, Store


class LocalStore(Store):
    """A directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = str(root)

    def _path(self, name: str) -> Path:
        return self.root / name

    def head(self, name: str, *, digest: bool = False) -> ObjectInfo | None:
        p = self._path(name)
        if not p.is_file():
            return None
        size = p.stat().st_size
        if not digest:
            return ObjectInfo(size, None, {})
        if name.endswith(".zst"):
            meta = zstd_file_digests(p)
            return ObjectInfo(size, meta["sha256"], meta)
        sha = sha256_file(p)
        return ObjectInfo(size, sha, {"sha256": sha})

    def get_bytes(self, name: str, limit: int) -> bytes | None:
        p = self._path(name)
        try:
            if p.stat().st_size > limit:
                raise StoreError(f"{p} is {p.stat().st_size} bytes, too large for a manifest",
                                 hint="pass the manifest.json that shardc push wrote")
            return p.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StoreError(f"{p} is a directory", hint="pass the manifest file") from None
        except OSError as exc:
            raise StoreError(f"cannot read {p}: {exc.strerror}") from None

    def put_bytes(self, name: str, data: bytes, metadata: dict[str, str]) -> None:
        self._mkdir()
        write_atomic(self._path(name), data)

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def abort_incomplete(self, names: Iterable[str]) -> int:
        return sum(remove_stale_partials(self.root, n) for n in names)

    def _mkdir(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {self.root}: {exc.strerror}") from None

    def put_files(self, items: Iterable[PutItem], on_bytes: Callable[[int], None]) -> None:
        self._mkdir()
        for item in items:
            try:
                self._put_file(item, on_bytes)
            finally:
                item.cleanup()
        fsync_dir(self.root)

    def _put_file(self, item: PutItem, on_bytes: Callable[[int], None]) -> None:
        dst = self._path(item.name)
        tmp: Path | None = None
        try:
            with open(item.path, "rb") as src:
                tmp, out = new_partial(dst)
                with out:
                    _copy(src, out.write, on_bytes)
                    out.flush()
                    os.fsync(out.fileno())
            if item.verified is not None:
                item.verified.result()  # the object may not appear before its hash matched
            os.replace(tmp, dst)
        except BaseException as exc:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot write {dst}: {exc.strerror}") from None
            raise

    def get_files(self, items: list[GetItem], on_bytes: Callable[[int], None]) -> list[BaseException | None]:
        errors: list[BaseException | None] = []
        for item in items:
            try:
                with open(self._path(item.name), "rb") as src:
                    _copy(src, item.sink.write, on_bytes)
                errors.append(None)
            except FileNotFoundError:
                errors.append(VerifyMismatch(f"{item.name}: named by the manifest but missing from {self.uri}",
                                             hint="the store was changed after the push; push the build again"))
            except ShardcError as exc:
                errors.append(exc)
            except OSError as exc:
                errors.append(StoreError(f"cannot read {self._path(item.name)}: {exc.strerror}"))
        return errors


def _copy(src: BinaryIO, write: Callable[[bytes], Any], on_bytes: Callable[[int], None]) -> None:
    while chunk := src.read(BLOCK):
        write(chunk)
        on_bytes(len(chunk))
