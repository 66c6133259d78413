"""A unit serving a workload: TTFT, TPOT, request rate and tokens/s per GPU, as vLLM schedules it.

vLLM's V1 engine runs one step at a time; a step carries one token of every running sequence
(decode) and, within ``max_num_batched_tokens`` (chunked prefill), the prompt chunks of requests
being admitted. A decode-only step streams the weights and the KV once (memory-bound at small
batches); a step with a prompt chunk is compute-bound, and every running sequence waits for it:
that is prefill's interference with decode.

With ``concurrency`` C requests in flight, each of ``isl`` prompt tokens and ``osl`` output tokens,
a request spends ``chunks`` = ceil(isl / chunk) steps in prefill and osl - 1 in decode, so a share
C x chunks / (chunks + osl - 1) of all steps carries a prompt chunk (at least one chunk per such
step; more when C is large). A request's TPOT is the mean of the steps it decodes through:

    TPOT = share x mixed step + (1 - share) x decode step
    request latency = TTFT + (osl - 1) x TPOT;  requests/s = C / latency;  tokens/s = requests/s x osl

(aiconfigurator's "agg" mode schedules the same way: its mix and generation-only steps.)

TTFT is the wait for a request's prefill under the scheduler, then the prefill. A request arrives
while the C - 1 others run (the arrival theorem of closed queues: it sees the engine as C - 1 requests
keep it), so the steps it meets carry a prompt in a share s' = (C - 1) x chunks / (chunks + osl - 1)
of them, and the engine is prefilling a share rho = s' x mixed / (s' x mixed + (1 - s') x decode) of
the time. It waits for (1) the step running when it arrives, which a random arrival meets in
proportion to its length (E[step^2] / (2 E[step])), then (2) the prompts queued ahead of it: vLLM
admits waiting prompts first come, first served, into the steps' token budget, and prefill is a
server busy rho of the time with a fixed service, so M/D/1's mean queue rho^2 / (2 (1 - rho))
prompts, each chunks x mixed step, k of them per step where the budget holds k whole prompts; then
(3) its own chunks x mixed steps:

    TTFT = residual step + queue ahead + chunks x mixed step

At C = 1 the engine is idle when the request arrives: TTFT is one prefill alone. Decode steps
interleave but never delay a waiting prompt beyond the step in progress (the scheduler puts waiting
prompts in the next step's budget). The concurrency is --concurrency when given, else the largest
that meets the TPOT (and TTFT) targets within the KV cache and max_num_seqs. The step costs come from
the unit's own model (candidate.py dense TP/PP, ep.py expert parallel) as a ``StepFn``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .formulas import SpeedParams, Workload


@dataclass(frozen=True)
class Step:
    """Seconds of one engine step, and its parts (of the slowest stage for PP)."""

    total: float
    memory: float
    compute: float
    comm: float  # all-reduces (TP), all-to-alls (EP), hand-offs (PP)
    fixed: float  # per-layer and per-step overheads


# (decoding sequences, prompt tokens in the step, those prompts' length) -> Step
StepFn = Callable[[float, float, int], Step]


@dataclass(frozen=True)
class Serving:
    """The workload's figures at one concurrency."""

    concurrency: int
    isl: int
    osl: int
    chunk: int  # prompt tokens per prefill step
    chunks: int  # prefill steps per request
    mixed_share: float  # share of steps that carry a prompt chunk
    decode_step_s: float
    mixed_step_s: float
    prefill_s: float  # one prompt alone on the idle unit: the TTFT floor
    wait_s: float  # TTFT's wait before the request's own prefill: the step in progress, the prompts ahead
    prefilling: float  # share of the time the others keep the unit prefilling (the queue's utilization)
    ttft_s: float
    tpot_s: float
    latency_s: float  # one request, first prompt token to last output token
    requests_per_s: float
    tokens_per_s: float  # output tokens/s of the unit (replica)
    tokens_per_s_per_gpu: float

    def to_json(self) -> dict[str, float | int]:
        return {"concurrency": self.concurrency, "ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "requests_per_s": self.requests_per_s,
                "tokens_per_s": self.tokens_per_s, "isl": self.isl, "osl": self.osl, "chunk": self.chunk,
                "chunks": self.chunks, "mixed_share": self.mixed_share,
                "decode_step_ms": self.decode_step_s * 1e3, "mixed_step_ms": self.mixed_step_s * 1e3,
                "prefill_ms": self.prefill_s * 1e3, "wait_ms": self.wait_s * 1e3, "prefilling": self.prefilling,
                "latency_ms": self.latency_s * 1e3}


def serving_at(step: StepFn, c: int, w: Workload, sp: SpeedParams, gpus: int) -> Serving:
    """The figures with ``c`` requests in flight (see the module docstring for the formulas)."""
    isl, osl = w.prompt, w.output
    room = max(sp.max_num_batched_tokens - (c - 1), 1)  # the budget left beside c - 1 decodes
    chunk = min(isl, room)
    chunks = math.ceil(isl / chunk)
    per_step = c * chunks / (chunks + osl - 1)  # prompt chunks per step, on average
    share = min(1.0, per_step)
    tokens = min(max(1.0, per_step) * chunk, float(room))  # prompt tokens of a step that has some
    decode = step(c, 0.0, isl).total
    mixed = step(max(c - 1, 0), tokens, isl).total
    prefill = chunks * step(0, chunk, isl).total
    wait, busy = queue_wait(c, chunks, osl, mixed, decode, room // isl if chunks == 1 else 1)
    ttft = wait + chunks * mixed if c > 1 else prefill
    tpot = share * mixed + (1 - share) * decode if osl > 1 else decode
    latency = ttft + (osl - 1) * tpot
    rps = c / latency
    return Serving(c, isl, osl, chunk, chunks, share, decode, mixed, prefill, wait, busy, ttft, tpot, latency, rps,
                   rps * osl, rps * osl / gpus)


def queue_wait(c: int, chunks: int, osl: int, mixed: float, decode: float, per_step: int) -> tuple[float, float]:
    """(seconds a request waits before its own prefill, share of the time the other c - 1 keep the unit
    prefilling): the step it arrives in plus M/D/1's queue of prompts ahead (module docstring);
    ``per_step`` whole prompts fit one step's budget."""
    if c <= 1:
        return 0.0, 0.0
    s = min(1.0, (c - 1) * chunks / (chunks + osl - 1))
    mean = s * mixed + (1 - s) * decode
    residual = (s * mixed ** 2 + (1 - s) * decode ** 2) / (2 * mean)
    rho = min(s * mixed / mean, 0.95)  # at saturation the closed loop caps the queue at c - 1 prompts
    ahead = min(rho ** 2 / (2 * (1 - rho)), c - 1)
    return residual + ahead * chunks * mixed / max(per_step, 1), rho


def choose(step: StepFn, cap: int, w: Workload, sp: SpeedParams, gpus: int) -> tuple[Serving, str, bool]:
    """(figures, what limits the concurrency, targets met): --concurrency when given; else the
    largest concurrency up to ``cap`` (the KV cache, max_num_seqs) that meets the TPOT target and,
    when given, the TTFT target. TPOT and TTFT grow with the concurrency: a bisection finds it."""
    tpot_target = w.target_ms / 1e3
    ttft_target = w.ttft_ms / 1e3 if w.ttft_ms is not None else math.inf

    def ok(v: Serving) -> bool:
        return v.tpot_s <= tpot_target and v.ttft_s <= ttft_target

    if w.concurrency is not None:
        v = serving_at(step, w.concurrency, w, sp, gpus)
        return v, "concurrency", ok(v)
    cap = max(cap, 1)
    lo, hi = 1, cap
    if ok(serving_at(step, cap, w, sp, gpus)):
        lo = cap
    else:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(serving_at(step, mid, w, sp, gpus)) else (lo, mid - 1)
    v = serving_at(step, lo, w, sp, gpus)
    if lo == cap:
        return v, "cap", ok(v)
    more = serving_at(step, lo + 1, w, sp, gpus)
    return v, ("tpot" if more.tpot_s > tpot_target else "ttft"), ok(v)


def sweep(step: StepFn, cap: int, w: Workload, sp: SpeedParams, gpus: int) -> tuple[Serving, ...]:
    """The figures at concurrency 1, 2, 4, ... up to ``cap`` (and ``cap`` itself): the curve
    ``--plot`` draws per candidate, over which its Pareto front is taken."""
    points, c = [], 1
    while c < cap:
        points.append(serving_at(step, c, w, sp, gpus))
        c *= 2
    points.append(serving_at(step, max(cap, 1), w, sp, gpus))
    return tuple(points)
