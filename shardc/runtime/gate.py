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
import hmac
import json
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, OutputError, ShardcError
from ..formats.files import create_temp, fsync_dir
from ..formats.manifest import Manifest
from ..formats.safetensors import MAX_HEADER, extent_problem, header_bytes, parse_header
from ..layout.dtypes import DTYPE_BYTES

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
    note: Callable[[str], None] | None = None, reference: str = "shardc",
) -> dict[str, Any]:
    """Score the baseline (or take it from ``baseline_cache``), then the candidate, and return the
    report (``report["pass"]``). ``note`` receives one-line remarks (a cache being recomputed).
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
        check_devices({"replicas": [ref.job_entry()], "device": device}, torchrun=in_torchrun())
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
    base_res = None
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
        return {}
    report = summarize(res, len(windows), thresholds)
    scored = len(windows) * window
    base_s = (base_res or {}).get("seconds")
    report.update({
        "baseline": _side(base) if scored_by is None else {**_side(base), "scored_by": scored_by},
        "candidate": _side(cand),
        "golden": {"source": label, "sha256": key["golden_sha256"],
                   "text_tokens": len(ids), "windows": len(windows), "window": window,
                   "tokens": scored},
        "thresholds": {"max_ppl_delta_pct": thresholds.max_ppl_delta_pct, "max_kl": thresholds.max_kl,
                       "min_top1": thresholds.min_top1},
        "baseline_cache": {"path": str(cache) if cache is not None else None, "status": status},
        "seconds": {"wall": wall, "compute": res.get("seconds"), "load": res.get("load_seconds"),
                    "baseline_compute": base_s, "baseline_load": (base_res or {}).get("load_seconds")},
    })
    return report


def cache_key(base: Any, text: str, window: int, max_tokens: int, windows: list[list[int]],
              threads: int | None = None, scored_by: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the baseline's logits depend on: the baseline build (its manifest's bytes pin every shard's
    sha256), the golden text and the window settings (the token windows themselves, hashed, also pin
    the tokenizer), the CPU threads per rank (None on a GPU), and what scored it: shardc's runtime
    (no ``reference`` entry, so caches written before the reference existed still hit) or
    ``scored_by`` (runtime/reference.py: transformers and torch versions). A cache of one reference
    is never read for the other: ``check_cache`` compares every entry either key has."""
    key: dict[str, Any] = {
        "cpu_threads": threads,
        "baseline_manifest_sha256": hashlib.sha256(base.manifest_path.read_bytes()).hexdigest(),
        "golden_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "window": int(window),
        "max_tokens": int(max_tokens),
        "windows_sha256": hashlib.sha256(json.dumps(windows).encode()).hexdigest(),
    }
    if scored_by is not None:
        key["reference"] = scored_by
    return key


CACHE_META = "shardc.baseline_cache"  # the key, as JSON (informative: the digest decides)
CACHE_DIGEST = "shardc.baseline_cache_hmac"
SECRET_ENV = "SHARDC_GATE_CACHE_SECRET"
_BLOCK = 8 << 20
NOTES = {"stale": "is of another baseline", "mismatch": "does not match its digest"}


class GateCacheError(ShardcError):
    """``--baseline-cache`` names what the gate must not read or overwrite: a build's file or a
    file in a build directory, the golden text, a directory or another non-regular file."""


def cache_digest(key: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """The keyed digest a cache carries, before its logits bytes are fed to it: HMAC-SHA256 keyed
    with this run's baseline manifest sha256 (plus ``SHARDC_GATE_CACHE_SECRET`` when set) over this
    run's key and the file's tensor table, then (``update``) the data bytes.

    What it stops: a cache of another baseline or golden text whose recorded key was edited to
    match (the digest is of this run's key, not the recorded one), edited or damaged logits, a
    tensor table changed to reinterpret the bytes, and a digest copied from another cache. What it
    cannot stop without the secret: someone who can write the cache file and read the baseline
    manifest can compute the digest of any logits they like, since the manifest is no secret; set
    ``SHARDC_GATE_CACHE_SECRET`` (for example a CI secret) and keep it from them, and a forged
    cache needs the secret. Either way a cache is only as trusted as the place it is kept, and a
    genuine cache of this very baseline, replayed, gives the same figures as a fresh pass."""
    material = bytes.fromhex(key["baseline_manifest_sha256"]) + os.environ.get(SECRET_ENV, "").encode()
    h = hmac.new(material, digestmod="sha256")
    h.update(json.dumps({"key": key, "tensors": tensors}, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    return h


def check_cache_location(path: Path, refs: list[Any], protected: list[Path]) -> None:
    """Refuse a cache path the gate would overwrite harmfully: one of the baseline's or the
    candidate's files, a file in a build directory (any directory holding a manifest.json), the
    golden text or tokenizer, a directory. Links are resolved: the rename lands at ``path`` (its
    own directory counts) and the bytes are read from its target (that directory counts too)."""
    target = Path(os.path.abspath(path))
    real = target.resolve()
    files = {p.resolve(): f"the golden text or tokenizer {p}" for p in protected}
    for ref in refs:
        files[ref.manifest_path.resolve()] = f"{ref.name}'s manifest"
        for name in [f.name for f in ref.manifest.files] + [s.file for s in ref.manifest.shards]:
            files[(ref.directory / name).resolve()] = f"{ref.name}'s {name}"
    hint = "keep baseline caches outside build directories, e.g. --baseline-cache caches/<baseline>.safetensors"
    for p in (target, real):
        if p in files:
            raise GateCacheError(f"baseline cache {path} is {files[p]}; the gate would overwrite it", hint=hint)
    builds = {d for ref in refs for d in (ref.directory, ref.manifest_path.parent)}
    for d in (target.parent, real.parent):
        if d.resolve() in builds or (d / "manifest.json").exists():
            raise GateCacheError(f"baseline cache {path} is in the build directory {d}", hint=hint)
    if real.is_dir():
        raise GateCacheError(f"baseline cache {path} is a directory", hint="name a file")


def check_cache(path: Path, key: dict[str, Any], copy_to: Path | None = None) -> tuple[str, str]:
    """("new", "") when there is no cache yet, ("hit", "") when it is this run's and its digest
    matches its bytes, ("stale", why) when it is another run's, unreadable or carries no digest,
    ("mismatch", why) when its digest does not match. ``copy_to``: on a hit, the checked bytes are
    there too (written as they are hashed), so later readers need not trust ``path`` again.
    Anything at ``path`` gives one of these or a GateCacheError (not a regular file, unreadable)."""
    if not path.exists():  # a dangling link too: the new cache replaces the link
        return "new", ""
    try:
        # O_NONBLOCK: a FIFO at the path must not block the open (reads of a regular file ignore it)
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise GateCacheError(f"baseline cache {path} is not a regular file", hint="name a file")
            return _check_open(f, path, key, copy_to)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise GateCacheError(f"cannot read baseline cache {path}{where}: {exc.strerror or exc}",
                             hint="check its permissions and free space in the temp directory") from None


def _check_open(f: Any, path: Path, key: dict[str, Any], copy_to: Path | None) -> tuple[str, str]:
    size = os.fstat(f.fileno()).st_size
    try:
        tensors, meta, start = _header(f, path.name, size)
    except ShardcError as exc:
        return "stale", f"unreadable: {exc.message}"
    try:
        found = json.loads(meta.get(CACHE_META, "null"))
    except (ValueError, RecursionError):
        found = None
    if not isinstance(found, dict):
        return "stale", "not a shardc baseline cache"
    for k in [*key, *(k for k in found if k not in key)]:  # an entry one side lacks differs too
        if found.get(k) != key.get(k):
            return "stale", f"{k} {_brief(k, found.get(k))} != {_brief(k, key.get(k))}"
    digest = meta.get(CACHE_DIGEST)
    if not isinstance(digest, str):
        return "stale", "it carries no digest (an older shardc's cache)"
    if problem := _layout_problem(tensors, size - start):
        return "mismatch", f"damaged: {problem}"
    h = cache_digest(key, tensors)
    out, tmp = _copy_target(copy_to)
    try:
        if out is not None:  # a header shardc wrote: what the candidate's reader parses is what was hashed
            out.write(_sealed_header(tensors, key, meta.get(CACHE_DIGEST, "")))
        f.seek(start)
        while chunk := f.read(_BLOCK):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
        if not hmac.compare_digest(h.hexdigest(), digest):
            return "mismatch", "edited or damaged since it was written"
        if out is not None:
            out.close()
            os.replace(tmp, copy_to)
            tmp = None
        return "hit", ""
    finally:
        if out is not None:
            out.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _brief(k: str, v: Any) -> str:
    """A key entry as a stale cache's line shows it: the reference by name (none is shardc's own)."""
    if k == "reference":
        return str(v.get("name")) if isinstance(v, dict) else "shardc" if v is None else str(v)[:12]
    return str(v)[:12]


def _layout_problem(tensors: dict[str, Any], data_len: int) -> str | None:
    """What keeps a header from being a cache's: one 3-D ``logits`` tensor of a known dtype that
    fills the data section exactly."""
    if set(tensors) != {"logits"}:
        return f"it holds the tensors {sorted(tensors)[:3]}, not logits alone"
    e = tensors["logits"]
    if e["dtype"] not in DTYPE_BYTES or len(e["shape"]) != 3:
        return f"logits are {e['dtype']}{e['shape']}, not a 3-D array of a known dtype"
    return extent_problem(tensors, data_len)


def _sealed_header(tensors: dict[str, Any], key: dict[str, Any], digest: str) -> bytes:
    """The header of a sealed cache (the tensors laid out in offset order, as a cache has them)."""
    order = sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"])
    layout = [(name, e["dtype"], e["shape"]) for name, e in order]
    return header_bytes(layout, {CACHE_META: json.dumps(key, sort_keys=True), CACHE_DIGEST: digest})


def _header(f: Any, name: str, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensors, metadata, data start) of an open safetensors file, bounded and checked."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ShardcError("shorter than a safetensors header")
    n = int.from_bytes(raw, "little")
    if n > min(MAX_HEADER, size - 8):
        raise ShardcError(f"header length {n} does not fit the file")
    tensors, meta = parse_header(f.read(n), name)
    return tensors, meta, 8 + n


def _copy_target(copy_to: Path | None) -> tuple[Any, Path | None]:
    if copy_to is None:
        return None, None
    fd, tmp = create_temp(copy_to)
    return open(fd, "wb"), tmp


def seal_cache(scratch: Path, path: Path, key: dict[str, Any]) -> None:
    """Write the baseline pass's logits file (``scratch``) to ``path`` with the key and its digest
    in the header (atomic: an exclusive temp file, fsynced, renamed). One pass over the bytes: the
    header is written with a placeholder digest of the same length and rewritten at the end. A
    disk that fails is OutputError (exit 1); the old cache, if any, stays as it was."""
    try:
        _seal(scratch, path, key)
    except OSError as exc:
        raise OutputError(f"cannot write baseline cache {path}: {exc.strerror or exc}",
                          hint="check free space and permissions, or name another file") from None


def _seal(scratch: Path, path: Path, key: dict[str, Any]) -> None:
    with open(scratch, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        tensors, _, start = _header(f, scratch.name, size)
        if problem := _layout_problem(tensors, size - start):
            raise ShardcError(f"the baseline pass wrote {scratch} wrongly: {problem}")
        h = cache_digest(key, tensors)
        fd, tmp = create_temp(path)
        try:
            with open(fd, "wb") as out:
                out.write(_sealed_header(tensors, key, "0" * 64))
                f.seek(start)
                while chunk := f.read(_BLOCK):
                    h.update(chunk)
                    out.write(chunk)
                out.seek(0)
                out.write(_sealed_header(tensors, key, h.hexdigest()))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(path.parent)


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
    by = b.get("scored_by")
    lines = [
        f"gate: {c['plan']} (tp{c['tp']} pp{c['pp']} {c['dtype']}) vs baseline {b['plan']} "
        f"(tp{b['tp']} pp{b['pp']} {b['dtype']})"
        + (f", baseline scored by {by['name']} {by.get(by['name'], '')}".rstrip() if by else ""),
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
