"""Launch configurations of a pick that cannot disagree with the plan: vLLM's arguments, a Kubernetes
pod fragment, and the check of an existing one.

Every number comes from the candidate the planner worked out (tensor/pipeline/data-parallel sizes,
the max model length its KV pool holds, the utilization its budget assumed, the KV dtype, the
concurrency its speed figures are at), so `shardc plan --emit` and `--check` read the same figures
as the table. Pure data: the CLI turns the pod into YAML (PyYAML) and prints.

A model's name and path reach YAML, a shell line and comments, so no user string is pasted into
structured text: the pod is data for ``yaml.safe_dump``, every shell word is ``shlex``-quoted, a
comment is ``comment``'s one line, and a string holding a control character is refused
(``refuse_control``) before anything is written (#41).
"""

from __future__ import annotations

import math
import re
import shlex
import unicodedata
from typing import Any

from ..errors import PlanError
from .gpus import GIB
from .records import Candidate, Search

SHM_PER_GPU = 2 * GIB  # /dev/shm per GPU: NCCL's shared-memory transport and vLLM's broadcast queue
HOST_BASE = 16 * GIB  # host memory besides the shards: Python, CUDA host allocations, the tokenizer
PARTITION = "VLLM_PP_LAYER_PARTITION"  # vllm/envs.py: layers per pipeline stage, comma-separated
DASHES = "-" * 2  # vLLM's option prefix (vLLM's options, not shardc's flags)


# Unicode's control characters (C0 with tab and newline, DEL, C1 with NEL), the line and paragraph
# separators YAML reads as line breaks, and lone surrogates (Python's stand-in for a file name's
# bytes that are not UTF-8, which no YAML, JSON or terminal text can carry).
_REFUSED = {"Cc": "a control character", "Zl": "a line separator", "Zp": "a paragraph separator",
            "Cs": "a byte that is not UTF-8"}


def control_char(text: str) -> tuple[int, str] | None:
    """(position, what) of the first character no emitted file may carry, or None."""
    for i, ch in enumerate(text):
        what = _REFUSED.get(unicodedata.category(ch))
        if what is not None:
            return i, what
    return None


def refuse_control(value: str, key: str, what: str) -> None:
    """A PlanError naming ``key`` when ``value`` (``what``: "the model path") holds a control
    character: it would end a comment line, start a YAML document or break a shell line in what
    `--emit` and `--out` write. The value is shown escaped (repr), shortened, so the error stays one line."""
    found = control_char(value)
    if found is None:
        return
    pos, kind = found
    start = max(pos - 24, 0)
    shown = ("..." if start else "") + repr(value[start:pos + 24]) + ("..." if len(value) > pos + 24 else "")
    raise PlanError(f"{what} holds {kind} (U+{ord(value[pos]):04X}) at character {pos + 1}: {shown}", key=key,
                    hint="rename it (or link it under a plain name): a name written into a pod spec, a shell "
                    "line or a plan file may not hold control characters")


def comment(text: str) -> str:
    """One '# ' comment line of YAML or shell; a control character is written escaped, so a comment
    can never end early and start a document, a key or a command of its own."""
    return "# " + "".join(repr(ch)[1:-1] if control_char(ch) else ch for ch in text) + "\n"


def _check_names(s: Search) -> None:
    """The strings of the search that reach an emitted file: refused before anything is made."""
    refuse_control(s.model_name, "model", "the model name")
    refuse_control(s.source, "model", "the model path")


def _option(name: str, value: str) -> list[str]:
    """`--name value`, or `--name=value` for a value that starts with '-', which vLLM's argparse
    would otherwise read as an option of its own."""
    return [f"{DASHES}{name}={value}"] if value.startswith("-") else [DASHES + name, value]


def model_ref(source: str) -> str:
    """What `vllm serve` takes: a hub repo id for hf://org/repo[@rev], else the path."""
    if source.startswith("hf://"):
        return source[len("hf://"):].split("@")[0]
    return source


def max_model_len(s: Search, c: Candidate) -> int:
    """The longest request the unit's KV pool holds, at most the length asked for (or the model's)."""
    assert c.kv is not None
    return c.kv.served_len


def max_num_seqs(s: Search, c: Candidate) -> int:
    """vLLM's --max-num-seqs for the pick (per DP rank under expert parallelism). With a concurrency
    or a TPOT target given, the concurrency the plan's figures are at: more sequences in flight would
    break the target. Otherwise (the default TPOT only sizes the batch) the sequences the KV pool
    holds at the average context, and never fewer than that concurrency: a server capped at the
    batch a default target allows would turn requests away that its memory holds. At most
    --max-num-batched-tokens, which vLLM requires (vllm/config/scheduler.py, SchedulerConfig:
    "max_num_batched_tokens ... must be greater than or equal to max_num_seqs")."""
    assert c.speed is not None and c.kv is not None
    bound = c.speed.batch if s.workload.concurrency is not None or s.workload.target_set else \
        max(c.speed.batch, c.kv.sequences)
    per_rank = math.ceil(bound / c.dp) if c.ep > 1 else bound
    return max(1, min(per_rank, s.speed.max_num_batched_tokens))


def vllm_options(s: Search, c: Candidate, build: bool = False) -> dict[str, str | None]:
    """vLLM's options for the pick, by vLLM's option name (None: a switch); an EP pick is data
    parallel with expert parallelism, each DP rank scheduling its share of the sequences.

    ``build``: vLLM serves the plan's shardc build (`--load-format shardc`, the pod): its config.json
    says how it is quantized, so no --quantization, and --dtype is the build's 16-bit dtype.
    Otherwise it serves the source model: --quantization fp8 for an fp8 pick (vLLM quantizes a
    16-bit checkpoint to fp8 online); a `source` pick loads the published quantized checkpoint as
    its config.json says."""
    assert c.speed is not None and c.pp is not None
    w, sp = s.workload, s.speed
    opts: dict[str, str | None] = {"load-format": "shardc"} if build else {}
    if c.ep > 1:
        opts.update({"tensor-parallel-size": "1", "data-parallel-size": str(c.dp), "enable-expert-parallel": None})
    else:
        opts.update({"tensor-parallel-size": str(c.tp), "pipeline-parallel-size": str(c.pp)})
    if build:
        opts["dtype"] = "float16" if s.model.torch_dtype == "float16" else "bfloat16"
    opts.update({"max-model-len": str(max_model_len(s, c)),
                 "gpu-memory-utilization": f"{w.gpu_memory_utilization:g}",
                 "kv-cache-dtype": w.kv_dtype if w.kv_dtype == "fp8" else "auto",
                 "max-num-seqs": str(max_num_seqs(s, c)), "max-num-batched-tokens": str(sp.max_num_batched_tokens),
                 "block-size": str(w.block_size)})
    if c.dtype == "fp8" and not build:
        opts["quantization"] = "fp8"
    return opts


def vllm_args(s: Search, c: Candidate, model: str | None = None) -> list[str]:
    """`vllm serve` arguments for the pick: the model (the source's, or ``model``: the directory its
    build is pulled into, served with `--load-format shardc`), then every option."""
    _check_names(s)
    args = [model_ref(s.source) if model is None else model]
    for name, value in vllm_options(s, c, build=model is not None).items():
        args += [DASHES + name] if value is None else [DASHES + name, value]
    return args


def vllm_command(s: Search, c: Candidate) -> str:
    """The `vllm serve` command line, every word shell-quoted, one option per line (a backslash
    ends each line but the last, as sh continues a line)."""
    words = ["vllm", "serve", *vllm_args(s, c)]
    head, rest = words[:3], words[3:]
    parts, i = [shlex.join(head)], 0
    while i < len(rest):
        n = 2 if i + 1 < len(rest) and not rest[i + 1].startswith(DASHES) else 1
        parts.append(shlex.join(rest[i:i + n]))
        i += n
    return " \\\n    ".join(parts)


def plan_stages(c: Candidate) -> tuple[int, ...]:
    """Layers per pipeline stage of the pick's plan (its ranks' layer ranges)."""
    seen: dict[int, tuple[int, int]] = {r.pp_stage: r.layers for r in c.weights}
    return tuple(b - a for _, (a, b) in sorted(seen.items()))


def vllm_default_stages(layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's own split when VLLM_PP_LAYER_PARTITION is unset (vllm/distributed/utils.py
    get_pp_indices): even, the remainder one each to the stages before the last, from the back."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def pod_name(c: Candidate) -> str:
    """The plan's name as a Kubernetes name (``k8s_name``)."""
    assert c.plan is not None
    return k8s_name(c.plan.name)


def k8s_name(plan_name: str) -> str:
    """A plan's name as a Kubernetes name (an RFC 1123 subdomain that is also a label value):
    lower case, '_' and anything else as '-', a dot never beside another dot or a dash, 63 at most."""
    name = re.sub(r"[^a-z0-9.-]", "-", plan_name.lower())
    name = re.sub(r"[.-]*\.[.-]*", ".", name)
    return name[:63].strip("-.") or "shardc"


def init_command(manifest_uri: str, name: str) -> str:
    """The init container's shell line: `shardc pull` of the build (every rank of the replica and
    its side files) into /models/<name>, then `shardc verify` on the GPUs; every word shell-quoted."""
    refuse_control(manifest_uri, "manifest_uri", "the manifest URI")
    pull = ["shardc", "pull", DASHES + "manifest", manifest_uri, DASHES + "all", DASHES + "dest", f"/models/{name}"]
    verify = ["shardc", "verify", DASHES + "manifest", f"/models/{name}/manifest.json", DASHES + "device", "cuda"]
    return shlex.join(pull) + " && " + shlex.join(verify)


def pod_spec(s: Search, c: Candidate, init: str, image: str) -> dict[str, Any]:
    """A pod holding one replica: its GPUs (tp x pp x dp), /dev/shm and host memory sized from the
    plan, an init container running ``init`` (the CLI's `shardc pull` of the plan's build into
    /models/<name>, then `shardc verify` on the GPUs), and vLLM serving that very directory with
    `--load-format shardc` (shardc/serving/), whatever the degrees: what was verified is what is
    served, and nothing is downloaded twice. ``image`` runs both containers, so it must hold shardc
    and vLLM (no public image does). The plan's pipeline stages go to vLLM as
    VLLM_PP_LAYER_PARTITION where vLLM's own split differs."""
    assert c.memory is not None and c.pp is not None
    refuse_control(image, "image", "the image")
    gpus, name = c.gpus, pod_name(c)
    shards = sum(r.nbytes for r in c.weights)  # every rank's shard: host memory while they load
    memory = math.ceil((shards + HOST_BASE) / GIB)
    shm = math.ceil(gpus * SHM_PER_GPU / GIB)
    resources = {"nvidia.com/gpu": gpus, "memory": f"{memory}Gi"}
    env = [{"name": "SHARDC_MODEL_DIR", "value": f"/models/{name}"}]
    stages = plan_stages(c)
    if c.pp > 1 and stages != vllm_default_stages(sum(stages), c.pp):
        env.append({"name": PARTITION, "value": ",".join(map(str, stages))})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "vllm", "shardc/plan": name}},
        "spec": {
            "initContainers": [{"name": "shardc-pull", "image": image, "command": ["sh", "-c", init],
                                "resources": {"limits": {"nvidia.com/gpu": gpus}},
                                "volumeMounts": [{"name": "models", "mountPath": "/models"}]}],
            "containers": [{"name": "vllm", "image": image, "command": ["vllm", "serve"],
                            "args": vllm_args(s, c, f"/models/{name}") + _option("served-model-name", s.model_name),
                            "env": env,
                            "resources": {"limits": dict(resources), "requests": dict(resources)},
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                             {"name": "models", "mountPath": "/models"}]}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}},
                        {"name": "models", "emptyDir": {}}],
        },
    }


# --- --check: an existing deployment against the plan -------------------------------------------

_FLAG = re.compile(r"^-{2}([a-z0-9-]+)(?:=(.*))?\Z")


def _flags(tokens: list[str]) -> dict[str, str]:
    """`--name value` / `--name=value` / `--switch` tokens as a dict (a switch maps to "true")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        m = _FLAG.match(tokens[i])
        if m:
            if m.group(2) is not None:
                out[m.group(1)] = m.group(2)
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith(DASHES):
                out[m.group(1)] = tokens[i + 1]
                i += 1
            else:
                out[m.group(1)] = "true"
        i += 1
    return out


def _containers(doc: Any) -> list[dict[str, Any]]:
    """Containers of a Pod, a Deployment/StatefulSet/Job (spec.template.spec) or a bare pod spec."""
    spec = doc.get("spec", doc) if isinstance(doc, dict) else {}
    if isinstance(spec, dict) and isinstance(spec.get("template"), dict):
        spec = spec["template"].get("spec", {})
    found = spec.get("containers") if isinstance(spec, dict) else None
    return [x for x in found if isinstance(x, dict)] if isinstance(found, list) else []


def _split(line: str) -> list[str]:
    """A shell line's words, as sh reads them; one that sh could not read is one PlanError."""
    try:
        return shlex.split(line.replace("\\\n", ""))  # a backslash ending a line continues it, as in sh
    except ValueError as exc:
        raise PlanError(f"cannot read the shell line {line[:60]!r}: {exc}", key="deployment",
                        hint="give a pod spec or `vllm serve` arguments as YAML") from None


def _number(value: Any, kind: type, what: str) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise PlanError(f"{what} must be a number, found {str(value)[:60]!r}", key="deployment",
                        hint="give GPU counts, lengths and the utilization as numbers") from None


_SHELL_C = re.compile(r"-[a-z]*c[a-z]*")  # sh -c, bash -lc, sh -ec: the next word is a shell line


def _listed(ct: dict[str, Any], key: str) -> list[Any]:
    """``ct[key]`` when it is a list, else nothing (absent, or not a list of words)."""
    value = ct.get(key)
    return value if isinstance(value, list) else []


def _words(ct: dict[str, Any]) -> list[str]:
    """A container's argv (command, then args) as the process gets it: each word whole (a served
    model name may hold spaces and quotes), except the line a shell runs (`sh -c LINE`), split."""
    words = [str(x) for key in ("command", "args") for x in _listed(ct, key)]
    shell = bool(words) and words[0].rsplit("/", 1)[-1] in ("sh", "bash", "dash", "ash", "zsh")
    i = next((i for i, w in enumerate(words[1:-1], 1) if _SHELL_C.fullmatch(w)), None) if shell else None
    return words if i is None else words[:i + 1] + _split(words[i + 1]) + words[i + 2:]


def read_deployment(doc: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """(vLLM flags, pod facts) of a deployment: a pod spec whose container runs `vllm serve`, or a
    `vllm serve ...` command line (a string or a list of arguments)."""
    facts: dict[str, Any] = {}
    if isinstance(doc, str):
        return _flags(_split(doc)), facts
    if isinstance(doc, list):
        return _flags([str(x) for x in doc]), facts
    tokens: list[str] = []
    for ct in _containers(doc):
        words = _words(ct)
        if any("vllm" in w or w.startswith(DASHES + "tensor-parallel") for w in words):
            tokens = words
            resources = ct.get("resources")
            limits = resources.get("limits") if isinstance(resources, dict) else None
            if isinstance(limits, dict) and "nvidia.com/gpu" in limits:
                facts["gpus"] = _number(limits["nvidia.com/gpu"], int, "nvidia.com/gpu")
            break
    spec = doc.get("spec", doc) if isinstance(doc, dict) else {}
    if isinstance(spec, dict) and isinstance(spec.get("template"), dict):
        spec = spec["template"].get("spec", {})
    for vol in (spec.get("volumes") or []) if isinstance(spec, dict) else []:
        ed = vol.get("emptyDir") if isinstance(vol, dict) else None
        if isinstance(ed, dict) and ed.get("medium") == "Memory":
            facts["shm"] = ed.get("sizeLimit")
    return _flags(tokens), facts


def _gib(size: Any) -> float | None:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(Gi|G|Mi|M|Ti|T)?\s*$", str(size))
    if not m:
        return None
    scale = {"Gi": 1, "G": 1e9 / GIB, "Mi": 1 / 1024, "M": 1e6 / GIB, "Ti": 1024, "T": 1e12 / GIB, None: 1 / GIB}
    return float(m.group(1)) * scale[m.group(2)]


def check_deployment(s: Search, c: Candidate, doc: Any) -> list[str]:
    """One line per place where the deployment disagrees with the plan (empty: they agree)."""
    flags, facts = read_deployment(doc)
    if not flags and "gpus" not in facts:
        return ["no `vllm serve` arguments found (a pod spec whose container runs vllm serve, or the "
                "command line itself)"]
    # a deployment serving the plan's build (the pod --emit k8s writes) or the source model (the
    # `vllm serve` line --emit vllm prints): each is held to its own options
    build = flags.get("load-format") == "shardc"
    want = {k: "true" if v is None else v for k, v in vllm_options(s, c, build=build).items()}
    defaults = {"pipeline-parallel-size": "1", "tensor-parallel-size": "1", "data-parallel-size": "1",
                "kv-cache-dtype": "auto", "gpu-memory-utilization": "0.9"}
    out = []
    if build and "quantization" in flags:  # vLLM refuses a --quantization the build's config.json contradicts
        out.append(f"{DASHES}quantization: the deployment has {flags['quantization']}, the build's config.json "
                   f"says how it is quantized (drop {DASHES}quantization)")
    for key in ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size", "kv-cache-dtype",
                "gpu-memory-utilization", "enable-expert-parallel", *(() if build else ("quantization",))):
        plan, got = want.get(key, defaults.get(key)), flags.get(key, defaults.get(key))
        if key == "gpu-memory-utilization" and plan and got and math.isclose(float(plan), _number(got, float, key)):
            continue
        if plan != got:
            out.append(f"{DASHES}{key}: the deployment has {got or 'none'}, the plan {plan or 'none'}")
    if "max-model-len" in flags and _number(flags["max-model-len"], int, "max-model-len") > int(want["max-model-len"]):
        out.append(f"{DASHES}max-model-len: the deployment asks {flags['max-model-len']}, the plan's KV pool holds "
                   f"{want['max-model-len']}")
    if "max-num-seqs" in flags and _number(flags["max-num-seqs"], int, "max-num-seqs") < int(want["max-num-seqs"]):
        out.append(f"{DASHES}max-num-seqs: the deployment allows {flags['max-num-seqs']}, the plan's figures are at "
                   f"{want['max-num-seqs']}")
    assert c.pp is not None  # a pick: worked out at its pp
    return out + pod_problems(facts, c.gpus, (c.tp, c.pp, c.dp), "the plan needs", "the plan sizes")


def pod_problems(facts: dict[str, Any], gpus: int, degrees: tuple[int, int, int], needs: str,
                 sizes: str) -> list[str]:
    """A pod's GPU count and /dev/shm against what a launch needs (a plan's pick or a build's)."""
    out = []
    if "gpus" in facts and facts["gpus"] != gpus:
        tp, pp, dp = degrees
        out.append(f"nvidia.com/gpu: the deployment requests {facts['gpus']}, {needs} {gpus} "
                   f"(tp {tp} x pp {pp} x dp {dp})")
    shm = _gib(facts["shm"]) if facts.get("shm") is not None else None
    if shm is not None and shm < gpus * SHM_PER_GPU / GIB:
        out.append(f"/dev/shm: the deployment gives {facts['shm']}, {sizes} "
                   f"{math.ceil(gpus * SHM_PER_GPU / GIB)}Gi ({SHM_PER_GPU // GIB} GiB per GPU)")
    return out
