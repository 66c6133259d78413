"""Object storage: the narrow interface push and pull need, and its records.

Stores are named by URI (:mod:`shardc.store.uri`, whose ``open_store`` is the factory): a plain
path or ``file://`` (the default; no services needed; :mod:`shardc.store.local`) or
``s3://bucket/prefix`` (boto3, imported only then; :mod:`shardc.store.s3`). Both sit behind
:class:`Store`, so the push/pull protocol (:mod:`shardc.store.push`, :mod:`shardc.store.pull`)
holds the rules and the backends hold the I/O (docs/architecture.md §2, §6). The backends import this module, never the
reverse.

Object metadata (S3 ``x-amz-meta-*``): ``sha256`` of the stored bytes; for ``.zst`` objects also
``codec``, ``content-size`` and ``content-sha256`` of the uncompressed file.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..layout.readfile import MANIFEST_LIMIT

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = MANIFEST_LIMIT  # the bound a local manifest has too: one number, one home
MiB = 1 << 20


def env_flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """Knobs of the S3 backend (retries, timeouts, multipart, parallelism). Environment variables
    override the defaults, so a subprocess (CI, tests) can be tuned without code:
    SHARDC_S3_MAX_ATTEMPTS (wins over boto's AWS_MAX_ATTEMPTS), SHARDC_S3_RETRY_MODE (or
    AWS_RETRY_MODE), SHARDC_S3_CONNECT_TIMEOUT, SHARDC_S3_READ_TIMEOUT, SHARDC_S3_STALL_LIMIT,
    SHARDC_MULTIPART_THRESHOLD, SHARDC_MULTIPART_CHUNKSIZE, SHARDC_S3_CONCURRENCY.

    A server that accepts connections and never answers costs one ``read_timeout`` per try; with
    6 tries with backoff that was 422 s per request. ``stall_limit`` bounds the sum: after a timeout
    a request is retried only if one more timed-out try would stay within it (2 tries, ~2 minutes,
    with the defaults). Errors that come back at once (5xx, resets) are bounded by ``max_attempts``.
    """

    max_attempts: int = 6  # total tries per request (botocore counts the first one)
    retry_mode: str = "standard"  # botocore: standard | adaptive (client-side rate limiting)
    connect_timeout: float = 10.0
    read_timeout: float = 60.0  # per try: no byte for this long is a timeout (botocore's default)
    stall_limit: float = 120.0  # per request: seconds spent in timed-out tries before giving up
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 64 * MiB  # S3 allows 10,000 parts: 625 GiB per file at 64 MiB
    max_concurrency: int = 10
    max_files_in_flight: int = 4  # bounds the look-ahead of hashing/compressing during a push

    @classmethod
    def from_env(cls, **overrides: Any) -> S3Settings:
        env = os.environ
        values: dict[str, Any] = {}
        for field, var, conv in (
            ("max_attempts", "AWS_MAX_ATTEMPTS", int),  # boto's own variable, then ours
            ("max_attempts", "SHARDC_S3_MAX_ATTEMPTS", int),
            ("connect_timeout", "SHARDC_S3_CONNECT_TIMEOUT", float),
            ("read_timeout", "SHARDC_S3_READ_TIMEOUT", float),
            ("stall_limit", "SHARDC_S3_STALL_LIMIT", float),
            ("multipart_threshold", "SHARDC_MULTIPART_THRESHOLD", int),
            ("multipart_chunksize", "SHARDC_MULTIPART_CHUNKSIZE", int),
            ("max_concurrency", "SHARDC_S3_CONCURRENCY", int),
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
        for field in ("connect_timeout", "read_timeout", "stall_limit"):
            if not values.get(field, 1) > 0:
                raise StoreError(f"the S3 {field.replace('_', ' ')} must be a positive number of seconds")
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
    sink: Any  # seekable file-like: write/seek/tell (a codec.VerifiedSink)


class Store(abc.ABC):
    """The narrow storage interface push and pull need. Names are plain file names under the
    store's root (validated by formats.files.safe_name before they get here)."""

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
