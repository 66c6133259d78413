"""What an S3 failure means to the person running shardc: boto3's, botocore's and s3transfer's
exceptions mapped to one ``StoreError`` line with a hint (no credentials, no bucket, access denied,
a server failing or stalling past its retries, a connection breaking off), every message passed
through ``redact`` so that credentials in an endpoint URL are never echoed. The S3 backend
(store/s3.py) routes every exception through ``translate``; botocore is imported only when one is
being translated.
"""

from __future__ import annotations

import re

from ..errors import ShardcError, StoreError
from .object_store import S3Settings

_CRED_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role "
    "provides them"
)
_RETRY_HINT = "the object store kept failing; check it and rerun (a rerun resumes), or raise SHARDC_S3_MAX_ATTEMPTS"
_STALL_HINT = ("if the store is only slow, raise SHARDC_S3_READ_TIMEOUT (per try) or "
               "SHARDC_S3_STALL_LIMIT (per request); otherwise check the endpoint")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']*@")


def redact(text: str) -> str:
    """``scheme://user:secret@host`` -> ``scheme://***@host``: no credentials in any message."""
    return _USERINFO.sub(r"\1***@", text)


def code_of(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError (``NoSuchKey``), or None."""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return str((resp.get("Error") or {}).get("Code") or "") or None
    return None


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError, or None."""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return None


def translate(exc: BaseException, what: str, *, bucket: str, endpoint: str,
              settings: S3Settings) -> ShardcError:
    """Map a boto3/botocore/s3transfer exception to a typed error with a hint, credentials redacted."""
    if isinstance(exc, ShardcError):
        return exc
    err = _translate(exc, what, bucket=bucket, endpoint=redact(endpoint), settings=settings)
    return StoreError(redact(err.message), hint=err.hint and redact(err.hint))


def _translate(exc: BaseException, what: str, *, bucket: str, endpoint: str,
               settings: S3Settings) -> ShardcError:
    from botocore import exceptions as bce

    attempts = settings.max_attempts
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return StoreError(f"{what}: no AWS credentials found", hint=_CRED_HINT)
    code, status = code_of(exc), status_of(exc)
    if code == "NoSuchBucket":
        return StoreError(f"{what}: bucket {bucket!r} does not exist at {endpoint}",
                          hint="create the bucket or fix the URI")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                "InvalidToken") or status == 403:
        return StoreError(f"{what}: access denied ({code or 'HTTP 403'})",
                          hint="check the credentials and the bucket policy")
    if isinstance(exc, bce.ClientError):
        msg = (exc.response.get("Error") or {}).get("Message") or ""
        if status is not None and (status >= 500 or code in ("Throttling", "SlowDown", "RequestTimeout")):
            detail = f": {msg}" if msg else ""
            return StoreError(f"{what}: HTTP {status} {code or ''} after {attempts} attempts{detail}",
                              hint=_RETRY_HINT)
        return StoreError(f"{what}: {code or status}: {msg}".rstrip(": "))
    # s3transfer (boto3's transfer manager) ships neither types nor stubs
    from s3transfer.exceptions import RetriesExceededError  # type: ignore[import-untyped]
    from urllib3.exceptions import ProtocolError

    if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError)):
        return StoreError(f"{what}: cannot reach {endpoint} after {attempts} attempts ({type(exc).__name__})",
                          hint="check the endpoint (`endpoint_url` / AWS_ENDPOINT_URL) and that the server is up")
    if isinstance(exc, bce.ReadTimeoutError):
        return StoreError(f"{what}: {endpoint} stopped answering (no reply within "
                          f"{settings.read_timeout:g} s per try, {settings.stall_limit:g} s per "
                          f"request at most)", hint=_STALL_HINT)
    if isinstance(exc, RetriesExceededError):
        exc = getattr(exc, "last_exception", None) or exc
    if isinstance(exc, (bce.HTTPClientError, ProtocolError, RetriesExceededError)):
        return StoreError(f"{what}: the connection to {endpoint} kept breaking off after {attempts} "
                          f"attempts ({type(exc).__name__})", hint=_RETRY_HINT)
    if isinstance(exc, bce.BotoCoreError):
        return StoreError(f"{what}: {type(exc).__name__}: {exc}", hint=_RETRY_HINT)
    if isinstance(exc, OSError):
        return StoreError(f"{what}: {exc.strerror or exc}")
    return StoreError(f"{what}: {type(exc).__name__}: {exc}")
