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

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, ShardcError
from ..formats.manifest import Manifest

DEFAULT_MAX_PPL_DELTA_PCT = 0.5
DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 8192
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


class GoldenError(ShardcError):
    """The golden text cannot be read or is too short for one window."""


@dataclass(frozen=True)
class Thresholds:
    max_ppl_delta_pct: float = DEFAULT_MAX_PPL_DELTA_PCT
    max_kl: float | None = None  # mean KL(baseline || candidate), nats per token
    min_top1: float | None = None  # fraction of positions whose argmax agrees


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
                          hint="use --golden pydoc, a UTF-8 text file or a JSONL file") from None
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
        raise GoldenError(f"--window must be at least 2, got {window}")
    if max_tokens < window:  # the user's limit, not the text, is what is short
        raise GoldenError(
            f"--max-tokens {max_tokens} is smaller than one --window of {window} tokens "
            f"(the golden text has {len(ids)})",
            hint=f"pass --max-tokens {window} or more, or a smaller --window",
        )
    n = min(len(ids), max_tokens) // window
    if n == 0:
        raise GoldenError(
            f"the golden text has {len(ids)} tokens, fewer than one window of {window}",
            hint="use a longer text or a smaller --window",
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


def summarize(res: dict[str, Any], windows: int, thresholds: Thresholds,
              samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Metrics and verdict from the per-position arrays of a compare job ([windows, positions])."""
    import numpy as np

    nb = np.asarray(res["nll_base"], dtype=np.float64).reshape(windows, -1)
    nc = np.asarray(res["nll_cand"], dtype=np.float64).reshape(windows, -1)
    kl = np.asarray(res["kl"], dtype=np.float64).reshape(-1)
    top1 = np.asarray(res["top1"], dtype=bool).reshape(-1)
    n = nb.size
    ppl_b = math.exp(float(nb.sum()) / n)
    ppl_c = math.exp(float(nc.sum()) / n)
    delta = (ppl_c / ppl_b - 1.0) * 100.0
    lo, hi = paired_bootstrap_ci(nb, nc, samples, seed)
    kl_mean = float(kl.sum() / kl.size)
    kl_p99 = float(np.percentile(kl, 99))
    agree = float(top1.sum() / top1.size)
    checks = [{"name": "ppl_delta_pct", "value": delta, "limit": thresholds.max_ppl_delta_pct,
               "rule": "abs(value) <= limit", "ok": abs(delta) <= thresholds.max_ppl_delta_pct}]
    if thresholds.max_kl is not None:
        checks.append({"name": "kl_mean", "value": kl_mean, "limit": thresholds.max_kl,
                       "rule": "value <= limit", "ok": kl_mean <= thresholds.max_kl})
    if thresholds.min_top1 is not None:
        checks.append({"name": "top1_agreement", "value": agree, "limit": thresholds.min_top1,
                       "rule": "value >= limit", "ok": agree >= thresholds.min_top1})
    return {
        "pass": all(c["ok"] for c in checks),
        "checks": checks,
        "positions": int(n),
        "baseline_ppl": ppl_b,
        "candidate_ppl": ppl_c,
        "ppl_delta_pct": delta,
        "ppl_delta_ci95_pct": [lo, hi],
        "kl_mean": kl_mean,
        "kl_p99": kl_p99,
        "top1_agreement": agree,
    }


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
    thresholds: Thresholds = Thresholds(), baseline_dir: str | Path | None = None,
    candidate_dir: str | Path | None = None, tokenizer: str | Path | None = None,
    timeout_s: float = 120.0, device: str = "cpu", baseline_cache: str | Path | None = None,
    note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Score the baseline (or take it from ``baseline_cache``), then the candidate, and return the
    report (``report["pass"]``). ``note`` receives one-line remarks (a cache being recomputed)."""
    from .api import load_tokenizer, open_build, save_baseline, score_against, scratch_path
    from .launch import check_devices, in_torchrun

    base = open_build(baseline, baseline_dir)
    cand = open_build(candidate, candidate_dir)
    check_compatible(base.manifest, cand.manifest)
    for ref in sorted((base, cand), key=lambda r: -r.world_size):  # the larger plan names the need
        check_devices({"replicas": [ref.job_entry()], "device": device}, torchrun=in_torchrun())
    text, label = golden_text(golden)
    tok = load_tokenizer(base, tokenizer)
    ids = tok.encode(text).ids
    windows = make_windows(ids, window, max_tokens)
    # On CPU every rank of both passes runs one thread: bf16 matmuls round differently with the
    # thread count, so this keeps a gate's figures (and a cached baseline) the same on any host
    # and for any pair of plans.
    threads = GATE_CPU_THREADS if device == "cpu" else None
    key = cache_key(base, text, window, max_tokens, windows, threads)
    t0 = time.perf_counter()
    path = Path(baseline_cache) if baseline_cache is not None else scratch_path(in_torchrun())
    status = "none"
    base_res = None
    try:
        if baseline_cache is not None:
            status, why = check_cache(path, key)
            if status == "stale" and note is not None:
                note(f"baseline cache {path} is of another baseline ({why}); recomputing it")
        if status != "hit":
            base_res = save_baseline(base, windows, path, key, timeout_s=timeout_s, device=device,
                                     threads=threads)
        res = score_against(cand, windows, path, timeout_s=timeout_s, device=device, threads=threads)
    finally:
        if baseline_cache is None and (not in_torchrun() or res_holder(cand)):
            path.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    if res is None:  # torchrun: another rank holds the result
        return {}
    report = summarize(res, len(windows), thresholds)
    scored = len(windows) * window
    base_s = (base_res or {}).get("seconds")
    report.update({
        "baseline": _side(base),
        "candidate": _side(cand),
        "golden": {"source": label, "sha256": key["golden_sha256"],
                   "text_tokens": len(ids), "windows": len(windows), "window": window,
                   "tokens": scored},
        "thresholds": {"max_ppl_delta_pct": thresholds.max_ppl_delta_pct, "max_kl": thresholds.max_kl,
                       "min_top1": thresholds.min_top1},
        "baseline_cache": {"path": str(path) if baseline_cache is not None else None, "status": status},
        "seconds": {"wall": wall, "compute": res.get("seconds"), "load": res.get("load_seconds"),
                    "baseline_compute": base_s, "baseline_load": (base_res or {}).get("load_seconds")},
    })
    return report


def cache_key(base: Any, text: str, window: int, max_tokens: int, windows: list[list[int]],
              threads: int | None = None) -> dict[str, Any]:
    """What the baseline's logits depend on: the baseline build (its manifest's bytes pin every shard's
    sha256), the golden text and the window settings (the token windows themselves, hashed, also pin
    the tokenizer), and the CPU threads per rank (None on a GPU)."""
    return {
        "cpu_threads": threads,
        "baseline_manifest_sha256": hashlib.sha256(base.manifest_path.read_bytes()).hexdigest(),
        "golden_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "window": int(window),
        "max_tokens": int(max_tokens),
        "windows_sha256": hashlib.sha256(json.dumps(windows).encode()).hexdigest(),
    }


def check_cache(path: Path, key: dict[str, Any]) -> tuple[str, str]:
    """("hit", ""), ("new", "") when there is no cache yet, or ("stale", what differs)."""
    if not path.exists():
        return "new", ""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            found = json.loads((f.metadata() or {}).get("shardc.baseline_cache", "null"))
    except Exception as exc:  # unreadable or not a cache: recompute rather than trust it
        return "stale", f"unreadable: {exc.__class__.__name__}"
    if not isinstance(found, dict):
        return "stale", "not a shardc baseline cache"
    for k, v in key.items():
        if found.get(k) != v:
            return "stale", f"{k} {str(found.get(k))[:12]} != {str(v)[:12]}"
    return "hit", ""


def res_holder(ref: Any) -> bool:
    """Under torchrun: is this process the rank that reads the baseline logits (and so may delete)?"""
    import os

    pp, tp = ref.manifest.layout.pp_degree, ref.manifest.layout.tp_degree
    return int(os.environ.get("RANK", "0")) == (pp - 1) * tp


def _side(ref: Any) -> dict[str, Any]:
    m = ref.manifest
    return {"plan": ref.name, "manifest": str(ref.manifest_path), "plan_sha256": m.plan_sha256,
            "tp": m.layout.tp_degree, "pp": m.layout.pp_degree, "dtype": m.layout.dtype}


def format_report(r: dict[str, Any]) -> str:
    """Human-readable summary (the JSON report carries the same numbers)."""
    b, c, g = r["baseline"], r["candidate"], r["golden"]
    lo, hi = r["ppl_delta_ci95_pct"]
    lines = [
        f"gate: {c['plan']} (tp{c['tp']} pp{c['pp']} {c['dtype']}) vs baseline {b['plan']} "
        f"(tp{b['tp']} pp{b['pp']} {b['dtype']})",
        f"golden: {g['source']}, {g['windows']} windows x {g['window']} tokens, {r['positions']} scored positions",
        f"perplexity: baseline {r['baseline_ppl']:.4f}  candidate {r['candidate_ppl']:.4f}  "
        f"delta {r['ppl_delta_pct']:+.4f}% (95% CI {lo:+.4f}% .. {hi:+.4f}%)",
        f"KL(baseline||candidate): mean {r['kl_mean']:.3e}  p99 {r['kl_p99']:.3e} nats/token",
        f"top-1 agreement: {r['top1_agreement'] * 100:.2f}%",
    ]
    for ch in r["checks"]:
        mark = "ok  " if ch["ok"] else "FAIL"
        lines.append(f"{mark} {ch['name']} = {ch['value']:.6g} ({ch['rule']}, limit {ch['limit']:g})")
    lines.append("PASS" if r["pass"] else "FAIL: the candidate does not match the baseline")
    return "\n".join(lines)
