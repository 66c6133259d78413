"""Typed errors that carry the failing field and a hint on how to fix it.

The library raises these; the CLI turns them into one line on stderr and an exit code, so a user
never sees a traceback for an expected problem (``--debug`` shows it).
"""

from __future__ import annotations


class ShardcError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with; ``hint`` says what would work."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.key = key

    def one_line(self) -> str:
        text = self.message if self.key is None else f"{self.key}: {self.message}"
        return f"{text} (hint: {self.hint})" if self.hint else text


class PlanError(ShardcError):
    """The plan file is malformed, has unknown keys, or asks for impossible degrees."""


class ModelError(ShardcError):
    """The model config is missing, unsupported, or inconsistent."""


class LayoutError(ShardcError):
    """The model cannot be split the way the plan asks (heads, KV heads, vocab, layers)."""


class SourceError(ShardcError):
    """The checkpoint cannot be read: missing files or tensors, wrong shapes, pickles, bad names."""


class ShardFormatError(ShardcError):
    """A safetensors file's header is damaged: too short, oversized, not JSON, or malformed entries."""


class QuantizationError(ShardcError):
    """A weight cannot be quantized (NaN/Inf) or a quantization override names nothing real."""


class OutputError(ShardcError):
    """The output cannot be written: too little disk space, or the disk failed mid-build. Not
    the input's fault, hence exit code 1; completed stages are kept so a rerun resumes."""

    exit_code = 1


class ManifestError(ShardcError):
    """A manifest is missing, unreadable, or not a shardc manifest."""


class StoreError(ShardcError):
    """Object storage failed: unknown scheme, missing bucket, credentials, exhausted retries."""


class VerifyMismatch(ShardcError):
    """A shard does not match the manifest or the plan (wrong bytes, shapes, or ranks)."""

    exit_code = 1


class DistributedError(ShardcError):
    """A peer in a process group failed or timed out."""

    exit_code = 1


class DeviceError(ShardcError):
    """The node lacks the devices a job needs (too few visible GPUs, no CUDA): bad input, exit 2."""


class ServeError(ShardcError):
    """An engine cannot serve this build as it stands: its degrees, partition or expert placement
    differ from the build's, or a parameter it declares has no tensor (or the wrong one) in the
    rank's shard (shardc/serving/)."""
