"""Human-readable planner output: the header, the candidate table with a per-GPU memory bar, the
summary; ``--explain``'s arithmetic lives in explain.py.

Pure formatting of a ``Search`` (no arithmetic of its own beyond restating the planner's figures),
so the numbers printed are the numbers decided on. ``--explain`` writes the arithmetic out line by
line with the values substituted, the way one checks it on paper against vLLM's log.
"""

from __future__ import annotations

from .candidate import routing
from .formulas import demand_tokens, demand_words
from .gpus import GB, GIB
from .policy import OBJECTIVE_WORDS
from .records import Candidate, Search
from .search import sixteen_bit

BAR_WIDTH = 24
BAR_LEGEND = ("bar: # weights  = KV cache  + overheads  . free  (whole GPU as CUDA reports it; | where vLLM's "
              "budget ends, memory x utilization)")


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def memory_bar(c: Candidate, width: int = BAR_WIDTH, limit: float | None = None) -> str:
    """[weights|KV|overheads|free] of the fullest GPU, one character per 1/width of its memory; the
    mark at ``limit`` (default: the utilization, where vLLM's budget ends and its headroom begins)."""
    m = c.memory
    if m is None:
        return ""
    limit = m.utilization if limit is None else limit
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
    kv = f"{w.kv_dtype if w.kv_dtype != 'auto' else sixteen_bit(m)} ({w.kv_bytes} B/value)"
    budget = f"`kv_memory` {gib(w.kv_memory)}" if w.kv_memory is not None else f"utilization {w.gpu_memory_utilization:g}"
    mla = m.forward.mla
    attn = (f"MLA latent {mla.kv_lora_rank} + rope {mla.rope}" if mla is not None else
            f"{m.num_kv_heads} KV heads x {m.head_dim}")
    k, experts = routing(m)
    moe = f", {experts} routed experts (top {k})" if experts else ""
    extras = ([f"{w.lora_adapters} LoRA adapters of rank {w.lora_rank}"] if w.lora_adapters else []) + (
        [f"draft model {s.draft_params / 1e9:.2f} B parameters"] if s.draft_params else [])
    why = {k: f" ({v})" if v else "" for k, v in w.origins().items()}
    out = [
        f"model   {s.model_name}: {s.params / 1e9:.2f} B parameters, {m.num_layers} layers, hidden {m.hidden_size:,}, "
        f"{m.num_heads} heads / {attn}, vocab {m.vocab_size:,}{moe}"
        f"{', tied embeddings' if m.tie_word_embeddings else ''}",
        f"gpus    {cl.total_gpus} x {g.name} ({cl.nodes} node{'s' if cl.nodes > 1 else ''} x {cl.gpus_per_node}): "
        f"{gib(g.memory)} {g.memory_from}, HBM {g.hbm_bandwidth / GB:,.0f} GB/s, "
        f"{g.link.name} {g.link.bandwidth / GB:,.0f} GB/s"
        + (f", {cl.inter_node.name} between nodes" if cl.nodes > 1 else ""),
        f"fabric  {cl.fabric()}",
        f"serve   KV demand {demand_words(w, m.max_position_embeddings)} "
        f"({demand_tokens(w, m.max_position_embeddings):,} tokens), "
        + (f"KV cap {gib(w.cap)}/GPU (a ceiling on the pool)" if w.capped else "no KV cap (the pool is what "
           "vLLM's budget leaves)")
        + f", isl {w.prompt:,}{why['isl']}, osl {w.output:,}{why['osl']}, avg context {w.context:,}{why['avg']}, "
        f"{budget}, block {w.block_size}, "
        f"KV {kv}, TPOT <= {w.target_ms:g} ms{'' if w.target_set else ' (default: sizes the batch only)'}, "
        + (f"TTFT <= {w.ttft_ms:g} ms, " if w.ttft_ms is not None else "")
        + (f"concurrency {w.concurrency}, " if w.concurrency is not None else "") +
        f"${w.price_per_gpu_hour:.2f}/GPU-hour" + "".join(f", {e}" for e in extras),
        f"choose  objective {s.objective}: {OBJECTIVE_WORDS[s.objective]}",
    ]
    return out


def table(s: Search) -> list[str]:
    """Fitting candidates by cost, then why the others are out."""
    rows = [c for c in s.candidates if c.fits and not c.skipped]
    rows.sort(key=lambda c: (c is not s.recommended, c is not s.alternative, not c.meets_target,
                             c.cost.dollars_per_mtok if c.cost else 0, c.tp, c.pp or 0))
    out = header(s) + [""]
    # right-aligned columns: (header, width); a column widens to its widest cell plus one space, so
    # cells never run together (a 512-token max len beside 399,549 sequences)
    cols = [("GPUs", 5), ("weights", 10), ("KV need/pool GiB", 18), ("KV B/tok", 10), ("max len", 9), ("seqs", 6),
            ("conc", 6), ("TTFT", 9), ("TPOT", 9), ("tok/s/GPU", 10), ("$/Mtok", 8)]
    cells = []
    for c in rows:
        assert c.memory and c.kv and c.speed and c.cost
        cells.append([f"{c.gpus}", f"{c.memory.weights / GIB:.2f} GiB",
                      f"{c.kv.demand_bytes / GIB:.2f}/{c.kv.budget / GIB:<6.2f}", f"{c.kv.bytes_per_token:,}",
                      f"{c.kv.served_len:,}", f"{c.kv.sequences:,}", f"{c.speed.batch:,}",
                      f"{c.speed.ttft_s * 1e3:.0f}ms", f"{c.speed.tpot_s * 1e3:.1f}ms" + ("" if c.meets_target else "!"),
                      f"{c.speed.tokens_per_s_per_gpu:,.0f}", f"{c.cost.dollars_per_mtok:.2f}"])
    widths = [max([w] + [len(row[i]) + 1 for row in cells]) for i, (_, w) in enumerate(cols)]
    out.append(f"  {'candidate':<17}" + "".join(f"{h:>{w}}" for (h, _), w in zip(cols, widths, strict=True)) + "  memory per GPU")
    for c, row in zip(rows, cells, strict=True):
        mark = "*" if c is s.recommended else "+" if c is s.alternative else "!" if not c.meets_target else " "
        out.append(f"{mark} {c.label:<17}" + "".join(f"{x:>{w}}" for x, w in zip(row, widths, strict=True)) + f"  {memory_bar(c)}")
    if not rows:
        out.append("  (no candidate fits)")
    out += ["  KV need/pool: the demand's KV per GPU / the pool the unit allocates (vLLM's budget, at most "
            "the cap); conc: requests in flight; TTFT/TPOT/tok/s with prefill interleaved (isl "
            f"{s.workload.prompt:,}, osl {s.workload.output:,})", "  " + BAR_LEGEND,
            "  * recommended   + fastest alternative   ! misses the TPOT target: the row, and its TPOT at the "
            "concurrency shown (1 when a single request misses it" + (", else the `concurrency` asked for)"
                                                                     if s.workload.concurrency else ")")]
    if any(c.ep > 1 for c in s.candidates):
        out.append("  ep=N dp=N: expert parallel on N GPUs (plan: dp_degree N, tp_degree 1, expert_parallel): each "
                   "holds the non-expert weights whole and 1/N of the experts, and the KV of 1/N of the requests")
    bad = [c for c in s.candidates if c.reasons]
    if bad:
        out += ["", "not feasible:"] + [f"  {c.label:<17}{c.reasons[0]}" for c in bad]
    skipped = [c for c in s.candidates if c.skipped]
    if skipped:
        out += ["", f"pipeline candidates not considered: {len(skipped)} ({skipped[0].skipped}); "
                    "`pp` forces a pipeline depth"]
    out += [""] + summary(s)
    return out


def summary(s: Search) -> list[str]:
    c = s.recommended
    if c is None:
        return ["no recommendation (see the reasons above)"]
    assert c.speed and c.cost and c.kv
    tags = [] if s.cluster.calibrated else [s.cluster.calibration]
    line = (f"recommended ({s.objective}{''.join(', ' + t for t in tags)}): {c.label} on {c.cost.gpus} "
            f"GPU{'s' if c.cost.gpus > 1 else ''}: {c.speed.tokens_per_s:,.0f} tok/s per replica "
            f"({c.speed.tokens_per_s_per_gpu:,.0f} per GPU, {c.speed.requests_per_s:.2f} requests/s) at "
            f"{c.speed.tpot_s * 1e3:.1f} ms TPOT, {c.speed.ttft_s * 1e3:.0f} ms TTFT (concurrency {c.speed.batch}), "
            f"${c.cost.dollars_per_mtok:.2f} per million output tokens, max model length {c.kv.served_len:,}"
            + (f" (the length asked for; its KV pool holds {c.kv.max_model_len:,} tokens)"
               if c.kv.max_model_len > c.kv.served_len else ""))
    out = [line]
    a = s.alternative
    if a is not None and a.speed and a.cost:
        out.append(f"fastest alternative: {a.label} on {a.cost.gpus} GPUs: {a.speed.tpot1_s * 1e3:.1f} ms TPOT at "
                   f"batch 1 (recommended: {c.speed.tpot1_s * 1e3:.1f} ms), {a.speed.tokens_per_s:,.0f} tok/s at "
                   f"concurrency {a.speed.batch}, ${a.cost.dollars_per_mtok:.2f}/Mtok")
    else:
        out.append(no_alternative(s))
    out += [f"warning: {x}" for x in s.warnings]
    if c.cost.replicas_for_demand is not None:
        out.append(f"demand {s.workload.demand_tokens_per_s:,.0f} tok/s: {c.cost.replicas_for_demand} replicas "
                   f"= {c.cost.gpus_for_demand} GPUs ({c.cost.replicas_in_cluster} fit in this cluster)")
    return out


def no_alternative(s: Search) -> str:
    """Why no alternative is named: none with more GPUs fits, or none of them is faster than the pick."""
    c = s.recommended
    assert c is not None and c.speed is not None
    cards = c.gpus
    more = [x for x in s.candidates if x.fits and not x.skipped and x.pp == 1 and x.dtype == c.dtype
            and x.tp > cards]
    if not more:
        return "fastest alternative: none (no single-node TP unit with more GPUs fits)"
    return (f"fastest alternative: none: no single-node TP unit with more GPUs is faster than the pick "
            f"({c.speed.tpot1_s * 1e3:.1f} ms TPOT at batch 1)")
