"""A quantized source's tensors checked against its format before a byte is written: every
stored tensor of every quantized weight present, in a dtype the format stores it in, with the
shape the weight and the format's grid imply (a scale grid that does not match the weight and its
block size is one line naming both, never a misread)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SourceError

if TYPE_CHECKING:
    from .source import Source


def check_stored(src: Source, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Check ``src``'s quantized weights; return ``expected`` with their stored tensors added (so
    the caller's unknown-tensor check accepts them)."""
    sq = src.squant
    assert sq is not None
    out = dict(expected)
    for name in sorted(src.squant_names):
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
            out[tname] = want
    for name, info in src.tensors.items():  # a 16-bit weight the config says nothing about
        if name in expected and name not in src.squant_names and info.dtype not in ("F16", "BF16", "F32"):
            raise SourceError(f"tensor {name!r} is stored as {info.dtype}, but shardc reads {sq.label} "
                              "quantization only for the decoder's linear projections",
                              hint="start from the unquantized checkpoint")
    return out
