"""Object storage: push a build to a store and pull (parts of) it back, verified.

``object_store`` (the Store interface and its records), ``uri`` (URIs and ``open_store``, the factory),
``local`` and ``s3`` (the backends), ``codec`` (zstd, hashing, verified sinks, partial files),
``push`` and ``pull`` (the protocol, described in ``transfer``).
"""

from .object_store import S3Settings, Store
from .pull import fetch_manifest, pull_build
from .push import push_build
from .uri import open_store, parse_uri, split_object_uri

__all__ = ["S3Settings", "Store", "fetch_manifest", "open_store", "parse_uri", "pull_build",
           "push_build", "split_object_uri"]
