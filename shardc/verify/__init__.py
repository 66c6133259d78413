"""Checks of a build: per rank, distributed, and the human-readable inspector."""
