"""Object storage: a narrow interface over where builds live, and the local backend.

Stores are named by URI: a plain path or ``file://`` (the default; no services needed) or
``s3://bucket/prefix`` (boto3, imported only then; see :mod:`shardc.store.s3`). Both sit behind
the small :class:`Store` interface, so the push/pull protocol (:mod:`shardc.store.transfer`)
holds the rules and the backends hold the I/O (docs/architecture.md §2, §6).

Object metadata (S3 ``x-amz-meta-*``): ``sha256`` of the stored bytes; for ``.zst`` objects also
``codec``, ``content-size`` and ``content-sha256`` of the uncompressed file.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

from ..build.source import sha256_file
from ..errors import ShardcError, StoreError, VerifyMismatch
from ..formats.manifest import fsync_dir, write_atomic

MANIFEST_NAME = "manifest.json"
CODECS = ("zstd",)
# zstd saves little on weights (random-like mantissas do not compress) and runs slower per core
# than a datacenter link to S3, so it is off unless asked for; level 1 compresses weights as well
# as 3, faster. Figures: docs/performance.md §2 (scripts/bench_store.py --zstd).
DEFAULT_COMPRESS: str | None = None
ZSTD_LEVEL = 1
MAX_MANIFEST_BYTES = 256 << 20
BLOCK = 16 << 20
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferSettings:
    """Knobs of the S3 backend. Environment variables override the defaults, so a subprocess (CI,
    tests) can be tuned without code: SHARDC_S3_MAX_ATTEMPTS, SHARDC_S3_RETRY_MODE (or boto's
    AWS_RETRY_MODE; SHARDC_S3_MAX_ATTEMPTS wins over AWS_MAX_ATTEMPTS), SHARDC_S3_CONNECT_TIMEOUT, SHARDC_S3_READ_TIMEOUT, SHARDC_MULTIPART_THRESHOLD,
    SHARDC_MULTIPART_CHUNKSIZE, SHARDC_S3_CONCURRENCY, SHARDC_FSYNC_DOWNLOADS."""

    max_attempts: int = 6  # total tries per request (botocore counts the first one)
    retry_mode: str = "standard"  # botocore: standard | adaptive (client-side rate limiting)
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 64 * MiB  # S3 allows 10,000 parts: 625 GiB per file at 64 MiB
    max_concurrency: int = 10
    max_files_in_flight: int = 4  # bounds the look-ahead of hashing/compressing during a push
    # Pulled files are renamed into place only after their sha256 matched, and every later pull
    # and verify re-hashes them: a file torn by a power loss is caught and fetched again, never
    # used. So pull skips the fsync by default (it costs about half of pull's throughput;
    # docs/performance.md §2); SHARDC_FSYNC_DOWNLOADS=1 turns it on.
    fsync_downloads: bool = False

    @classmethod
    def from_env(cls, **overrides: Any) -> TransferSettings:
        env = os.environ
        values: dict[str, Any] = {}
        for field, var, conv in (
            ("max_attempts", "AWS_MAX_ATTEMPTS", int),  # boto's own variable, then ours
            ("max_attempts", "SHARDC_S3_MAX_ATTEMPTS", int),
            ("connect_timeout", "SHARDC_S3_CONNECT_TIMEOUT", float),
            ("read_timeout", "SHARDC_S3_READ_TIMEOUT", float),
            ("multipart_threshold", "SHARDC_MULTIPART_THRESHOLD", int),
            ("multipart_chunksize", "SHARDC_MULTIPART_CHUNKSIZE", int),
            ("max_concurrency", "SHARDC_S3_CONCURRENCY", int),
            ("fsync_downloads", "SHARDC_FSYNC_DOWNLOADS", lambda v: v.lower() in ("1", "true", "yes")),
        ):
            if env.get(var):
                try:
                    values[field] = conv(env[var])
                except ValueError:
                    raise StoreError(f"{var}={env[var]!r} is not a number") from None
        mode = env.get("SHARDC_S3_RETRY_MODE") or env.get("AWS_RETRY_MODE")
        if mode:
            if mode not in ("standard", "adaptive", "legacy"):
                raise StoreError(f"retry mode {mode!r} is unknown", hint="use standard or adaptive")
            values["retry_mode"] = mode
        values.update(overrides)
        if values.get("max_attempts", 1) < 1:
            raise StoreError("the number of S3 attempts must be at least 1")
        return cls(**values)


@dataclasses.dataclass
class ObjectInfo:
    size: int
    sha256: str | None  # sha256 of the stored bytes, as recorded (S3 metadata) or computed (local)
    metadata: dict[str, str]


@dataclasses.dataclass
class PutItem:
    """One file to upload. ``verified`` (if set) resolves once the local bytes are known to match
    the manifest, or raises: backends must not let the object appear before it resolves."""

    name: str
    path: Path
    size: int
    metadata: dict[str, str]
    content_type: str = "application/octet-stream"
    cleanup: Callable[[], None] = lambda: None
    verified: Future[None] | None = None


@dataclasses.dataclass
class GetItem:
    name: str
    sink: Any  # write(bytes); seekable() -> False


class Store(abc.ABC):
    """The narrow storage interface push and pull need. Names are plain file names under the
    store's root (validated by manifest.safe_name before they get here)."""

    uri: str

    def object_uri(self, name: str) -> str:
        return f"{self.uri.rstrip('/')}/{name}"

    @abc.abstractmethod
    def head(self, name: str, *, digest: bool = False) -> ObjectInfo | None:
        """Size and recorded metadata; None if absent. ``digest``: the caller will compare the
        sha256, so a backend without recorded hashes computes them."""

    @abc.abstractmethod
    def get_bytes(self, name: str, limit: int) -> bytes | None: ...

    @abc.abstractmethod
    def put_bytes(self, name: str, data: bytes, metadata: dict[str, str]) -> None: ...

    @abc.abstractmethod
    def delete(self, name: str) -> None: ...

    @abc.abstractmethod
    def abort_incomplete(self, names: Iterable[str]) -> int:
        """Clean up partial uploads of these names left by a killed writer; returns how many."""

    @abc.abstractmethod
    def put_files(self, items: Iterable[PutItem], on_bytes: Callable[[int], None]) -> None: ...

    @abc.abstractmethod
    def get_files(self, items: list[GetItem], on_bytes: Callable[[int], None]) -> list[BaseException | None]: ...


# --- URIs ---------------------------------------------------------------------------------------

def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(scheme, bucket, path)``: ("file", "", "/abs/or/rel") or ("s3", bucket, prefix)."""
    if not isinstance(uri, str) or not uri:
        raise StoreError("empty storage URI", hint="use a local path, file:///path or s3://bucket/prefix")
    if "://" not in uri:
        return "file", "", uri
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        host, sep, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise StoreError(f"file URI {uri!r} names a host", hint="use file:///absolute/path")
        return "file", "", "/" + path if sep else "/"
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StoreError(f"{uri!r} has no bucket", hint="use s3://bucket/prefix")
        return "s3", bucket, prefix.strip("/")
    raise StoreError(f"unknown storage scheme {scheme!r} in {uri!r}",
                     hint="use a local path, file:///path or s3://bucket/prefix")


def open_store(uri: str, *, endpoint_url: str | None = None,
               settings: TransferSettings | None = None) -> Store:
    scheme, bucket, path = parse_uri(uri)
    if scheme == "s3":
        from .s3 import S3Store

        return S3Store(bucket, path, endpoint_url=endpoint_url, settings=settings)
    return LocalStore(Path(path))


def split_object_uri(uri: str) -> tuple[str, str]:
    """``.../dir/name.json`` -> (``.../dir``, ``name.json``). A trailing ``/``, a bare bucket or a
    local directory means ``manifest.json`` inside it."""
    scheme, bucket, path = parse_uri(uri)
    if uri.endswith("/") or (scheme == "file" and Path(path).is_dir()) or (scheme == "s3" and not path):
        return uri.rstrip("/") or "/", MANIFEST_NAME
    if scheme == "s3":
        root, _, name = path.rpartition("/")
        return f"s3://{bucket}" + (f"/{root}" if root else ""), name
    p = Path(path)
    return str(p.parent), p.name


# --- local backend ------------------------------------------------------------------------------

class LocalStore(Store):
    """A directory. Writes are atomic (temp + fsync + rename), like the build's own files."""

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
                dst = self._path(item.name)
                tmp = partial_name(dst)
                try:
                    with open(item.path, "rb") as src, open(tmp, "wb") as out:
                        _copy(src, out.write, on_bytes)
                        out.flush()
                        os.fsync(out.fileno())
                    if item.verified is not None:
                        item.verified.result()
                    os.replace(tmp, dst)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
                    raise StoreError(f"cannot write {dst}: {exc.strerror}") from None
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
            finally:
                item.cleanup()
        fsync_dir(self.root)

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


def zstd_module() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - depends on the environment
        raise StoreError("zstd compression needs the zstandard package",
                         hint="pip install 'shardc[zstd]'") from None
    return zstandard


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


def partial_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial-{os.getpid()}")


def remove_stale_partials(directory: Path, name: str) -> int:
    """Temp files of killed processes (their pid is gone) are removed; live ones are left alone."""
    n = 0
    for p in directory.glob(f".{name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1].removesuffix(".zst")
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
