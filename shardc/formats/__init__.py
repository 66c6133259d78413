"""File formats shardc writes and reads: safetensors shards, the manifest, file helpers.

``safetensors`` owns the shard-file format, ``manifest`` the typed build record (read it with
``manifest.load(path)`` / ``manifest.loads(bytes)``, write it with ``Manifest.save`` / ``dumps``),
``files`` the hashing, temp-file and atomic-write helpers every writer uses.
"""

from .. import lazy_seam

_SEAM = {
    "ShardWriter": "safetensors", "read_header": "safetensors", "shard_metadata": "safetensors",
    "Manifest": "manifest", "ShardEntry": "manifest", "FileEntry": "manifest",
    "sha256_file": "files", "write_atomic": "files", "create_temp": "files", "safe_name": "files",
    "human_size": "files",
}
__all__ = sorted(_SEAM)
__getattr__ = lazy_seam(__name__, _SEAM)
