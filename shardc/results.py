"""What a library call returns to its caller, and the one JSON form of it.

The results of push, pull, export, verify, inspect, gate and the runtime API are frozen dataclasses (closed
sets of words are ``StrEnum``s), defined next to the code that makes them; nothing edits one after
it is made. ``to_json`` is their only serialization: ``--json`` output (commands/output.py), a
gate report file, and a rank's verdict sent through the rendezvous store all go through it, so
the JSON keys are the field names, except where a field says otherwise (``field(metadata={"json": "pass"})``: ``pass``
is a Python keyword) or is left out while unset (``optional``: the JSON never had that key then).
Like ``errors``, this module is imported by every package and imports nothing of shardc.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from pathlib import PurePath
from typing import Any


class StrEnum(str, Enum):
    """A closed set of words, equal to its JSON string (``enum.StrEnum`` is Python 3.11+; shardc
    supports 3.10)."""

    def __str__(self) -> str:
        return str(self.value)


def optional(default: Any = None) -> Any:
    """A field whose key is absent from the JSON while it is None (a verify report has
    ``plan_check`` only when a plan was given)."""
    return dataclasses.field(default=default, metadata={"omit_none": True})


def to_json(obj: Any) -> Any:
    """``obj`` as JSON data: dataclasses as objects (keys per the fields above), enums as their
    values, tuples as lists, paths as strings; everything else as it is."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[f.metadata.get("json", f.name)] = to_json(value)
        return out
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    return obj
