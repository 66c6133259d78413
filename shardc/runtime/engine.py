"""Schedules for one rank of a replica: pipelined scoring (prefill only) and greedy generation.

Pipeline parallel: stage s receives micro-batch m's hidden states from stage s-1 (same TP rank),
runs its layers and posts an asynchronous send to stage s+1 before starting micro-batch m+1, so up to
``pp`` micro-batches are in flight and the bubble is (pp - 1) / (M + pp - 1) of the run for M
micro-batches (GPipe, forward only). In generation each prompt is its own micro-batch with its own
KV cache; the last stage sends every sampled token back to the other stages (equal TP rank), which
the first stage embeds for the next step and every stage uses to know when a sequence has ended.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .comm import Comm
from .decoder import KVCache, StageModel

# isends allowed in flight before the oldest is waited for: bounds memory, keeps the pipe full.
MAX_IN_FLIGHT = 4


class StageRunner:
    """One rank's role in its replica's pipeline."""

    def __init__(self, comm: Comm, model: StageModel) -> None:
        self.comm, self.model = comm, model
        rep = comm.replica
        self.first = comm.pp_stage == 0
        self.last = comm.pp_stage == rep.pp - 1
        self.prev = rep.rank(comm.tp_rank, comm.pp_stage - 1, comm.dp_rank) if not self.first else None
        self.next = rep.rank(comm.tp_rank, comm.pp_stage + 1, comm.dp_rank) if not self.last else None
        self.hidden = model.d.hidden
        self._sends: deque[Any] = deque()
        # (micro-batch, start, end) of this rank's compute, wall clock (comparable across processes):
        # shows micro-batches overlapping across stages, and the measured bubble.
        self.trace: list[tuple[int, float, float]] = []
        self.decode_seconds: float | None = None  # generate: wall time after the first token

    def _send(self, x: torch.Tensor, dst: int, what: str) -> None:
        self._sends.append(self.comm.isend(x, dst, what))
        while len(self._sends) > MAX_IN_FLIGHT:
            self._sends.popleft().wait()

    def drain(self) -> None:
        while self._sends:
            self._sends.popleft().wait()

    def _stage_input(self, ids: torch.Tensor, what: str) -> torch.Tensor:
        """Embed on the first stage, else receive the previous stage's hidden states."""
        if self.first:
            return self.model.embed(ids.to(self.comm.device))
        shape = (ids.shape[0], ids.shape[1], self.hidden)
        assert self.prev is not None  # set for every stage but the first
        return self.comm.recv(shape, self.model.dtype, self.prev,
                              f"receiving {what} from pipeline stage {self.comm.pp_stage - 1}")

    def score(self, windows: torch.Tensor, micro_batch: int,
              on_logits: Callable[[int, torch.Tensor | None], None]) -> None:
        """Forward every window (prefill, no cache); the last stage hands fp32 logits to on_logits.

        Only TP rank 0 of the last stage gets the gathered logits; other ranks get None.
        """
        for m, chunk in enumerate(windows.split(micro_batch)):
            self.comm.beat()
            what = f"micro-batch {m} activations"
            with torch.inference_mode():
                x = self._stage_input(chunk, what)
                t0 = time.time()
                h = self.model.layers(x)
                if not self.last:
                    self.trace.append((m, t0, time.time()))
                    assert self.next is not None  # set for every stage but the last
                    self._send(h, self.next, f"sending {what} to pipeline stage {self.comm.pp_stage + 1}")
                    continue
                logits = self.model.logits(h, everyone=False)
                self.trace.append((m, t0, time.time()))
            on_logits(m, logits)
        self.drain()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                 max_len: int) -> list[list[int]]:
        """Greedy decoding of every prompt (one micro-batch each). Every rank returns the tokens."""
        dev, d = self.comm.device, self.model.d
        layers = [lw.index for lw in self.model.w.layers]
        caches = [KVCache(layers, 1, d, max_len, self.model.dtype, dev) for _ in prompts]
        # On a GPU without EOS tokens to watch, sampled tokens stay on the device and feed the next
        # step from there: no host sync and no host-to-device copy per step (one .tolist() at the end).
        lazy = dev.type == "cuda" and not eos
        out: list[list[Any]] = [[] for _ in prompts]
        awaiting = [False] * len(prompts)  # a token from the last stage is due for this sequence
        c = self.comm
        last_rank = c.replica.rank(c.tp_rank, c.replica.pp - 1, c.dp_rank)
        others = [c.replica.rank(c.tp_rank, s, c.dp_rank) for s in range(c.replica.pp - 1)]

        def finished(m: int) -> bool:
            return len(out[m]) >= max_new_tokens or bool(out[m] and out[m][-1] in eos)

        def collect(m: int, step: int) -> None:
            if awaiting[m]:
                tok = self.comm.recv((1,), torch.int64, last_rank,
                                     f"receiving step {step} token of sequence {m} from the last stage")
                out[m].append(tok.view(()) if lazy else int(tok.item()))
                awaiting[m] = False

        t_first = None
        for step in range(max_new_tokens):
            if step == 1:  # decode rate from here on: prefill and first-call set-up excluded
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t_first = time.perf_counter()
            for m, prompt in enumerate(prompts):
                collect(m, step - 1)
                if finished(m):
                    continue
                self.comm.beat()
                if step and lazy:
                    ids = out[m][-1].view(1, 1)
                else:
                    ids = torch.tensor([prompt if step == 0 else [out[m][-1]]], dtype=torch.int64)
                what = f"sequence {m} step {step} activations"
                with torch.inference_mode():
                    h = self.model.layers(self._stage_input(ids, what), caches[m])
                    if not self.last:
                        assert self.next is not None  # set for every stage but the last
                        self._send(h, self.next, f"sending {what} to pipeline stage {self.comm.pp_stage + 1}")
                        awaiting[m] = True
                        continue
                    logits = self.model.logits(h[:, -1:], everyone=True)
                assert logits is not None
                tok = logits[0, -1].argmax()
                out[m].append(tok if lazy else int(tok))
                for dst in others:
                    self._send(tok.reshape(1).to(torch.int64), dst, f"sending step {step} token to {dst}")
        for m in range(len(prompts)):
            collect(m, max_new_tokens - 1)
        self.drain()
        if lazy:
            out = [torch.stack(o).tolist() if o else [] for o in out]
        self.decode_seconds = time.perf_counter() - t_first if t_first is not None else None
        return out


class Timer:
    """Wall time of the compute phase, for throughput figures."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def pipeline_stats(trace: dict[int, list[list[float]]], tp: int, pp: int) -> dict[str, float]:
    """Measured pipeline bubble from the per-rank compute traces (TP rank 0 of each stage) next to
    GPipe's (pp - 1) / (M + pp - 1) for M micro-batches: the idle share of each stage's span."""
    stages = [trace[s * tp] for s in range(pp) if s * tp in trace]
    if not stages or not stages[0]:
        return {}
    start = min(t0 for st in stages for _, t0, _ in st)
    end = max(t1 for st in stages for _, _, t1 in st)
    span = max(end - start, 1e-9)
    busy = [sum(t1 - t0 for _, t0, t1 in st) for st in stages]
    m = len(stages[0])
    return {
        "micro_batches": m,
        "bubble_measured": 1.0 - sum(busy) / (len(stages) * span),
        "bubble_formula": (pp - 1) / (m + pp - 1),
    }
