"""The planner's formulas: memory, KV-cache, speed and cost arithmetic for TP x PP x dtype.

Pure arithmetic on the model config and GPU spec sheets (no torch, no I/O), so ``shardc plan``
answers instantly. Weight bytes per GPU come from the Layout (weights.py), the same records
``shardc build`` writes. KV math follows vLLM exactly (paged blocks of
``block_size`` tokens; a budget holds ``block * floor(budget / (block * bytes_per_token))``
tokens), because vLLM refuses deployments with this arithmetic and ours must agree with it.
The KV budget a unit would allocate follows vLLM's accounting (see ``Overheads``); the KV the
deployment *needs* is the demand (``demand_tokens``: the requests asked for), which shards by KV
head like the weights. The plan's cap is a ceiling on the pool, never a reservation.
Everything else (overheads, efficiencies) is a named parameter printed by ``--explain``.
candidate.py applies these to one replica shape, search.py lists the shapes, policy.py picks one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .gpus import CALIBRATED, GIB, GPU

ACT_BYTES = 2  # activations (all-reduce payloads, PP hand-offs) stay 16-bit: weight-only quant
KV_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1}
# No default ceiling on the KV pool (#33): vLLM allocates what its budget leaves, and a 20 GiB
# ceiling held the batch below what the targets allowed; --kv-cache-cap still sets one.
DEFAULT_KV_CAP = math.inf
DEFAULT_AVG_CONTEXT = 2048  # tokens per sequence for the speed model when --avg-context is not given
DEFAULT_TPOT_MS = 25.0  # sizes the batch when no target is given; a requirement only when given
LORA_BYTES = 2  # adapters are served 16-bit
DTYPE_ORDER = ("source", "bf16", "fp16", "int8", "fp8")  # last tie-break: keep precision when cost is equal


def rate_dtype(model: Any, dtype: str) -> str:
    """The dtype whose streaming and GEMM rates a unit of ``dtype`` gets: itself, or for ``source``
    (a quantized checkpoint kept as stored) what its stored values are: fp8 values run fp8 GEMMs,
    integer or 4-bit values (int4/int8 packed, MXFP4) stream as 8-bit weights and compute in 16
    bits; the bytes themselves come from the Layout, at their real size."""
    if dtype != "source":
        return dtype
    if _SOURCE_RATE[0] is model:  # asked for every step of every sweep: DeepSeek-V3's table is ~50k rows
        return _SOURCE_RATE[1]
    from ..layout.quant_formats import detect_source

    source_format = detect_source(model.config)
    if source_format is None:
        rate = "bf16"
    else:
        names = sorted(source_format.quantized(model))
        rate = "fp8" if names and source_format.stored(names[0])[0].dtypes[0] == "F8_E4M3" else "int8"
    _SOURCE_RATE[:] = [model, rate]
    return rate


_SOURCE_RATE: list[Any] = [None, ""]  # the last model rate_dtype answered for, and its answer


@dataclass(frozen=True)
class Overheads:
    """Per-GPU memory besides weights and KV cache, split the way vLLM accounts for it.

    vLLM sizes the KV cache as ``total x gpu_memory_utilization - non_kv_cache_memory``, where the
    non-KV memory is the loaded weights + the torch peak increase of a profiling forward pass (the
    activations) + the non-torch memory that appeared since the worker's first memory snapshot
    (NCCL buffers allocated by the first collectives, custom all-reduce buffers). The CUDA context
    exists before that snapshot (recent versions also create the NCCL communicators before it), and
    the CUDA graphs are captured after the KV cache is allocated (``memory_profiling`` "does not
    consider CUDAGraph memory"), so neither comes out of the budget: both must fit in the headroom
    ``total x (1 - gpu_memory_utilization)``. vLLM refuses to start when the memory free at its
    snapshot is below ``total x utilization``, and a graph capture that finds no room is an OOM,
    so that headroom rule, not a fixed share of the card, is what says a unit starts. (vLLM
    sources: ``vllm/v1/worker/gpu_worker.py`` ``init_device`` (init_snapshot after the distributed
    init, requested_memory, the "Free memory on device ... is less than desired GPU memory
    utilization" check), ``determine_available_memory`` and ``compile_or_warm_up_model``
    (``capture_model`` after ``initialize_from_config``); ``vllm/utils/mem_utils.py`` (older:
    ``vllm/utils/__init__.py``) ``memory_profiling`` (non_kv_cache_memory = non_torch_increase +
    torch_peak_increase + weights_memory, the increase counted from the snapshot). Older V1
    releases counted all non-torch memory, the context included, in the budget; newer ones with
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` count a graph estimate in it: either way the
    pool is smaller by that part, which ``--param activations=...`` reproduces.)

    The defaults are calibrated on the measured deployment (Llama-3.3-70B bf16, TP=2 on
    A100-80GB: 65.74 GiB of weights and 5.63 GiB of KV per GPU leave nothing measurable for the
    profiled part); newer vLLM on H100 profiles ~5 GiB of activations, which ``--param`` sets.
    """

    activations: int = GIB // 4  # torch peak increase of vLLM's profiling run (in the budget)
    cuda_context: int = GIB // 2  # CUDA context + cuBLAS workspaces (in the headroom)
    nccl: int = GIB // 8  # non-torch increase: NCCL buffers (in the budget); zero on one GPU
    cuda_graphs: int = GIB // 2  # captured decode CUDA graphs (in the headroom)

    def per_gpu(self, world: int) -> dict[str, int]:
        out = dataclasses.asdict(self)
        if world == 1:
            out["nccl"] = 0
        return out

    def in_budget(self, world: int) -> int:
        """What vLLM subtracts from ``total x utilization`` besides the weights: activations + NCCL."""
        over = self.per_gpu(world)
        return over["activations"] + over["nccl"]

    def outside(self, world: int) -> int:
        """What lives in vLLM's headroom, outside ``total x utilization``: the CUDA context and graphs."""
        return sum(self.per_gpu(world).values()) - self.in_budget(world)


@dataclass(frozen=True)
class SpeedParams:
    """Knobs of the engine-step model (serving.py); each one is printed by ``--explain``.

    The efficiencies and overheads are fitted per card (these defaults: Hopper's; gpus.CALIBRATED the
    others, speed_for picks them) against aiconfigurator 0.12's measured vLLM kernel tables
    (scripts/bench_plan.py --peer --fit; docs/performance.md): they are properties of the kernels on a
    card, not of one model or batch."""

    hbm_efficiency: float = 0.91  # share of peak HBM bandwidth 16-bit weight GEMMs reach
    kv_hbm_efficiency: float = 0.67  # the same for the paged-attention kernels' KV reads
    w8_hbm_efficiency: float = 0.76  # the same for 8-bit weights (fp8, int8): their kernels stream less well
    compute_efficiency: float = 0.77  # share of peak 16-bit FLOP/s that GEMMs and attention reach (prefill)
    fp8_compute_efficiency: float = 0.43  # share of peak fp8 FLOP/s that fp8 GEMMs reach
    link_efficiency: float = 0.47  # share of link bandwidth NCCL reaches (bus bandwidth)
    layer_overhead_us: float = 36.8  # per layer and step: norms, activation, attention launch (fixed)
    step_overhead_ms: float = 0.0  # per engine step: scheduler, sampling, logits (fixed)
    allreduce_overhead_us: float = 4.8  # per TP all-reduce: its kernel's launch and barrier (fixed)
    two_stage_us: float = 1.3  # per two-stage custom all-reduce (vllm_allreduce_s): its second barrier
    # per layer, a step of one token with fp8 weights: where fp8 GEMMs of one row take a slower kernel
    # than of two (fixed, whatever the weights' size: 44-65 us on Blackwell in aiconfigurator 0.12's
    # tables; Hopper's 1.5 is next to nothing)
    fp8_single_token_us: float = 1.5
    # per layer and step with fp8 weights, however many tokens: vLLM's W8A8 quantizes each GEMM's
    # activations (a per-token fp8 quant kernel before each of the layer's linears), a cost that neither
    # the weights' size nor the batch sets (fitted 0 where the grid does not ask for it: Hopper)
    fp8_layer_us: float = 0.0
    max_num_batched_tokens: int = 8192  # vLLM's token budget per step (chunked prefill)
    microbatches: int | None = None  # GPipe micro-batches in flight; None: one per stage
    max_num_seqs: int = 256  # scheduler cap on the decode batch (vLLM's default)
    # with `kv_memory` (vLLM's kv_cache_memory_bytes, which bypasses the utilization budget), a GPU
    # filled beyond this is infeasible; with the utilization budget, the headroom rule applies instead
    max_memory_fraction: float = 0.95


def speed_for(gpu: GPU, **given: Any) -> SpeedParams:
    """The speed knobs for ``gpu``: the card's fitted efficiencies, then what the command line gave
    (``--param NAME=VALUE``) over them."""
    return SpeedParams(**{**CALIBRATED.get(gpu.peer or "", {}), **given})  # gpus.CALIBRATED: fitted per card


@dataclass(frozen=True)
class Workload:
    """What the deployment must serve, and what it costs."""

    avg_context: int | None = None  # None: isl + osl / 2 for speed; the demand uses the request length
    max_model_len: int | None = None  # None: max_position_embeddings, as vLLM defaults it
    concurrency: int | None = None  # requests in flight (and in the KV cache); None: the most that meet the targets
    isl: int | None = None  # prompt tokens per request; None: 3/4 of avg_context (1,536)
    osl: int | None = None  # output tokens per request; None: 1/2 of avg_context (1,024)
    ttft_ms: float | None = None  # time-to-first-token target, a requirement when given
    allow_long_context: bool = False  # max_model_len beyond max_position_embeddings (vLLM's opt-in)
    kv_cache_cap: int | None = None  # ceiling on the KV pool per GPU; None: --kv-memory when set, else none
    kv_memory: float | None = None  # per GPU KV budget as an engine measured it (overrides the math)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_dtype: str = "auto"  # auto: the 16-bit dtype of the model
    target_tpot_ms: float | None = None  # None: DEFAULT_TPOT_MS sizes the batch but binds nothing
    price_per_gpu_hour: float = 2.80
    demand_tokens_per_s: float | None = None
    lora_adapters: int = 0  # adapters resident at once (vLLM's max_loras)
    lora_rank: int = 0  # their largest rank (max_lora_rank)
    # the average context when none of avg_context, isl and osl is given (fit_defaults: never more
    # than the longest request allows)
    default_context: int = DEFAULT_AVG_CONTEXT

    @property
    def target_ms(self) -> float:
        """The TPOT the batch is sized for: the user's target, else the default."""
        return DEFAULT_TPOT_MS if self.target_tpot_ms is None else self.target_tpot_ms

    @property
    def requests(self) -> int:
        """Requests the KV demand holds at once: --concurrency, else one."""
        return self.concurrency or 1

    @property
    def context(self) -> int:
        """Average tokens a decoding sequence has in its cache: --avg-context, else isl + osl / 2
        (2,048 with the default 1,536-token prompts and 1,024-token outputs)."""
        if self.avg_context is not None:
            return self.avg_context
        if self.isl is not None or self.osl is not None:
            return self.prompt + self.output // 2
        return self.default_context

    @property
    def prompt(self) -> int:
        """Prompt tokens per request (isl): --isl, else 3/4 of the average context."""
        if self.isl is not None:
            return self.isl
        base = self.avg_context if self.avg_context is not None else self.default_context
        return max(1, base * 3 // 4)

    @property
    def output(self) -> int:
        """Output tokens per request (osl): --osl, else 1/2 of the average context."""
        if self.osl is not None:
            return self.osl
        base = self.avg_context if self.avg_context is not None else self.default_context
        return max(1, base // 2)

    def origins(self) -> dict[str, str]:
        """Where isl, osl and the average context come from, in words for the report: given, or
        derived (from which input), or the default."""
        given = {"isl": self.isl is not None, "osl": self.osl is not None, "avg": self.avg_context is not None}
        out = {}
        for key, fraction in (("isl", "3/4"), ("osl", "1/2")):
            out[key] = ("" if given[key] else f"{fraction} of avg context" if given["avg"] else
                        "default" if self.default_context == DEFAULT_AVG_CONTEXT else
                        f"{fraction} of {self.default_context:,}, 4/5 of the longest request")
        out["avg"] = ("" if given["avg"] else "isl + osl/2" if given["isl"] or given["osl"] else
                      "default" if self.default_context == DEFAULT_AVG_CONTEXT else "4/5 of the longest request")
        return out

    @property
    def target_set(self) -> bool:
        return self.target_tpot_ms is not None

    @property
    def cap(self) -> float:
        if self.kv_cache_cap is not None:
            return self.kv_cache_cap
        return self.kv_memory if self.kv_memory is not None else DEFAULT_KV_CAP

    @property
    def capped(self) -> bool:
        """A ceiling on the pool was given (--kv-cache-cap, or a measured --kv-memory)."""
        return math.isfinite(self.cap)

    @property
    def kv_bytes(self) -> int:
        return KV_DTYPE_BYTES.get(self.kv_dtype, 2)


# --- the formulas, as small pure functions (unit-tested against hand-computed cases) ----------


def kv_bytes_per_token(layers: int, kv_heads: int, tp: int, head_dim: int, kv_bytes: int) -> int:
    """K and V for every layer on the GPU: 2 x layers x max(1, kv_heads // tp) x head_dim x bytes."""
    return 2 * layers * max(1, kv_heads // tp) * head_dim * kv_bytes


def mla_kv_bytes_per_token(layers: int, kv_lora_rank: int, rope_dim: int, kv_bytes: int) -> int:
    """MLA caches one latent per token and layer, whole on every TP rank: layers x (rank + rope) x bytes."""
    return layers * (kv_lora_rank + rope_dim) * kv_bytes


def indexer_key_bytes(head_dim: int) -> int:
    """DSA's indexer key per token and layer as vLLM caches it (DeepseekV32IndexerCache, uint8):
    head_dim FP8 values plus one fp32 scale per 128 of them, whatever the KV dtype: 132 B at 128."""
    return head_dim + head_dim // 128 * 4


def lora_bytes_per_layer(hidden: int, q_dim: int, kv_dim: int, inter: int, adapters: int, rank: int) -> int:
    """LoRA A (rank x in) and B (out x rank) for q, k, v, o, gate, up, down of one layer, all adapters:
    adapters x rank x (in + out summed over the seven) x 2 B = adapters x rank x (7h + 2q + 2kv + 3i) x 2."""
    return adapters * rank * (7 * hidden + 2 * q_dim + 2 * kv_dim + 3 * inter) * LORA_BYTES


def min_cards(sharded: float, per_card: float, replicated: float) -> int | None:
    """Rule 2: ceil(sharded memory / what one card has left after the replicated part); None: nothing left."""
    room = per_card - replicated
    return max(1, math.ceil(sharded / room)) if room > 0 else None


def round_to_blocks(tokens: int, block: int) -> int:
    """Paged KV is allocated in whole blocks: ceil(tokens / block) x block."""
    return -(-tokens // block) * block


def request_kv_bytes(bytes_per_token: int, length: int, block: int) -> int:
    """KV memory one request of ``length`` tokens needs on one GPU (vLLM's refusal check)."""
    return bytes_per_token * round_to_blocks(length, block)


def demand_tokens(w: Workload, max_position: int) -> int:
    """KV tokens the deployment must hold at once (on every GPU that holds a layer's KV).

    At least one request of the max model length (vLLM refuses to start otherwise:
    ``check_enough_kv_cache_memory`` in ``vllm/v1/core/kv_cache_utils.py``; default the model's
    max_position_embeddings, as vLLM's), and ``concurrency`` requests of ``avg_context``
    tokens when given, else of the max model length; each request is paged in whole blocks.
    """
    length = w.max_model_len or max_position
    each = request_tokens(w, length)
    return max(round_to_blocks(length, w.block_size), w.requests * round_to_blocks(each, w.block_size))


def request_tokens(w: Workload, length: int) -> int:
    """KV tokens one request of the demand holds: --avg-context, else isl + osl when given (a
    request's cache at its end), else the max model length."""
    if w.avg_context is not None:
        return w.avg_context
    if w.isl is not None or w.osl is not None:
        return w.prompt + w.output
    return length


def demand_words(w: Workload, max_position: int) -> str:
    """The demand in words: which requests it is, as --explain and the reasons say it."""
    length = w.max_model_len or max_position
    each = request_tokens(w, length)
    n, block = w.requests, w.block_size
    if n * round_to_blocks(each, block) > round_to_blocks(length, block):
        return f"{n} requests of {each:,} tokens"
    one = f"one {length:,}-token request"
    return one if n == 1 else f"{one}, which covers {n} x {each:,} tokens"


def kv_blocks(budget: float, bytes_per_token: int, block: int) -> int:
    """Whole KV blocks a budget holds: floor(budget / (block x bytes per token))."""
    return max(0, math.floor(budget / (block * bytes_per_token))) if bytes_per_token else 0


def max_model_len(budget: float, bytes_per_token: int, block: int, max_position: int) -> int:
    """vLLM's estimate: block x floor(budget / (block x bytes per token)), capped at the model's."""
    return min(block * kv_blocks(budget, bytes_per_token, block), max_position)


def sequences_at(blocks: int, avg_context: int, block: int) -> int:
    """Concurrent sequences of ``avg_context`` tokens that ``blocks`` KV blocks hold."""
    return blocks // -(-avg_context // block)


def ring_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth + 2(n-1) hops x latency; free for n = 1."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def custom_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """vLLM's custom all-reduce over NVLink peer-to-peer (two-shot: a reduce-scatter and an
    all-gather, each one round of direct writes to every peer): the ring's bandwidth term,
    2(n-1)/n x bytes / bandwidth, but 2 x latency whatever n is, since every GPU talks to every
    other at once instead of passing the data round a ring of n hops; free for n = 1."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * latency


def vllm_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float, two_stage_us: float) -> float:
    """vLLM's custom all-reduce over NVLink as it picks its kernel (csrc/custom_all_reduce.cuh,
    CustomAllreduce::allreduce): one stage (every GPU reads every peer's whole buffer: (n-1) x bytes /
    bandwidth, one round of latency) for 2 GPUs, and on a full NVLink mesh below 512 KiB for up to 4
    GPUs or 256 KiB for up to 8; else two stages (custom_allreduce_s, plus ``two_stage_us`` for its
    second barrier); free for n = 1."""
    if n <= 1:
        return 0.0
    if vllm_allreduce_stages(n, nbytes) == 1:
        return (n - 1) * nbytes / bandwidth + latency
    return custom_allreduce_s(n, nbytes, bandwidth, latency) + two_stage_us * 1e-6


def vllm_allreduce_stages(n: int, nbytes: float) -> int:
    """1 or 2: the custom all-reduce kernel vLLM runs for ``nbytes`` on ``n`` NVLink GPUs."""
    return 1 if n == 2 or (n <= 4 and nbytes < 512 * 1024) or (n <= 8 and nbytes < 256 * 1024) else 2


def all_to_all_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """One all-to-all (an EP dispatch or combine): each GPU sends (n-1)/n of its ``nbytes`` to the
    others over its own link, plus (n-1) x latency for the peer exchanges; free for n = 1."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def gpipe_bubble(p: int, m: int) -> float:
    """Idle share of a GPipe schedule with p stages and m micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def dollars_per_mtok(gpus: int, price_per_gpu_hour: float, tokens_per_s: float) -> float:
    """Cost of one million output tokens: GPU-hours for 1e6 tokens x price."""
    return gpus * price_per_gpu_hour * 1e6 / (tokens_per_s * 3600)


def experts_touched(batch: float, active: int, routed: int) -> float:
    """Expected share of routed experts a decode step reads: 1 - (1 - k/n)^batch (uniform routing)."""
    if not routed:
        return 1.0
    return 1.0 - math.pow(1.0 - active / routed, max(batch, 1.0))
