"""The tests' plans, written once: a replica group of tp x pp GPUs over one source.

Each test file used to spell the same plan dict with its own helper; the name, source and
sections are arguments here, so a file keeps the exact plan (and so the plan sha256, the shard
file names and every golden byte) it had. Import by name: ``from plan_helpers import plan``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def plan_data(tp: int, pp: int = 1, dtype: str = "bf16", *, name: str = "t", source: str | Path = "synthetic",
              model: dict[str, Any] | None = None, group: dict[str, Any] | None = None,
              **sections: Any) -> dict[str, Any]:
    """The plan as data: ``replica_group`` (name, degrees, dtype, gpus_per_replica = tp * pp, plus
    ``group``), ``model`` (the source, plus ``model``) and any further top-level ``sections``
    (``quantization={...}``). Nothing is added that the caller did not give: the plan's hash stays
    the one its test was written against."""
    data: dict[str, Any] = {
        "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                          "gpus_per_replica": tp * pp, **(group or {})},
        "model": {"source": str(source), **(model or {})},
    }
    data.update(sections)
    return data


def plan(tp: int, pp: int = 1, dtype: str = "bf16", **kw: Any):
    """``plan_data`` parsed and checked by ``plan_from_dict``: a ``Plan``."""
    from shardc.layout.plan import plan_from_dict

    return plan_from_dict(plan_data(tp, pp, dtype, **kw))


def write_plan(path: Path, tp: int, pp: int = 1, dtype: str = "bf16", **kw: Any) -> Path:
    """``plan_data`` written as a YAML plan file at ``path`` (what the CLI reads); returns path."""
    path.write_text(yaml.safe_dump(plan_data(tp, pp, dtype, **kw)))
    return path
