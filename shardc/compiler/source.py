"""What the compiler asks of its input: the ``Source`` protocol, declared once.

Three kinds of input implement it, none by inheriting another's fields:

* ``CheckpointSource`` (compiler/checkpoint.py): a Hugging Face checkpoint, local or ``hf://``;
* ``BuildSource`` (compiler/build_tensors.py): an existing build, its tensors reassembled from its
  ranks (reshard, export, ``verify --deep``'s reference);
* ``QuantizedSource`` (compiler/quantized.py): either of those whose config.json declares a
  quantization (layout/quant_formats/), each quantized weight also readable dense.

The compiler (compile.py, materialize.py, stages.py, outputs.py) sees only this protocol, so a
new kind of input is a new class with these members, not a subclass with placeholders
(docs/architecture.md §8, "add a source").
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..formats.manifest import SourceRecord
from ..layout.model import ModelSpec
from ..layout.quant_formats import SourceQuantization
from .tiles import Tiles


@dataclass(frozen=True)
class TensorInfo:
    """One tensor a source holds: its file (empty for a build's reassembled tensor), dtype and
    shape, and where its bytes start in a safetensors file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None


class Source(Protocol):
    """An input of the compiler: named tensors, the config they belong to, and their identity."""

    uri: str  # as the plan (or the command line) wrote it: recorded in the manifest
    directory: Path  # where config.json and the tokenizer files are copied from

    # read-only to the compiler (a wrapper such as QuantizedSource passes its inner source's on)
    @property
    def config(self) -> dict[str, Any]:
        """The model's config.json."""
        ...

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor the source holds, by name."""
        ...

    @property
    def source_format(self) -> SourceQuantization | None:
        """A quantized source's format (None otherwise)."""
        ...

    @property
    def quantized_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """The [out, in] of each weight a quantized source stores quantized (empty otherwise)."""
        ...

    def check(self, model: ModelSpec, quantized: Source | None = None) -> None:
        """Refuse (SourceError) a source that is not ``model``'s before a byte is written.
        ``quantized``: the QuantizedSource wrapping this one, whose stored tensors count as known."""
        ...

    def guard(self) -> AbstractContextManager[None]:
        """Held while the build maps the source's bytes (a truncated file: an error, not SIGBUS)."""
        ...

    def view(self, name: str) -> np.ndarray | Tiles:
        """The tensor as stored, read-only (a mapped view where it can be; a reshard's input ranks
        side by side, where they are mapped: Tiles)."""
        ...

    def dense(self, name: str) -> np.ndarray | Tiles:
        """``view``, or a quantized weight dequantized by its format's reference."""
        ...

    def holds_quantized(self, name: str, scheme: str) -> bool:
        """Whether ``quantized`` hands this tensor over already quantized in ``scheme``."""
        ...

    def quantized(self, name: str, scheme: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """Quantized values, scales and error stats the source holds (see holds_quantized)."""
        ...

    def confirm(self) -> None:
        """Block until every byte read so far is known good (called before each commit)."""
        ...

    def start_hashing(self) -> None:
        """Begin computing the identity in the background."""
        ...

    def identity(self) -> SourceRecord:
        """What the manifest records as the source (uri, revision, file hashes or input build)."""
        ...

    def fingerprint(self) -> list[list]:
        """Cheap identity a resume record must match."""
        ...

