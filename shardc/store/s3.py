"""The S3 backend of :class:`shardc.store.object_store.Store` (boto3, imported only for ``s3://`` URIs).

Why it looks the way it does:

* Settings come from boto3's own chain (environment, profiles, ``AWS_ENDPOINT_URL``, instance
  roles); ``endpoint_url`` only overrides the endpoint. Nothing here reads, prints or logs a key.
* Every client call goes through botocore's retry modes (``standard`` by default: exponential
  backoff with jitter on throttling, 5xx and connection errors) with a bounded number of attempts
  and connect/read timeouts, so a dead or failing server ends as one clear ``StoreError`` after a
  bounded time instead of a hang.
* Transfers use boto3's classic transfer manager: parallel multipart uploads and ranged downloads.
  Uploads carry ``ChecksumAlgorithm=SHA256`` (the server checks every part) and the file's full
  sha256 as object metadata, which is what lets a re-push skip objects that are already correct.
  The transfer manager aborts its multipart upload when a transfer fails; uploads left behind by a
  killed process are swept by :meth:`S3Store.abort_incomplete` at the start of the next push.
* Downloads go to a seekable sink (:class:`shardc.store.codec.VerifiedSink`): ranged parts land at
  their offsets in a partial file, which is hashed (and decompressed) at commit.
* A server that accepts connections and never answers is bounded per request by
  ``S3Settings.stall_limit`` (a ``needs-retry`` hook that stops retrying timeouts), not only by
  ``max_attempts x read_timeout``.
* Credentials in an endpoint URL (``http://user:secret@host``) are never echoed: every message
  passes through :func:`shardc.store.s3_errors.redact` (s3_errors.py: what an S3 failure means,
  as one StoreError with a hint).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from ..errors import ShardcError, StoreError, VerifyMismatch
from .object_store import GetItem, ObjectInfo, PutItem, S3Settings, Store
from .s3_errors import code_of, redact, status_of, translate


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:  # pragma: no cover - depends on the environment
        raise StoreError("s3:// needs boto3", hint="pip install 'shardc[s3]'") from None
    return boto3


_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _session(boto3: Any) -> Any:
    """A fresh session (credentials and settings re-read from their sources every time) sharing
    one botocore data loader, so the S3 service model (a noticeable parse) is read once per process."""
    import botocore.session

    global _LOADER
    core = botocore.session.get_session()
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core)


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``."""

    def __init__(
        self, bucket: str, prefix: str, *, endpoint_url: str | None = None,
        settings: S3Settings | None = None,
    ) -> None:
        boto3 = _boto3()
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.settings = s = settings or S3Settings.from_env()
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        config = Config(
            # total_max_attempts counts the first try; botocore's "max_attempts" key counts only
            # the retries (one request more than SHARDC_S3_MAX_ATTEMPTS and the error messages say)
            retries={"mode": s.retry_mode, "total_max_attempts": s.max_attempts},
            connect_timeout=s.connect_timeout,
            read_timeout=s.read_timeout,
            max_pool_connections=s.max_concurrency + 4,
            user_agent_extra="shardc",
            # Every byte we download is checked against the manifest's sha256 as it streams in;
            # botocore re-hashing whole-object GETs (SHA-256 for our objects) would do it twice.
            response_checksum_validation="when_required",
        )
        try:
            session = _session(boto3)
            self.client = session.client("s3", endpoint_url=endpoint_url, config=config)
        except Exception as exc:  # bad profile, malformed endpoint URL, ...
            raise StoreError(redact(f"cannot set up the S3 client for {self.uri}: {exc}"),
                             hint="check `endpoint_url`, AWS_ENDPOINT_URL and AWS_PROFILE") from None
        self.endpoint = redact(self.client.meta.endpoint_url)
        self.client.meta.events.register_first("needs-retry.s3", self._stall_guard,
                                               unique_id="shardc-stall-limit")
        self.transfer_config = TransferConfig(
            multipart_threshold=s.multipart_threshold,
            multipart_chunksize=s.multipart_chunksize,
            max_concurrency=s.max_concurrency,
            num_download_attempts=s.max_attempts,
            preferred_transfer_client="classic",
        )

    # -- small helpers -------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _error(self, exc: BaseException, what: str) -> ShardcError:
        """One clear line for a botocore/s3transfer failure (never with credentials in it)."""
        return translate(exc, what, bucket=self.bucket, endpoint=self.endpoint, settings=self.settings)

    def _stall_guard(self, caught_exception: BaseException | None = None,
                     request_dict: dict[str, Any] | None = None, **_: Any) -> bool | None:
        """Runs before botocore's retry handler: after a timeout, no retry once another timed-out
        try would take the request past ``stall_limit`` (False ends the retries; None defers)."""
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

        s = self.settings
        if isinstance(caught_exception, ReadTimeoutError):
            wait = s.read_timeout
        elif isinstance(caught_exception, ConnectTimeoutError):
            wait = s.connect_timeout
        else:
            return None
        context = (request_dict or {}).setdefault("context", {})
        stalled = context["shardc_stalled"] = context.get("shardc_stalled", 0.0) + wait
        return False if stalled + wait > s.stall_limit else None

    # -- Store interface -----------------------------------------------------------------------
    def _head_object(self, name: str) -> dict[str, Any] | None:
        """HEAD of an object, None when it is missing; any other failure is one StoreError."""
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:
            if status_of(exc) == 404:
                return None
            raise self._error(exc, f"checking {self.object_uri(name)}") from None

    def head(self, name: str, *, digest: bool = False) -> ObjectInfo | None:
        r = self._head_object(name)
        if r is None:
            return None
        meta = {k.lower(): v for k, v in (r.get("Metadata") or {}).items()}
        return ObjectInfo(size=int(r["ContentLength"]), sha256=meta.get("sha256"), metadata=meta)

    def get_bytes(self, name: str, limit: int) -> bytes | None:
        """A small object (the manifest).

        botocore retries the request but not a body that breaks off halfway (nor the error body
        of a GET, e.g. the 404 of a first push); those are retried here, bounded the same way.
        """
        from botocore.exceptions import ResponseStreamingError
        from urllib3.exceptions import ProtocolError

        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                body = r["Body"]
                try:
                    if int(r.get("ContentLength") or 0) > limit:
                        raise StoreError(f"{self.object_uri(name)} is {r['ContentLength']} bytes, too "
                                         "large for a manifest",
                                         hint="pass the URI of the manifest.json that shardc push wrote")
                    return body.read()
                finally:
                    body.close()
            except ShardcError:
                raise
            except Exception as exc:
                if code_of(exc) in ("NoSuchKey", "404"):
                    return None
                if not isinstance(exc, (ResponseStreamingError, ProtocolError)) or attempt == self.settings.max_attempts:
                    raise self._error(exc, f"reading {self.object_uri(name)}") from None
                time.sleep(min(0.05 * 2**attempt, 5.0) * random.random())
        raise AssertionError("unreachable")  # pragma: no cover

    def version(self, name: str) -> tuple[int, str] | None:
        """(size, ETag) of an object (None when it is missing): what ``get_range`` pins."""
        r = self._head_object(name)
        return None if r is None else (int(r["ContentLength"]), str(r["ETag"]))

    def get_range(self, name: str, lo: int, hi: int, into: memoryview, etag: str) -> int:
        """Bytes [lo, hi) of an object straight into ``into`` (one ranged GET, no copy); the
        number of bytes read. ``IfMatch=etag``: an object replaced since ``version`` is a
        StoreError, never bytes of two objects. A body that breaks off is fetched again, bounded
        as ``get_bytes`` is."""
        from botocore.exceptions import ResponseStreamingError
        from urllib3.exceptions import ProtocolError

        uri = self.object_uri(name)
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={lo}-{hi - 1}",
                                           IfMatch=etag)
                body, got = r["Body"], 0
                try:
                    while got < hi - lo and (k := body.readinto(into[got : hi - lo])):
                        got += k
                finally:
                    body.close()
                return got
            except Exception as exc:
                if status_of(exc) == 412 or code_of(exc) == "PreconditionFailed":
                    raise StoreError(f"{uri} changed while it was read (its ETag is no longer {etag})",
                                     hint="it was pushed again meanwhile; load it again once the push has "
                                          "finished") from None
                if not isinstance(exc, (ResponseStreamingError, ProtocolError)) or attempt == self.settings.max_attempts:
                    raise self._error(exc, f"reading bytes {lo}..{hi} of {uri}") from None
                time.sleep(min(0.05 * 2**attempt, 5.0) * random.random())
        raise AssertionError("unreachable")  # pragma: no cover

    def put_bytes(self, name: str, data: bytes, metadata: dict[str, str]) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data,
                                   Metadata=metadata, ChecksumAlgorithm="SHA256",
                                   ContentType="application/json")
        except Exception as exc:
            raise self._error(exc, f"writing {self.object_uri(name)}") from None

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:
            raise self._error(exc, f"deleting {self.object_uri(name)}") from None

    def abort_incomplete(self, names: Iterable[str]) -> int:
        """Abort multipart uploads of our keys left behind by an earlier, killed push.

        Only keys this push is about to write are touched. Two pushes of the same build to the same
        place at the same time would abort each other's uploads; that fails loudly, never silently.
        """
        keys = {self.key(n) for n in names}
        aborted = 0
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key("")):
                for up in page.get("Uploads") or []:
                    if up["Key"] in keys:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"],
                                                           UploadId=up["UploadId"])
                        aborted += 1
        except Exception as exc:
            raise self._error(exc, f"listing incomplete uploads under {self.uri}") from None
        return aborted

    def put_files(self, items: Iterable[PutItem], on_bytes: Callable[[int], None]) -> None:
        """Upload in parallel. ``items`` is consumed lazily, so the caller can prepare the next file
        while earlier ones upload; at most ``max_files_in_flight`` are queued at once.

        An object appears in S3 only on PutObject / CompleteMultipartUpload. A botocore hook holds
        those calls until the item's ``verified`` future resolved (and fails them if it raised), so
        parts upload while the local file is still being hashed, yet nothing unverified completes.
        """
        from boto3.s3.transfer import create_transfer_manager

        gates: dict[str, Future[None]] = {}

        def gate(params: dict[str, Any], **_: Any) -> None:
            fut = gates.get(params.get("Key", ""))
            if fut is not None:
                fut.result()

        events = self.client.meta.events
        hooks = [(f"before-parameter-build.s3.{op}", f"shardc-verified-{op}")
                 for op in ("PutObject", "CompleteMultipartUpload")]
        for event, uid in hooks:
            events.register(event, gate, unique_id=uid)
        manager = create_transfer_manager(self.client, self.transfer_config)
        inflight: deque[tuple[PutItem, Future]] = deque()
        sub = _Progress(on_bytes)
        try:
            for item in items:
                while len(inflight) >= self.settings.max_files_in_flight:
                    self._finish_put(*inflight.popleft())
                if item.verified is not None:
                    gates[self.key(item.name)] = item.verified
                extra = {"ChecksumAlgorithm": "SHA256", "Metadata": dict(item.metadata),
                         "ContentType": item.content_type}
                fut = manager.upload(str(item.path), self.bucket, self.key(item.name),
                                     extra_args=extra, subscribers=[sub])
                inflight.append((item, fut))
            while inflight:
                self._finish_put(*inflight.popleft())
        except BaseException:
            _cancel(manager, [fut for _, fut in inflight])  # aborts open multipart uploads
            for item, _ in inflight:
                item.cleanup()
            raise
        finally:
            for event, uid in hooks:
                events.unregister(event, unique_id=uid)
        manager.shutdown()

    def _finish_put(self, item: PutItem, fut: Future) -> None:
        try:
            fut.result()
        except ShardcError:
            raise
        except Exception as exc:
            if item.verified is not None and item.verified.done() and item.verified.exception():
                raise item.verified.exception() from None  # type: ignore[misc]
            raise self._error(exc, f"uploading {item.name} to {self.uri}") from None
        finally:
            item.cleanup()

    def get_files(
        self, items: list[GetItem], on_bytes: Callable[[int], None]
    ) -> list[BaseException | None]:
        """Download each item into its sink (parts in parallel). Returns one error (or None) per item."""
        from boto3.s3.transfer import create_transfer_manager

        manager = create_transfer_manager(self.client, self.transfer_config)
        sub = _Progress(on_bytes)
        errors: list[BaseException | None] = []
        fut = None
        try:
            for item in items:
                # One file at a time, each with full part concurrency (parts land at their offsets
                # in a seekable sink): bounded memory, and a shard completes (and is verified and
                # renamed) as early as possible.
                fut = manager.download(self.bucket, self.key(item.name), item.sink, subscribers=[sub])
                try:
                    fut.result()
                    errors.append(None)
                except ShardcError as exc:  # raised by our sink (too many bytes, bad zstd stream)
                    errors.append(exc)
                except Exception as exc:
                    if status_of(exc) == 404:
                        errors.append(VerifyMismatch(
                            f"{item.name}: named by the manifest but missing from {self.uri}",
                            hint="the store was changed after the push; push the build again"))
                    else:
                        errors.append(self._error(exc, f"downloading {self.object_uri(item.name)}"))
        except BaseException:
            _cancel(manager, [fut] if fut is not None else [])
            raise
        manager.shutdown()
        return errors


def _cancel(manager: Any, futures: list[Any]) -> None:
    """Cancel the transfers in flight and wait until they wound down (failed multipart uploads
    are aborted on the way). Not ``manager.shutdown(cancel=True, ...)``: s3transfer 0.19 passes
    those arguments on shifted (the message lands in ``exc_type``), so it raised
    ``TypeError: 'str' object is not callable`` instead of letting the first error through."""
    for fut in futures:
        fut.cancel()
    manager.shutdown()


class _Progress:
    """s3transfer subscriber feeding a byte counter (retries report negative progress)."""

    def __init__(self, on_bytes: Callable[[int], None]) -> None:
        self.on_bytes = on_bytes
        self.lock = threading.Lock()

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        pass

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        with self.lock:
            self.on_bytes(bytes_transferred)

    def on_done(self, future: Any, **kwargs: Any) -> None:
        pass
