"""Run in vLLM's venv (.venv-vllm), not by pytest: vLLM's own workers without its engine.

``python vllm_workers.py JOB.json OUT.json`` starts ``tp * pp`` processes that each set up vLLM's
parallel state as its workers do (gloo on CPU), build the model class vLLM picks for the build's
config.json, and fill it with ``--load-format shardc`` from the build; with ``source`` in the job,
they build the same class again and fill it with vLLM's default loader from the source
checkpoint, and compare every parameter byte for byte. Each rank writes what it found (or the
one-line error the load format raised) to OUT.json. No KV cache, no scheduler, no forward: an
engine start is 35-110 s here, this is a few seconds per model, so every family and degree can be
checked against vLLM's own loader (tests/serving/test_vllm_families.py).

JOB: {"tp": N, "pp": N, "expert_parallel": false, "env": {...},
      "cases": [{"name": NAME, "build": DIR, "source": DIR | null, "dtype": "bfloat16"}, ...]}
(the parallel state is set up once per process, then each case is loaded in turn). OUT: one list per
rank of {"name", "parameters", "differ" | "error"}.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback


def _config(model: str, job: dict, load_format: str, dtype: str = "bfloat16"):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, tensor_parallel_size=job["tp"], pipeline_parallel_size=job.get("pp", 1),
                      dtype=dtype, load_format=load_format, enforce_eager=True,
                      skip_tokenizer_init=True, max_model_len=256,
                      enable_expert_parallel=job.get("expert_parallel", False)).create_engine_config()


def _model(vllm_config):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype), \
            torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config)
    loader = get_model_loader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config):
        loader.load_weights(model, vllm_config.model_config)
    return model


def _case(case: dict, cfg, job: dict) -> dict:
    """Load one build with the shardc load format (and its source with vLLM's default loader)."""
    result: dict = {"name": case["name"]}
    try:
        mine = dict(_model(cfg).named_parameters())
        result["parameters"] = len(mine)
        if case.get("source"):
            theirs = dict(_model(_config(case["source"], job, "auto", case.get("dtype", "bfloat16")))
                          .named_parameters())
            result["differ"] = sorted(n for n in mine.keys() | theirs.keys() if n not in mine or n not in theirs
                                      or not _same(mine[n].data, theirs[n].data))
            result["bytes"] = sum(p.numel() * p.element_size() for p in mine.values())
    except Exception as exc:  # the test reads the line the load format raised
        result["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        result["traceback"] = traceback.format_exc()[-3000:]
    return result


def _same(a, b) -> bool:
    """Byte for byte: dtype, shape and every bit (NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def _rank(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(job.get("env", {}))
    # what vLLM's CPU worker sets before it joins the group (vllm/v1/worker/cpu_worker.py init_device):
    # the shared-memory all-reduce names its segment by it, and on a CPU whose vLLM kernels have that
    # all-reduce (AVX-512 builds: torch.ops._C.init_shm_manager) a rank without it stops with a KeyError
    os.environ["VLLM_DIST_IDENT"] = str(port)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what vLLM does in each process: the entry point registers "shardc"
    configs = [_config(c["build"], job, "shardc", c.get("dtype", "bfloat16")) for c in job["cases"]]
    # vLLM creates its expert-parallel group only when the config current at set-up is a MoE one
    first = next((c for c in configs if c.model_config.is_moe), configs[0])
    with set_current_vllm_config(first):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=job["tp"],
                                  pipeline_model_parallel_size=job.get("pp", 1))
    results = []
    for case, cfg in zip(job["cases"], configs, strict=True):
        results.append(_case(case, cfg, job))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    out = sys.argv[2]
    import torch.multiprocessing as mp

    world = job["tp"] * job.get("pp", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(world, port, job, out), nprocs=world, start_method="spawn", join=True)
    results = [json.loads(open(f"{out}.{r}").read()) for r in range(world)]
    for r in range(world):
        os.unlink(f"{out}.{r}")
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
