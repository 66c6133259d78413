"""``verify --deep REF``: every tensor of a rank against the source it was cut from, byte for byte.

The reference is opened once per verify (not once per rank) and first checked to be this build's
model: its config describes the same model (``ModelSpec.summary`` and the family's options) and,
for a checkpoint, holds every tensor the model needs with its shape (the build's own
``Source.check``). A reference of another model is a mismatch, one line naming the config key or
tensor that differs (exit 1, like a tensor whose bytes differ), never a ``KeyError`` from a tensor
the reference lacks; a reference that does not exist or cannot be read is bad input (exit 2),
keyed ``deep`` so the CLI names ``--deep``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError, ShardcError, SourceError
from ..layout.model import ModelSpec, config_key, model_from_config
from ..layout.ranks import Layout, RankLayout

if TYPE_CHECKING:
    from ..compiler.source import Source

DEEP_HINT = "pass a source checkpoint directory, or a build (its directory or manifest.json), that exists"


def open_deep(ref: str, layout: Layout) -> Source | str:
    """The reference as a ``Source`` (compiler/source.py), or the mismatch line (a ``str``) when
    it is another model's. A build is read as reshard reads one, quantized tensors compared
    dequantized unless the verified build holds them in the same scheme; a quantized checkpoint
    through its format, as build reads it."""
    from ..compiler.build_files import open_local_input
    from ..compiler.build_tensors import BuildSource
    from ..compiler.checkpoint import open_source
    from ..compiler.quantized import with_quantization

    local = "://" not in ref or ref.startswith("file://")
    path = Path(ref.removeprefix("file://"))
    if local and not path.exists():
        raise SourceError(f"the reference {ref} does not exist", key="deep", hint=DEEP_HINT)
    try:
        if local and (path.suffix == ".json" or (path / "manifest.json").is_file()):
            inp = open_local_input(ref)
            problem = other_model(ref, inp.manifest.config, layout.model)
            if problem is not None:
                inp.close()
                return problem
            return BuildSource(inp, layout, dequantize=True).as_source()
        checkpoint = open_source(ref)
    except ShardcError as exc:
        if exc.key in (None, "model.source"):  # the reference, not a plan's source
            exc.key = "deep"
            if exc.hint is None:
                exc.hint = DEEP_HINT
        raise
    problem = other_model(ref, checkpoint.config, layout.model)
    if problem is not None:
        return problem
    source = with_quantization(checkpoint, layout.model)
    try:
        source.check(layout.model)
    except SourceError as exc:
        return f"the reference {ref} is not a checkpoint of this build's model: {exc.message} (deep check)"
    return source


def other_model(ref: str, config: dict[str, Any], model: ModelSpec) -> str | None:
    """Why the reference's config is not the verified build's model (the first key that differs),
    or None."""
    try:
        theirs = model_from_config(config)
    except ModelError as exc:
        return f"the reference {ref} is not this build's model: {exc.one_line()} (deep check)"
    a, b = theirs.summary(), model.summary()
    for key in [*a, *(k for k in b if k not in a)]:  # summary order: the architecture first
        if a.get(key) != b.get(key):
            return (f"the reference {ref} is another model: its config has {config_key(key)}={a.get(key)!r}, "
                    f"this build's {b.get(key)!r} (deep check)")
    for key in sorted(set(theirs.options) | set(model.options)):
        if theirs.options.get(key) != model.options.get(key):
            return (f"the reference {ref} is another model: its config has {key}={theirs.options.get(key)!r}, "
                    f"this build's {model.options.get(key)!r} (deep check)")
    return None


def deep_check(res: Any, path: Path, rank_layout: RankLayout, layout: Layout, source: Source) -> None:
    """Reassemble against the reference (``open_deep``'s Source) and fail ``res`` (a RankResult)
    per tensor that differs: byte-exact for 16-bit, re-quantized for int8/fp8 (re-sliced when the
    reference build holds them quantized)."""
    import numpy as np
    from safetensors import safe_open

    from ..compiler.arrays import as_bytes, from_torch
    from ..compiler.materialize import Materializer, cut

    mat = Materializer(source, layout)
    with safe_open(path, framework="pt") as f:
        for spec in rank_layout.tensors:
            want = cut(mat.full(spec), spec)
            got = from_torch(f.get_tensor(spec.name))
            if spec.pad_rows:
                if as_bytes(got[got.shape[0] - spec.pad_rows :]).any():
                    res.fail(f"tensor {spec.name}: padded vocab rows are not zero")
                got = got[: got.shape[0] - spec.pad_rows]
            if got.shape != want.shape or not np.array_equal(as_bytes(got), as_bytes(want)):
                res.fail(f"tensor {spec.name} differs from source {spec.source} (deep check)")
    res.checks.append("deep")
