"""The loader: everything ``shardc.load_shard`` does, local and from object storage (docs/architecture.md §1.3).

``local`` reads a local rank's shard (``load_shard``) and serves ``verify --device``
(``load_for_verify``); ``remote`` streams one from object storage through a store's ranged reads
(``load_remote``; the S3 side is store/ranged.py's, handed in by the facade). Both check the rank
first (``rank_checks``), then read through the one chunk engine: ``sources`` (where chunks come
from, how each is read and hashed), ``sinks`` (where checked chunks go: host, GPU, ``into=``, a
file), ``tensors`` (the tensors made of what was read). ``early_start`` starts a local CPU
load's reads before the checking modules are imported; ``upgrade`` gives a format_version 2 shard
(no chunk digests) its chunk digests on read; ``devices`` is which device a rank uses.

No re-exports: importing the package imports nothing (the early start's imports stay light).
"""

__all__: list[str] = []
