"""Distributed verify: every process checks its own rank's shard, then the group agrees.

Launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment) or any
launcher that sets the same variables. Every wait has a deadline: a peer that never joins, crashes
or hangs makes every live process fail with a message naming it, never a hang.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import DistributedError, ManifestError
from ..formats.manifest import Manifest, typed
from .checks import verify_build
from .devices import check_gpus, node_ranks, resolve_device


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        raise ManifestError(
            f"distributed verify needs {name} in the environment",
            hint="launch with torchrun --nproc-per-node=<tp*pp> -m shardc.cli verify --distributed ...",
        ) from None


def open_rendezvous(rank: int, world: int, timeout_s: float, *, hosted: bool, prefix: str) -> Any:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT under ``prefix`` (so reruns against a
    long-lived store do not collide). Rank 0 hosts it unless ``hosted`` (a launcher or torchrun's
    agent does). The one rendezvous of shardc: distributed verify and the runtime both use it."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise DistributedError("MASTER_PORT is not set", hint="launch with torchrun or shardc's launcher") from None
    try:
        base = dist.TCPStore(addr, port, world, is_master=rank == 0 and not hosted,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise DistributedError(
            f"rank {rank}: cannot reach the rendezvous at {addr}:{port} within {timeout_s:.0f}s "
            f"({exc.__class__.__name__})", hint="is the launcher (or rank 0, which hosts it) still running?",
        ) from None
    return dist.PrefixStore(prefix, base)


def distributed_verify(
    manifest: Manifest | dict[str, Any], directory: Path, *, device: str | None = None, deep: str | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Verify this process's rank and gather every rank's verdict. Raises DistributedError when a
    peer is missing or hung; returns the combined report otherwise (ok=False if any rank failed)."""
    import torch.distributed as dist

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    _env_int("MASTER_PORT")
    manifest = typed(manifest)
    layout = manifest.to_layout()
    if world != layout.plan.world_size:
        raise ManifestError(
            f"WORLD_SIZE={world} but the plan has tp*pp = {layout.plan.world_size} ranks",
            hint=f"launch {layout.plan.world_size} processes",
        )
    # Each process checks on its own GPU (cuda -> cuda:LOCAL_RANK), after making sure the node has
    # one per local rank: 8 ranks on GPU 0 would fit a 70B shard 8 times onto one card.
    check_gpus(layout.plan.name, device, node_ranks(world))
    device = resolve_device(device)
    timeout = timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = open_rendezvous(rank, world, timeout_s, hosted=agent_store, prefix="shardc-verify")
    store.set(f"joined/{rank}", "1")

    mine = verify_build(manifest, directory, [layout.ranks[rank]], device=device, deep=deep)
    store.set(f"done/{rank}", "1")

    def absent(prefix: str) -> list[int]:
        return [r for r in range(world) if not store.check([f"{prefix}/{r}"])]

    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=timeout)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, json.dumps(mine))
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone has read
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError / DistStoreError
        who = _diagnose(store, rank, world, absent)
        raise DistributedError(f"rank {rank}: distributed verify failed after up to {timeout_s:.0f}s: "
                               f"{who} ({exc.__class__.__name__})") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    reports = [json.loads(g) for g in gathered]
    failed = [r for r, rep in enumerate(reports) if not rep["ok"]]
    problems = [p for rep in reports for p in rep["problems"]]
    return {
        "ok": not failed,
        "plan": layout.plan.name,
        "plan_sha256": layout.plan.sha256,
        "this_rank": rank,
        "failed_ranks": failed,
        "problems": sorted(set(problems)),
        "ranks": [rep["ranks"][0] for rep in reports],
    }


def _diagnose(store: Any, rank: int, world: int, absent: Any, linger_s: float = 5.0) -> str:
    """Name the peers that never joined or never finished. Rank 0 hosts the store, so it lingers
    until the others have read their diagnosis (or ``linger_s`` passes) before leaving."""
    import time

    try:
        never = absent("joined")
        hung = [r for r in absent("done") if r not in never]
        store.set(f"diagnosed/{rank}", "1")
    except Exception:  # the store itself is gone: rank 0 died
        return "rank 0 (which hosts the rendezvous) is gone"
    if rank == 0:
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            waiting = [r for r in absent("diagnosed") if r not in never]
            if not waiting:
                break
            time.sleep(0.05)
    if never:
        return f"rank(s) {never} never joined"
    if hung:
        return f"rank(s) {hung} did not finish verifying"
    return "a peer failed mid-collective"
