"""The compiler: source checkpoint -> per-rank shard files (+ quantization) -> manifest.

``compile.build`` is the entry point; ``source`` declares what the compiler reads, ``checkpoint``
reads checkpoints, ``materialize`` and ``stages`` produce the bytes, ``outputs`` writes the side
files. No re-exports: the compiler's modules import
numpy at import time, and ``import shardc.compiler`` must stay free of it (a 16-bit build imports
neither numba nor torch, and ``shardc --help`` no numpy), so callers import from the module
(``from shardc.compiler.compile import build``), where go-to-definition leads.
"""

__all__: list[str] = []
