"""A build's own launch (#42): the `vllm serve` line, the pod and the check of an existing one for a
shardc build directory, served through vLLM's `--load-format shardc` (shardc/serving/).

Not a search: every figure is the build's, read by the CLI from its manifest (its plan's degrees,
its pipeline stages, its 16-bit dtype, its model's length bound) and handed here as plain data
(``BuildLaunch``), so the planner never reads a manifest (tests/test_layering.py). What differs
from the search's launch (deploy.py): the model is the build directory itself, never the source
model from the hub, so what `shardc verify` checked is what vLLM serves and nothing is downloaded
twice; no `--quantization` (a quantized build's config.json carries its quantization_config, which
vLLM reads); the pipeline stages are passed as vLLM's `VLLM_PP_LAYER_PARTITION`, because shardc
gives a remainder of layers to the first stages and vLLM, by default, to the ones before the last.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

from .deploy import (
    DASHES,
    HOST_BASE,
    PARTITION,
    SHM_PER_GPU,
    _number,
    _option,
    _split,
    k8s_name,
    pod_problems,
    read_deployment,
    refuse_control,
    vllm_default_stages,
)
from .gpus import GIB

# The safetensors name of a build's 16-bit tensors -> vLLM's --dtype word (vllm/config/model.py ModelDType).
VLLM_DTYPE = {"BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class BuildLaunch:
    """What a build's launch is made of, from its manifest (the CLI reads it; commands/plan_emit.py)."""

    directory: str  # the build directory vLLM serves (an absolute path)
    name: str  # the plan's name (replica_group.name): the pod's and the served model's name
    tp: int
    pp: int
    dp: int
    expert_parallel: bool
    stages: tuple[int, ...]  # layers per pipeline stage, as the build cut them
    dtype: str  # the plan's dtype (bf16, fp16, int8, fp8, source): for the comment
    base_dtype: str  # the 16-bit tensors' safetensors dtype (BF16, F16)
    max_model_len: int | None  # the model's bound (max_position_embeddings), or a shorter one asked for
    shard_bytes: int  # every rank's shard: host memory while they load
    manifest_uri: str | None = None  # where the plan says the build is pushed (checkpoint.manifest_uri)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        ep = " expert_parallel" if self.expert_parallel else ""
        return f"tp={self.tp} pp={self.pp}" + (f" dp={self.dp}" if self.dp > 1 else "") + f"{ep} {self.dtype}"


def _check(b: BuildLaunch) -> None:
    """The strings of a launch made in code that reach an emitted file, refused as the CLI's are."""
    refuse_control(b.directory, "model", "the build directory")
    refuse_control(b.name, "model", "the plan name")


def build_options(b: BuildLaunch) -> dict[str, str | None]:
    """vLLM's options for the build, by option name (None: a switch)."""
    opts: dict[str, str | None] = {"load-format": "shardc", "tensor-parallel-size": str(b.tp)}
    if b.pp > 1:
        opts["pipeline-parallel-size"] = str(b.pp)
    if b.expert_parallel:  # each DP rank schedules its own sequences; the experts spread over all
        opts.update({"data-parallel-size": str(b.dp), "enable-expert-parallel": None})
    opts["dtype"] = VLLM_DTYPE[b.base_dtype]
    if b.max_model_len is not None:
        opts["max-model-len"] = str(b.max_model_len)
    return opts


def build_env(b: BuildLaunch) -> dict[str, str]:
    """The environment vLLM needs for this build: its pipeline stages, whenever there are several."""
    return {PARTITION: ",".join(map(str, b.stages))} if b.pp > 1 else {}


def build_args(b: BuildLaunch, model: str) -> list[str]:
    """`vllm serve` arguments: the model directory, then every option."""
    _check(b)
    args = ["./" + model if model.startswith("-") else model]  # never read as an option
    for name, value in build_options(b).items():
        args += [DASHES + name] if value is None else [DASHES + name, value]
    return args


def build_vllm_command(b: BuildLaunch) -> str:
    """`[VLLM_PP_LAYER_PARTITION=..] vllm serve DIR --load-format shardc ...`, every word shell-quoted."""
    env = [f"{k}={v}" for k, v in build_env(b).items()]
    return shlex.join([*env, "vllm", "serve", *build_args(b, b.directory)])


def build_init_command(manifest_uri: str, dest: str) -> str:
    """The init container's shell line: `shardc pull` of every rank and the side files into
    ``dest``, then `shardc verify` of them on the GPUs; every word shell-quoted."""
    refuse_control(manifest_uri, "manifest_uri", "the manifest URI")
    pull = ["shardc", "pull", DASHES + "manifest", manifest_uri, DASHES + "all", DASHES + "dest", dest]
    verify = ["shardc", "verify", DASHES + "manifest", f"{dest}/manifest.json", DASHES + "device", "cuda"]
    return shlex.join(pull) + " && " + shlex.join(verify)


def build_pod(b: BuildLaunch, image: str, manifest_uri: str) -> dict[str, Any]:
    """A pod serving the build: an init container pulls and verifies it into an emptyDir volume, and
    vLLM serves that directory with `--load-format shardc`: the bytes verified are the bytes served.
    ``image`` runs both containers, so it holds shardc and vLLM."""
    refuse_control(image, "image", "the image")
    name = k8s_name(b.name)
    dest = f"/models/{name}"
    resources = {"nvidia.com/gpu": b.gpus, "memory": f"{math.ceil((b.shard_bytes + HOST_BASE) / GIB)}Gi"}
    env = [{"name": "SHARDC_MODEL_DIR", "value": dest}] + [{"name": k, "value": v} for k, v in build_env(b).items()]
    mount = {"name": "models", "mountPath": "/models"}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "vllm", "shardc/plan": name}},
        "spec": {
            "initContainers": [{"name": "shardc-pull", "image": image,
                                "command": ["sh", "-c", build_init_command(manifest_uri, dest)],
                                "resources": {"limits": {"nvidia.com/gpu": b.gpus}}, "volumeMounts": [mount]}],
            "containers": [{"name": "vllm", "image": image, "command": ["vllm", "serve"],
                            "args": build_args(b, dest) + _option("served-model-name", b.name), "env": env,
                            "resources": {"limits": dict(resources), "requests": dict(resources)},
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, dict(mount)]}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": f"{math.ceil(b.gpus * SHM_PER_GPU / GIB)}Gi"}},
                        {"name": "models", "emptyDir": {}}],
        },
    }


# --- --check: an existing deployment against the build -------------------------------------------

def _partition(doc: Any) -> str | None:
    """VLLM_PP_LAYER_PARTITION as the deployment sets it: a `NAME=VALUE` word of the command line,
    or an entry of a container's env."""
    if isinstance(doc, (str, list)):
        words = _split(doc) if isinstance(doc, str) else [str(x) for x in doc]
        return next((w.split("=", 1)[1] for w in words if w.startswith(PARTITION + "=")), None)
    spec = doc.get("spec", doc) if isinstance(doc, dict) else {}
    if isinstance(spec, dict) and isinstance(spec.get("template"), dict):
        spec = spec["template"].get("spec", {})
    for ct in (spec.get("containers") or []) if isinstance(spec, dict) else []:
        for e in (ct.get("env") or []) if isinstance(ct, dict) else []:
            if isinstance(e, dict) and e.get("name") == PARTITION:
                return str(e.get("value"))
    return None


def check_build(b: BuildLaunch, doc: Any) -> list[str]:
    """One line per place where a deployment (a pod spec, or the `vllm serve` line) disagrees with
    the build's launch (empty: they agree)."""
    flags, facts = read_deployment(doc)
    if not flags and "gpus" not in facts:
        return ["no `vllm serve` arguments found (a pod spec whose container runs vllm serve, or the "
                "command line itself)"]
    want = {k: "true" if v is None else v for k, v in build_options(b).items()}
    defaults = {"load-format": "auto", "tensor-parallel-size": "1", "pipeline-parallel-size": "1",
                "data-parallel-size": "1"}
    out = []
    for key in ("load-format", "tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size",
                "enable-expert-parallel", "quantization"):
        build, got = want.get(key, defaults.get(key)), flags.get(key, defaults.get(key))
        if build != got:
            out.append(f"{DASHES}{key}: the deployment has {got or 'none'}, the build {build or 'none'}")
    dtype = {"half": "float16"}.get(flags.get("dtype", ""), flags.get("dtype"))
    if dtype not in (None, "auto", want["dtype"]):
        out.append(f"{DASHES}dtype: the deployment has {flags['dtype']}, the build's tensors are {want['dtype']}")
    if "max-model-len" in flags and "max-model-len" in want and \
            _number(flags["max-model-len"], int, "max-model-len") > int(want["max-model-len"]):
        out.append(f"{DASHES}max-model-len: the deployment asks {flags['max-model-len']}, the model's bound is "
                   f"{want['max-model-len']}")
    stages, got_stages = ",".join(map(str, b.stages)), _partition(doc)
    unset_ok = b.stages == vllm_default_stages(sum(b.stages), b.pp)
    if b.pp > 1 and got_stages != stages and not (got_stages is None and unset_ok):
        out.append(f"{PARTITION}: the deployment has {got_stages or 'none (vLLM splits the layers its own way)'}, "
                   f"the build's stages hold {stages} layers")
    return out + pod_problems(facts, b.gpus, (b.tp, b.pp, b.dp), "the build needs", "the build's launch sizes")

