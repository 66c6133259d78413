"""The compiler: source checkpoint -> per-rank shard files (+ quantization) -> manifest.

``compile.build`` is the entry point; ``source`` reads checkpoints, ``materialize`` and ``stages``
produce the bytes, ``outputs`` writes the side files. Importing this package imports nothing heavy.
"""

from .. import lazy_seam

_SEAM = {
    "build": "compile", "BuildResult": "compile",
    "Source": "sources", "CheckpointSource": "source", "open_source": "source",
    "llama_config": "synthetic", "write_checkpoint": "synthetic",
}
__all__ = sorted(_SEAM)
__getattr__ = lazy_seam(__name__, _SEAM)
