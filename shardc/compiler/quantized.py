"""A quantized source's tensors checked against its format before a byte is written: every
stored tensor of every quantized weight present, in a dtype the format stores it in, with the
shape the weight and the format's grid imply (a scale grid that does not match the weight and its
block size is one line naming both, never a misread)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SourceError
from ..formats.manifest import SourceRecord
from ..layout.model import ModelSpec
from ..layout.quant_formats import SourceQuantization, detect_source
from ..layout.ranks import Layout
from ..layout.tensors import source_tensors
from .source import Source, TensorInfo
from .tiles import Tiles


class QuantizedSource:
    """A source whose config.json declares a quantization (layout/quant_formats/): the inner
    source's tensors as stored, plus each quantized weight dense (``dense``: dequantized by the
    format's reference). Everything else is the inner source's; a ``Source`` (compiler/source.py)."""

    def __init__(self, inner: Source, source_format: SourceQuantization, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.inner, self.source_format, self.quantized_shapes = inner, source_format, shapes
        # every stored tensor of a quantized weight, by name: its values are checked where read
        self._stored = {st.tensor(name): st for name in shapes for st in source_format.stored(name) if not st.value}

    @property
    def uri(self) -> str:
        return self.inner.uri

    @uri.setter
    def uri(self, value: str) -> None:
        self.inner.uri = value

    @property
    def directory(self) -> Path:
        return self.inner.directory

    @directory.setter
    def directory(self, value: Path) -> None:
        self.inner.directory = value

    @property
    def config(self) -> dict[str, Any]:
        return self.inner.config

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        return self.inner.tensors

    def check(self, model: ModelSpec, quantized: Source | None = None) -> None:
        """The inner source's check, with this format's stored tensors checked and known."""
        self.inner.check(model, quantized=self)

    @contextmanager
    def guard(self) -> Iterator[None]:
        with self.inner.guard():
            yield

    def view(self, name: str) -> np.ndarray | Tiles:
        """The inner source's tensor, a stored tensor of a quantized weight checked by its format
        (a build's own tiles were checked when it was built)."""
        out = self.inner.view(name)
        st = self._stored.get(name)
        if st is not None and isinstance(out, np.ndarray):
            self.source_format.check_values(name, st, out)
        return out

    def dense(self, name: str) -> np.ndarray | Tiles:
        """``view``, or a quantized weight's float32 dequantization by its format's reference."""
        if name not in self.quantized_shapes:
            return self.inner.dense(name)
        # the format's reference reads arrays (np.asarray: the same object for one; Tiles put together)
        return self.source_format.dequantize(name, self.quantized_shapes[name], lambda n: np.asarray(self.inner.view(n)))

    def holds_quantized(self, name: str, scheme: str) -> bool:
        return self.inner.holds_quantized(name, scheme)

    def quantized(self, name: str, scheme: str) -> tuple[np.ndarray, np.ndarray, dict]:
        return self.inner.quantized(name, scheme)

    def confirm(self) -> None:
        self.inner.confirm()

    def start_hashing(self) -> None:
        self.inner.start_hashing()

    def identity(self) -> SourceRecord:
        return self.inner.identity()

    def fingerprint(self) -> list[list]:
        return self.inner.fingerprint()


def quantization_of(config: dict[str, Any], model: ModelSpec) -> tuple[SourceQuantization, dict[str, tuple[int, ...]]] | None:
    """A config.json's source quantization (layout/quant_formats/) and the [out, in] of each weight
    it quantizes; None for a 16-bit source. A config that quantizes none of the family's weights,
    or whose parameters do not fit their shapes (a group longer than a row), is refused here,
    before any tensor is read."""
    source_format = detect_source(config)
    if source_format is None:
        return None
    names = source_format.applied(model)
    shapes = {t.name: t.shape for t in source_tensors(model) if t.name in names}
    source_format.check_shapes(shapes)
    return source_format, shapes


def with_quantization(src: Source, model: ModelSpec) -> Source:
    """``src`` as a QuantizedSource when its config.json declares a quantization, else itself."""
    q = quantization_of(src.config, model)
    return src if q is None else QuantizedSource(src, *q)


def check_stored(src: Source, model: ModelSpec, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Check a quantized source's (a QuantizedSource's) weights; return ``expected`` with their
    stored tensors added (so the caller's unknown-tensor check accepts them)."""
    source_format = src.source_format
    if source_format is None:
        return expected
    out = dict(expected)
    for name in sorted(src.quantized_shapes):
        full = expected[name]
        for st in source_format.stored(name):
            tname = st.tensor(name)
            info = src.tensors.get(tname)
            want = st.shape(full)
            if info is None:
                kept = src.tensors.get(name)
                hint = (f"the {source_format.label} config says it is quantized; list it in the config's "
                        "modules_to_not_convert / ignore if the checkpoint keeps it in 16 bits"
                        if kept is not None and kept.dtype in ("F16", "BF16", "F32")
                        else "download the complete checkpoint")
                raise SourceError(f"tensor {tname!r} is missing from the checkpoint at {src.uri} "
                                  f"({source_format.label})", hint=hint)
            if info.dtype not in st.dtypes:
                raise SourceError(f"tensor {tname!r} has dtype {info.dtype}; {source_format.label} stores it as "
                                  f"{' or '.join(st.dtypes)}", hint="the checkpoint does not match its quantization_config")
            if info.shape != want:
                raise SourceError(f"tensor {tname!r} has shape {list(info.shape)}, but weight {name} "
                                  f"{list(full)} with {source_format.label} implies {list(want)}",
                                  hint="the checkpoint does not match its quantization_config (weight_block_size?)")
            if st.value and np.asarray(src.view(tname)).tolist() != list(full):  # X.weight_shape: what unpacking reads
                raise SourceError(f"tensor {tname!r} holds {np.asarray(src.view(tname)).tolist()}, but weight {name} is "
                                  f"{list(full)}", hint="the checkpoint does not match its config.json")
            out[tname] = want
    for name in expected:  # a weight the table keeps 16-bit, stored quantized (a quantized lm_head)
        stored = [st.tensor(name) for st in source_format.stored(name) if st.suffix and st.tensor(name) in src.tensors]
        if name not in src.quantized_shapes and stored:
            raise SourceError(f"tensor {name!r} is stored quantized ({stored[0]}), but shardc reads {source_format.label} "
                              "quantization only for the decoder's linear projections",
                              hint="use a checkpoint that keeps it in 16 bits (list it in the config's ignore)")
    out |= {name: info.shape for name, info in src.tensors.items()  # KV-cache scales: not weights
            if source_format.unbuilt(name) and info.dtype == "F32" and math.prod(info.shape) == 1}
    for name, info in src.tensors.items():  # a 16-bit weight the config says nothing about
        if name in expected and name not in src.quantized_shapes and info.dtype not in ("F16", "BF16", "F32"):
            raise SourceError(f"tensor {name!r} is stored as {info.dtype}, but shardc reads {source_format.label} "
                              "quantization only for the decoder's linear projections",
                              hint="start from the unquantized checkpoint")
    return out


# casts that keep every value: a dtype: source build may widen a stored tensor, never narrow it
_EXACT = {("BF16", "F32"), ("F16", "F32")}


def check_kept(src: Source, layout: Layout) -> None:
    """A ``dtype: source`` build copies the stored tensors in the dtypes the Layout derives from
    config.json; a source holding one in a dtype that would not convert exactly is refused."""
    if layout.plan.dtype != "source" or src.source_format is None:
        return
    for rank_layout in layout.ranks:
        for t in rank_layout.tensors:
            info = src.tensors.get(t.source)
            if t.value is None and info is not None and info.dtype != t.dtype and (info.dtype, t.dtype) not in _EXACT:
                raise SourceError(f"tensor {t.source!r} is {info.dtype}, but {src.source_format.label} per its "
                                  f"config.json stores it as {t.dtype}; dtype: source would not copy it exactly",
                                  key="replica_group.dtype",
                                  hint="declare the scale dtype in config.json (weights.scale_dtype), or "
                                       "build with dtype: bf16 (dequantized)")
