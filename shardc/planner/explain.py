"""``shardc plan --explain``: the arithmetic of one candidate, line by line, with the numbers substituted.
Pure formatting of a ``Search`` (no arithmetic of its own beyond restating the planner's figures), the way
one checks it on paper against vLLM's log; split from report.py, which prints the table."""

from __future__ import annotations

from typing import Any

from .candidate import attn_flops, indexer_key_bytes, kv_bpt, routing
from .ep import ep_demand_words, linear_block
from .formulas import SpeedParams, demand_words, experts_touched, rate_dtype, vllm_allreduce_stages
from .gpus import GB, GIB, GPU, fp8_fixed_us, gemm_flops
from .policy import OBJECTIVE_WORDS
from .records import Candidate, Search
from .report import gib


def explain(s: Search, c: Candidate) -> list[str]:
    """The arithmetic for one candidate, line by line, with the numbers substituted."""
    m, g = s.model, s.cluster.gpu
    assert c.pp is not None and c.memory is not None and c.kv is not None
    mem, kvh = c.memory, max(1, m.num_kv_heads // c.tp)
    stage_w = [r for r in c.weights if r.pp_stage == mem.stage][0]
    layers = stage_w.layers[1] - stage_w.layers[0]
    o: list[str] = [f"== {s.model_name} as {c.label} on {c.gpus} x {g.name} =="]
    if c.ep > 1:
        o += _explain_ep(s, c)
    else:
        o += _explain_mla(s, c, layers) if m.forward.mla is not None else _explain_llama(s, c, layers, kvh)
    o += _explain_memory(s, c)
    if c.reasons:
        o += ["", f"Verdict: infeasible: {'; '.join(c.reasons)}"]
        return o
    o += (_explain_ep_speed(s, c) if c.ep > 1 else _explain_speed(s, c)) + _explain_choice(s, c)
    return o


def _explain_mla(s: Search, c: Candidate, layers: int) -> list[str]:
    m, w, mem, kv = s.model, s.workload, c.memory, c.kv
    a, (k, experts) = m.forward.mla, routing(m)
    assert a is not None and mem is not None and kv is not None
    q = f"q_a {a.q_lora_rank:,} + q_b" if a.q_lora_rank else "q"
    stage_w = [r for r in c.weights if r.pp_stage == mem.stage][0]
    dsa = "" if (ix := a.indexer) is None else (f" + {sum(ix.own[slice(*stage_w.layers)])} indexer layers x {indexer_key_bytes(ix.head_dim)} B"
                                                f" (DSA's key: {ix.head_dim} fp8 bytes and an fp32 scale per 128, as vLLM caches it)")
    return ["", f"Parameters (the family's tensor table, {m.architecture}): per layer MLA {q}, kv_a "
            f"{a.kv_lora_rank + a.rope:,}x{m.hidden_size:,}, kv_b, o; dense MLP {m.intermediate_size:,}"
            + (f"; {experts} routed experts (top {k})" if experts else "") + f" = {s.params:,} parameters",
            "", f"Weights per GPU (the Layout of this plan; fullest GPU: stage {mem.stage}, layers "
            f"{stage_w.layers[0]}-{stage_w.layers[1] - 1}): q_a, kv_a, their norms and the router replicated, "
            f"q_b/kv_b by whole heads and o by columns over tp={c.tp}",
            f"  = {mem.weights:,} B = {gib(mem.weights)}",
            "", "KV cache per token per GPU (MLA latent, whole on every TP rank: not divided by tp):",
            f"  {layers} layers x ({a.kv_lora_rank} kv_lora_rank + {a.rope} qk_rope_head_dim) x "
            f"{w.kv_bytes} B{dsa} = {mem.kv_bytes_per_token:,} B",
            f"  one {kv.request_len:,}-token request: {kv.bytes_per_token:,} B x ceil({kv.request_len:,} / "
            f"{w.block_size}) x {w.block_size} = {kv.request_bytes:,} B = {gib(kv.request_bytes)}"]


def _explain_ep(s: Search, c: Candidate) -> list[str]:
    m, w, mem, kv, ew, n = s.model, s.workload, c.memory, c.kv, c.ep_detail, c.ep
    assert mem is not None and kv is not None and ew is not None
    held = linear_block(ew.experts, n, 0)
    each = ew.expert_bytes[0]
    o = ["", f"Expert parallelism: {n} GPUs, plan dp_degree {n}, tp_degree 1, expert_parallel "
         "(the experts placed whole):",
         f"  non-expert weights (attention, norms, router, shared/dense MLPs, embeddings), whole on every GPU: "
         f"{gib(ew.base_bytes)}",
         f"  routed experts: {ew.experts} per MoE layer x {ew.moe_layers} MoE layers, one expert "
         f"{gib(each)} over its layers; vLLM's linear placement gives rank 0 experts {held.start}-{held.stop - 1} "
         f"(ceil({ew.experts} / {n}) = {len(held)}, the largest share)",
         f"  per GPU = {gib(ew.base_bytes)} + {len(held)} x {gib(each)} = {mem.weights:,} B = {gib(mem.weights)}",
         "", "KV cache per token per GPU (split by request, not by head: every KV head of every layer"
         + (", the MLA latent" if m.forward.mla is not None else "") + "):",
         f"  {kv.bytes_per_token:,} B; demand on each GPU: "
         f"{ep_demand_words(w, m.max_position_embeddings, n)} ({kv.demand_tokens:,} tokens)",
         f"  one {kv.request_len:,}-token request: {kv.bytes_per_token:,} B x ceil({kv.request_len:,} / "
         f"{w.block_size}) x {w.block_size} = {kv.request_bytes:,} B = {gib(kv.request_bytes)} (one stream's KV "
         "never splits)"]
    return o


def _explain_ep_speed(s: Search, c: Candidate) -> list[str]:
    m, g, w, sp, v, ew, n = s.model, s.cluster.gpu, s.workload, s.speed, c.speed, c.ep_detail, c.ep
    assert v is not None and c.kv is not None and ew is not None
    rw = max(c.weights, key=lambda r: r.nbytes)
    held = len(linear_block(ew.experts, n, 0))
    share = experts_touched(v.batch, ew.top_k, ew.experts)
    local = -(-v.batch // n)
    link = g.link
    return ["", f"Decode-only step (roofline, approximate), {v.batch} requests over {n} GPUs ({local} streams on "
            f"the fullest) at {w.context:,} tokens of context:",
            f"  HBM: (non-expert {gib(rw.read_bytes - rw.expert_bytes)} + own experts {gib(rw.expert_bytes)} x "
            f"1-(1-{ew.top_k}/{ew.experts})^{v.batch} = {share:.0%} read + KV {local} x {w.context:,} x "
            f"{c.kv.bytes_per_token:,} B) / ({g.hbm_bandwidth / GB:,.0f} GB/s x {_w_eff(sp, c, s.model):g}, KV x "
            f"{sp.kv_hbm_efficiency:g}) = "
            f"{v.memory_s * 1e3:.2f} ms",
            f"  compute: {local} streams x (2 x {ew.base_linear:,} + attention) + {v.batch} x {ew.top_k} x "
            f"{held}/{ew.experts} routed tokens x 2 x {ew.expert_linear:,} FLOP / "
            f"({gemm_flops(g, rate_dtype(s.model, c.dtype or '')) / 1e12:,.0f} TFLOP/s x {_c_eff(sp, c, g, s.model):g}) = {v.compute_s * 1e3:.2f} ms",
            f"  all-to-all: 2 (dispatch, combine) x {ew.moe_layers} MoE layers x [({n}-1)/{n} x {local} x "
            f"{ew.top_k} x {m.hidden_size:,} x 2 B / ({link.bandwidth / GB:,.0f} GB/s x {sp.link_efficiency:g}) + "
            f"({n}-1) x {link.latency * 1e6:g} us] = {v.allreduce_s * 1e3:.2f} ms ({link.name})",
            f"  step = max({v.memory_s * 1e3:.2f}, {v.compute_s * 1e3:.2f}) + {v.allreduce_s * 1e3:.2f} + fixed "
            f"{v.fixed_s * 1e3:.2f} + {sp.step_overhead_ms:g} = {v.slot_s * 1e3:.2f} ms; not modelled: expert load "
            "imbalance, dispatch kernels, DP ranks waiting for each other",
            *_explain_serving(s, c)]


def _explain_llama(s: Search, c: Candidate, layers: int, kvh: int) -> list[str]:
    m, w, tp, mem, kv = s.model, s.workload, c.tp, c.memory, c.kv
    assert mem is not None and kv is not None
    h, hd, inter, q, kvo = m.hidden_size, m.head_dim, m.intermediate_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    stage_w = [r for r in c.weights if r.pp_stage == mem.stage][0]
    o: list[str] = []
    o += ["", "Parameters (from config.json):",
          f"  embed_tokens {m.vocab_size:,} x {h:,}; per layer q {q:,}x{h:,}, k and v {kvo:,}x{h:,}, "
          f"o {h:,}x{q:,}, gate and up {inter:,}x{h:,}, down {h:,}x{inter:,}, 2 norms {h:,}"
          + (", biases" if m.qkv_bias or m.o_bias or m.mlp_bias else ""),
          f"  x {m.num_layers} layers + final norm {h:,} + "
          + ("lm_head tied to embed_tokens" if m.tie_word_embeddings else f"lm_head {m.vocab_size:,} x {h:,}")
          + f" = {s.params:,} parameters"]
    quant = (f"{c.dtype} projections at 1 B/param + a float32 scale per output row; embeddings, lm_head "
             "and norms 16-bit" if c.dtype in ("int8", "fp8") else
             "the checkpoint's quantized tensors as stored (values and scales at their real size), the rest "
             "16-bit" if c.dtype == "source" else f"every tensor {c.dtype}, 2 B/param")
    o += ["", f"Weights per GPU (the Layout of this plan; fullest GPU: stage {mem.stage}, layers "
          f"{stage_w.layers[0]}-{stage_w.layers[1] - 1}):",
          f"  {quant}; q/k/v/gate/up split by rows, o/down by columns over tp={tp}; norms replicated",
          f"  KV heads per rank max(1, {m.num_kv_heads} // {tp}) = {kvh}"
          + (" (replicated: tp > kv_heads)" if tp > m.num_kv_heads else "")
          + f"; vocab rows per rank ceil({m.vocab_size:,} / {tp}) = {-(-m.vocab_size // tp):,}",
          f"  = {mem.weights:,} B = {gib(mem.weights)}"]
    full = layers - (sum(m.forward.hybrid.linear[slice(*stage_w.layers)]) if m.forward.hybrid else 0)
    o += ["", "KV cache per token per GPU:",
          f"  2 (K and V) x {full} {'full-attention ' if full != layers else ''}layers x max(1, {m.num_kv_heads} // {tp}) "
          f"KV heads x {hd} head_dim x {w.kv_bytes} B = {mem.kv_bytes_per_token:,} B",
          f"  one {kv.request_len:,}-token request: {kv.bytes_per_token:,} B x ceil({kv.request_len:,} / {w.block_size}) x "
          f"{w.block_size}" + (f" + {kv.state_bytes:,} B linear-attention state" if kv.state_bytes else "")
          + f" = {kv.request_bytes:,} B = {gib(kv.request_bytes)}"]
    return o


def _explain_memory(s: Search, c: Candidate) -> list[str]:
    m, g, w, sp, mem, kv = s.model, s.cluster.gpu, s.workload, s.speed, c.memory, c.kv
    assert mem is not None and kv is not None
    o: list[str] = []
    inside = {k: v for k, v in mem.overheads.items() if k in ("activations", "nccl")}
    head = {k: v for k, v in mem.overheads.items() if k not in inside}
    words = demand_words(w, m.max_position_embeddings)
    o += ["", "Memory per GPU (vLLM's accounting: KV = total x utilization - weights - profiled activations "
          "- NCCL; the CUDA context and graphs sit in the headroom):",
          f"  usable = {gib(g.memory)} ({g.memory_from}) x {w.gpu_memory_utilization:g} = {gib(mem.usable)}",
          "  overheads in vLLM's budget = " + " + ".join(f"{k} {v / GIB:.2f}" for k, v in inside.items())
          + f" = {gib(mem.in_budget)}; in the headroom = "
          + " + ".join(f"{k} {v / GIB:.2f}" for k, v in head.items()) + f" = {gib(sum(head.values()))}",
          f"  KV available = {mem.usable / GIB:.2f} - {mem.weights / GIB:.2f}"
          + (f" - {mem.extra / GIB:.2f} (LoRA/draft)" if mem.extra else "")
          + f" - {mem.in_budget / GIB:.2f} = {gib(mem.kv_available)}"]
    if mem.extra:
        o.insert(-2, _extra_line(s, c))
    if w.kv_memory is not None:
        o.append(f"  KV pool = `kv_memory` {gib(w.kv_memory)} (as the serving engine measured it)")
    else:
        cap = f"cap {gib(w.cap)}" if w.capped else "no cap"
        o.append(f"  KV pool = min({cap}, available {gib(mem.kv_available)}) = {gib(mem.kv_budget)} "
                 "(what the unit allocates; the cap is a ceiling, not a reservation)")
    o.append(f"  KV demand = {words}: {kv.demand_tokens:,} tokens x {mem.kv_bytes_per_token:,} B = "
             f"{gib(mem.kv_demand)} per GPU -> " + ("fits the pool" if kv.tokens >= kv.demand_tokens else
                                                  "more than the pool holds"))
    o.append(f"  in use = {mem.weights / GIB:.2f} + " + (f"{mem.extra / GIB:.2f} + " if mem.extra else "")
             + f"{mem.overhead / GIB:.2f} + {max(mem.kv_budget, 0) / GIB:.2f} = "
             f"{gib(mem.used)} = {mem.used_fraction:.1%} of {gib(g.memory)} "
             + (f"(limit {sp.max_memory_fraction:.0%}: a measured pool bypasses vLLM's budget)" if w.kv_memory is not None
                else f"(CUDA context and graphs {s.overheads.outside(c.gpus) / GIB:.2f} GiB in the "
                f"{g.memory * (1 - w.gpu_memory_utilization) / GIB:.2f} GiB headroom: vLLM starts when they fit)"))
    o += ["", "KV capacity (vLLM's block rounding):",
          f"  blocks = floor({gib(kv.budget)} / ({w.block_size} x {kv.bytes_per_token:,} B)) = {kv.blocks:,}"
          f" -> {kv.tokens:,} tokens",
          f"  max model length = {w.block_size} x {kv.blocks:,} = {kv.tokens:,}, capped at "
          f"{max(kv.request_len, m.max_position_embeddings):,} -> {kv.max_model_len:,}",
          f"  sequences at {w.context:,} tokens = floor({kv.blocks:,} / ceil({w.context:,} / {w.block_size}))"
          + ("" if not kv.state_bytes else f", at most floor({gib(kv.budget)} / (ceil({w.context:,} / {w.block_size}) x "
             f"{w.block_size} x {kv.bytes_per_token:,} B + {kv.state_bytes:,} B state of the linear-attention layers))")
          + f" = {kv.sequences:,}"]
    return o


def _extra_line(s: Search, c: Candidate) -> str:
    m, w, mem = s.model, s.workload, c.memory
    assert mem is not None and c.pp is not None
    parts = []
    if w.lora_adapters:
        q, kvo = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        rw = next(r for r in c.weights if r.pp_stage == mem.stage)
        parts.append(f"LoRA {w.lora_adapters} x rank {w.lora_rank} x {rw.layers[1] - rw.layers[0]} layers x "
                     f"(7 x {m.hidden_size:,} + 2 x {q:,} + "
                     f"2 x {kvo:,} + 3 x {m.intermediate_size:,}) x 2 B / tp={c.tp}")
    if s.draft_params:
        parts.append(f"draft {s.draft_params:,} params x 2 B / {c.tp * c.pp} GPUs")
    return f"  LoRA/draft (sharded like the weights) = {' + '.join(parts)} = {gib(mem.extra)}"


def _explain_speed(s: Search, c: Candidate) -> list[str]:
    m, g, w, sp, cl = s.model, s.cluster.gpu, s.workload, s.speed, s.cluster
    assert c.speed and c.cost and c.pp
    v, tp, pp = c.speed, c.tp, c.pp
    rw = max((r for r in c.weights if r.pp_stage == v.stage), key=lambda r: r.read_bytes)
    layers = rw.layers[1] - rw.layers[0]
    b = v.batch / v.microbatches
    bpt = kv_bpt(m, layers, tp, w.kv_bytes, rw.layers[0])
    read: float = rw.read_bytes  # less the routed experts a step leaves unread
    routed = ""
    if rw.expert_bytes:
        k, experts = routing(m)
        share = experts_touched(b, k, experts)
        read -= rw.expert_bytes * (1 - share)
        routed = f" (routed experts {gib(rw.expert_bytes)} x 1-(1-{k}/{experts})^{b:g} = {share:.0%} read)"
    attn = (f"{attn_flops(m)} x {layers} layers x {m.num_heads // tp} heads" if m.forward.mla is not None else
            f"4 x {layers} layers x {m.num_heads // tp} heads x {m.head_dim}")
    link = g.link
    o = ["", f"Decode-only step (roofline), {v.batch} requests at {w.context:,} tokens of context"
         + (f", {v.microbatches} micro-batches of {b:g}" if pp > 1 else "") + f"; slowest stage {v.stage}:",
         f"  HBM: weights read {gib(read)}{routed} / ({g.hbm_bandwidth / GB:,.0f} GB/s x {_w_eff(sp, c, s.model):g}) + KV "
         f"{b:g} x {w.context:,} x {bpt:,} B / (x {sp.kv_hbm_efficiency:g}) = {v.memory_s * 1e3:.2f} ms",
         f"  compute: {b:g} x (2 x {rw.linear_params:,} params + {attn} x {w.context:,}) FLOP / "
         f"({gemm_flops(g, rate_dtype(s.model, c.dtype or '')) / 1e12:,.0f} TFLOP/s {'fp8' if rate_dtype(s.model, c.dtype or '') == 'fp8' and gemm_flops(g, 'fp8') > g.flops else '16-bit'}"
         f" x {_c_eff(sp, c, g, s.model):g}) = {v.compute_s * 1e3:.2f} ms",
         _allreduce_words(g, tp, layers, b, m.hidden_size, sp)
         + (" + the hand-off to the next stage" if pp > 1 and v.stage < pp - 1 else "")
         + f" = {v.allreduce_s * 1e3:.2f} ms ({link.name if cl.nodes == 1 else link.name + '/' + cl.inter_node.name})",
         f"  fixed: {layers} layers x {sp.layer_overhead_us:g} us"
         + (f" + {layers} x {one:g} us (fp8: activations quantized" + (", GEMMs of one row)" if b <= 1 else ")")
            if (one := fp8_fixed_us(g, rate_dtype(s.model, c.dtype or ""), sp, b)) else "")
         + f" = {v.fixed_s * 1e3:.2f} ms",
         f"  slot = max({v.memory_s * 1e3:.2f}, {v.compute_s * 1e3:.2f}) + {v.allreduce_s * 1e3:.2f} + "
         f"{v.fixed_s * 1e3:.2f} = {v.slot_s * 1e3:.2f} ms"]
    if pp > 1:
        o.append(f"  GPipe: bubble (p-1)/(m+p-1) = ({pp}-1)/({v.microbatches}+{pp}-1) = {v.bubble:.1%}; "
                 f"step = (m+p-1) x slot + {sp.step_overhead_ms:g} ms")
    else:
        o.append(f"  step = slot + {sp.step_overhead_ms:g} ms (scheduler, sampling)")
    return o + _explain_serving(s, c)


def _allreduce_words(g: GPU, tp: int, layers: int, b: float, hidden: int, sp: SpeedParams) -> str:
    """The all-reduce term of --explain's step, with the kernel vLLM picks for this size
    (formulas.vllm_allreduce_s), the system's measured all-reduce (GPU.allreduce) or the ring off NVLink."""
    link, nbytes = g.link, b * hidden * 2
    size, bw = f"{b:g} x {hidden:,} x 2 B", f"({link.bandwidth / GB:,.0f} GB/s x {sp.link_efficiency:g})"
    measured = g.allreduce_s(tp, nbytes)
    if measured is not None:
        words = (f"{measured * 1e6:.1f} us (vLLM's all-reduce of {nbytes / 1024:,.0f} KiB as measured on {tp} "
                 f"{g.name} GPUs, aiconfigurator 0.12)")
    elif not link.name.startswith("nvlink"):
        words = f"[2({tp}-1)/{tp} x {size} / {bw} + 2({tp}-1) x {link.latency * 1e6:g} us] (ring)"
    elif vllm_allreduce_stages(tp, nbytes) == 1:
        words = (f"[({tp}-1) x {size} / {bw} + {link.latency * 1e6:g} us] (vLLM's one-stage custom all-reduce: "
                 f"{nbytes / 1024:,.0f} KiB on {tp} GPUs)")
    else:
        words = (f"[2({tp}-1)/{tp} x {size} / {bw} + 2 x {link.latency * 1e6:g} us + {sp.two_stage_us:g} us] "
                 f"(vLLM's two-stage custom all-reduce: {nbytes / 1024:,.0f} KiB on {tp} GPUs)")
    over = (f" + 2 x {layers} x {sp.allreduce_overhead_us:g} us launch"
            if tp > 1 and sp.allreduce_overhead_us and measured is None else "")
    return f"  all-reduce: 2 x {layers} layers x {words}{over}"


def _w_eff(sp: SpeedParams, c: Candidate, model: Any) -> float:
    return sp.w8_hbm_efficiency if rate_dtype(model, c.dtype or "") in ("int8", "fp8") else sp.hbm_efficiency


def _c_eff(sp: SpeedParams, c: Candidate, g: GPU, model: Any) -> float:
    return sp.fp8_compute_efficiency if gemm_flops(g, rate_dtype(model, c.dtype or "")) > g.flops \
        else sp.compute_efficiency


def _explain_serving(s: Search, c: Candidate) -> list[str]:
    w, sp, v, k, x = s.workload, s.speed, c.speed, c.cost, c.serving
    assert v is not None and k is not None and x is not None
    gpus = c.gpus
    limit = {"tpot": f"the most within the {w.target_ms:g} ms TPOT target",
             "ttft": f"the most within the {w.ttft_ms or 0:g} ms TTFT target",
             "kv": "every request the KV cache holds", "max_num_seqs": f"max_num_seqs {sp.max_num_seqs}",
             "concurrency": "`concurrency`"}
    o = ["", f"Serving (isl {x.isl:,}, osl {x.osl:,}; vLLM chunked prefill, {sp.max_num_batched_tokens:,} tokens "
         "per step):",
         f"  concurrency {x.concurrency} = {limit[v.limited_by]}"
         + ("" if c.meets_target else " (misses the target)"),
         f"  prompt in ceil({x.isl:,} / {x.chunk:,}) = {x.chunks} chunk(s); steps with a chunk: "
         f"min(1, {x.concurrency} x {x.chunks} / ({x.chunks} + {x.osl:,} - 1)) = {x.mixed_share:.1%}",
         f"  decode step {x.decode_step_s * 1e3:.2f} ms; step with a prompt chunk {x.mixed_step_s * 1e3:.2f} ms; "
         f"one prompt alone {x.prefill_s * 1e3:.2f} ms",
         f"  TPOT = {x.mixed_share:.3f} x {x.mixed_step_s * 1e3:.2f} + {1 - x.mixed_share:.3f} x "
         f"{x.decode_step_s * 1e3:.2f} = {x.tpot_s * 1e3:.2f} ms (batch 1: {v.tpot1_s * 1e3:.2f} ms)",
         f"  TTFT = wait {x.wait_s * 1e3:.2f} (the step in progress and the prompts ahead; the others keep the "
         f"unit prefilling {x.prefilling:.0%} of the time) + {x.chunks} x {x.mixed_step_s * 1e3:.2f} = "
         f"{x.ttft_s * 1e3:.1f} ms" if x.concurrency > 1 else
         f"  TTFT = one prefill alone on the idle unit = {x.ttft_s * 1e3:.1f} ms",
         f"  request = {x.ttft_s * 1e3:.1f} + ({x.osl:,} - 1) x {x.tpot_s * 1e3:.2f} = {x.latency_s:.2f} s; "
         f"{x.concurrency} / {x.latency_s:.2f} s = {x.requests_per_s:.2f} requests/s",
         "", "Throughput and cost:",
         f"  tokens/s per replica = {x.requests_per_s:.3f} x {x.osl:,} = {x.tokens_per_s:,.0f}; per GPU / {gpus} = "
         f"{x.tokens_per_s_per_gpu:,.0f}",
         f"  $/Mtok = {gpus} GPUs x ${w.price_per_gpu_hour:.2f}/h x 1e6 / ({x.tokens_per_s:,.0f} tok/s x 3,600 s/h)"
         f" = ${k.dollars_per_mtok:.3f}  ({k.gpu_hours_per_mtok:.3f} GPU-hours per Mtok)",
         f"  replicas per node = {s.cluster.gpus_per_node} // {gpus} = {k.replicas_per_node}; in this cluster: "
         f"{k.replicas_in_cluster}"]
    if k.replicas_for_demand is not None:
        o.append(f"  demand: ceil({w.demand_tokens_per_s:,.0f} / {x.tokens_per_s:,.0f}) = {k.replicas_for_demand} "
                 f"replicas = {k.gpus_for_demand} GPUs")
    return o


def _explain_choice(s: Search, c: Candidate) -> list[str]:
    o = ["", f"Choice (objective {s.objective}: {OBJECTIVE_WORDS[s.objective]}):"]
    if s.objective == "fit":
        o += _explain_fit(s)
    elif s.objective == "cost":
        eligible = [x for x in s.candidates if x.fits and not x.skipped and x.meets_target]
        others = sorted((x for x in eligible if x is not c), key=lambda x: x.cost.dollars_per_mtok if x.cost else 0)
        o.append(f"  cheapest $/Mtok of {len(eligible)} candidates that fit the KV cap and meet the TPOT target "
                 "(ties go to the smaller TP group, then bf16/fp16, int8, fp8)")
        o += [f"  next: {x.label} ${x.cost.dollars_per_mtok:.3f}" for x in others[:3] if x.cost]
    else:
        ranked = sorted((x for x in s.candidates if x.fits and not x.skipped and x.speed),
                        key=lambda x: (x.require_speed().tpot1_s, x.tp * (x.pp or 1)))
        o += [f"  {x.label}: {x.require_speed().tpot1_s * 1e3:.2f} ms at batch 1" for x in ranked[:4]]
    if c is not s.recommended:
        o.append(f"  {c.label} is not the recommendation: status {c.status}")
    a = s.alternative
    if a is not None and a.speed:
        o.append(f"  fastest alternative (single-node TP unit with more GPUs, lowest TPOT at batch 1): {a.label}, "
                 f"{a.speed.tpot1_s * 1e3:.2f} ms")
    o += [f"  warning: {x}" for x in s.warnings]
    skipped = [x for x in s.candidates if x.skipped]
    if skipped:
        o.append(f"  {len(skipped)} pipeline candidates not considered: {skipped[0].skipped}")
    sp, ov = s.speed, s.overheads
    o += ["", "Assumptions (named parameters):",
          "  overheads per GPU: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in ov.per_gpu(2).items())
          + " (nccl only with > 1 GPU)",
          f"  hbm_efficiency {sp.hbm_efficiency:g}, w8_hbm_efficiency {sp.w8_hbm_efficiency:g}, "
          f"kv_hbm_efficiency {sp.kv_hbm_efficiency:g}, compute_efficiency {sp.compute_efficiency:g}, "
          f"fp8_compute_efficiency {sp.fp8_compute_efficiency:g}, "
          f"link_efficiency {sp.link_efficiency:g}, layer_overhead_us {sp.layer_overhead_us:g}, "
          f"step_overhead_ms {sp.step_overhead_ms:g}, allreduce_overhead_us {sp.allreduce_overhead_us:g}, "
          f"two_stage_us {sp.two_stage_us:g}, "
          f"fp8_single_token_us {sp.fp8_single_token_us:g}, fp8_layer_us {sp.fp8_layer_us:g} (fitted to aiconfigurator 0.12's vLLM tables: "
          "docs/performance.md), "
          f"max_num_batched_tokens {sp.max_num_batched_tokens}, microbatches {sp.microbatches or 'one per stage'}, "
          f"max_num_seqs {sp.max_num_seqs}, max memory per GPU {sp.max_memory_fraction:.0%} (with `kv_memory`)"]
    return o


def _explain_fit(s: Search) -> list[str]:
    """Rules 1-4 with the numbers substituted, per dtype walked: the demand, the sharded and
    replicated parts, the minimum, each step, and why each smaller unit was rejected."""
    o: list[str] = []
    measured = s.workload.kv_memory is not None
    for t in s.trails:
        if measured:
            o.append(f"  {t.dtype}: KV demand = {t.demand}: {t.demand_tokens:,} tokens, inside the measured "
                     f"`kv_memory` pool of {gib(t.kv_replicated)} on every GPU (replicated)")
        else:
            kv_where = ("replicated: an MLA latent is whole on every GPU" if t.kv_replicated else
                        "sharded by KV head")
            o.append(f"  {t.dtype}: KV demand = {t.demand}: {t.demand_tokens:,} tokens = "
                     f"{gib(t.kv_demand or t.kv_replicated)} over all KV heads ({kv_where})")
        parts = f"weights {gib(t.weights)}" + (f" + LoRA {gib(t.lora)}" if t.lora else "") + (
            f" + draft {gib(t.draft)}" if t.draft else "") + (f" + KV demand {gib(t.kv_demand)}" if t.kv_demand else "")
        o.append(f"    sharded = {parts} = {gib(t.sharded)}")
        o.append(f"    replicated per GPU = overheads {gib(t.replicated)} (activations, NCCL, CUDA context and "
                 f"graphs)" + (f" + KV demand {gib(t.kv_replicated)}" if t.kv_replicated else ""))
        if measured:
            o.append(f"    room per card = {t.limit / GIB:.2f} at the limit - {t.replicated / GIB:.2f} - "
                     f"{t.kv_replicated / GIB:.2f} = {gib(t.room)} ({gib(t.one_card_room)} on one card, no NCCL)")
        else:
            o.append(f"    room per card = {t.usable / GIB:.2f} usable - {t.in_budget / GIB:.2f} in vLLM's budget"
                     + (f" - {t.kv_replicated / GIB:.2f}" if t.kv_replicated else "") + f" = {gib(t.room)} "
                     f"({gib(t.one_card_room)} on one card, no NCCL); CUDA context and graphs "
                     f"{t.outside / GIB:.2f} GiB in the {t.headroom / GIB:.2f} GiB headroom")
        if t.minimum is None:
            o.append("    the replicated part alone fills a card")
        else:
            o.append(f"    one card: {gib(t.sharded)} <= {gib(t.one_card_room)}? "
                     + ("yes -> minimum 1" if t.minimum == 1 else
                        f"no -> minimum = ceil({t.sharded / GIB:.2f} / {t.room / GIB:.2f}) = {t.minimum} GPUs"))
            o.append(f"    valid TP (divides the heads, <= the fabric limit {t.tp_limit}): "
                     f"{', '.join(map(str, t.valid_tps)) or 'none'}")
        if t.ep_ladder:
            o.append(f"    EP ladder (powers of two up to min({routing(s.model)[1]} experts, the "
                     f"{s.cluster.tp_limit}-GPU EP domain of the fabric); the smallest that fits within "
                     f"{s.speed.max_memory_fraction:.0%} wins, else the dense TP/PP path):")
            o += [f"      {label}: weights {gib(wb)} per GPU, in use {gib(used)}: {verdict}"
                  for label, wb, used, verdict in t.ep_ladder]
        o += [f"    {label}: {verdict}" for label, verdict in t.steps]
        o += [f"    rejected {label}: {why}" for label, why in t.rejected if label not in dict(t.steps)]
        o.append(f"    -> {t.chosen}" if t.chosen else "    -> no unit of this dtype")
    return o
