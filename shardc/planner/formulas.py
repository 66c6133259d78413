"""The planner's formulas: memory, KV-cache, speed and cost arithmetic for TP x PP x dtype.

Pure arithmetic on the model config and GPU spec sheets (no torch, no I/O), so ``shardc plan``
answers instantly. Weight bytes per GPU come from the Layout, the same records ``shardc build``
writes, so the planner can never disagree with the shards about replicated norms, KV-head
replication, vocab padding or quantization scales. KV math follows vLLM exactly (paged blocks of
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
import re
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from ..spec.layout import build_layout, check_degrees, layer_of, stage_ranges
from ..spec.model import ModelSpec
from ..spec.plan import (
    DEFAULT_IGNORE,
    DEFAULT_SHARD_PREFIX,
    DP_SHARD_PREFIX,
    QUANTIZED_DTYPES,
    Plan,
)
from ..spec.tensors import STACKED, tensor_table
from .gpus import GIB, Cluster

ACT_BYTES = 2  # activations (all-reduce payloads, PP hand-offs) stay 16-bit: weight-only quant
KV_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1}
DEFAULT_KV_CAP = 20 * GIB  # the serving design's ceiling on the KV pool per GPU shard
DEFAULT_AVG_CONTEXT = 2048  # tokens per sequence for the speed model when --avg-context is not given
DEFAULT_TPOT_MS = 25.0  # sizes the batch when no target is given; a requirement only when given
LORA_BYTES = 2  # adapters are served 16-bit
DTYPE_ORDER = ("bf16", "fp16", "int8", "fp8")  # last tie-break: keep precision when cost is equal


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
    """Knobs of the decode roofline; each one is printed by ``--explain``."""

    hbm_efficiency: float = 0.8  # share of peak HBM bandwidth that decode GEMVs reach
    compute_efficiency: float = 0.5  # share of peak FLOP/s that batched decode GEMMs reach
    link_efficiency: float = 0.75  # share of link bandwidth NCCL reaches (bus bandwidth)
    microbatches: int | None = None  # GPipe micro-batches in flight; None: one per stage
    max_num_seqs: int = 256  # scheduler cap on the decode batch (vLLM's default)
    # with `kv_memory` (vLLM's kv_cache_memory_bytes, which bypasses the utilization budget), a GPU
    # filled beyond this is infeasible; with the utilization budget, the headroom rule applies instead
    max_memory_fraction: float = 0.95


@dataclass(frozen=True)
class Workload:
    """What the deployment must serve, and what it costs."""

    avg_context: int | None = None  # None: DEFAULT_AVG_CONTEXT for speed; the demand uses the request length
    max_model_len: int | None = None  # None: max_position_embeddings, as vLLM defaults it
    concurrency: int = 1  # requests the KV cache must hold at once
    allow_long_context: bool = False  # max_model_len beyond max_position_embeddings (vLLM's opt-in)
    kv_cache_cap: int | None = None  # ceiling on the KV pool per GPU; None: --kv-memory when set, else 20 GiB
    kv_memory: float | None = None  # per GPU KV budget as an engine measured it (overrides the math)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_dtype: str = "auto"  # auto: the 16-bit dtype of the model
    target_tpot_ms: float | None = None  # None: DEFAULT_TPOT_MS sizes the batch but binds nothing
    price_per_gpu_hour: float = 2.80
    demand_tokens_per_s: float | None = None
    lora_adapters: int = 0  # adapters resident at once (vLLM's max_loras)
    lora_rank: int = 0  # their largest rank (max_lora_rank)

    @property
    def target_ms(self) -> float:
        """The TPOT the batch is sized for: the user's target, else the default."""
        return DEFAULT_TPOT_MS if self.target_tpot_ms is None else self.target_tpot_ms

    @property
    def context(self) -> int:
        """Tokens per sequence for the speed model: --avg-context, else the default."""
        return DEFAULT_AVG_CONTEXT if self.avg_context is None else self.avg_context

    @property
    def target_set(self) -> bool:
        return self.target_tpot_ms is not None

    @property
    def cap(self) -> float:
        if self.kv_cache_cap is not None:
            return self.kv_cache_cap
        return self.kv_memory if self.kv_memory is not None else DEFAULT_KV_CAP

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
    each = w.avg_context if w.avg_context is not None else length
    return max(round_to_blocks(length, w.block_size), w.concurrency * round_to_blocks(each, w.block_size))


def demand_words(w: Workload, max_position: int) -> str:
    """The demand in words: which requests it is, as --explain and the reasons say it."""
    length = w.max_model_len or max_position
    each = w.avg_context if w.avg_context is not None else length
    n, block = w.concurrency, w.block_size
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


def check_inputs(model: ModelSpec, cluster: Cluster, w: Workload, speed: SpeedParams) -> None:
    """Nonsensical inputs end here, as one PlanError naming the field (``key``; hints quote other
    fields in backticks), before any arithmetic. The CLI maps field names to its flags."""
    max_pos = model.max_position_embeddings

    def bad(key: str, message: str, hint: str | None = None) -> PlanError:
        return PlanError(message, key=key, hint=hint)

    if not 0 < w.gpu_memory_utilization <= 1:
        raise bad("gpu_memory_utilization", f"must be in (0, 1], found {w.gpu_memory_utilization:g}",
                  "vLLM's default is 0.9")
    if w.kv_dtype not in ("auto", *KV_DTYPE_BYTES):
        raise bad("kv_dtype", f"unknown KV dtype {w.kv_dtype!r}", "use auto, fp16, bf16 or fp8")
    if w.max_model_len is not None and w.max_model_len < 1:
        raise bad("max_model_len", f"must be a positive number of tokens, found {w.max_model_len}",
                  f"use 1 to {max_pos}")
    if w.max_model_len is not None and w.max_model_len > max_pos and not w.allow_long_context:
        raise bad("max_model_len", f"{w.max_model_len:,} exceeds the model's max_position_embeddings "
                  f"{max_pos:,}", f"use `max_model_len` <= {max_pos}, or `allow_long_context` to go beyond it")
    if w.concurrency < 1:
        raise bad("concurrency", f"must be a positive number of requests, found {w.concurrency}",
                  "use 1 or more")
    if w.context > (w.max_model_len or max_pos):
        raise bad("avg_context", f"{w.context:,} is longer than the longest request "
                  f"({w.max_model_len or max_pos:,} tokens)", "lower `avg_context`")
    if w.kv_memory is not None and w.kv_memory >= cluster.gpu.memory:
        raise bad("kv_memory", f"{w.kv_memory / GIB:.2f} GiB is more than the GPU's "
                  f"{cluster.gpu.memory / GIB:.2f} GiB", "give the KV memory of one GPU")
    if w.cap >= cluster.gpu.memory:
        raise bad("kv_cache_cap", f"{w.cap / GIB:.2f} GiB per GPU is more than the GPU's "
                  f"{cluster.gpu.memory / GIB:.2f} GiB", "the cap is per GPU")
    for name, value in (("block_size", w.block_size), ("avg_context", w.context),
                        ("target_tpot_ms", w.target_ms), ("price_per_gpu_hour", w.price_per_gpu_hour),
                        ("gpus_per_node", cluster.gpus_per_node), ("nodes", cluster.nodes)):
        if not value > 0:
            raise bad(name, f"must be positive, found {value}")
    if speed.microbatches is not None and speed.microbatches < 1:
        raise bad("microbatches", f"must be positive, found {speed.microbatches}")
    if (w.lora_adapters > 0) != (w.lora_rank > 0) or min(w.lora_adapters, w.lora_rank) < 0:
        raise bad("lora_adapters" if w.lora_adapters <= 0 else "lora_rank",
                  f"LoRA needs both a positive adapter count and rank, found {w.lora_adapters} adapters of "
                  f"rank {w.lora_rank}", "give `lora_adapters` and `lora_rank` together")


# --- weights from the Layout ------------------------------------------------------------------


@dataclass(frozen=True)
class RankWeights:
    """One GPU's weights as the Layout lists them."""

    tp_rank: int
    pp_stage: int
    layers: tuple[int, int]
    nbytes: int  # stored bytes: quantized weights + float32 scales + 16-bit rest
    read_bytes: int  # streamed from HBM per decode step (all but the embedding-row lookup)
    linear_params: int  # matmul weight elements: 2 FLOPs each per token
    kv_heads: int  # KV heads this rank holds (one replicated head when tp > kv_heads)
    expert_bytes: int = 0  # routed MoE experts among nbytes: a decode step reads only those routed to


def rank_weights(model: ModelSpec, plan: Plan) -> list[RankWeights]:
    """Every rank's weights, asked of the Layout of a probe model with one layer per stage.

    Decoder layers of one model have identical tensors, so a stage's bytes are its non-layer tensors
    plus (layers on the stage) x (its one probe layer). The probe Layout lists pp x 9 layer tensors
    per rank instead of 80 x 9, which keeps a search of dozens of candidates far below a second;
    tests check the result against the full Layout byte for byte.
    """
    check_degrees(model, plan)
    counts = [b - a for a, b in stage_ranges(model, plan)]
    probe_model = dataclasses.replace(model, num_layers=plan.pp)
    probe = build_layout(probe_model, dataclasses.replace(plan, pp_layers=(1,) * plan.pp))
    # routed experts (MoE families): a decode step reads only the experts its tokens are routed to
    routed = {n for n, r in tensor_table(probe_model).items() if r.expert is not None or r.split == STACKED} \
        if model.forward.moe else set()
    real = stage_ranges(model, plan)
    out = []
    for rl in probe.ranks:
        n = counts[rl.pp_stage]
        totals = {"nbytes": 0, "read": 0, "linear": 0, "expert": 0}
        kv_heads = 0
        for t in rl.tensors:
            mult = n if layer_of(t.name) is not None else 1
            embed = t.name == "model.embed_tokens.weight"
            streamed = not embed or (model.tie_word_embeddings and plan.pp == 1)  # tied: also lm_head
            totals["nbytes"] += mult * t.nbytes
            totals["read"] += mult * t.nbytes if streamed else 0
            totals["expert"] += mult * t.nbytes if t.source in routed else 0
            # matrices (stacked experts: E of them); packed: values, not words
            if streamed and (len(t.shape) == 2 or t.split == STACKED and len(t.shape) == 3) and t.scale_of is None:
                totals["linear"] += mult * math.prod(t.shape) * (t.pack or 1)
            if t.name.endswith("self_attn.k_proj.weight"):
                kv_heads = t.shape[0] // model.head_dim
        kv_heads = kv_heads or max(1, model.num_kv_heads // plan.tp)  # k stored fused (Phi-3)
        out.append(
            RankWeights(rl.tp_rank, rl.pp_stage, real[rl.pp_stage], totals["nbytes"], totals["read"],
                        totals["linear"], kv_heads, totals["expert"])
        )
    return out


# --- plans ------------------------------------------------------------------------------------


def plan_name(model_name: str, tp: int, pp: int, dtype: str, ep: int = 1) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-._")[:96] or "model"
    return f"{slug}-ep{ep}-{dtype}" if ep > 1 else f"{slug}-tp{tp}pp{pp}-{dtype}"


def plan_dict(
    name: str, source: str, tp: int, pp: int, dtype: str, *, kv_cache_cap_gib: float | None = None,
    max_concurrent_sequences: int | None = None, dp: int = 1,
) -> dict[str, Any]:
    """A plan file's content (the schema of spec/plan.py), ready for ``plan_from_dict``/YAML.

    ``dp`` > 1: an expert-parallel plan (``expert_parallel: true``, ``dp_degree: dp``; the EP group
    is the dp x tp ranks of a stage), with the shard names that carry ``{dp_rank}``."""
    rg: dict[str, Any] = {
        "name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype, "gpus_per_replica": tp * pp * dp,
        "nvlink_domain": "node-local",
    }
    if dp > 1:
        rg["dp_degree"] = dp
        rg["expert_parallel"] = True
    if kv_cache_cap_gib:
        rg["kv_cache_cap_gb"] = int(kv_cache_cap_gib) if kv_cache_cap_gib == int(kv_cache_cap_gib) else kv_cache_cap_gib
    if max_concurrent_sequences:
        rg["max_concurrent_sequences"] = max_concurrent_sequences
    rg["checkpoint"] = {"shard_prefix": DEFAULT_SHARD_PREFIX if dp == 1 else DP_SHARD_PREFIX}
    out: dict[str, Any] = {"replica_group": rg, "model": {"source": source}}
    if dtype in QUANTIZED_DTYPES:
        out["quantization"] = {"ignore": list(DEFAULT_IGNORE)}
    return out


# --- the figures of one candidate -----------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """The fullest GPU of a replica: where the memory rules bite first."""

    stage: int
    total: int
    utilization: float
    weights: int
    overheads: dict[str, int]
    kv_bytes_per_token: int
    kv_available: float  # total x utilization - weights - extra - in-budget overheads (may be negative)
    kv_budget: float  # the pool this GPU would allocate: min(cap, available), or --kv-memory
    extra: int = 0  # LoRA adapters and the draft model on this GPU (sharded like the weights)
    in_budget: int = 0  # the overheads vLLM subtracts from total x utilization (activations, NCCL)
    kv_demand: int = 0  # KV bytes the demanded requests need on this GPU

    @property
    def usable(self) -> float:
        return self.total * self.utilization

    @property
    def overhead(self) -> int:
        return sum(self.overheads.values())

    @property
    def used(self) -> float:
        return self.weights + self.extra + self.overhead + max(self.kv_budget, 0.0)

    @property
    def used_fraction(self) -> float:
        return self.used / self.total


@dataclass(frozen=True)
class KvFigures:
    bytes_per_token: int  # per GPU, of the stage with the most layers
    budget: float  # per GPU, of the limiting GPU
    blocks: int  # per GPU, the minimum over stages: every stage must hold every token
    tokens: int
    max_model_len: int
    sequences: int  # at the average context
    request_len: int  # --max-model-len, else max_position_embeddings
    request_bytes: int  # KV one request of request_len needs per GPU
    demand_tokens: int = 0  # demand_tokens(): what the pool must hold at once
    demand_bytes: int = 0  # those tokens' KV on one GPU (of the stage with the most KV per token)


@dataclass(frozen=True)
class Speed:
    batch: int  # sequences decoded together
    stage: int  # the slowest stage, whose figures follow
    microbatches: int
    bubble: float
    memory_s: float  # of the slowest stage, per micro-batch pass
    compute_s: float
    allreduce_s: float
    handoff_s: float
    slot_s: float  # one micro-batch through one stage (the slowest)
    tpot_s: float  # time per output token of every sequence: (m + p - 1) x slot
    tokens_per_s: float
    limited_by: str  # tpot | kv | max_num_seqs
    tpot1_s: float = 0.0  # time per output token at batch 1: the latency a lone request sees


@dataclass(frozen=True)
class Cost:
    gpus: int
    dollars_per_mtok: float
    gpu_hours_per_mtok: float
    replicas_per_node: int  # 0 when a replica spans nodes
    replicas_in_cluster: int
    replicas_for_demand: int | None
    gpus_for_demand: int | None
