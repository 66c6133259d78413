"""Run a job on tp x pp processes: the built-in launcher, or in-process under torchrun.

The launcher hosts the rendezvous store itself (a TCPStore on a free port chosen by the OS), so it
can read every rank's heartbeat, and starts one ``python -m shardc.runtime.worker`` per rank with
torchrun's environment variables. It watches the processes: a rank that dies is named at once (and
the others are stopped rather than left to time out); a rank that hangs makes its peers' collectives
time out, and the launcher names the rank that neither finished nor reported an error. A watchdog
stops everything if no heartbeat moves for longer than the collective timeout allows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import shardc.errors as errors

from ..errors import DistributedError, ShardcError
from .api_results import Wire

POLL_S = 0.05
GRACE_S = 3.0  # after one rank fails, how long the others get to report before they are stopped


def in_torchrun() -> bool:
    """True inside a torchrun (or other env://) launch: run this rank in-process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_PORT" in os.environ)


def run_job(job: dict[str, Any], *, quiet: bool = True) -> Wire | None:
    """Execute ``job`` and return its result's wire form: spawn the ranks, or (under torchrun) be one of them.

    Under torchrun every rank calls this; only the rank holding the result gets it back.
    """
    job = dict(job)
    job.setdefault("id", uuid.uuid4().hex[:12])
    check_devices(job, torchrun=in_torchrun())
    if in_torchrun():
        from .worker import execute

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # Every rank derives the same id; a gate's two passes (``phase``) get separate prefixes.
        job["id"] = f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'env')}-" \
                    f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{job.get('phase', 'job')}"
        hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return execute(job, rank, world, hosted_store=hosted)
    return launch(job, quiet=quiet)


def check_devices(job: dict[str, Any], *, torchrun: bool) -> None:
    """Before anything loads: a CUDA job needs one visible GPU per rank on this node (DeviceError,
    exit 2, otherwise), and ``cuda:N`` pins a single rank, not several."""
    from ..errors import DeviceError
    from ..loader.devices import check_gpus, node_ranks
    from .worker import _replicas

    device = str(job.get("device", "cpu"))
    if not device.startswith("cuda"):
        return
    reps, _ = _replicas(job)
    world = sum(r.size for r in reps)
    if device != "cuda" and world > 1:
        raise DeviceError(f"{device} pins one GPU, but plan {reps[0].name} has {world} ranks",
                          key="device", hint="use `device` cuda: rank r runs on cuda:LOCAL_RANK")
    name = " + ".join(r.name for r in reps)
    check_gpus(name, device, node_ranks(world) if torchrun else world)


def launch(job: dict[str, Any], *, quiet: bool = True) -> Wire | None:
    """Spawn one process per rank, wait, and return the result (or raise a ShardcError naming ranks)."""
    import torch
    import torch.distributed as dist

    from .worker import world_size

    world = world_size(job)
    timeout = float(job.get("timeout_s", 120.0))
    load_timeout = float(job.get("load_timeout_s", max(timeout, 600.0)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if job.get("device", "cpu") == "cpu":
        job.setdefault("threads", max(1, cores // world))
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                          timeout=timedelta(seconds=max(timeout, 30.0)), wait_for_workers=False)
    prefix = dist.PrefixStore(f"shardc/{job['id']}", store)
    with tempfile.TemporaryDirectory(prefix="shardc-job-") as tmp:
        d = Path(tmp)
        (d / "job.json").write_text(json.dumps(job))
        procs, logs = [], []
        try:
            for rank in range(world):
                env = dict(os.environ)
                env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port), "OMP_NUM_THREADS": str(job.get("threads") or 1),
                    "TOKENIZERS_PARALLELISM": "false",
                })
                log = open(d / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "shardc.runtime.worker", str(d / "job.json")],
                    env=env, stdout=log if quiet else None, stderr=log, start_new_session=True,
                ))
            _watch(procs, d, prefix, world, job, timeout, load_timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    _stop(p)
            for log in logs:
                log.close()
        result_path = d / "result.pt"
        if not result_path.is_file():
            raise DistributedError("the job finished but no rank wrote a result", hint="this is a bug")
        return torch.load(result_path, weights_only=True)


def _stop(p: subprocess.Popen) -> None:
    """Stop one of our rank processes (its own session: SIGKILL the process group we created)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _who(job: dict[str, Any], rank: int) -> str:
    from .comm import describe
    from .worker import _replicas

    try:
        reps, _ = _replicas(job)
    except ShardcError:
        return f"rank {rank}"
    return describe(reps, rank)


def _tail(d: Path, rank: int, lines: int = 3) -> str:
    try:
        text = (d / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def _beats(store: Any, world: int) -> dict[int, int]:
    out = {}
    for r in range(world):
        try:
            out[r] = int(store.get(f"beat/{r}")) if store.check([f"beat/{r}"]) else 0
        except Exception:
            out[r] = 0
    return out


def _watch(procs: list[subprocess.Popen], d: Path, store: Any, world: int, job: dict[str, Any],
           timeout: float, load_timeout: float) -> None:
    """Wait for every rank; raise the most telling error as soon as something goes wrong."""
    first_fail: float | None = None
    last = _beats(store, world)
    last_change = last_poll = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        now = time.monotonic()
        if failed and first_fail is None:
            first_fail = now
        running = [r for r, c in enumerate(codes) if c is None]
        if failed:
            assert first_fail is not None  # set above at the first failure
            if not running or now - first_fail > GRACE_S or _died(codes, d):
                raise _diagnose(codes, d, job, store, world)
        if now - last_poll > 0.5:  # heartbeats: the backstop for a job where nobody times out
            last_poll = now
            beats = _beats(store, world)
            if beats != last:
                last, last_change = beats, now
            elif now - last_change > _stall_limit(store, world, timeout, load_timeout):
                low = min(beats.values())
                stuck = [r for r in running if beats[r] == low]
                names = ", ".join(_who(job, r) for r in stuck) or "every rank"
                raise DistributedError(
                    f"no progress for {now - last_change:.0f}s: {names} stopped at step {low}",
                    hint="a rank is hung; see its log, or raise `timeout_s` if it is only slow",
                )
        time.sleep(POLL_S)


def _stall_limit(store: Any, world: int, timeout: float, load_timeout: float) -> float:
    """Workers time out on their own after ``timeout``; this is only the backstop."""
    try:
        loaded = all(store.check([f"loaded/{r}"]) for r in range(world))
    except Exception:
        loaded = False
    return (timeout if loaded else load_timeout) * 2 + 30


def _died(codes: list[int | None], d: Path) -> bool:
    """A rank that exited without an error report crashed (killed, OOM): no need to wait."""
    return any(c not in (None, 0) and not (d / f"error-{r}.json").is_file() for r, c in enumerate(codes))


def _diagnose(codes: list[int | None], d: Path, job: dict[str, Any], store: Any, world: int) -> ShardcError:
    """Pick the root cause: a crashed rank, else a rank's own error, else a hung rank, else a timeout."""
    reports = {}
    for r in range(len(codes)):
        try:
            reports[r] = json.loads((d / f"error-{r}.json").read_text())
        except (OSError, json.JSONDecodeError):
            pass
    crashed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in reports]
    if crashed:
        r = crashed[0]
        c = codes[r]
        assert c is not None
        how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with code {c}"
        tail = _tail(d, r)
        return DistributedError(
            f"{_who(job, r)} {how}" + (f" (last output: {tail})" if tail else ""),
            hint="the other ranks were stopped; check that rank's host (OOM killer, preemption)",
        )
    own = [rep for rep in reports.values() if not rep.get("peer")]
    if own:
        rep = min(own, key=lambda x: x["rank"])
        cls = getattr(errors, rep["type"], None) if rep.get("shardc") else None
        msg = f"{_who(job, rep['rank'])}: {rep['message']}"
        if isinstance(cls, type) and issubclass(cls, ShardcError):
            err = cls(msg)
            return err
        return DistributedError(msg, hint="unexpected error in a rank; rerun with `debug` for its traceback")
    hung = [r for r, c in enumerate(codes) if c is None]
    peer = reports[min(reports)] if reports else None
    if hung:
        names = ", ".join(_who(job, r) for r in hung)
        detail = f" (first report: {peer['message']})" if peer else ""
        return DistributedError(
            f"{names} hung: the other ranks timed out waiting for it{detail}",
            hint="see that rank's log; raise `timeout_s` only if it is merely slow",
        )
    if peer:
        return DistributedError(peer["message"])
    return DistributedError("the job failed without a report", hint="rerun with `debug`")
