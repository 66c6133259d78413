"""Human-readable planner output: the candidate table with a per-GPU memory bar, and ``--explain``.

Pure formatting of a ``Search`` (no arithmetic of its own beyond restating the planner's figures),
so the numbers printed are the numbers decided on. ``--explain`` writes the arithmetic out line by
line with the values substituted, the way one checks it on paper against vLLM's log.
"""

from __future__ import annotations

from .gpus import GB, GIB
from .search import Candidate, Search, default_dtypes

BAR_WIDTH = 24
BAR_LEGEND = "bar: # weights  = KV cache  + overheads  . free  (whole GPU as CUDA reports it; | at 95%)"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def memory_bar(c: Candidate, width: int = BAR_WIDTH, limit: float = 0.95) -> str:
    """[weights|KV|overheads|free] of the fullest GPU, one character per 1/width of its memory."""
    m = c.memory
    if m is None:
        return ""
    cells = []
    for char, part in (("#", m.weights), ("=", max(m.kv_budget, 0.0)), ("+", m.overhead)):
        cells.append(char * round(width * part / m.total))
    text = "".join(cells)[:width]
    text += "." * (width - len(text))
    mark = min(width - 1, round(width * limit))
    if text[mark] == ".":
        text = text[:mark] + "|" + text[mark + 1 :]
    return f"[{text}]"


def header(s: Search) -> list[str]:
    m, g, w, cl = s.model, s.cluster.gpu, s.workload, s.cluster
    kv = f"{w.kv_dtype if w.kv_dtype != 'auto' else default_dtypes(m)[0]} ({w.kv_bytes} B/value)"
    budget = f"--kv-memory {gib(w.kv_memory)}" if w.kv_memory is not None else f"utilization {w.gpu_memory_utilization:g}"
    return [
        f"model   {s.model_name}: {s.params / 1e9:.2f} B parameters, {m.num_layers} layers, hidden {m.hidden_size:,}, "
        f"{m.num_heads} heads / {m.num_kv_heads} KV heads x {m.head_dim}, vocab {m.vocab_size:,}"
        f"{', tied embeddings' if m.tie_word_embeddings else ''}",
        f"gpus    {cl.total_gpus} x {g.name} ({cl.nodes} node{'s' if cl.nodes > 1 else ''} x {cl.gpus_per_node}): "
        f"{gib(g.memory)} as CUDA reports it, HBM {g.hbm_bandwidth / GB:,.0f} GB/s, "
        f"{g.link.name} {g.link.bandwidth / GB:,.0f} GB/s"
        + (f", {cl.inter_node.name} between nodes" if cl.nodes > 1 else ""),
        f"serve   avg context {w.avg_context:,}, KV cap {gib(w.cap)}/GPU, {budget}, block {w.block_size}, "
        f"KV {kv}, TPOT <= {w.target_tpot_ms:g} ms, ${w.price_per_gpu_hour:.2f}/GPU-hour",
    ]


def table(s: Search) -> list[str]:
    """Fitting candidates by cost, then why the others are out."""
    rows = [c for c in s.candidates if c.fits and not c.skipped]
    rows.sort(key=lambda c: (c is not s.recommended, not c.meets_target,
                             c.cost.dollars_per_mtok if c.cost else 0, c.tp, c.pp or 0))
    out = header(s) + [""]
    out.append(f"  {'candidate':<17}{'GPUs':>5}{'weights':>10}{'KV B/tok':>10}{'max len':>9}{'seqs':>6}"
               f"{'batch':>6}{'TPOT':>9}{'tok/s':>8}{'$/Mtok':>8}  memory per GPU")
    for c in rows:
        assert c.memory and c.kv and c.speed and c.cost
        mark = "*" if c is s.recommended else ("!" if not c.meets_target else " ")
        out.append(
            f"{mark} {c.label:<17}{c.tp * (c.pp or 1):>5}{c.memory.weights / GIB:>6.2f} GiB"
            f"{c.kv.bytes_per_token:>10,}{c.kv.max_model_len:>9,}{c.kv.sequences:>6,}{c.speed.batch:>6,}"
            f"{c.speed.tpot_s * 1e3:>7.1f}ms{c.speed.tokens_per_s:>8,.0f}{c.cost.dollars_per_mtok:>8.2f}  "
            f"{memory_bar(c)}"
        )
    if not rows:
        out.append("  (no candidate fits)")
    out += ["  " + BAR_LEGEND, "  * recommended   ! misses the TPOT target (shown at batch 1)"]
    bad = [c for c in s.candidates if c.reasons]
    if bad:
        out += ["", "not feasible:"] + [f"  {c.label:<17}{c.reasons[0]}" for c in bad]
    skipped = [c for c in s.candidates if c.skipped]
    if skipped:
        out += ["", f"pipeline candidates not considered: {len(skipped)} ({skipped[0].skipped}); "
                    "--pp N forces a pipeline depth"]
    out += [""] + summary(s)
    return out


def summary(s: Search) -> list[str]:
    c = s.recommended
    if c is None:
        return ["no recommendation (see the reasons above)"]
    assert c.speed and c.cost and c.kv
    line = (f"recommended: {c.label} on {c.cost.gpus} GPU{'s' if c.cost.gpus > 1 else ''}: "
            f"{c.speed.tokens_per_s:,.0f} tok/s per replica at {c.speed.tpot_s * 1e3:.1f} ms TPOT "
            f"(batch {c.speed.batch}), ${c.cost.dollars_per_mtok:.2f} per million output tokens, "
            f"max model length {c.kv.max_model_len:,}")
    out = [line]
    if c.cost.replicas_for_demand is not None:
        out.append(f"demand {s.workload.demand_tokens_per_s:,.0f} tok/s: {c.cost.replicas_for_demand} replicas "
                   f"= {c.cost.gpus_for_demand} GPUs ({c.cost.replicas_in_cluster} fit in this cluster)")
    return out


def explain(s: Search, c: Candidate) -> list[str]:
    """The arithmetic for one candidate, line by line, with the numbers substituted."""
    m, g, w, sp = s.model, s.cluster.gpu, s.workload, s.speed
    assert c.pp is not None and c.memory is not None and c.kv is not None
    tp, pp, mem, kv = c.tp, c.pp, c.memory, c.kv
    h, hd, inter, q, kvo = m.hidden_size, m.head_dim, m.intermediate_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    kvh = max(1, m.num_kv_heads // tp)
    stage_w = [r for r in c.weights if r.pp_stage == mem.stage][0]
    layers = stage_w.layers[1] - stage_w.layers[0]
    o: list[str] = [f"== {s.model_name} as {c.label} on {tp * pp} x {g.name} =="]
    o += ["", "Parameters (from config.json):",
          f"  embed_tokens {m.vocab_size:,} x {h:,}; per layer q {q:,}x{h:,}, k and v {kvo:,}x{h:,}, "
          f"o {h:,}x{q:,}, gate and up {inter:,}x{h:,}, down {h:,}x{inter:,}, 2 norms {h:,}"
          + (", biases" if m.qkv_bias or m.o_bias or m.mlp_bias else ""),
          f"  x {m.num_layers} layers + final norm {h:,} + "
          + ("lm_head tied to embed_tokens" if m.tie_word_embeddings else f"lm_head {m.vocab_size:,} x {h:,}")
          + f" = {s.params:,} parameters"]
    quant = (f"{c.dtype} projections at 1 B/param + a float32 scale per output row; embeddings, lm_head "
             "and norms 16-bit" if c.dtype in ("int8", "fp8") else f"every tensor {c.dtype}, 2 B/param")
    o += ["", f"Weights per GPU (the Layout of this plan; fullest GPU: stage {mem.stage}, layers "
          f"{stage_w.layers[0]}-{stage_w.layers[1] - 1}):",
          f"  {quant}; q/k/v/gate/up split by rows, o/down by columns over tp={tp}; norms replicated",
          f"  KV heads per rank max(1, {m.num_kv_heads} // {tp}) = {kvh}"
          + (" (replicated: tp > kv_heads)" if tp > m.num_kv_heads else "")
          + f"; vocab rows per rank ceil({m.vocab_size:,} / {tp}) = {-(-m.vocab_size // tp):,}",
          f"  = {mem.weights:,} B = {gib(mem.weights)}"]
    o += ["", "KV cache per token per GPU:",
          f"  2 (K and V) x {layers} layers x max(1, {m.num_kv_heads} // {tp}) KV heads x {hd} head_dim x "
          f"{w.kv_bytes} B = {mem.kv_bytes_per_token:,} B",
          f"  one {kv.request_len:,}-token request: {kv.bytes_per_token:,} B x ceil({kv.request_len:,} / "
          f"{w.block_size}) x {w.block_size} = {kv.request_bytes:,} B = {gib(kv.request_bytes)}"]
    over = " + ".join(f"{k} {v / GIB:.2f}" for k, v in mem.overheads.items())
    o += ["", "Memory per GPU:",
          f"  usable = {gib(g.memory)} (as CUDA reports it) x {w.gpu_memory_utilization:g} = {gib(mem.usable)}",
          f"  overheads = {over} = {gib(mem.overhead)}",
          f"  KV available = {mem.usable / GIB:.2f} - {mem.weights / GIB:.2f} - {mem.overhead / GIB:.2f} = "
          f"{gib(mem.kv_available)}"]
    if w.kv_memory is not None:
        o.append(f"  KV budget = --kv-memory {gib(w.kv_memory)} (as the serving engine measured it)")
    else:
        o.append(f"  KV budget = min(cap {gib(w.cap)}, {gib(mem.kv_available)}) = {gib(mem.kv_budget)}")
    o.append(f"  in use = {mem.weights / GIB:.2f} + {mem.overhead / GIB:.2f} + {max(mem.kv_budget, 0) / GIB:.2f} = "
             f"{gib(mem.used)} = {mem.used_fraction:.1%} of {gib(g.memory)} (limit {sp.max_memory_fraction:.0%})")
    o += ["", "KV capacity (vLLM's block rounding):",
          f"  blocks = floor({gib(kv.budget)} / ({w.block_size} x {kv.bytes_per_token:,} B)) = {kv.blocks:,}"
          f" -> {kv.tokens:,} tokens",
          f"  max model length = {w.block_size} x {kv.blocks:,} = {kv.tokens:,}, capped at "
          f"max_position_embeddings {m.max_position_embeddings:,} -> {kv.max_model_len:,}",
          f"  sequences at {w.avg_context:,} tokens = floor({kv.blocks:,} / ceil({w.avg_context:,} / "
          f"{w.block_size})) = {kv.sequences:,}"]
    if c.reasons:
        o += ["", f"Verdict: infeasible: {'; '.join(c.reasons)}"]
        return o
    o += _explain_speed(s, c) + _explain_choice(s, c)
    return o


def _explain_speed(s: Search, c: Candidate) -> list[str]:
    m, g, w, sp, cl = s.model, s.cluster.gpu, s.workload, s.speed, s.cluster
    assert c.speed and c.cost and c.pp
    v, tp, pp = c.speed, c.tp, c.pp
    rw = max((r for r in c.weights if r.pp_stage == v.stage), key=lambda r: r.read_bytes)
    layers = rw.layers[1] - rw.layers[0]
    b = v.batch / v.microbatches
    bpt = 2 * layers * max(1, m.num_kv_heads // tp) * m.head_dim * w.kv_bytes
    link = g.link
    o = ["", f"Decode step (roofline), batch {v.batch} at {w.avg_context:,} tokens of context"
         + (f", {v.microbatches} micro-batches of {b:g}" if pp > 1 else "") + f"; slowest stage {v.stage}:",
         f"  HBM: (weights read {gib(rw.read_bytes)} + KV {b:g} x {w.avg_context:,} x {bpt:,} B) / "
         f"({g.hbm_bandwidth / GB:,.0f} GB/s x {sp.hbm_efficiency:g}) = {v.memory_s * 1e3:.2f} ms",
         f"  compute: {b:g} x (2 x {rw.linear_params:,} params + 4 x {layers} layers x {m.num_heads // tp} heads x "
         f"{m.head_dim} x {w.avg_context:,}) FLOP / ({g.flops / 1e12:,.0f} TFLOP/s x {sp.compute_efficiency:g}) "
         f"= {v.compute_s * 1e3:.2f} ms",
         f"  roofline = max({v.memory_s * 1e3:.2f}, {v.compute_s * 1e3:.2f}) = "
         f"{max(v.memory_s, v.compute_s) * 1e3:.2f} ms",
         f"  all-reduce: 2 x {layers} layers x [2({tp}-1)/{tp} x {b:g} x {m.hidden_size:,} x 2 B / "
         f"({link.bandwidth / GB:,.0f} GB/s x {sp.link_efficiency:g}) + 2({tp}-1) x {link.latency * 1e6:g} us] = "
         f"{v.allreduce_s * 1e3:.2f} ms ({link.name})"]
    if pp > 1:
        hop = (f"none (stage {v.stage} is the last)" if v.stage == pp - 1 else
               f"{b:g} x {m.hidden_size:,} x 2 B over {link.name if cl.nodes == 1 else link.name + '/' + cl.inter_node.name}"
               f" + latency = {v.handoff_s * 1e3:.3f} ms")
        o += [f"  hand-off to the next stage: {hop}",
              f"  slot = {max(v.memory_s, v.compute_s) * 1e3:.2f} + {v.allreduce_s * 1e3:.2f} + "
              f"{v.handoff_s * 1e3:.3f} = {v.slot_s * 1e3:.2f} ms",
              f"  GPipe: bubble (p-1)/(m+p-1) = ({pp}-1)/({v.microbatches}+{pp}-1) = {v.bubble:.1%}; "
              f"TPOT = (m+p-1) x slot = {v.microbatches + pp - 1} x {v.slot_s * 1e3:.2f} = {v.tpot_s * 1e3:.2f} ms"]
    else:
        o.append(f"  TPOT = {max(v.memory_s, v.compute_s) * 1e3:.2f} + {v.allreduce_s * 1e3:.2f} = "
                 f"{v.tpot_s * 1e3:.2f} ms")
    limit = {"tpot": f"the largest batch within the {w.target_tpot_ms:g} ms target",
             "kv": "every sequence the KV cache holds", "max_num_seqs": f"max_num_seqs {sp.max_num_seqs}"}
    o.append(f"  batch {v.batch} = {limit[v.limited_by]}" if c.meets_target else
             f"  batch 1 misses the {w.target_tpot_ms:g} ms target: no batch meets it")
    k = c.cost
    world = tp * pp
    o += ["", "Throughput and cost:",
          f"  tokens/s per replica = {v.batch} / {v.tpot_s * 1e3:.2f} ms = {v.tokens_per_s:,.0f}",
          f"  $/Mtok = {world} GPUs x ${w.price_per_gpu_hour:.2f}/h x 1e6 / ({v.tokens_per_s:,.0f} tok/s x 3,600 s/h)"
          f" = ${k.dollars_per_mtok:.3f}  ({k.gpu_hours_per_mtok:.3f} GPU-hours per Mtok)",
          f"  replicas per node = {cl.gpus_per_node} // {world} = {k.replicas_per_node}; in this cluster: "
          f"{k.replicas_in_cluster}"]
    if k.replicas_for_demand is not None:
        o.append(f"  demand: ceil({w.demand_tokens_per_s:,.0f} / {v.tokens_per_s:,.0f}) = {k.replicas_for_demand} "
                 f"replicas = {k.gpus_for_demand} GPUs")
    return o


def _explain_choice(s: Search, c: Candidate) -> list[str]:
    sp, ov = s.speed, s.overheads
    eligible = [x for x in s.candidates if x.fits and not x.skipped and x.meets_target]
    others = sorted((x for x in eligible if x is not c), key=lambda x: x.cost.dollars_per_mtok if x.cost else 0)
    o = ["", "Choice:"]
    if c is s.recommended:
        o.append(f"  cheapest $/Mtok of {len(eligible)} candidates that fit the KV cap and meet the TPOT target "
                 "(ties go to the smaller TP group, then bf16/fp16, int8, fp8)")
        o += [f"  next: {x.label} ${x.cost.dollars_per_mtok:.3f}" for x in others[:3] if x.cost]
    else:
        o.append(f"  {c.label} is not the recommendation: status {c.status}")
    skipped = [x for x in s.candidates if x.skipped]
    if skipped:
        o.append(f"  {len(skipped)} pipeline candidates not considered: {skipped[0].skipped}")
    o += ["", "Assumptions (named parameters):",
          "  overheads per GPU: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in ov.per_gpu(2).items())
          + " (nccl only with > 1 GPU)",
          f"  hbm_efficiency {sp.hbm_efficiency:g}, compute_efficiency {sp.compute_efficiency:g}, "
          f"link_efficiency {sp.link_efficiency:g}, microbatches {sp.microbatches or 'one per stage'}, "
          f"max_num_seqs {sp.max_num_seqs}, max memory per GPU {sp.max_memory_fraction:.0%}"]
    return o
