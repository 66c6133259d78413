"""Process groups for one or more replicas in one torch.distributed world, with timeouts that name ranks.

A world holds one replica (``shardc run``) or two side by side (``shardc gate`` runs baseline and
candidate together so their logits can be compared position by position). Inside a replica, global
rank = base + (pp_stage * dp + dp_rank) * tp + tp_rank (TP groups contiguous, docs/architecture.md
§3.2; dp = 1 unless the plan has attention data parallelism). Each (replica, stage, DP group) gets
its own TP group, and with dp > 1 each (replica, stage) an expert group of all its dp x tp ranks;
pipeline hand-offs are point-to-point on the world group between equal TP and DP ranks.

Every collective and point-to-point wait runs under the process-group timeout. A failure is
re-raised as DistributedError that says which operation failed and which ranks were behind, read
from per-rank heartbeats in the rendezvous store, so a dead or hung peer is named instead of
leaving the job hanging.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError

BEAT_S = 0.25  # least interval between heartbeat writes on a GPU


@dataclass(frozen=True)
class Replica:
    """One plan's ranks inside the world."""

    index: int
    name: str
    tp: int
    pp: int
    base: int  # first global rank
    dp: int = 1  # attention data-parallel groups per stage (expert-parallel plans)

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, pp_stage: int, dp_rank: int = 0) -> int:
        return self.base + (pp_stage * self.dp + dp_rank) * self.tp + tp_rank

    def owns(self, rank: int) -> bool:
        return self.base <= rank < self.base + self.size

    def place(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_stage) of a global rank in this replica."""
        local = rank - self.base
        return local % self.tp, local // (self.tp * self.dp)

    def dp_of(self, rank: int) -> int:
        return (rank - self.base) // self.tp % self.dp


def describe(replicas: list[Replica], rank: int) -> str:
    """'rank 3 (candidate tp 0, pp 1)': how errors name a rank."""
    for r in replicas:
        if r.owns(rank):
            t, p = r.place(rank)
            name = f"{r.name} " if len(replicas) > 1 else ""
            dp = f", dp {r.dp_of(rank)}" if r.dp > 1 else ""
            return f"rank {rank} ({name}tp {t}, pp {p}{dp})"
    return f"rank {rank}"


def open_store(rank: int, world: int, timeout_s: float, *, hosted: bool, prefix: str) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT (hosted by the launcher or torchrun's agent,
    else by rank 0), under a per-job prefix so reruns against a long-lived store do not collide."""
    from ..verify.distributed import open_rendezvous

    return open_rendezvous(rank, world, timeout_s, hosted=hosted, prefix=prefix)


class Comm:
    """This process's communication: TP collectives, pipeline send/recv, heartbeats, diagnosis."""

    def __init__(self, rank: int, world: int, replicas: list[Replica], store: dist.Store,
                 timeout_s: float, backend: str, device: torch.device) -> None:
        self.rank, self.world, self.replicas = rank, world, replicas
        self.store, self.timeout_s, self.device = store, timeout_s, device
        self.replica = next(r for r in replicas if r.owns(rank))
        self.tp = self.replica.tp
        self.tp_rank, self.pp_stage = self.replica.place(rank)
        self.dp_rank = self.replica.dp_of(rank)
        self.step = 0
        self._beat_at = 0.0
        timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                    world_size=world, timeout=timeout)
            # new_group is collective over the whole world: every rank creates every group, in order.
            self.tp_group: Any = None
            self.ep_group: Any = None  # dp > 1: every rank of the stage (the experts' group)
            for r in replicas:
                for s in range(r.pp):
                    for d in range(r.dp):
                        if r.tp == 1:
                            continue
                        ranks = [r.rank(t, s, d) for t in range(r.tp)]
                        g = dist.new_group(ranks, timeout=timeout, backend=backend)
                        if rank in ranks:
                            self.tp_group = g
                    if r.dp > 1:
                        ranks = [r.rank(t, s, d) for d in range(r.dp) for t in range(r.tp)]
                        g = dist.new_group(ranks, timeout=timeout, backend=backend)
                        if rank in ranks:
                            self.ep_group = g
        except DistributedError:
            raise
        except Exception as exc:
            raise self._error("process-group setup", exc, time.monotonic()) from None
        self.tp0 = self.replica.rank(0, self.pp_stage, self.dp_rank)
        self.ep = self.tp * self.replica.dp

    # -- heartbeats and diagnosis ------------------------------------------------------------
    def beat(self) -> None:
        """Record progress; a timed-out peer compares these to name the rank that stopped.

        On a GPU a decode step takes milliseconds and a store write is a TCP round trip, so the beat
        is written at most every BEAT_S (the watchdog's limits are tens of seconds); ``_error``
        writes the exact step before laggards are compared. CPU runs write every step."""
        self.step += 1
        _fault_point(self.rank, self.step)
        now = time.monotonic()
        if self.device.type == "cuda" and now - self._beat_at < BEAT_S:
            return
        self._beat_at = now
        self.store.set(f"beat/{self.rank}", str(self.step))

    def mark(self, key: str) -> None:
        self.store.set(f"{key}/{self.rank}", "1")

    def wait_all(self, key: str, timeout_s: float, what: str) -> None:
        """Store barrier (e.g. 'every rank has loaded its shard') that names the ranks missing."""
        keys = [f"{key}/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:
            missing = [r for r in range(self.world) if not self._check(f"{key}/{r}")]
            who = ", ".join(describe(self.replicas, r) for r in missing) or "a peer"
            raise DistributedError(
                f"{describe(self.replicas, self.rank)}: {what}: {who} did not get there within "
                f"{timeout_s:.0f}s", hint="check that rank's log; raise `timeout_s` if it is only slow",
            ) from None

    def _check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def laggards(self) -> list[tuple[int, int]]:
        """(rank, step) of the ranks whose heartbeat is behind the others'."""
        steps = {}
        for r in range(self.world):
            try:
                steps[r] = int(self.store.get(f"beat/{r}")) if self._check(f"beat/{r}") else 0
            except Exception:
                return []
        top = max(steps.values(), default=0)
        return [(r, s) for r, s in steps.items() if s < top]

    def _error(self, what: str, exc: BaseException, t0: float) -> DistributedError:
        text = str(exc)
        try:  # the exact step (beats may be throttled), so laggards are named right
            self.store.set(f"beat/{self.rank}", str(self.step))
        except Exception:
            pass
        waited = time.monotonic() - t0
        if "Timed out" in text or "timed out" in text or "timeout" in text.lower():
            why = f"timed out after {waited:.1f}s (timeout {self.timeout_s:g}s)"
        elif "closed" in text or "reset" in text or "Broken pipe" in text:
            why = "lost the connection to a peer (it died?)"
        else:
            why = f"failed ({exc.__class__.__name__}: {text.splitlines()[0][:200] if text else ''})"
        lag = self.laggards()
        blame = ""
        if lag:
            blame = "; behind: " + ", ".join(f"{describe(self.replicas, r)} at step {s}" for r, s in lag)
        return DistributedError(
            f"{describe(self.replicas, self.rank)}: {what} {why}{blame}",
            hint="a peer died or hung; see its log. Raise `timeout_s` only if it is merely slow",
        )

    def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        except DistributedError:
            raise
        except Exception as exc:  # gloo/nccl raise RuntimeError / DistBackendError / DistStoreError
            raise self._error(what, exc, t0) from None

    # -- tensor parallel -----------------------------------------------------------------------
    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Sum over the TP group in fp32, in TP-rank order, rounded once to x's dtype.

        Implemented as all-gather + local ordered sum rather than the backend's all-reduce, whose
        reduction order is unspecified: this way every rank and every run gets the same bits, and
        the result equals summing the partials of a tp-way split in order (the tests' reference).
        """
        return x if self.tp == 1 else self._ordered_sum(x, self.tp, self.tp_group, what)

    def all_reduce_experts(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Sum over the stage's expert group (all dp x tp ranks; the TP group when dp = 1), in fp32
        and rank order, rounded once to x's dtype, as ``all_reduce_sum``."""
        if self.replica.dp == 1:
            return self.all_reduce_sum(x, what)
        return self._ordered_sum(x, self.ep, self.ep_group, what)

    def _ordered_sum(self, x: torch.Tensor, n: int, group: Any, what: str) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        self._run(what, dist.all_gather, parts, x, group=group)
        total = parts[0].float()
        for p in parts[1:]:
            total += p.float()
        return total.to(x.dtype)

    def gather_vocab(self, x: torch.Tensor, what: str, everyone: bool) -> torch.Tensor | None:
        """Concatenate vocabulary slices along the last dim (rank order = vocabulary order)."""
        if self.tp == 1:
            return x
        x = x.contiguous()
        if everyone:
            parts = [torch.empty_like(x) for _ in range(self.tp)]
            self._run(what, dist.all_gather, parts, x, group=self.tp_group)
            return torch.cat(parts, dim=-1)
        gathered = [torch.empty_like(x) for _ in range(self.tp)] if self.tp_rank == 0 else None
        self._run(what, dist.gather, x, gathered, dst=self.tp0, group=self.tp_group)
        return torch.cat(gathered, dim=-1) if gathered is not None else None

    # -- point to point ------------------------------------------------------------------------
    def isend(self, x: torch.Tensor, dst: int, what: str) -> Any:
        work = self._run(what, dist.isend, x.contiguous(), dst)
        return _Pending(self, work, what, x)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._run(what, dist.recv, buf, src)
        return buf

    def barrier(self, what: str) -> None:
        self._run(what, dist.barrier)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Pending:
    """An isend in flight; keeps the tensor alive until wait()."""

    def __init__(self, comm: Comm, work: Any, what: str, tensor: torch.Tensor) -> None:
        self.comm, self.work, self.what, self.tensor = comm, work, what, tensor

    def wait(self) -> None:
        self.comm._run(self.what, self.work.wait)


def _fault_point(rank: int, step: int) -> None:
    """Fault injection for the failure tests: SHARDC_FAULT='kill:RANK:STEP' or 'hang:RANK:STEP'."""
    spec = os.environ.get("SHARDC_FAULT")
    if not spec:
        return
    action, r, s = spec.split(":")
    if int(r) != rank or int(s) != step:
        return
    if action == "kill":
        os.kill(os.getpid(), 9)
    if action == "hang":
        while True:
            time.sleep(3600)
