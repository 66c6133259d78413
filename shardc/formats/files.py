"""Byte counts for people: one format in every message and summary."""

from __future__ import annotations


def human_size(n: int) -> str:
    """GiB with 3 decimals from 256 MiB up, MiB with 2 below (so small test models read right)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"
