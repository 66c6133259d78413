"""File formats shardc writes and reads: safetensors shards, the manifest, file helpers.

``safetensors`` owns the shard-file format (``ShardWriter``, ``read_header``, ``shard_metadata``),
``manifest`` the typed build record (read it with ``manifest.load(path)`` / ``manifest.loads(bytes)``,
write it with ``Manifest.save`` / ``dumps``), ``chunk_digests`` the chunk digests, ``files`` the hashing,
temp-file and atomic-write helpers every writer uses. No re-exports: callers import from the module
(where go-to-definition leads), and a command that only needs ``files.human_size`` does not load
the manifest's validators at start-up.
"""

__all__: list[str] = []
