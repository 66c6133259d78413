"""Faults planted in a manifest held as data, and shard entries resealed to match planted bytes:
the tests that must get past size and sha256 to reach the check under test (helpers, not
fixtures: imported by name, ``from manifest_edits import reseal``)."""

from __future__ import annotations


def edit_at(d: dict, path: tuple, value) -> None:
    """Plant a fault in a manifest held as data: set ``d[path...]`` to ``value``, or delete that
    key when ``value`` is ``KeyError``."""
    *head, last = path
    for k in head:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value


def sealed(data: bytes, chunk_size: int | None) -> dict:
    """What a manifest's shard entry records of these bytes: size, sha256 and, with a chunk size
    (format_version 3), the sha256 of every chunk (cut here, independently of shardc)."""
    import hashlib

    out = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if chunk_size is not None:
        out["chunks"] = [hashlib.sha256(data[i : i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]
    return out


def reseal(entry, data: bytes) -> None:
    """Make a shard entry (a manifest dict's or a ShardEntry) match ``data``: a test that plants
    bytes the hashes must not catch (a NaN under a matching sha256) reseals the entry."""
    if isinstance(entry, dict):
        entry.update(sealed(data, entry.get("chunk_size")))
        return
    for key, value in sealed(data, entry.chunk_size).items():
        setattr(entry, key, tuple(value) if key == "chunks" else value)
