"""Checks of a build: per rank, distributed, and the human-readable inspector.

Plain imports (go-to-definition works); torch is imported inside the functions that load tensors.
"""

from .checks import check_manifest_against_layout, verify_build, verify_rank
from .distributed import distributed_verify, open_rendezvous
from .inspect import describe

__all__ = ["check_manifest_against_layout", "describe", "distributed_verify", "open_rendezvous",
           "verify_build", "verify_rank"]
