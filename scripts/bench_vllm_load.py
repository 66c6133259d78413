#!/usr/bin/env python3
"""vLLM weight loading (issue #42): ``--load-format shardc`` on a shardc build against vLLM's default
loader on the source checkpoint, the same model at the same tp, in the same run.

Run with the main venv's python: it writes a synthetic bf16 Llama checkpoint (shardc's seeded writer;
head_dim 128, a vocabulary that is a multiple of 128, so vLLM's vocabulary cut is shardc's), builds it
with shardc at tp=2 bf16 twice, once with sha256 chunk digests (the default) and once with blake3
(``replica_group.checkpoint.chunk_digest``), all in a temp directory, then runs vLLM in a child process with vLLM's own
python (``--vllm-python``, default .venv-vllm/bin/python in this checkout, or in ../main beside a
git worktree).

What is timed, and why not the engine: an engine start costs 35-110 s on a 2-core CPU host, most of
it not loading, and its workers' pids and logs would have to be fished out of the engine. The child
is instead the no-engine harness of tests/serving/vllm_workers.py: ``tp`` processes that set up
vLLM's parallel state as its workers do (gloo; each pinned to one core with one torch thread, as
``VLLM_CPU_OMP_THREADS_BIND=0|1`` binds the engine's), build the model class vLLM picks, and call
the very ``load_weights`` of the loader vLLM's ``get_model_loader`` returns (the default loader for
the checkpoint, shardc's for the build: every shard byte checked against the manifest). Each worker
times its ``load_weights`` and reads its own ``/proc/self/io`` just before and just after it.

Two phases per loader, each loader first in turn from round to round:
  * timed: every worker loads at once, as in an engine start, page cache dropped first
    (``echo 3 > /proc/sys/vm/drop_caches``, needs root; else every file is read once first and the
    output says "warm cache"); the load time is the slowest worker's (the engine waits for all);
  * bytes: each worker alone, the page cache dropped just before it: ``read_bytes`` (what it made the
    kernel fetch from storage, readahead included) against the checkpoint's size. On one host the
    workers share the page cache, so in the timed phase one worker's reads serve the other; alone,
    each worker's figure is what it needs from disk on a host of its own.
Finally every shardc model's parameters are compared byte for byte with the default loader's on every
worker, and each worker times hashing its shard in memory with each digest (the floor of a checked load
on its one core).

Examples:
  python scripts/bench_vllm_load.py                        # ~0.6 GB checkpoint, tp=2, 3 rounds
  python scripts/bench_vllm_load.py --size-gb 1 --repeat 5 --json /tmp/vllm_load.json
  python scripts/bench_vllm_load.py --chunk-digest sha256     # only the build with sha256 chunk digests
  python scripts/bench_vllm_load.py --vllm-python /opt/vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# vLLM's venv: the checkout's own, else the main checkout's beside this git worktree
VLLM_PYTHONS = [ROOT / ".venv-vllm" / "bin" / "python", ROOT.parent / "main" / ".venv-vllm" / "bin" / "python"]
DEFAULT_VLLM_PYTHON = next((p for p in VLLM_PYTHONS if p.exists()), VLLM_PYTHONS[0])
DIGESTS = ("sha256", "blake3")  # a build's chunk digests (replica_group.checkpoint.chunk_digest)
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -- the checkpoint and the build (main venv) -------------------------------------------------------
def shape_for(size_gb: float) -> dict[str, Any]:
    """A Llama shape of about ``size_gb`` GB in bf16: 2048 hidden, 16 heads of 128 (vLLM's CPU
    attention takes head_dim 32, 64, 80, 96, 112, 128, ...), 4 KV heads (a multiple of tp 2 and 4),
    a 32000-row vocabulary (250 x 128: vLLM pads its vocabulary to 64 rows per rank, shardc cuts it
    evenly) untied, and as many layers as fill the rest."""
    hidden, inter, heads, kv, vocab = 2048, 5632, 16, 4, 32000
    head_dim = hidden // heads
    per_layer = 2 * (hidden * hidden * 2 + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden)
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    return dict(hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
                num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab)


def make_model(root: Path, size_gb: float, tp: int, digests: tuple[str, ...] = DIGESTS) -> tuple[Path, dict[str, Path]]:
    """The synthetic checkpoint and its shardc builds at ``tp``, bf16, one per chunk digest (the
    plan's replica_group.checkpoint.chunk_digest): (source dir, {"shardc-<digest>": build dir})."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    src = write_checkpoint(root / "src", llama_config(**shape_for(size_gb)))
    builds = {}
    for digest in digests:
        plan = plan_from_dict({"replica_group": {"name": "bench-vllm", "tp_degree": tp, "pp_degree": 1,
                                                 "dtype": "bf16", "gpus_per_replica": tp,
                                                 "checkpoint": {"chunk_digest": digest}},
                               "model": {"source": str(src)}})
        builds[f"shardc-{digest}"] = build(plan, out_dir=root / f"build-{digest}").manifest_path.parent
    return src, builds


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


# -- the worker harness (vLLM's venv) ---------------------------------------------------------------
def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def _drop_or_warm(job: dict[str, Any]) -> str:
    """Empty the page cache (root), else read every file of both models once: returns which."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return "cold (drop_caches)"
    except OSError:
        for p in job["files"]:
            with open(p, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
        return "warm cache"


def _config(model: str, job: dict[str, Any], load_format: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, tensor_parallel_size=job["tp"], dtype="bfloat16", load_format=load_format,
                      enforce_eager=True, skip_tokenizer_init=True, max_model_len=256).create_engine_config()


def _load(cfg: Any, model: Any) -> tuple[float, dict[str, int]]:
    """vLLM's loader for ``cfg`` (as vLLM's worker gets it) filling ``model``: seconds, io delta."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(cfg.load_config)
    with set_current_vllm_config(cfg):
        before, t0 = _io(), time.perf_counter()
        loader.load_weights(model, cfg.model_config)
        seconds, after = time.perf_counter() - t0, _io()
    return seconds, {k: after[k] - before[k] for k in ("read_bytes", "rchar")}


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    os.environ.update(job["env"])
    cpus = sorted(os.sched_getaffinity(0))
    import torch

    if len(cpus) >= world:  # one core and one thread per worker, as the engine binds them
        os.sched_setaffinity(0, {cpus[rank]})
        torch.set_num_threads(1)
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype

    load_general_plugins()  # the entry point registers "shardc", as in every vLLM process
    # vLLM's CPU worker sets this before it joins the group (cpu_worker.py init_device); its shared-memory
    # all-reduce (AVX-512 builds) names its segment by it
    os.environ["VLLM_DIST_IDENT"] = str(port)
    loaders = ["default", *job["builds"]]
    cfgs = {"default": _config(job["source"], job, "auto"),
            **{name: _config(path, job, "shardc") for name, path in job["builds"].items()}}
    with set_current_vllm_config(cfgs[loaders[1]]):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=world)
    models = {}
    for name, cfg in cfgs.items():
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            models[name] = initialize_model(vllm_config=cfg)
    import shardc

    res: dict[str, Any] = {"rank": rank, "cpus": sorted(os.sched_getaffinity(0)), "shardc": shardc.__file__,
                           "setup_s": time.time() - job["t0"], "first": {}, "timed": {n: [] for n in loaders},
                           "alone": {}}
    # round 0 is each loader's first load in the process (its lazy imports, shardc's modules among
    # them, and its code paths run for the first time): recorded apart, not in the medians
    for r in range(job["repeat"] + 1):
        for name in loaders[r % len(loaders):] + loaders[:r % len(loaders)]:  # each loader first in turn
            dist.barrier()
            if rank == 0:
                res["cache"] = _drop_or_warm(job)
            dist.barrier()
            seconds, io = _load(cfgs[name], models[name])
            if r == 0:
                res["first"][name] = seconds
            else:
                res["timed"][name].append({"seconds": seconds, **io})
    for name in loaders:
        res["alone"][name] = None
        for r in range(world):
            dist.barrier()
            if rank == r:
                _drop_or_warm(job)
                seconds, io = _load(cfgs[name], models[name])
                res["alone"][name] = {"seconds": seconds, **io}
    dist.barrier()
    theirs = dict(models["default"].named_parameters())
    res["parameters"], res["differ"] = len(theirs), []
    for name in loaders[1:]:
        mine = dict(models[name].named_parameters())
        res["differ"] += sorted(f"{name}: {n}" for n in mine.keys() | theirs.keys() if n not in mine or n not in theirs
                                or not _same(mine[n].data, theirs[n].data))
    res["hash_s"] = _hash_floor(job, rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)


def _hash_floor(job: dict[str, Any], rank: int) -> dict[str, float]:
    """Seconds to hash this worker's shard with each build's digest on its one core, the bytes
    already in memory: the least any loader that checks every byte can take here."""
    from shardc.digests import new_hash

    name = f"model-tp{rank:02d}-pp00.safetensors"
    out = {}
    for loader, path in job["builds"].items():
        data = Path(path, name).read_bytes()
        digest = json.loads(Path(path, "manifest.json").read_text())["shards"][name].get("chunk_digest", "sha256")
        t0 = time.perf_counter()
        for i in range(0, len(data), 16 << 20):
            new_hash(digest).update(memoryview(data)[i : i + (16 << 20)])
        out[loader] = time.perf_counter() - t0
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def worker_main(job_path: str, out: str) -> None:
    """The child (vLLM's python): ``tp`` worker processes, their results gathered into ``out``."""
    import socket

    import torch.multiprocessing as mp

    job = {**json.loads(Path(job_path).read_text()), "t0": time.time()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(job["tp"], port, job, out), nprocs=job["tp"], start_method="spawn", join=True)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(job["tp"])]
    Path(out).write_text(json.dumps(results))


# -- the parent: run, sum up, print -----------------------------------------------------------------
def run_vllm(vllm_python: Path, job: dict[str, Any], tmp: Path, timeout: int) -> list[dict[str, Any]]:
    (tmp / "job.json").write_text(json.dumps(job))
    # this checkout's shardc (its plugin module too: the entry point names the module, the path finds it),
    # and its bytecode kept for the run, as an installed package has it (a checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would compile shardc's modules inside the first timed load)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONPYCACHEPREFIX": str(tmp / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    log = tmp / "vllm.log"
    with open(log, "w") as f:
        p = subprocess.run([str(vllm_python), __file__, "--worker", str(tmp / "job.json"), str(tmp / "out.json")],
                           stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=tmp)
    if p.returncode:
        sys.stderr.write("\n".join(log.read_text().strip().splitlines()[-25:]) + "\n")
        raise SystemExit(f"bench_vllm_load.py: vLLM's workers failed (exit {p.returncode}); the end of "
                         "their output is above")
    return json.loads((tmp / "out.json").read_text())


def summarize(ranks: list[dict[str, Any]], ckpt_bytes: int, shard_bytes: list[int], manifest_bytes: int,
              tp: int) -> dict[str, Any]:
    """Per loader: the median over rounds of the slowest worker's load seconds, and each worker's
    read_bytes alone; each shardc build's time over the default's, and the bytes target
    (checkpoint / tp + manifest) each shardc worker is held to."""
    out: dict[str, Any] = {"method": "in-process harness: vLLM's workers' parallel state and loaders, no engine",
                           "cache": ranks[0].get("cache"), "tp": tp, "checkpoint_bytes": ckpt_bytes,
                           "manifest_bytes": manifest_bytes, "shard_bytes": shard_bytes,
                           "target_bytes_per_worker": ckpt_bytes / tp + manifest_bytes,
                           "parameters": ranks[0]["parameters"],
                           "differ": sorted({n for r in ranks for n in r["differ"]}), "loaders": {}}
    for name in ranks[0]["timed"]:
        rounds = len(ranks[0]["timed"][name])
        slowest = [max(r["timed"][name][i]["seconds"] for r in ranks) for i in range(rounds)]
        out["loaders"][name] = {
            "load_s": statistics.median(slowest), "load_s_rounds": slowest,
            "timed_read_bytes_per_worker": [statistics.median(t["read_bytes"] for t in r["timed"][name])
                                            for r in ranks],
            "alone_read_bytes_per_worker": [r["alone"][name]["read_bytes"] for r in ranks],
            "alone_rchar_per_worker": [r["alone"][name]["rchar"] for r in ranks],
            "alone_s_per_worker": [r["alone"][name]["seconds"] for r in ranks],
            "first_load_s": max(r["first"][name] for r in ranks)}
        if name != "default":
            out["loaders"][name]["time_ratio"] = out["loaders"][name]["load_s"] / out["loaders"]["default"]["load_s"]
            out["loaders"][name]["hash_only_s"] = max(r["hash_s"][name] for r in ranks)
    out["setup_s"] = max(r["setup_s"] for r in ranks)
    return out


def report(s: dict[str, Any], repeat: int) -> None:
    gb, ck = 1e9, s["checkpoint_bytes"]
    d = s["loaders"]["default"]
    mine = {n: v for n, v in s["loaders"].items() if n != "default"}
    print(f"vLLM load, tp={s['tp']}, checkpoint {ck / gb:.3f} GB bf16 ({s['parameters']} parameters per worker); "
          f"{s['method']}; page cache: {s['cache']}; median of {repeat} round(s), each loader first in turn")
    print(f"  load_weights, slowest worker: default loader {d['load_s']:.2f}s (rounds "
          f"{', '.join(f'{x:.2f}' for x in d['load_s_rounds'])})")
    for n, c in mine.items():
        print(f"    {n}: {c['load_s']:.2f}s (rounds {', '.join(f'{x:.2f}' for x in c['load_s_rounds'])}), every byte "
              f"checked: {n} / default = {c['time_ratio']:.2f}x (target <= 1.0x); hashing its shard alone, "
              f"in memory on the worker's one core: {c['hash_only_s']:.2f}s")
    print("  (each loader's first load in its processes, imports included, not in the medians: "
          + ", ".join(f"{n} {v['first_load_s']:.2f}s" for n, v in s["loaders"].items()) + ")")
    print(f"  bytes read from disk per worker, each alone with the page cache dropped "
          f"(/proc/self/io read_bytes; shardc's target ~ checkpoint / {s['tp']} + manifest = "
          f"{s['target_bytes_per_worker'] / gb:.3f} GB):")
    for r in range(s["tp"]):
        a = d["alone_read_bytes_per_worker"][r]
        print(f"    worker {r} (its shard {s['shard_bytes'][r] / gb:.3f} GB): " + ", ".join(
            f"{n} {c['alone_read_bytes_per_worker'][r] / gb:.3f} GB "
            f"({c['alone_read_bytes_per_worker'][r] / ck:.2f}x the checkpoint)" for n, c in mine.items())
            + f", default {a / gb:.3f} GB ({a / ck:.2f}x)")
    print("  all workers together while loading at once (one shared page cache): " + ", ".join(
        f"{n} {sum(c['timed_read_bytes_per_worker']) / gb:.3f} GB" for n, c in s["loaders"].items()))
    same = "every parameter byte-identical" if not s["differ"] else f"PARAMETERS DIFFER: {s['differ'][:5]}"
    print(f"  each shardc build's model against the default loader's: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.6, help="checkpoint size, GB (bf16); default 0.6")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per loader (default 3)")
    ap.add_argument("--chunk-digest", choices=(*DIGESTS, "both"), default="both",
                    help="the builds' chunk digests, which shardc checks as it loads: one build per digest "
                         "(default both)")
    ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="the python of vLLM's venv (default: .venv-vllm/bin/python)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for vLLM's workers (default 600)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(*a.worker)
        return
    sys.path.insert(0, str(ROOT))  # this checkout's shardc writes the build its plugin loads
    from shardc.errors import ShardcError
    vllm_python = Path(a.vllm_python)
    if not os.access(vllm_python, os.X_OK):
        ap.error(f"--vllm-python {vllm_python} is not an executable: give the python of a venv with vLLM "
                 "and shardc installed")
    if not 0.05 <= a.size_gb <= 64 or a.tp < 1 or a.repeat < 1:
        ap.error("--size-gb must be 0.05-64, --tp and --repeat at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-", dir=os.environ.get("BENCH_DIR")) as t:
        tmp = Path(t)
        t0 = time.perf_counter()
        try:
            src, builds = make_model(tmp, a.size_gb, a.tp, DIGESTS if a.chunk_digest == "both" else (a.chunk_digest,))
        except ShardcError as exc:  # e.g. a tp the model's 16 heads, 4 KV heads or vocabulary do not divide
            ap.error(f"--tp {a.tp}: {exc.one_line()}")
        print(f"checkpoint and {len(builds)} tp={a.tp} build(s) written in {time.perf_counter() - t0:.1f}s "
              f"under {tmp}", flush=True)
        from shardc.formats.manifest import load

        first = next(iter(builds.values()))
        ranks_files = [first / rl.file for rl in load(first / "manifest.json").to_layout().ranks]
        job = {"tp": a.tp, "repeat": a.repeat, "source": str(src), "builds": {n: str(p) for n, p in builds.items()},
               "files": [str(p) for p in files_of(src) + [f for b in builds.values() for f in files_of(b)]],
               "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                   str(i) for i in range(a.tp)), "VLLM_LOGGING_LEVEL": "WARNING"}}
        ranks = run_vllm(vllm_python, job, tmp, a.timeout)
        s = summarize(ranks, sum(p.stat().st_size for p in src.glob("*.safetensors")),
                      [p.stat().st_size for p in ranks_files], (first / "manifest.json").stat().st_size, a.tp)
        s["shardc_module"] = ranks[0]["shardc"]
    report(s, a.repeat)
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1) + "\n")
    if s["differ"]:  # a faster load of other weights is no figure
        raise SystemExit(f"bench_vllm_load.py: {len(s['differ'])} parameters differ between the two loaders")


if __name__ == "__main__":
    main()
