"""The rollout gate: does a candidate plan produce the same model as a trusted baseline plan?

There is no unsharded ground truth for a 70B model, so the bar is cross-validation between plans on a
golden text. The baseline is scored first and its logits kept (losslessly, in the plan's 16-bit
dtype), then the candidate is scored on the same devices and compared with them, so a gate needs
max(baseline GPUs, candidate GPUs), not the sum. ``--baseline-cache`` keeps the baseline's logits
between gates (llama.cpp's ``--kl-divergence-base`` is the model), keyed by the baseline manifest's
sha256, the golden text and the window settings: a second gate costs the candidate only, with the
same numbers. Every position is scored with an fp32 log-softmax and every sum is taken in fp64. Reported: baseline and
candidate perplexity, the perplexity delta with a paired bootstrap confidence interval (windows are
resampled as blocks, the same draw for both plans), KL(baseline || candidate) mean and p99, and top-1
agreement. The gate passes when every configured threshold holds (default: |ppl delta| <= 0.5%).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ManifestError, ShardcError
from ..formats.manifest import Manifest
from .api_results import PositionScores, ReferencePass, ScoreResult
from .gate_cache import NOTES, cache_key, check_cache, check_cache_location, seal_cache
from .gate_report import (
    CacheRecord,
    CacheStatus,
    GateCheck,
    GateMetrics,
    GateReport,
    GateSeconds,
    GateSide,
    GoldenRecord,
    Metric,
    Thresholds,
)

DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 8192
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0
DEFAULT_THRESHOLDS = Thresholds()  # |ppl delta| <= 0.5%, nothing else


class GoldenError(ShardcError):
    """The golden text cannot be read or is too short for one window."""


def golden_text(source: str) -> tuple[str, str]:
    """(text, label). ``pydoc``: CPython's bundled pydoc_data.topics; else a .txt or .jsonl file.

    JSONL lines are JSON strings or objects with a "text" field; documents are joined by a blank line.
    """
    if source == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc"
    path = Path(source)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GoldenError(f"cannot read golden text {source!r}: {exc}",
                          hint="use `golden` pydoc, a UTF-8 text file or a JSONL file") from None
    if path.suffix != ".jsonl":
        return raw, str(path)
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise GoldenError(f"{path}:{n} is not JSON", hint="one JSON object per line") from None
        text = rec if isinstance(rec, str) else rec.get("text") if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise GoldenError(f"{path}:{n} has no string 'text' field", hint='lines like {"text": "..."}')
        docs.append(text)
    return "\n\n".join(docs), str(path)


def make_windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens from the first ``max_tokens`` tokens.

    Each window is scored on its own (positions 1..window-1 given the window's prefix), so both
    plans see exactly the same contexts.
    """
    if window < 2:
        raise GoldenError(f"must be at least 2, got {window}", key="window")
    if max_tokens < window:  # the user's limit, not the text, is what is short
        raise GoldenError(
            f"{max_tokens} is smaller than one `window` of {window} tokens (the golden text has {len(ids)})",
            key="max_tokens", hint=f"give `max_tokens` {window} or more, or a smaller `window`",
        )
    n = min(len(ids), max_tokens) // window
    if n == 0:
        raise GoldenError(
            f"the golden text has {len(ids)} tokens, fewer than one window of {window}",
            hint="use a longer text or a smaller `window`",
        )
    return [ids[i * window : (i + 1) * window] for i in range(n)]


def check_compatible(base: Manifest, cand: Manifest) -> None:
    """Both manifests must describe the same network (shape, vocabulary, tokenizer)."""
    keys = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "vocab_size", "rope_theta", "rope_scaling")
    for k in keys:
        if base.model.get(k) != cand.model.get(k):
            raise ManifestError(
                f"baseline and candidate are different models: {k} is {base.model.get(k)!r} vs "
                f"{cand.model.get(k)!r}", hint="gate two plans built from the same checkpoint",
            )
    tok = (base.tokenizer_sha256, cand.tokenizer_sha256)
    if tok[0] and tok[1] and tok[0] != tok[1]:
        raise ManifestError("baseline and candidate ship different tokenizer.json files",
                            hint="gate two plans built from the same checkpoint")


def summarize(res: PositionScores, windows: int, thresholds: Thresholds,
              samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> GateMetrics:
    """Metrics and verdict from the per-position arrays of a compare job ([windows, positions])."""
    import numpy as np

    nb = np.asarray(res.nll_base, dtype=np.float64).reshape(windows, -1)
    nc = np.asarray(res.nll_cand, dtype=np.float64).reshape(windows, -1)
    kl = np.asarray(res.kl, dtype=np.float64).reshape(-1)
    top1 = np.asarray(res.top1, dtype=bool).reshape(-1)
    n = nb.size
    ppl_b = math.exp(float(nb.sum()) / n)
    ppl_c = math.exp(float(nc.sum()) / n)
    delta = (ppl_c / ppl_b - 1.0) * 100.0
    lo, hi = paired_bootstrap_ci(nb, nc, samples, seed)
    kl_mean = float(kl.sum() / kl.size)
    kl_p99 = float(np.percentile(kl, 99))
    agree = float(top1.sum() / top1.size)
    checks = [GateCheck(Metric.PPL_DELTA_PCT, delta, thresholds.max_ppl_delta_pct, "abs(value) <= limit",
                        abs(delta) <= thresholds.max_ppl_delta_pct)]
    if thresholds.max_kl is not None:
        checks.append(GateCheck(Metric.KL_MEAN, kl_mean, thresholds.max_kl, "value <= limit",
                                kl_mean <= thresholds.max_kl))
    if thresholds.min_top1 is not None:
        checks.append(GateCheck(Metric.TOP1_AGREEMENT, agree, thresholds.min_top1, "value >= limit",
                                agree >= thresholds.min_top1))
    return GateMetrics(passed=all(c.ok for c in checks), checks=tuple(checks), positions=int(n),
                       baseline_ppl=ppl_b, candidate_ppl=ppl_c, ppl_delta_pct=delta, ppl_delta_ci95_pct=(lo, hi),
                       kl_mean=kl_mean, kl_p99=kl_p99, top1_agreement=agree)


def paired_bootstrap_ci(nb: Any, nc: Any, samples: int, seed: int) -> tuple[float, float]:
    """95% CI of the ppl delta %: resample windows (blocks keep within-window correlation), the same
    draw for both plans, so what varies is the text, not the pairing."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if nb.shape[0] < 2:  # one window: fall back to resampling positions
        nb, nc = nb.reshape(-1, 1), nc.reshape(-1, 1)
    sb, sc = nb.sum(axis=1), nc.sum(axis=1)
    per = nb.shape[1]
    idx = rng.integers(0, sb.shape[0], size=(samples, sb.shape[0]))
    tot = idx.shape[1] * per
    d = (np.exp((sc[idx].sum(axis=1) - sb[idx].sum(axis=1)) / tot) - 1.0) * 100.0
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


GATE_CPU_THREADS = 1  # per rank, both passes (see run_gate)


def run_gate(
    baseline: str | Path, candidate: str | Path, *, golden: str = "pydoc",
    max_tokens: int = DEFAULT_MAX_TOKENS, window: int = DEFAULT_WINDOW,
    thresholds: Thresholds = DEFAULT_THRESHOLDS, baseline_dir: str | Path | None = None,
    candidate_dir: str | Path | None = None, tokenizer: str | Path | None = None,
    timeout_s: float = 120.0, device: str = "cpu", baseline_cache: str | Path | None = None,
    note: Callable[[str], None] | None = None, reference: str = "shardc",
) -> GateReport | None:
    """Score the baseline (or take it from ``baseline_cache``), then the candidate, and return the
    report (``report.passed``; None under torchrun on the ranks that do not hold it). ``note`` receives one-line remarks (a cache being recomputed).
    ``reference``: what scores the baseline, shardc's runtime or ``"transformers"``
    (runtime/reference.py; a tp=1 baseline); the candidate is always scored by shardc's runtime."""
    from .api import load_tokenizer, open_build, save_baseline, score_against, scratch_path
    from .launch import check_devices, in_torchrun
    from .reference import check_reference, reference_record, save_baseline_transformers

    base = open_build(baseline, baseline_dir)
    cand = open_build(candidate, candidate_dir)
    check_compatible(base.manifest, cand.manifest)
    check_reference(base, reference, torchrun=in_torchrun())
    scored_by = reference_record(reference)
    for ref in sorted((base, cand), key=lambda r: -r.world_size):  # the larger plan names the need
        check_devices({"replicas": [ref.wire_entry()], "device": device}, torchrun=in_torchrun())
    text, label = golden_text(golden)
    tok = load_tokenizer(base, tokenizer)
    ids = tok.encode(text).ids
    windows = make_windows(ids, window, max_tokens)
    # On CPU every rank of both passes runs one thread: bf16 matmuls round differently with the
    # thread count, so this keeps a gate's figures (and a cached baseline) the same on any host
    # and for any pair of plans.
    threads = GATE_CPU_THREADS if device == "cpu" else None
    key = cache_key(base, text, window, max_tokens, windows, threads, scored_by)
    t0 = time.perf_counter()
    cache = Path(baseline_cache) if baseline_cache is not None else None
    if cache is not None:
        check_cache_location(cache, [base, cand], [Path(p) for p in (golden, tokenizer) if p and p != "pydoc"])
    # The candidate always reads a private scratch copy: on a hit, the bytes whose digest was
    # checked (so the cache file cannot change between the check and the read).
    scratch = scratch_path(in_torchrun())
    torchrun = in_torchrun()
    status = "none"
    base_res: ScoreResult | ReferencePass | None = None
    res = None
    try:
        if cache is not None:
            status, why = check_cache(cache, key, copy_to=scratch if not torchrun or res_holder(cand) else None)
            if status in NOTES and note is not None:
                note(f"baseline cache {cache} {NOTES[status]} ({why}); recomputing it")
        if status != "hit":
            if scored_by is not None:  # transformers, in this process (refused under torchrun)
                base_res = save_baseline_transformers(base, windows, scratch, key, device=device,
                                                      threads=threads)
            else:
                base_res = save_baseline(base, windows, scratch, key, timeout_s=timeout_s, device=device,
                                         threads=threads)
            if cache is not None and (not torchrun or res_holder(base)):  # the rank that wrote it
                seal_cache(scratch, cache, key)
        res = score_against(cand, windows, scratch, timeout_s=timeout_s, device=device, threads=threads)
    finally:
        if not torchrun or res_holder(cand):
            scratch.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    if res is None:  # torchrun: another rank holds the result
        return None
    metrics = summarize(res.scores, len(windows), thresholds)
    return GateReport(
        **{f.name: getattr(metrics, f.name) for f in dataclasses.fields(metrics)},
        baseline=_side(base, scored_by), candidate=_side(cand),
        golden=GoldenRecord(label, key["golden_sha256"], len(ids), len(windows), window, len(windows) * window),
        thresholds=thresholds,
        baseline_cache=CacheRecord(str(cache) if cache is not None else None, CacheStatus(status)),
        seconds=GateSeconds(wall, res.seconds, res.load_seconds, base_res.seconds if base_res else None,
                            base_res.load_seconds if base_res else None),
    )


def res_holder(ref: Any) -> bool:
    """Under torchrun: is this process the rank that reads the baseline logits (and so may delete)?"""

    pp, tp = ref.manifest.layout.pp_degree, ref.manifest.layout.tp_degree
    return int(os.environ.get("RANK", "0")) == (pp - 1) * tp


def _side(ref: Any, scored_by: dict[str, Any] | None = None) -> GateSide:
    m = ref.manifest
    return GateSide(ref.name, str(ref.manifest_path), m.plan_sha256, m.layout.tp_degree, m.layout.pp_degree,
                    m.layout.dtype, scored_by)
