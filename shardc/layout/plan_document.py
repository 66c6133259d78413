"""A plan document read with bounds, before its schema is checked (layout/plan.py): YAML with
aliases counted expanded (a 10-line alias bomb is billions of values), nesting and size bounded,
and only plain JSON values anywhere (the plan is recorded as canonical JSON)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .readfile import PLAN_LIMIT, decode_text, read_regular_file

MAX_YAML_NODES = 10_000  # scalars + collections, counted with aliases expanded
MAX_DEPTH = 32


def read_plan_yaml(path: Path) -> Any:
    """The parsed YAML of a plan file (one PlanError for a file that is not a bounded YAML document)."""
    data = read_regular_file(path, limit=PLAN_LIMIT, what="plan file", error=PlanError)
    text = decode_text(data, path, what="plan file", error=PlanError)
    import yaml  # here, not at the top: load_shard reads plans from manifests (JSON) at cold start

    try:
        return _safe_yaml(text, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PlanError(f"{path} is not valid YAML{where}", hint="fix the YAML syntax") from None
    except RecursionError:
        raise PlanError(f"{path} is nested too deeply", hint="a plan is a few levels deep") from None
    except (ValueError, OverflowError) as exc:  # a YAML value its constructor refuses (a 5000-digit int)
        raise PlanError(f"{path} holds a value that cannot be read: {exc}", hint="fix the value") from None


def check_plain(raw: dict[str, Any]) -> None:
    """The plan is recorded as canonical JSON: only JSON values (string keys, finite numbers; no
    dates or binary from YAML tags), bounded in depth and size, are accepted anywhere in it,
    ``autoscaling`` included. Iterative, so a deep document is an error and not a RecursionError."""
    stack: list[tuple[Any, str, int]] = [(raw, "", 0)]
    seen = 0
    while stack:
        value, where, depth = stack.pop()
        seen += 1
        if seen > MAX_YAML_NODES:
            raise PlanError(f"the plan has more than {MAX_YAML_NODES} values", key=where or None,
                            hint="a plan is a few dozen keys")
        if depth > MAX_DEPTH:
            raise PlanError(f"nested deeper than {MAX_DEPTH} levels", key=where, hint="a plan is a few levels deep")
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise PlanError(f"has a key that is not a string ({k!r})", key=where or None)
                stack.append((v, f"{where}.{k}" if where else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"must be a finite number, found {value!r}", key=where)
        elif value is not None and not isinstance(value, (str, int, float)):
            raise PlanError(f"must be a plain YAML value (string, number, list, mapping), found "
                            f"{type(value).__name__}", key=where, hint="quote dates and drop !!binary tags")


def _safe_yaml(text: str, path: Path) -> Any:
    """``yaml.safe_load`` with the document bounded before it is expanded: aliases make a
    10-line file into billions of values (an alias bomb), so nodes are counted with aliases
    expanded, stopping at the limit, before any Python object is built."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        count, depth_stack = 0, [(node, 0)]
        while depth_stack:
            n, depth = depth_stack.pop()
            count += 1
            if count > MAX_YAML_NODES or depth > MAX_DEPTH:
                raise PlanError(f"{path} has more than {MAX_YAML_NODES} values or {MAX_DEPTH} levels "
                                "(counting YAML aliases expanded)", hint="a plan is a few dozen keys")
            if isinstance(n, yaml.MappingNode):
                depth_stack.extend((x, depth + 1) for kv in n.value for x in kv)
            elif isinstance(n, yaml.SequenceNode):
                depth_stack.extend((x, depth + 1) for x in n.value)
        return loader.construct_document(node)
    finally:
        loader.dispose()
