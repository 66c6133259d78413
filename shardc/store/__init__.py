"""Object storage: push a build to a store and pull (parts of) it back, verified.

``base`` (the Store interface, its records, ``open_store``), ``local`` and ``s3`` (the backends),
``codec`` (zstd, hashing, verified sinks, partial files), ``push`` / ``pull`` (the protocol,
described in ``transfer``).
"""

from .base import S3Settings, Store, open_store, parse_uri, split_object_uri
from .pull import fetch_manifest, pull_build
from .push import push_build

__all__ = ["S3Settings", "Store", "fetch_manifest", "open_store", "parse_uri", "pull_build",
           "push_build", "split_object_uri"]
