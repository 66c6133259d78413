"""One rank's process: join the world, load its own shard, run the job's schedule.

Run by the built-in launcher (``python -m shardc.runtime.worker JOB.json``, torchrun-style env vars)
or in-process under torchrun. A job is plain JSON: the replicas (manifest + shard directory), the
kind of work and its inputs. The rank that holds the answer returns it as plain data and tensors
(``runtime/api_results.py`` ``Wire``: the launcher has it written to ``result.pt``, read back with
``weights_only``); every other rank returns None. The API makes the typed result from it.

Kinds:
  generate  greedy generation of ``prompts`` (token ids); result: tokens per prompt.
  score     forward ``windows`` [N, T]; result: per-position NLL (fp32 log-softmax, fp64 kept),
            optionally the fp32 logits themselves (tests).
  score with ``save_logits``: also write the fp32 logits, losslessly in the plan's 16-bit dtype
            (they are 16-bit GEMM outputs), to a safetensors file: the gate's baseline pass.
  against   the gate's candidate pass: score the windows and compare with the baseline's saved
            logits: per-position NLL of both, KL(baseline || candidate) and top-1 agreement. The
            two passes run one after the other on the same devices, so a gate needs max(baseline,
            candidate) GPUs, not their sum.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DistributedError, ShardcError
from .api_results import Wire

if TYPE_CHECKING:  # the types only: the worker imports them when it runs
    from ..formats.manifest import Manifest


def _replicas(job: dict[str, Any]) -> tuple[list[Any], list[Manifest]]:
    from ..formats.manifest import load
    from .comm import Replica

    reps, manifests, base = [], [], 0
    for i, spec in enumerate(job["replicas"]):
        m = load(spec["manifest"])
        tp, pp, dp = m.layout.tp_degree, m.layout.pp_degree, m.layout.dp_degree
        reps.append(Replica(i, spec.get("name") or m.name, tp, pp, base, dp))
        manifests.append(m)
        base += tp * pp * dp
    return reps, manifests


def world_size(job: dict[str, Any]) -> int:
    """Processes the job needs: the sum of its replicas' tp * pp * dp."""
    reps, _ = _replicas(job)
    return sum(r.size for r in reps)


def execute(job: dict[str, Any], rank: int, world: int, *, hosted_store: bool) -> Wire | None:
    """Run this rank's part of ``job``. Returns the result on the rank that holds it, else None."""
    import torch

    from ..loader.devices import resolve_device
    from .comm import Comm, open_store
    from .decoder import StageModel
    from .engine import StageRunner, Timer
    from .weights import compute_dtype, load_stage, local_dims

    reps, manifests = _replicas(job)
    need = sum(r.size for r in reps)
    if world < need:
        raise DistributedError(
            f"WORLD_SIZE={world} but the job needs {need} processes "
            f"({' + '.join(f'{r.name}: {r.tp}x{r.pp}' for r in reps)})",
            hint=f"launch {need} processes (torchrun --nproc-per-node {need})",
        )
    if rank >= need:  # under torchrun a gate's smaller plan leaves the surplus ranks idle
        return None
    world = need
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    device = torch.device(resolve_device(job.get("device", "cpu")) or "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = float(job.get("timeout_s", 120.0))
    store = open_store(rank, world, timeout, hosted=hosted_store, prefix=f"shardc/{job['id']}")
    comm = Comm(rank, world, reps, store, timeout, backend, device)
    try:
        rep = comm.replica
        manifest = manifests[rep.index]
        layout = manifest.to_layout()
        directory = Path(job["replicas"][rep.index]["dir"])
        t_load = time.perf_counter()
        weights = load_stage(manifest, directory, layout, comm.tp_rank, comm.pp_stage, device, comm.dp_rank)
        # rope and activation as this shardc reads the config (not as an older one recorded them)
        model = StageModel(weights, local_dims(layout), {**layout.model.summary(), "config": manifest.config}, comm,
                           compute_dtype(manifest), device, layout.model.forward)
        load_s = time.perf_counter() - t_load
        comm.mark("loaded")
        comm.wait_all("loaded", float(job.get("load_timeout_s", max(timeout, 600.0))),
                      "waiting for every rank to load its shard")
        runner = StageRunner(comm, model)
        timer = Timer()
        cpu0 = time.process_time()
        kind = job["kind"]
        if kind == "generate":
            result = _generate(job, runner, comm)
        elif kind == "score":
            result = _score(job, runner, comm)
        elif kind == "against":
            result = _against(job, runner, comm)
        else:
            raise ValueError(f"unknown job kind {kind!r}")
        seconds = timer.seconds()
        cpu = time.process_time() - cpu0
        comm.barrier("final barrier")  # nobody tears down while a peer still waits on it
        if result is None:
            return None
        # cpu_seconds: this rank's process CPU time (all threads) while computing
        return {**result, "seconds": seconds, "load_seconds": load_s, "cpu_seconds": cpu}
    finally:
        comm.close()


def _generate(job: dict[str, Any], runner: Any, comm: Any) -> Wire | None:
    g = job["generate"]
    prompts = [list(map(int, p)) for p in g["prompts"]]
    max_new = int(g["max_new_tokens"])
    max_len = max(len(p) for p in prompts) + max_new
    tokens = runner.generate(prompts, max_new, set(g.get("eos", [])), max_len)
    holder = comm.replica.rank(0, comm.replica.pp - 1)
    return {"tokens": tokens, "decode_seconds": runner.decode_seconds} if comm.rank == holder else None


def _windows(job: dict[str, Any]) -> Any:
    import numpy as np
    import torch

    s = job["score"]
    arr = np.load(s["windows_file"]) if "windows_file" in s else np.asarray(s["windows"], dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))


def _score(job: dict[str, Any], runner: Any, comm: Any) -> Wire | None:
    import torch

    windows = _windows(job)
    keep_logits = bool(job["score"].get("return_logits", False))
    save = _LogitSaver(job, windows, comm, runner.model) if job["score"].get("save_logits") else None
    nll, logits_out = [], []
    marks = [time.perf_counter()]  # when each micro-batch's scores were done: steady-state rates

    def on_logits(m: int, logits: torch.Tensor | None) -> None:
        if logits is None or comm.dp_rank:  # DP groups > 0 compute the same logits as group 0
            return
        mb = int(job["score"].get("micro_batch", 1))
        targets = windows[m * mb : (m + 1) * mb, 1:]
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll.append(-lp.gather(-1, targets[..., None].to(lp.device))[..., 0].double().cpu())
        if keep_logits:
            logits_out.append(logits.cpu())
        if save is not None:
            save.write(logits)
        marks.append(time.perf_counter())

    try:
        runner.score(windows, int(job["score"].get("micro_batch", 1)), on_logits)
        if save is not None:
            save.commit()
    finally:
        if save is not None:
            save.abort()
    comm.store.set(f"trace/{comm.rank}", json.dumps(runner.trace))
    if comm.rank != comm.replica.rank(0, comm.replica.pp - 1):
        return None
    comm.wait_all("trace", comm.timeout_s, "collecting compute traces")
    trace = {r: json.loads(comm.store.get(f"trace/{r}")) for r in range(comm.world)}
    out: Wire = {"nll": torch.cat(nll), "tokens": int(windows.numel()),
                           "batch_seconds": torch.tensor(marks).diff(), "trace": trace}
    if keep_logits:
        out["logits"] = torch.cat(logits_out)
    return out


class _LogitSaver:
    """Streams the last stage's logits [windows, T - 1, vocab] into a safetensors file (atomic: a
    temp file renamed at commit). The fp32 logits are casts of the plan's 16-bit GEMM outputs, so
    storing them in that dtype is lossless and halves the file."""

    def __init__(self, job: dict[str, Any], windows: Any, comm: Any, model: Any) -> None:
        from ..formats.safetensors import ShardWriter
        from ..layout.dtypes import from_torch_name

        self.writer = None
        if comm.rank != comm.replica.rank(0, comm.replica.pp - 1):
            return
        s = job["score"]
        name = from_torch_name(str(model.dtype))
        assert name is not None  # the compute dtype, a 16-bit safetensors dtype (weights.compute_dtype)
        n, t = windows.shape
        shape = (n, t - 1, model.d.vocab)
        meta = {"shardc.baseline_cache": json.dumps(s.get("cache_key", {}), sort_keys=True)}
        self.writer = ShardWriter(Path(s["save_logits"]), [("logits", name, shape)], meta)
        self.dtype = model.dtype

    def write(self, logits: Any) -> None:
        import torch

        if self.writer is None:
            return
        part = logits[:, :-1].to(self.dtype)
        assert torch.equal(part.float(), logits[:, :-1]), "logits are not exact in the plan's dtype"
        self.writer.write(part.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())

    def commit(self) -> None:
        if self.writer is not None:
            self.writer.commit()
            self.writer = None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _against(job: dict[str, Any], runner: Any, comm: Any) -> Wire | None:
    """Gate, candidate pass: score the windows; the last TP-0 rank compares with the baseline's
    saved logits, read window by window."""
    import torch
    from safetensors import safe_open

    windows = _windows(job)
    mb = int(job["score"].get("micro_batch", 1))
    cols: dict[str, list[torch.Tensor]] = {"nll_base": [], "nll_cand": [], "kl": [], "top1": []}
    holder = comm.rank == comm.replica.rank(0, comm.replica.pp - 1)
    base = safe_open(job["score"]["baseline_logits"], framework="pt") if holder else None
    rows = base.get_slice("logits") if base is not None else None

    def on_logits(m: int, logits: torch.Tensor | None) -> None:
        if logits is None or comm.dp_rank:  # DP groups > 0 compute the same logits as group 0
            return
        assert rows is not None
        prev = rows[m * mb : (m + 1) * mb].to(logits.device, non_blocking=True).float()
        targets = windows[m * mb : (m + 1) * mb, 1:, None].to(logits.device)
        lb = torch.log_softmax(prev, dim=-1)
        lc = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        cols["nll_base"].append(-lb.gather(-1, targets)[..., 0].double())
        cols["nll_cand"].append(-lc.gather(-1, targets)[..., 0].double())
        # KL(base || cand) = sum_v p_b (log p_b - log p_c): fp32 terms, fp64 sum over the vocabulary.
        cols["kl"].append((lb.exp() * (lb - lc)).double().sum(-1).clamp_min(0))
        cols["top1"].append(lb.argmax(-1) == lc.argmax(-1))
        del prev, lb, lc

    runner.score(windows, mb, on_logits)
    if not holder:
        return None
    out: Wire = {k: torch.cat(v).cpu() for k, v in cols.items()}  # one transfer at the end
    out["tokens"] = int(windows.numel())
    return out


def main(argv: list[str]) -> int:
    """Entry point for the built-in launcher: env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT."""
    job_path = Path(argv[1])
    job = json.loads(job_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = job_path.parent
    try:
        result = execute(job, rank, world, hosted_store=True)
        if result is not None:
            import io

            import torch

            from ..formats.files import write_atomic

            buf = io.BytesIO()
            torch.save(result, buf)
            write_atomic(out_dir / "result.pt", buf.getvalue())
        code = 0
    except BaseException as exc:  # report everything, including KeyboardInterrupt, to the launcher
        report = {
            "rank": rank,
            "type": exc.__class__.__name__,
            "shardc": isinstance(exc, ShardcError),
            "message": exc.one_line() if isinstance(exc, ShardcError) else f"{exc.__class__.__name__}: {exc}",
            "peer": isinstance(exc, DistributedError),
            "traceback": traceback.format_exc(),
        }
        from ..formats.files import write_atomic

        write_atomic(out_dir / f"error-{rank}.json", json.dumps(report).encode())
        print(report["traceback"], file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group whose peer died can block in its destructors.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
