"""Distributed verify: every process checks its own rank's shard, then the group agrees.

Launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment) or any
launcher that sets the same variables. The verdicts meet in the rendezvous store (rank 0 hosts it,
or torchrun's agent): each rank writes ``joined``, its ``report``, then ``read`` once it holds every
report, so a key that never appears names the rank at fault. Every wait has a deadline: a peer that
never joins, hangs or dies makes every live process fail with a message naming it, never a hang.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import DistributedError, ManifestError
from ..formats.manifest import Manifest
from ..loader.devices import check_gpus, node_ranks, resolve_device
from ..results import to_json
from .checks import verify_build
from .report import RankVerdict, VerifyReport


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        raise ManifestError(
            f"distributed verify needs {name} in the environment",
            hint="launch every rank with torchrun (--nproc-per-node=<tp*pp>), which sets it",
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
            f"({exc.__class__.__name__})",
            hint="is the launcher (or rank 0, which hosts it) running? Raise `timeout_s` if it starts slowly",
        ) from None
    return dist.PrefixStore(prefix, base)


class _NoAnswer(Exception):
    """A store call outlived the deadline ``_within`` gave it."""


def _within(limit_s: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` under a deadline of our own. torch's TCPStore client can block past its own timeout
    when the store's host is alive but stopped (a hung rank 0): with torch 2.13 every call that
    waits for an answer does. The call runs in a daemon thread, left behind if it never returns."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="shardc-store-call")
    t.start()
    t.join(limit_s)
    if t.is_alive():
        raise _NoAnswer(f"no answer within {limit_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class _Bounded:
    """The store calls distributed verify makes, each under ``_within``."""

    def __init__(self, store: Any, limit_s: float) -> None:
        self.store, self.limit_s = store, limit_s

    def set(self, key: str, value: str) -> None:
        _within(self.limit_s, lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return _within(self.limit_s, lambda: self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        return _within(self.limit_s, lambda: self.store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        _within(self.limit_s, lambda: self.store.wait(keys, timeout))


def distributed_verify(
    manifest: Manifest, directory: Path, *, device: str | None = None, deep: str | None = None,
    timeout_s: float = 60.0,
) -> VerifyReport:
    """Verify this process's rank and gather every rank's verdict. Raises DistributedError when a
    peer is missing or hung; returns the combined report otherwise (ok=False if any rank failed)."""
    # c10d logs its own connect retries and timeouts on stderr, with C++ stack frames; the caller gets
    # one DistributedError instead (TORCH_CPP_LOG_LEVEL=INFO shows them). Read when torch loads.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    _env_int("MASTER_PORT")
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
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    run = f"/{os.environ.get('TORCHELASTIC_RUN_ID', '')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    # torchrun's agent store outlives a restart: a run's keys must not be read by the next one.
    # c10d retries a refused connection once, for up to the timeout each time, with a random
    # back-off between the two (up to about the timeout again): its own error must come first.
    try:
        store = _Bounded(_within(3 * timeout_s + 10, lambda: open_rendezvous(
            rank, world, timeout_s, hosted=agent_store, prefix="shardc-verify" + (run if agent_store else ""))),
            timeout_s + 5)
    except _NoAnswer:
        where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
        raise DistributedError(
            f"rank {rank}: the rendezvous at {where} takes connections but does not answer",
            hint=f"is rank 0 (which hosts it) or the launcher stopped? Raise `timeout_s` (now {timeout_s:g}s) "
                 "if it is only slow") from None
    hosts = rank == 0 and not agent_store
    wait = timedelta(seconds=timeout_s)
    phase = "join"

    def keys(what: str) -> list[str]:
        return [f"{what}/{r}" for r in range(world)]

    def failed(exc: BaseException) -> DistributedError:
        who = _diagnose(store, rank, world, phase, timeout_s, hosts=hosts)
        return DistributedError(
            f"rank {rank}: distributed verify failed after up to {timeout_s:g}s: {who} "
            f"({'no answer' if isinstance(exc, _NoAnswer) else exc.__class__.__name__})",
            hint=f"a peer that is only slow needs a larger `timeout_s` (now {timeout_s:g}s)",
        )

    # The verdicts travel through the rendezvous store, each wait bounded by the timeout, so a
    # missing key names the rank at fault; a dead rank 0 (the store's host) fails every store call.
    # Each failure is one DistributedError, never a traceback; verify_build itself stays outside.
    try:
        store.set(f"joined/{rank}", "1")
    except Exception as exc:
        raise failed(exc) from None
    mine = verify_build(manifest, directory, [layout.ranks[rank]], device=device, deep=deep)
    try:
        phase = "report"
        store.set(f"report/{rank}", json.dumps(to_json(mine)))
        store.wait(keys("report"), wait)
        reports = [json.loads(store.get(k)) for k in keys("report")]
        phase = "read"
        store.set(f"read/{rank}", "1")
        store.wait(keys("read"), wait)  # every rank has every verdict: the group agrees
        phase = "leave"
        if not hosts:
            store.set(f"left/{rank}", "1")
    except Exception as exc:
        raise failed(exc) from None
    if hosts:  # rank 0 hosts the store: it stays until the others are past their last wait
        try:
            store.wait(keys("left")[1:], wait)
        except Exception:
            pass  # a peer that stopped after reading every verdict does not change them
    # each peer's report (its JSON form): a rank fails for its file or for the build's own problems
    failed_ranks = tuple(r for r, rep in enumerate(reports) if not rep["ok"])
    problems = tuple(sorted({p for rep in reports for p in rep["problems"]}))
    return VerifyReport(not failed_ranks, layout.plan.name, layout.plan.sha256, problems,
                        tuple(RankVerdict.from_json(rep["ranks"][0]) for rep in reports),
                        this_rank=rank, failed_ranks=failed_ranks)


def _diagnose(store: Any, rank: int, world: int, phase: str, timeout_s: float, *, hosts: bool) -> str:
    """Name the peers at fault from the keys they wrote: never joined, joined but never reported a
    verdict (hung, dead or slow while verifying), or reported but never read the others' (hung or
    dead after reporting). Rank 0 hosts the store (unless a launcher does), so it stays until every
    rank still waiting on the store has its diagnosis (or the timeout passes)."""
    import time

    def absent(what: str, ranks: list[int] | range = range(world)) -> list[int]:
        return [r for r in ranks if not store.check([f"{what}/{r}"])]

    try:
        store.set(f"diagnosed/{rank}", "1")
        never = absent("joined")
        unfinished = [r for r in absent("report") if r not in never] if phase != "read" else []
        unread = [r for r in absent("read") if r != rank] if phase == "read" else []
        if hosts:
            waiting = [r for r in range(1, world) if r not in never + unfinished + unread]
            deadline = time.monotonic() + timeout_s
            while absent("diagnosed", waiting) and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # the store itself is gone: rank 0 died (or hangs, and the store with it)
        return "rank 0 (which hosts the rendezvous) is gone or not answering"
    parts = [f"rank(s) {never} never joined"] if never else []
    parts += [f"rank(s) {unfinished} did not finish verifying"] if unfinished else []
    parts += [f"rank(s) {unread} stopped answering after reporting (hung or killed)"] if unread else []
    return "; ".join(parts) or "a peer was late (it reported just after the timeout)"
