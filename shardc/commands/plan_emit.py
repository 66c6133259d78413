"""`shardc plan --emit / --check / --plot`: the pick as launch configs, an existing deployment
checked against it, and the picture; and a build's own launch (`--model BUILD_DIR`, #42), its
manifest read here and handed to the planner as plain data. The planner (planner/deploy.py,
planner/launch.py, planner/plot.py) does the work, this module reads files, formats YAML and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import PlanError
from ..formats.files import write_atomic


def emit_config(result: Any, kind: str, manifest_uri: str, image: str | None = None) -> None:
    """--emit vllm: the `vllm serve` command line; --emit k8s: a pod (YAML) for one replica."""
    import yaml

    from ..planner.deploy import comment, init_command, pod_name, pod_spec, vllm_command

    rec = result.require_recommendation()
    if kind == "vllm":
        if rec.dtype == "int8":  # vLLM quantizes fp8 online, not int8: the source line would serve 16 bits
            raise PlanError(f"the pick {rec.label} is int8, which vLLM cannot make from {result.source} (it has no "
                            "online int8 weight-only mode): the line would serve 16-bit weights",
                            key="--emit", hint="serve the int8 build: `shardc build` the plan (--out), then "
                            "`shardc plan --model BUILD_DIR --emit vllm`, or --emit k8s; or --dtype fp8 / bf16")
        click.echo(vllm_command(result, rec))
        return
    if image is None:
        raise PlanError("the pod's two containers (shardc pull and verify, then vLLM serving the verified build "
                        "with --load-format shardc) run one image, which must hold both shardc and vLLM",
                        key="--image", hint="build one (pip install shardc vllm) and give --image "
                        "REGISTRY/NAME:TAG; no public image holds both")
    init = init_command(manifest_uri, pod_name(rec))
    text = yaml.safe_dump(pod_spec(result, rec, init, image), sort_keys=False)  # one document, every string quoted
    click.echo(comment(f"shardc plan: {result.model_name} as {rec.label} on {rec.gpus} x {result.cluster.gpu.name}")
               + text, nl=False)


def check(result: Any, path: Path) -> None:
    """--check FILE: one line per disagreement and exit 1, or one line saying they agree."""
    from ..planner.deploy import check_deployment

    doc = _deployment(path)
    rec = result.require_recommendation()
    _report(path, lambda: check_deployment(result, rec, doc), f"the plan ({rec.label} on {rec.gpus} GPUs)")


def _deployment(path: Path) -> Any:
    """The deployment --check reads: its Pod (Deployment, StatefulSet, Job) document, else its first."""
    import yaml

    from ..layout.readfile import read_regular_file

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
    return next((d for d in docs if isinstance(d, dict) and d.get("kind") in ("Pod", "Deployment", "StatefulSet",
                                                                            "Job")), docs[0] if docs else None)


def _report(path: Path, problems_of: Any, what: str) -> None:
    """--check's verdict: one line per disagreement and exit 1, or one line saying they agree."""
    try:
        problems = problems_of()
    except PlanError as exc:  # a shell line sh cannot read, a count that is not a number
        exc.key = "--check"
        raise
    if not problems:
        click.echo(f"{path}: agrees with {what}")
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


# --- a build's own launch (#42) ---------------------------------------------------------------------

# What a build's launch takes: the rest size a search (--gpu, --tp, --dtype, ...) or write its
# results (--out, --plot, --json), and a build's plan has already fixed all of that.
BUILD_FLAGS = ("--model", "--emit", "--check", "--manifest-uri", "--image", "--max-model-len")


def plain_inputs(**values: str | Path | None) -> None:
    """The strings of `shardc plan` that reach its output (a comment, a pod, a shell line, a file
    name) hold no control character: each is one line naming its flag, before anything is read."""
    from ..planner.deploy import refuse_control

    what = {"model_ref": ("--model", "the model path"), "draft_model": ("--draft-model", "the draft model path"),
            "manifest_uri": ("--manifest-uri", "the manifest URI"), "out": ("--out", "the plan path"),
            "plot": ("--plot", "the picture's path"), "check": ("--check", "the deployment file's path"),
            "image": ("--image", "the image")}
    for field, value in values.items():
        if value is not None:
            refuse_control(str(value), *what[field])


def launch_build(ctx: click.Context, args: dict[str, Any]) -> bool:
    """`shardc plan` of a build's directory with --emit or --check (or without --gpu): its launch,
    printed here (True); False for a search. --image is refused where no pod is printed."""
    emit, check_file, image = args["emit"], args["check_file"], args["image"]
    if image is not None and (emit != "k8s" or check_file is not None):
        raise PlanError("applies to --emit k8s only (the pod's image)", key="--image", hint="drop --image")
    if args["gpu_name"] is not None and not emit and check_file is None:
        return False
    plain_inputs(model_ref=args["model_ref"], manifest_uri=args["manifest_uri"], check=check_file, image=image)
    directory = build_dir(args["model_ref"])
    if directory is None:
        return False
    given = [p.opts[0] for p in ctx.command.params
             if ctx.get_parameter_source(p.name or "") not in (click.core.ParameterSource.DEFAULT, None)]
    build_launch(directory, emit=emit, check_file=check_file, image=image, max_model_len=args["max_model_len"],
                 manifest_uri=args["manifest_uri"] if "--manifest-uri" in given else None, given=given)
    return True


def build_dir(model_ref: str) -> Path | None:
    """The directory when ``--model`` is a shardc build: one holding manifest.json (or a rebuild's
    switch journal, whose missing manifest `load` explains); any other directory is a checkpoint."""
    import os

    from ..formats.manifest import SWITCH_JOURNAL

    path = Path(model_ref)
    if path.is_dir() and any(os.path.lexists(path / n) for n in ("manifest.json", SWITCH_JOURNAL)):
        return path
    return None


def build_launch(directory: Path, *, emit: str | None, check_file: Path | None, manifest_uri: str | None,
                 image: str | None, max_model_len: int | None, given: list[str]) -> None:
    """`shardc plan --model BUILD_DIR --emit vllm|k8s` / `--check FILE`: the build's own launch."""
    import yaml

    from ..planner.deploy import comment
    from ..planner.launch import build_pod, build_vllm_command, check_build

    extra = next((f for f in given if f not in BUILD_FLAGS), None)
    if extra is not None:
        raise PlanError(f"does not apply to a build's launch: {directory} is a shardc build, whose plan fixed "
                        "its GPUs, degrees and dtype", key=extra,
                        hint=f"drop {extra} (a build's launch takes {', '.join(BUILD_FLAGS[1:])}); to size a new "
                        "deployment, plan the model's checkpoint or config.json with --gpu")
    if emit is None and check_file is None:
        raise PlanError(f"{directory} is a shardc build (it holds manifest.json): plan prints its launch, it "
                        "does not search", key="--model",
                        hint="add --emit vllm, --emit k8s --image IMAGE or --check FILE; to size a deployment of "
                        "its model, add --gpu PRESET")
    if emit == "k8s" and check_file is None and image is None:
        raise PlanError("a build's pod needs the image its two containers run, which must hold both shardc "
                        "(`shardc pull`, `shardc verify`) and vLLM with shardc installed (`--load-format shardc`)",
                        key="--image", hint="build one (pip install shardc vllm) and give --image "
                        "REGISTRY/NAME:TAG; no public image holds both")
    launch = read_build(directory, max_model_len, manifest_uri)
    if check_file is not None:
        doc = _deployment(check_file)
        _report(check_file, lambda: check_build(launch, doc), f"the build ({launch.label} on {launch.gpus} GPUs)")
    elif emit == "vllm":
        click.echo(build_vllm_command(launch))
    else:
        if launch.manifest_uri is None:
            raise PlanError("the pod pulls the build from its store, and neither --manifest-uri nor the build's "
                            "plan (replica_group.checkpoint.manifest_uri) says where it is", key="--manifest-uri",
                            hint="give --manifest-uri s3://BUCKET/PREFIX/manifest.json, where shardc push put it")
        if "://" not in launch.manifest_uri and not launch.manifest_uri.startswith("/"):
            where = "--manifest-uri" if manifest_uri else "the build's plan (replica_group.checkpoint.manifest_uri)"
            raise PlanError(f"{where} gives {launch.manifest_uri!r}, a relative path, which names nothing inside the "
                            "pod", key="--manifest-uri", hint="give --manifest-uri s3://BUCKET/PREFIX/manifest.json "
                            "(where shardc push put it), or an absolute path mounted in the pod")
        assert image is not None
        text = yaml.safe_dump(build_pod(launch, image, launch.manifest_uri), sort_keys=False)
        click.echo(comment(f"shardc plan: the build {launch.name} ({launch.label}) on {launch.gpus} GPUs, "
                           "served with --load-format shardc") + text, nl=False)


def read_build(directory: Path, max_model_len: int | None, manifest_uri: str | None) -> Any:
    """The build's launch figures from its manifest: read and checked by the one reader
    (formats/manifest.py), its Layout recomputed from its plan and model config (as verify does:
    the degrees, stages and dtype are the plan's, never the manifest's summary of them)."""
    from ..errors import ManifestError, ModelError, ShardcError
    from ..formats.manifest import load
    from ..formats.manifest_records import REBUILD
    from ..layout.quantization import base_dtype
    from ..planner.deploy import refuse_control
    from ..planner.launch import BuildLaunch

    path = directory / "manifest.json"
    try:
        manifest = load(path)
    except ManifestError as exc:
        exc.key = exc.key or "--model"  # the manifest's field when it names one, else the flag
        raise
    try:
        layout = manifest.to_layout()
    except ShardcError as exc:  # a plan or config this shardc cannot lay out: not a build it made
        raise ManifestError(f"{path}: its plan and model config do not lay out: {exc.message}",
                            key=f"{'model.config' if isinstance(exc, ModelError) else 'plan'}.{exc.key or ''}".strip("."),
                            hint=REBUILD) from None
    plan, model = layout.plan, layout.model
    bound = model.max_position_embeddings if "max_position_embeddings" in manifest.config else None
    if max_model_len is not None and bound is not None and max_model_len > bound:
        raise PlanError(f"{max_model_len:,} exceeds the model's max_position_embeddings {bound:,}",
                        key="--max-model-len", hint=f"use --max-model-len <= {bound}, or drop it (the model's)")
    uri = manifest_uri or plan.manifest_uri
    if uri is not None and manifest_uri is None:
        refuse_control(uri, "replica_group.checkpoint.manifest_uri", "the build's manifest URI")
    resolved = str(directory.resolve())
    refuse_control(resolved, "--model", "the model path")  # as resolved: a link may lead to such a name
    return BuildLaunch(directory=resolved, name=plan.name, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                       expert_parallel=plan.expert_parallel, stages=tuple(b - a for a, b in layout.stages),
                       dtype=plan.dtype, base_dtype=base_dtype(model, plan), max_model_len=max_model_len or bound,
                       shard_bytes=manifest.total_bytes, manifest_uri=uri)
