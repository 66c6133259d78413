"""Sharded runtime: execute a built plan's shard files the way a serving replica would.

Every rank loads only its own shard file (through verify's checked loader), tensor-parallel blocks
all-reduce over a real torch.distributed group, and pipeline stages hand activations on with
send/recv. ``api`` holds the library entry points (generate, score); importing this package does not
import torch.
"""

from __future__ import annotations

# the modules (not imported here: they import torch); the library entry points are in ``api``
__all__ = ["api", "api_results", "comm", "decoder", "engine", "gate", "gate_cache", "gate_report", "launch",
           "reference", "support", "weights", "worker"]
