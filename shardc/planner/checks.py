"""The planner's input checks: nonsensical workloads and parameters end here, as one PlanError naming
the field (``key``; hints quote other fields in backticks), before any arithmetic. The CLI maps
field names to its flags. Split from formulas.py, which keeps the arithmetic."""

from __future__ import annotations

from ..errors import PlanError
from ..layout.model import ModelSpec
from .formulas import KV_DTYPE_BYTES, SpeedParams, Workload
from .gpus import GIB, Cluster


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
    if w.concurrency is not None and w.concurrency < 1:
        raise bad("concurrency", f"must be a positive number of requests, found {w.concurrency}",
                  "use 1 or more")
    length = w.max_model_len or max_pos
    for key, value in (("isl", w.isl), ("osl", w.osl)):
        if value is not None and value < 1:
            raise bad(key, f"must be a positive number of tokens, found {value}", f"use 1 to {length - 1:,}")
    if (w.isl is not None or w.osl is not None) and w.prompt + w.output > length:
        which = "max_model_len" if w.max_model_len else "the model's max_position_embeddings"
        raise bad("isl" if w.isl is not None and w.isl >= length else "osl",
                  f"isl {w.prompt:,} + osl {w.output:,} = {w.prompt + w.output:,} tokens is more than "
                  f"{which} {length:,}", f"keep `isl` + `osl` <= {length:,}")
    if w.ttft_ms is not None and not w.ttft_ms > 0:
        raise bad("ttft_ms", f"must be a positive number of milliseconds, found {w.ttft_ms:g}")
    if w.context > (w.max_model_len or max_pos):
        raise bad("avg_context", f"{w.context:,} is longer than the longest request "
                  f"({w.max_model_len or max_pos:,} tokens)", "lower `avg_context`")
    if w.kv_memory is not None and w.kv_memory >= cluster.gpu.memory:
        raise bad("kv_memory", f"{w.kv_memory / GIB:.2f} GiB is more than the GPU's "
                  f"{cluster.gpu.memory / GIB:.2f} GiB", "give the KV memory of one GPU")
    if w.capped and w.cap >= cluster.gpu.memory:
        raise bad("kv_cache_cap", f"{w.cap / GIB:.2f} GiB per GPU is more than the GPU's "
                  f"{cluster.gpu.memory / GIB:.2f} GiB", "the cap is per GPU")
    for name, amount in (("block_size", w.block_size), ("avg_context", w.context),
                         ("target_tpot_ms", w.target_ms), ("price_per_gpu_hour", w.price_per_gpu_hour),
                         ("gpus_per_node", cluster.gpus_per_node), ("nodes", cluster.nodes)):
        if not amount > 0:
            raise bad(name, f"must be positive, found {amount}")
    if speed.microbatches is not None and speed.microbatches < 1:
        raise bad("microbatches", f"must be positive, found {speed.microbatches}")
    if (w.lora_adapters > 0) != (w.lora_rank > 0) or min(w.lora_adapters, w.lora_rank) < 0:
        raise bad("lora_adapters" if w.lora_adapters <= 0 else "lora_rank",
                  f"LoRA needs both a positive adapter count and rank, found {w.lora_adapters} adapters of "
                  f"rank {w.lora_rank}", "give `lora_adapters` and `lora_rank` together")
