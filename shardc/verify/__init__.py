"""Checks of a build: per rank, distributed, and the human-readable inspector."""

from .. import lazy_seam

_SEAM = {
    "verify_build": "checks", "verify_rank": "checks", "load_shard": "loader",
    "check_manifest_against_layout": "checks",
    "distributed_verify": "distributed", "open_rendezvous": "distributed",
    "describe": "inspect",
}
__all__ = sorted(_SEAM)
__getattr__ = lazy_seam(__name__, _SEAM)
