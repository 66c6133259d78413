"""`shardc plan`: parse the flags, run the planner, print the table / --explain / --json, write --out.

Flag values are parsed by small click types that raise ``PlanError``, so a bad value ends as one
line on stderr with exit code 2 (the ShardcGroup contract) instead of click's usage block. The
planner names its inputs by field (``key="block_size"``, hints quote fields in backticks); the one
field-to-flag table (output.py ``FLAGS``) maps them to this command's flags. Nothing here imports torch: the planner is arithmetic.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import click

from ..errors import PlanError, ShardcError
from ..formats.files import write_atomic
from ..layout.model import PRESETS
from ..units import parse_size
from .options import json_option
from .output import flag_for, in_flags


def flags(text: str) -> str:
    """`field` -> its flag, in a hint, a warning or a report line (unknown names are left alone)."""
    return in_flags(text, plan_cmd)


def _as_flags(exc: ShardcError, key: str | None = None) -> ShardcError:
    """The planner's error, its key and hint in this command's terms."""
    exc.key = key or flag_for(exc.key, plan_cmd) or exc.key
    exc.hint = flags(exc.hint) if exc.hint else exc.hint
    return exc

class _Flag(click.ParamType):
    """A value parser whose failures are PlanErrors naming the flag (one line, exit 2)."""

    def __init__(self, metavar: str, what: str | None, parse: Any) -> None:
        self.name, self.what, self._parse = metavar, what, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        flag = param.opts[0] if param is not None else self.name
        try:
            return self._parse(value)
        except (ValueError, TypeError) as exc:
            msg = f"must be a {self.what}" if self.what else str(exc)
            raise PlanError(f"{msg}, found {value!r}", key=flag) from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise ValueError
        return value

    return parse


def _choice(*values: str) -> Any:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError
        return text

    return parse


POS_INT = _Flag("N", "positive integer", _positive(int))
OBJECTIVE = _Flag("fit|cost|latency", "known objective (fit, cost, latency)", _choice("fit", "cost", "latency"))
POS_FLOAT = _Flag("X", "positive number", _positive(float))
SIZE = _Flag("SIZE", None, parse_size)
DTYPE = _Flag("auto|fp16|bf16|int8|fp8|source", "dtype (auto, fp16, bf16, int8, fp8, source)",
              _choice("auto", "fp16", "bf16", "int8", "fp8", "source"))
KV_DTYPE = _Flag("auto|fp16|bf16|fp8", "KV dtype (auto, fp16, bf16, fp8)", _choice("auto", "fp16", "bf16", "fp8"))


def _param(text: str) -> tuple[str, float]:
    """NAME=VALUE for one named assumption: an overhead (a size, may be 0), a speed parameter, or
    allow_long_context=1 (a max model length beyond the model's, vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    from ..planner.formulas import Overheads, SpeedParams

    name, sep, value = text.partition("=")
    names = [*Overheads.__dataclass_fields__, *SpeedParams.__dataclass_fields__, "allow_long_context"]
    if not sep or name not in names:
        raise ValueError(f"must be NAME=VALUE with NAME one of {', '.join(names)}")
    if name == "allow_long_context":
        if value not in ("0", "1"):
            raise ValueError("allow_long_context must be 0 or 1")
        return name, int(value)
    if name in Overheads.__dataclass_fields__:
        return name, parse_size(value, allow_zero=True)
    number = float(value)
    if number <= 0 or (name == "max_memory_fraction" and number > 1):
        raise ValueError(f"{name} must be positive" + (" and at most 1" if name == "max_memory_fraction" else ""))
    return name, int(number) if name in ("microbatches", "max_num_seqs", "max_num_batched_tokens") else number


PARAM = _Flag("NAME=VALUE", None, _param)


@click.command("plan", epilog="""\b
Examples:
  shardc plan --model llama-3.3-70b --gpu a100-80gb --dtype bf16     # 131,072-token requests: tp=4
  shardc plan --model llama-3.3-70b --gpu a100-80gb --dtype bf16 --max-model-len 32768   # tp=2
  shardc plan --model llama-3.3-70b --gpu a100-80gb --objective cost # cheapest $/Mtok at the target
  shardc plan --model llama-3.3-70b --gpu a100-40gb-pcie --dtype bf16 --max-model-len 32768  # tp4 x pp2
  shardc plan --model llama-3.1-8b --gpu l40s --max-model-len 8192 --concurrency 32 --avg-context 4096
  shardc plan --model llama-3.3-70b --gpu h100-sxm --dtype bf16 --target-tpot-ms 30 --out plans/l70.yaml
  shardc plan --model /data/Llama-3.3-70B-Instruct --gpu a100-80gb --nodes 2 --json
  shardc plan --model llama-3.3-70b --gpu a100-80gb --tp 2 --dtype bf16 --max-model-len 32768 --kv-memory 5.63GiB \\
      --target-tpot-ms 60 --explain      # reproduce vLLM's numbers for a measured KV budget
  shardc plan --model llama-3.3-70b --gpu a100-80gb --lora-adapters 8 --lora-rank 64 --draft-model llama-3.1-8b
  shardc plan --model deepseek-v3 --gpu h200 --dtype fp8 --explain  # MLA latent whole per GPU, EP
  shardc plan --model gpt-oss-120b --gpu h100-sxm  # as published (MXFP4 experts): one GPU
  shardc plan --model llama-3.1-405b --gpu h200 --param activations=2GiB --param hbm_efficiency=0.7
  shardc plan --model build/demo-tp3pp2-bf16 --emit vllm    # a build's own launch: its degrees, --load-format shardc
  shardc plan --model build/x --emit k8s --image REGISTRY/shardc-vllm:TAG --manifest-uri s3://models/x/manifest.json
""")
@click.option("--model", "model_ref", required=True, metavar="PRESET|config.json|DIR",
              help=f"Model preset ({', '.join(PRESETS)}), a config.json, or a checkpoint directory; or a shardc "
              "build's directory (holding manifest.json), whose own launch --emit prints and --check checks.")
@click.option("--gpu", "gpu_name", metavar="PRESET", help="a100-40gb, a100-80gb, a100-40gb-pcie, "
              "a100-80gb-pcie, h100-sxm, h200, l40s, b200, b300, gb200, gb300, rtx-pro-6000. Required, except for "
              "a build's launch.")
@click.option("--gpus-per-node", type=POS_INT, help="GPUs per node: the NVLink domain that TP stays inside. "
              "[default: 8; gb200, gb300: 72, the NVL72 rack]")
@click.option("--gpus", type=POS_INT, help="The GPUs of your node: the same as --gpus-per-node (with --nodes M, "
              "M nodes of that many); both given must agree.")
@click.option("--objective", type=OBJECTIVE, default="fit", show_default=True, metavar="fit|cost|latency",
              help="fit: smallest unit that fits (TP first, then stages); cost: cheapest $/Mtok meeting the "
              "TPOT target; latency: lowest TPOT at batch 1.")
@click.option("--nodes", type=POS_INT, default=1, show_default=True, help="Nodes available.")
@click.option("--dtype", type=DTYPE, default="auto", show_default=True, metavar="auto|source|fp16|bf16|int8|fp8",
              help="Weight dtype. source: a checkpoint published quantized (block FP8, MXFP4, compressed-tensors) "
              "kept as stored, sized at its stored bytes, scales included; auto searches source first when "
              "the checkpoint (or preset) is published so, then its 16-bit dtype, int8 and fp8.")
@click.option("--kv-dtype", type=KV_DTYPE, default="auto", show_default=True, metavar="auto|fp16|bf16|fp8",
              help="KV-cache dtype; auto = 16-bit.")
@click.option("--max-model-len", type=POS_INT, help="Longest request; one of them must fit in the KV cache "
              "(vLLM's check). [default: the model's max_position_embeddings, as vLLM's]")
@click.option("--concurrency", type=POS_INT,
              help="Requests in flight: the speed figures are at this concurrency and the KV cache must hold "
              "them (of --avg-context tokens when given, else isl + osl with --isl/--osl, else --max-model-len). "
              "[default: the most that meet the TPOT/TTFT targets; the KV demand is one request]")
@click.option("--isl", type=POS_INT, help="Prompt tokens per request (prefill). [default: 1536]")
@click.option("--osl", type=POS_INT, help="Output tokens per request (decode). [default: 1024]")
@click.option("--ttft-ms", type=POS_FLOAT, help="Time-to-first-token target, a requirement when given.")
@click.option("--avg-context", type=POS_INT,
              help="Average tokens per request: sizes the --concurrency demand, the batch and the KV reads. "
              "[default: 2048 for speed; the demand uses --max-model-len]")
@click.option("--kv-cache-cap", type=SIZE, help="Ceiling on the KV pool a GPU allocates [default: none (the "
              "pool is what vLLM's budget leaves), or --kv-memory]; a ceiling, not a reservation: the demand "
              "must fit under it.")
@click.option("--kv-memory", type=SIZE, help="KV budget per GPU as a serving engine measured it "
              "(replaces the memory arithmetic, to reproduce an engine's numbers).")
@click.option("--gpu-memory-utilization", type=POS_FLOAT, default=0.9, show_default=True,
              help="Share of GPU memory vLLM's budget takes (weights, activations, NCCL, KV; vLLM's flag); "
              "the CUDA context and graphs must fit in the rest.")
@click.option("--block-size", type=POS_INT, default=16, show_default=True, help="Paged-KV block size in tokens.")
@click.option("--price-per-gpu-hour", type=POS_FLOAT, default=2.80, show_default=True, help="US$ per GPU-hour.")
@click.option("--target-tpot-ms", type=POS_FLOAT,
              help="Decode latency target (time per output token), a requirement when given. "
              "[default: 25 ms, which only sizes the batch]")
@click.option("--demand-tokens-per-s", type=POS_FLOAT, help="Output tokens/s to serve: sizes the replica count.")
@click.option("--lora-adapters", type=POS_INT, help="LoRA adapters resident at once (memory, sharded).")
@click.option("--lora-rank", type=POS_INT, help="Their largest LoRA rank.")
@click.option("--draft-model", metavar="PRESET|config.json|DIR",
              help="Speculative-decoding draft model: its 16-bit weights count as sharded memory.")
@click.option("--tp", "tps", type=POS_INT, multiple=True, help="Only these TP degrees (repeatable).")
@click.option("--pp", "pps", type=POS_INT, multiple=True, help="Only these PP degrees (repeatable).")
@click.option("--gpu-memory", type=SIZE, help="Override the preset's memory (as CUDA reports it).")
@click.option("--hbm-bandwidth", type=POS_FLOAT, metavar="GB/S", help="Override the preset's HBM bandwidth.")
@click.option("--nvlink-bandwidth", type=POS_FLOAT, metavar="GB/S",
              help="Override the intra-node link bandwidth (per GPU, per direction).")
@click.option("--interconnect", default="ib-ndr", show_default=True, metavar="PRESET",
              help="Link between nodes: ib-ndr, ib-hdr, pcie4, pcie5, nvlink3, nvlink4.")
@click.option("--fabric", metavar="PRESET", help="Link inside a node, instead of the GPU preset's: nvlink3, "
              "nvlink4, pcie4, pcie5 (TP up to 4), nvlink-bridge (pairs), xgmi. Sets the TP limit.")
@click.option("--param", "params", type=PARAM, multiple=True, metavar="NAME=VALUE",
              help="Override a named assumption: activations, cuda_context, nccl, cuda_graphs (sizes); "
              "hbm_efficiency, compute_efficiency, link_efficiency, layer_overhead_us, step_overhead_ms, "
              "max_num_batched_tokens, microbatches, max_num_seqs, max_memory_fraction; allow_long_context=1 allows --max-model-len beyond the model's.")
@click.option("--explain", is_flag=True, help="Print the arithmetic line by line with the numbers substituted.")
@json_option
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the recommended plan here (a plan file for `shardc build`).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw tokens/s per GPU vs TPOT of every feasible candidate (Pareto front, the pick) and "
              "memory per GPU into this .svg or .png (needs matplotlib: the plot extra).")
@click.option("--emit", type=_Flag("vllm|k8s", "launch config (vllm, k8s)", _choice("vllm", "k8s")),
              metavar="vllm|k8s", help="Print the pick's `vllm serve` command, or a Kubernetes pod for it.")
@click.option("--manifest-uri", default="s3://CHANGE-ME/manifest.json", show_default=True,
              help="With --emit k8s: where the build's manifest lives (shardc pull's --manifest); for a build's "
              "pod, default: its plan's replica_group.checkpoint.manifest_uri.")
@click.option("--image", help="With --emit k8s (required there): the image both containers run; it must hold "
              "shardc and vLLM (the pod pulls and verifies the build, then vLLM serves it with --load-format "
              "shardc).")
@click.option("--check", "check_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Read a pod spec or `vllm serve` arguments (YAML) and list where they disagree with the "
              "pick, one line each (exit 1).")
def plan_cmd(model_ref: str, gpu_name: str | None, gpus_per_node: int | None, gpus: int | None, objective: str, nodes: int, dtype: str,
             kv_dtype: str, max_model_len: int | None, concurrency: int | None, isl: int | None,
             osl: int | None, ttft_ms: float | None, avg_context: int | None, kv_cache_cap: float | None,
             kv_memory: float | None, gpu_memory_utilization: float, block_size: int,
             price_per_gpu_hour: float, target_tpot_ms: float | None, demand_tokens_per_s: float | None,
             lora_adapters: int | None, lora_rank: int | None, draft_model: str | None,
             tps: tuple[int, ...], pps: tuple[int, ...], gpu_memory: float | None,
             hbm_bandwidth: float | None, nvlink_bandwidth: float | None, interconnect: str,
             fabric: str | None, params: tuple[tuple[str, float], ...], explain: bool, as_json: bool,
             out_file: Path | None, plot_file: Path | None, emit: str | None, manifest_uri: str,
             image: str | None, check_file: Path | None) -> None:
    """Size a deployment: memory, KV cache, speed and cost of every TP x PP x dtype, and the pick.

    The default objective (fit) recommends the smallest unit that holds the model and the KV
    demand (one --max-model-len request, or --concurrency of them) inside vLLM's budget (memory x
    --gpu-memory-utilization), with the CUDA context and graphs in the headroom beyond it: TP
    first, up to the fabric's limit (the NVLink domain; 4 on PCIe), pipeline stages only when no TP
    is enough. The KV cap is a ceiling on the pool, not a reservation. Beside the pick: the fastest
    single-node TP unit with more GPUs, when one is faster. Given a build's directory, --emit and
    --check take the build's own launch (vllm serve DIR --load-format shardc), no search.
    """
    args = dict(locals())
    from .plan_emit import launch_build

    try:
        if not launch_build(click.get_current_context(), args):
            _plan(**args)
    except ShardcError as exc:
        raise _as_flags(exc) from None


def _plan(model_ref: str, gpu_name: str | None, gpus_per_node: int | None, gpus: int | None, objective: str, nodes: int, dtype: str,
          kv_dtype: str, max_model_len: int | None, concurrency: int | None, isl: int | None,
          osl: int | None, ttft_ms: float | None, avg_context: int | None, kv_cache_cap: float | None,
          kv_memory: float | None, gpu_memory_utilization: float, block_size: int, price_per_gpu_hour: float,
          target_tpot_ms: float | None, demand_tokens_per_s: float | None, lora_adapters: int | None,
          lora_rank: int | None, draft_model: str | None, tps: tuple[int, ...], pps: tuple[int, ...],
          gpu_memory: float | None, hbm_bandwidth: float | None, nvlink_bandwidth: float | None,
          interconnect: str, fabric: str | None, params: tuple[tuple[str, float], ...], explain: bool,
          as_json: bool, out_file: Path | None, plot_file: Path | None = None, emit: str | None = None,
          manifest_uri: str = "", check_file: Path | None = None, image: str | None = None) -> None:
    from ..planner.deploy import refuse_control
    from ..planner.explain import explain as explain_lines
    from ..planner.formulas import Overheads, SpeedParams, Workload, speed_for
    from ..planner.gpus import GB, Cluster, get_gpu, get_interconnect, override_gpu
    from ..planner.models import resolve_model
    from ..planner.report import header, summary, table
    from ..planner.search import search
    from .plan_emit import plain_inputs

    plain_inputs(model_ref=model_ref, draft_model=draft_model, manifest_uri=manifest_uri, out=out_file,
                  plot=plot_file, check=check_file, image=image)
    if gpu_name is None:  # only a build's launch takes none (plan_emit.launch_build)
        hint = ("give --gpu PRESET (a100-80gb, h100-sxm, h200, ...), or --model a build's directory (shardc "
                "build's --out, holding manifest.json) to print its launch")
        if Path(model_ref).is_dir():
            raise PlanError(f"{model_ref} holds no manifest.json, so it is not a shardc build, and sizing it as a "
                            "checkpoint needs --gpu", key="--model", hint=hint)
        raise PlanError("is required to size a deployment", key="--gpu", hint=hint)
    model, name, source = resolve_model(model_ref)
    refuse_control(source, "--model", "the model path")  # as resolved: a link may lead to such a name
    draft = None
    if draft_model:
        try:
            draft = resolve_model(draft_model)[0]
        except ShardcError as exc:
            raise _as_flags(exc, "--draft-model") from None
    gpu = override_gpu(
        get_gpu(gpu_name), memory=int(gpu_memory) if gpu_memory else None,
        hbm_bandwidth=hbm_bandwidth * GB if hbm_bandwidth else None,
        link_bandwidth=nvlink_bandwidth * GB if nvlink_bandwidth else None, fabric=fabric,
    )
    cluster = Cluster(gpu, node_gpus(gpus, gpus_per_node) or gpu.domain, nodes, get_interconnect(interconnect))
    named = dict(params)
    workload = Workload(
        avg_context=avg_context, max_model_len=max_model_len, concurrency=concurrency, isl=isl, osl=osl,
        ttft_ms=ttft_ms,
        allow_long_context=bool(named.pop("allow_long_context", 0)),
        kv_cache_cap=int(kv_cache_cap) if kv_cache_cap else None, kv_memory=kv_memory,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, kv_dtype=kv_dtype,
        target_tpot_ms=target_tpot_ms, price_per_gpu_hour=price_per_gpu_hour,
        demand_tokens_per_s=demand_tokens_per_s, lora_adapters=lora_adapters or 0, lora_rank=lora_rank or 0,
    )
    over = Overheads(**{k: int(v) for k, v in named.items() if k in Overheads.__dataclass_fields__})
    speed = speed_for(gpu, **{k: v for k, v in named.items() if k in SpeedParams.__dataclass_fields__})
    result = search(model, cluster, workload, dtypes=None if dtype == "auto" else [dtype], tps=tps or None,
                    pps=pps or None, overheads=over, speed=speed, model_name=name, source=source,
                    objective=objective, draft=draft)
    if check_file is not None or emit is not None:
        from .plan_emit import check, emit_config

        if check_file is not None:
            check(result, check_file)
        else:
            emit_config(result, emit or "", manifest_uri, image)
        return
    if as_json:
        _echo_json(result)
    elif explain:
        evaluated = [c for c in result.candidates if c.memory is not None]
        target = result.recommended or (evaluated[0] if len(evaluated) == 1 else None)
        lines = explain_lines(result, target) if target else table(result)
        click.echo(flags("\n".join([*header(result), "", *lines, "", *summary(result)])))
    else:
        click.echo(flags("\n".join(table(result))))
    rec = result.require_recommendation()
    if plot_file is not None:
        from .plan_emit import plot

        plot(result, plot_file, quiet=as_json)
    if out_file is not None:
        write_plan(result.plan_for(rec, _source_for(source, model_ref, out_file)), out_file, result, rec)
        if not as_json:
            click.echo(f"wrote {out_file} (build it with: shardc build {shlex.quote(str(out_file))})")


def _echo_json(result: Any) -> None:
    """--json: one document on stdout, the figures even when nothing fits (then with the error in it;
    once a document is out, the group's handler prints no second one: ``echo_json``)."""
    from .output import echo_json, error_object

    data = result.to_json()
    try:
        result.require_recommendation()
    except ShardcError as exc:
        data["error"] = error_object(_as_flags(exc))
        echo_json(data)
        raise
    echo_json(data)
    for warning in result.warnings:
        click.echo(f"warning: {flags(warning)}", err=True)


def node_gpus(gpus: int | None, gpus_per_node: int | None) -> int | None:
    """--gpus is --gpus-per-node under the name users reach for; given both, they must agree. None:
    neither given (the GPU preset's node: eight, or an NVL72 rack's 72)."""
    if gpus is not None and gpus_per_node is not None and gpus != gpus_per_node:
        raise PlanError(f"--gpus {gpus} and --gpus-per-node {gpus_per_node} disagree", key="--gpus",
                        hint="--gpus is the GPUs of one node, the same as --gpus-per-node: give one of them")
    return gpus or gpus_per_node


def _source_for(source: str, model_ref: str, out_file: Path) -> str:
    """Presets keep their hf:// source; a local checkpoint is written relative to the plan file."""
    if "://" in source:
        return source
    return os.path.relpath(source, out_file.resolve().parent)


def write_plan(data: dict[str, Any], out_file: Path, result: Any, cand: Any) -> None:
    """Write the plan atomically (temp file + rename), with the planner's figures as a comment."""
    import yaml

    from ..planner.deploy import comment

    assert cand.speed and cand.cost and cand.kv
    head = (
        comment(f"shardc plan: {result.model_name} on {cand.gpus} x {result.cluster.gpu.name}, {cand.label}")
        + comment(f"{cand.speed.tokens_per_s:,.0f} tok/s per replica at {cand.speed.tpot_s * 1e3:.1f} ms TPOT "
                  f"(batch {cand.speed.batch}), ${cand.cost.dollars_per_mtok:.2f}/Mtok, max model length "
                  f"{cand.kv.max_model_len:,}")
    )
    text = head + yaml.safe_dump(data, sort_keys=False)  # the plan as data: every string quoted by PyYAML
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out_file, text.encode())
    except OSError as exc:
        raise PlanError(f"cannot write {out_file}: {exc.strerror}", key="--out") from None


COMMANDS = [plan_cmd]
