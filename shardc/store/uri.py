"""Storage URIs, and the factory that opens the backend a URI names.

Apart from :mod:`shardc.store.object_store` so that the backends, which import the records there, are
never imported back by it (no import cycle, not even a lazy one); boto3 loads only for ``s3://``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import StoreError
from .object_store import MANIFEST_NAME, S3Settings, Store

# --- URIs ---------------------------------------------------------------------------------------

_URI_HINT = "use a local path, file:///path or s3://bucket/prefix"


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(scheme, bucket, path)``: ("file", "", "/abs/or/rel") or ("s3", bucket, prefix).

    An S3 prefix with ``.`` or ``..`` segments is refused: S3 keeps them literally (keys named
    ``../x``), and tools that map keys to paths would write outside their directory.
    """
    if not isinstance(uri, str) or not uri:
        raise StoreError("empty storage URI", hint=_URI_HINT)
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
        prefix = prefix.strip("/")
        if any(part in (".", "..") for part in prefix.split("/")):
            raise StoreError(f"{uri!r} has '.' or '..' in its key prefix",
                             hint="S3 keys are not paths; write the prefix out, e.g. s3://bucket/models/x")
        return "s3", bucket, prefix
    raise StoreError(f"unknown storage scheme {scheme!r} in {uri!r}", hint=_URI_HINT)


def open_store(uri: str, *, endpoint_url: str | None = None,
               settings: S3Settings | None = None) -> Store:
    """The backend for ``uri``; boto3 is imported only for ``s3://``."""
    scheme, bucket, path = parse_uri(uri)
    if scheme == "s3":
        from .s3 import S3Store  # imports boto3 lazily itself

        return S3Store(bucket, path, endpoint_url=endpoint_url, settings=settings)
    from .local import LocalStore

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
