"""File formats shardc writes and reads: safetensors shards, the manifest, file helpers."""
