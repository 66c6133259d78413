"""A quantized source's tensors checked against its format before a byte is written: every
stored tensor of every quantized weight present, in a dtype the format stores it in, with the
shape the weight and the format's grid imply (a scale grid that does not match the weight and its
block size is one line naming both, never a misread)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SourceError
from ..layout.model import ModelSpec
from ..layout.sourcequant import detect_source
from ..layout.tensors import source_tensors

if TYPE_CHECKING:
    from ..layout.ranks import Layout
    from .source import Source


def read_quantization(src: Source, model: ModelSpec) -> bool:
    """Read the source's quantization_config (layout/sourcequant/) into ``src.squant`` and
    ``src.squant_shapes``; whether it is quantized."""
    src.squant = detect_source(src.config)
    if src.squant is not None:
        names = src.squant.quantized(model)
        src.squant_shapes = {t.name: t.shape for t in source_tensors(model) if t.name in names}
    return src.squant is not None


def check_stored(src: Source, model: ModelSpec, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Check a quantized source's weights; return ``expected`` with their stored tensors added (so
    the caller's unknown-tensor check accepts them). A 16-bit source: ``expected`` as it is."""
    if not read_quantization(src, model):
        return expected
    sq = src.squant
    assert sq is not None
    out = dict(expected)
    for name in sorted(src.squant_shapes):
        full = expected[name]
        for st in sq.stored(name):
            tname = name + st.suffix
            info = src.tensors.get(tname)
            want = st.shape(full)
            if info is None:
                kept = src.tensors.get(name)
                hint = (f"the {sq.label} config says it is quantized; list it in the config's "
                        "modules_to_not_convert / ignore if the checkpoint keeps it in 16 bits"
                        if kept is not None and kept.dtype in ("F16", "BF16", "F32")
                        else "download the complete checkpoint")
                raise SourceError(f"tensor {tname!r} is missing from the checkpoint at {src.uri} "
                                  f"({sq.label})", hint=hint)
            if info.dtype not in st.dtypes:
                raise SourceError(f"tensor {tname!r} has dtype {info.dtype}; {sq.label} stores it as "
                                  f"{' or '.join(st.dtypes)}", hint="the checkpoint does not match its quantization_config")
            if info.shape != want:
                raise SourceError(f"tensor {tname!r} has shape {list(info.shape)}, but weight {name} "
                                  f"{list(full)} with {sq.label} implies {list(want)}",
                                  hint="the checkpoint does not match its quantization_config (weight_block_size?)")
            if st.value and src.view(tname).tolist() != list(full):  # X.weight_shape: what unpacking reads
                raise SourceError(f"tensor {tname!r} holds {src.view(tname).tolist()}, but weight {name} is "
                                  f"{list(full)}", hint="the checkpoint does not match its config.json")
            out[tname] = want
    for name in expected:  # a weight the table keeps 16-bit, stored quantized (a quantized lm_head)
        stored = [name + st.suffix for st in sq.stored(name) if st.suffix and name + st.suffix in src.tensors]
        if name not in src.squant_shapes and stored:
            raise SourceError(f"tensor {name!r} is stored quantized ({stored[0]}), but shardc reads {sq.label} "
                              "quantization only for the decoder's linear projections",
                              hint="use a checkpoint that keeps it in 16 bits (list it in the config's ignore)")
    for name, info in src.tensors.items():  # a 16-bit weight the config says nothing about
        if name in expected and name not in src.squant_shapes and info.dtype not in ("F16", "BF16", "F32"):
            raise SourceError(f"tensor {name!r} is stored as {info.dtype}, but shardc reads {sq.label} "
                              "quantization only for the decoder's linear projections",
                              hint="start from the unquantized checkpoint")
    return out


# casts that keep every value: a dtype: source build may widen a stored tensor, never narrow it
_EXACT = {("BF16", "F32"), ("F16", "F32")}


def check_kept(src: Source, layout: Layout) -> None:
    """A ``dtype: source`` build copies the stored tensors in the dtypes the Layout derives from
    config.json; a source holding one in a dtype that would not convert exactly is refused."""
    if layout.plan.dtype != "source" or src.squant is None:
        return
    for rl in layout.ranks:
        for t in rl.tensors:
            info = src.tensors.get(t.source)
            if t.value is None and info is not None and info.dtype != t.dtype and (info.dtype, t.dtype) not in _EXACT:
                raise SourceError(f"tensor {t.source!r} is {info.dtype}, but {src.squant.label} per its "
                                  f"config.json stores it as {t.dtype}; dtype: source would not copy it exactly",
                                  key="replica_group.dtype",
                                  hint="declare the scale dtype in config.json (weights.scale_dtype), or "
                                       "build with dtype: bf16 (dequantized)")
