"""`shardc plan --emit / --check / --plot`: the pick as launch configs, an existing deployment
checked against it, and the picture; the planner (planner/deploy.py, planner/plot.py) does the
work, this module parses files, formats YAML and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import PlanError
from ..formats.files import write_atomic


def emit_config(result: Any, kind: str, manifest_uri: str) -> None:
    """--emit vllm: the `vllm serve` command line; --emit k8s: a pod (YAML) for one replica."""
    import yaml

    from ..planner.deploy import comment, init_command, pod_name, pod_spec, vllm_command

    rec = result.require_recommendation()
    if rec.dtype == "int8":  # vLLM quantizes fp8 online, not int8: it must load the quantized weights
        click.echo("warning: vLLM has no online int8 weight-only mode: serve `shardc export` of the int8 "
                   "build (its config.json carries the compressed-tensors quantization_config) in place of "
                   f"{result.source}", err=True)
    if kind == "vllm":
        click.echo(vllm_command(result, rec))
        return
    init = init_command(manifest_uri, pod_name(rec), rec.gpus)
    text = yaml.safe_dump(pod_spec(result, rec, init), sort_keys=False)  # one document, every string quoted
    click.echo(comment(f"shardc plan: {result.model_name} as {rec.label} on {rec.gpus} x {result.cluster.gpu.name}")
               + text, nl=False)


def check(result: Any, path: Path) -> None:
    """--check FILE: one line per disagreement and exit 1, or one line saying they agree."""
    import yaml

    from ..layout.readfile import read_regular_file
    from ..planner.deploy import check_deployment

    try:
        data = read_regular_file(path, limit=1 << 20, what="deployment file", error=PlanError)
    except PlanError as exc:
        exc.key = "--check"
        raise
    try:
        docs = [d for d in yaml.safe_load_all(data) if d is not None]
    except yaml.YAMLError as exc:
        raise PlanError(f"cannot read {path}: {str(exc).splitlines()[0]}", key="--check",
                        hint="give a pod spec or `vllm serve` arguments as YAML") from None
    rec = result.require_recommendation()
    doc = next((d for d in docs if isinstance(d, dict) and d.get("kind") in ("Pod", "Deployment", "StatefulSet",
                                                                            "Job")), docs[0] if docs else None)
    try:
        problems = check_deployment(result, rec, doc)
    except PlanError as exc:  # a shell line sh cannot read, a count that is not a number
        exc.key = "--check"
        raise
    if not problems:
        click.echo(f"{path}: agrees with the plan ({rec.label} on {rec.gpus} GPUs)")
        return
    for line in problems:
        click.echo(f"{path}: {line}")
    raise SystemExit(1)


def plot(result: Any, path: Path, quiet: bool = False) -> None:
    """--plot FILE: the picture, its format from the suffix, written atomically."""
    from ..planner.plot import render

    fmt = path.suffix.lower().lstrip(".")
    try:
        data = render(result, fmt)
    except PlanError as exc:
        exc.key = "--plot"
        raise
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as exc:
        raise PlanError(f"cannot write {path}: {exc.strerror}", key="--plot") from None
    if not quiet:
        click.echo(f"wrote {path} ({len(data):,} bytes)")
