"""Cold-start verification: is the local shard the right shard, with the right bytes?

The expected tensors come from the Layout recomputed from the plan and model config, never from
the manifest's own tensor list, so "a valid file of the wrong plan" (a TP=8 shard under a TP=4
plan) is caught. Checks run cheapest-first per rank; hashing runs in parallel threads (hashlib
releases the GIL) in large blocks; shape checks read only the safetensors header.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..build.source import sha256_file
from ..errors import ManifestError, VerifyMismatch
from ..formats.manifest import layout_of
from ..spec.layout import Layout, RankLayout

MAX_HEADER = 100 << 20


@dataclass
class RankResult:
    file: str
    tp_rank: int
    pp_stage: int
    rank: int
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(f"{self.file}: {msg}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file, "tp_rank": self.tp_rank, "pp_stage": self.pp_stage, "rank": self.rank,
            "ok": self.ok, "problems": self.problems, "warnings": self.warnings, "checks": self.checks,
        }


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors JSON header (raises ValueError when it does not parse)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"header length {n} is implausible")
        data = f.read(n)
        if len(data) != n:
            raise ValueError("header truncated")
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def check_manifest_against_layout(manifest: dict[str, Any], layout: Layout) -> list[str]:
    """The manifest's own tensor records must be exactly what the Layout says (another plan's
    manifest, or an edited one, disagrees)."""
    problems = []
    if manifest["plan_sha256"] != layout.plan.sha256:
        problems.append("manifest plan_sha256 does not match the hash of its own plan")
    by_file = {s["file"]: s for s in manifest["shards"]}
    for rl in layout.ranks:
        entry = by_file.get(rl.file)
        if entry is None:
            problems.append(f"manifest lacks shard {rl.file} that the plan requires")
            continue
        if (entry["tp_rank"], entry["pp_stage"], entry["rank"]) != (rl.tp_rank, rl.pp_stage, rl.rank):
            problems.append(f"manifest entry {rl.file} has the wrong ranks")
        want = {t.name: t.record() for t in rl.tensors}
        have = {n: {k: v for k, v in r.items() if k not in ("stats", "scale")}
                for n, r in entry["tensors"].items()}
        for name in sorted(set(want) | set(have)):
            if name not in have:
                problems.append(f"manifest entry {rl.file} lacks tensor {name}")
            elif name not in want:
                problems.append(f"manifest entry {rl.file} lists unexpected tensor {name}")
            elif want[name] != have[name]:
                problems.append(f"manifest entry {rl.file} tensor {name}: expected {want[name]}, found {have[name]}")
    extra = set(by_file) - {rl.file for rl in layout.ranks}
    problems += [f"manifest lists shard {f} that the plan does not have" for f in sorted(extra)]
    return problems


def _check_header(res: RankResult, path: Path, rl: RankLayout, layout: Layout) -> None:
    from ..build.compile import shard_metadata

    try:
        header = read_header(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        res.fail(f"safetensors header does not parse ({exc})")
        return
    res.checks.append("header")
    meta = header.pop("__metadata__", {}) or {}
    want_meta = shard_metadata(layout, rl)
    for key in ("shardc.plan_sha256", "shardc.tp_degree", "shardc.pp_degree", "shardc.tp_rank",
                "shardc.pp_stage", "shardc.rank"):
        if meta.get(key) != want_meta[key]:
            res.fail(f"metadata {key} is {meta.get(key)!r}, expected {want_meta[key]!r} "
                     f"(a shard of another plan or rank?)")
    res.checks.append("metadata")
    want = {t.name: t for t in rl.tensors}
    for name in sorted(set(want) - set(header)):
        res.fail(f"missing tensor {name}")
    for name in sorted(set(header) - set(want)):
        res.fail(f"unexpected tensor {name}")
    res.checks.append("tensor-set")
    for name in sorted(set(want) & set(header)):
        t, h = want[name], header[name]
        if h.get("dtype") != t.dtype or list(h.get("shape", [])) != list(t.shape):
            res.fail(f"tensor {name}: expected {t.dtype}{list(t.shape)}, found "
                     f"{h.get('dtype')}{h.get('shape')}")
    res.checks.append("dtype-shape")


def _load_on_device(res: RankResult, path: Path, device: str) -> int:
    """Load every tensor onto the device and check finiteness. Returns bytes loaded."""
    import torch
    from safetensors import safe_open

    total = 0
    with safe_open(path, framework="pt", device=device) as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            total += t.numel() * t.element_size()
            if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
                res.fail(f"tensor {name} holds NaN or Inf on {device}")
            del t
    res.checks.append(f"load:{device}")
    return total


def _device_room(res: RankResult, rl: RankLayout, layout: Layout, device: str) -> None:
    kv = (layout.plan.kv_cache_cap_gb or 0) * 2**30
    need = rl.nbytes + kv
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(idx).total_memory
        where = f"{device} ({total / 2**30:.1f} GiB)"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = f"host memory ({total / 2**30:.1f} GiB)"
    if need > total:
        res.warnings.append(
            f"weights {rl.nbytes / 2**30:.2f} GiB + KV cap {kv / 2**30:.1f} GiB exceed {where}"
        )


def _deep(res: RankResult, path: Path, rl: RankLayout, layout: Layout, source_uri: str) -> None:
    """Reassemble against the source (a checkpoint or an input build): byte-exact for 16-bit,
    re-quantized for int8/fp8 (re-sliced when the reference build holds them quantized)."""
    import numpy as np
    from safetensors import safe_open

    from ..build.compile import Materializer, cut
    from ..build.reshard import open_reference
    from ..spec.dtypes import as_bytes, from_torch

    source = open_reference(source_uri, layout)  # a checkpoint, or the build it was resharded from
    mat = Materializer(source, layout)
    with safe_open(path, framework="pt") as f:
        for spec in rl.tensors:
            want = cut(mat.full(spec), spec)
            got = from_torch(f.get_tensor(spec.name))
            if spec.pad_rows:
                if as_bytes(got[got.shape[0] - spec.pad_rows :]).any():
                    res.fail(f"tensor {spec.name}: padded vocab rows are not zero")
                got = got[: got.shape[0] - spec.pad_rows]
            if got.shape != want.shape or not np.array_equal(as_bytes(got), as_bytes(want)):
                res.fail(f"tensor {spec.name} differs from source {spec.source} (deep check)")
    res.checks.append("deep")


def verify_rank(
    manifest: dict[str, Any], directory: Path, layout: Layout, rl: RankLayout, *,
    device: str | None = None, deep: str | None = None, hashed: str | None = None,
) -> RankResult:
    """All checks for one rank, in order; stops at the first failing stage that makes later ones moot."""
    res = RankResult(rl.file, rl.tp_rank, rl.pp_stage, rl.rank)
    entry = next((s for s in manifest["shards"] if s["file"] == rl.file), None)
    path = Path(directory) / rl.file
    if entry is None:
        res.fail("not in the manifest")
        return res
    if not path.is_file():
        res.fail(f"missing (expected at {path})")
        return res
    res.checks.append("present")
    size = path.stat().st_size
    if size != entry["size"]:
        res.fail(f"size {size} bytes, expected {entry['size']} (truncated or replaced?)")
        return res
    res.checks.append("size")
    digest = hashed if hashed is not None else sha256_file(path)
    if digest != entry["sha256"]:
        res.fail(f"sha256 {digest[:16]}..., expected {entry['sha256'][:16]}... (corrupted bytes)")
    else:
        res.checks.append("sha256")
    _check_header(res, path, rl, layout)
    if not res.ok:
        return res
    if device:
        _load_on_device(res, path, device)
        _device_room(res, rl, layout, device)
    if deep:
        _deep(res, path, rl, layout, deep)
    return res


def select_ranks(layout: Layout, rank: int | None = None, tp_rank: int | None = None,
                 pp_stage: int | None = None) -> list[RankLayout]:
    """--rank R, --tp-rank T --pp-stage P, or all ranks."""
    if rank is not None:
        if not 0 <= rank < layout.plan.world_size:
            raise ManifestError(f"--rank {rank} is outside 0..{layout.plan.world_size - 1} for this plan")
        return [layout.ranks[rank]]
    if tp_rank is not None or pp_stage is not None:
        if tp_rank is None or pp_stage is None:
            raise ManifestError("--tp-rank and --pp-stage go together", hint="or use --rank R")
        return [layout.rank(tp_rank, pp_stage)]
    return list(layout.ranks)


def verify_build(
    manifest: dict[str, Any], directory: str | Path, ranks: list[RankLayout] | None = None, *,
    device: str | None = None, deep: str | None = None, jobs: int | None = None,
) -> dict[str, Any]:
    """Verify ranks (default: all). Returns {"ok", "problems", "ranks": [...]}; never raises for
    mismatches (the caller maps ok=False to exit code 1)."""
    layout = layout_of(manifest)
    ranks = list(layout.ranks) if ranks is None else ranks
    problems = check_manifest_against_layout(manifest, layout)
    directory = Path(directory)
    entries = {s["file"]: s for s in manifest["shards"]}

    def digest(rl: RankLayout) -> str | None:
        p = directory / rl.file
        e = entries.get(rl.file)
        if e is None or not p.is_file() or p.stat().st_size != e["size"]:
            return None
        return sha256_file(p)

    workers = jobs or min(len(ranks), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        digests = list(pool.map(digest, ranks))
    results = [
        verify_rank(manifest, directory, layout, rl, device=device, deep=deep, hashed=d)
        for rl, d in zip(ranks, digests, strict=True)
    ]
    all_problems = problems + [p for r in results for p in r.problems]
    return {
        "ok": not all_problems,
        "plan": layout.plan.name,
        "plan_sha256": layout.plan.sha256,
        "problems": all_problems,
        "ranks": [r.as_dict() for r in results],
    }


def load_rank_tensors(manifest: dict[str, Any], directory: str | Path, tp_rank: int, pp_stage: int,
                      device: str = "cpu") -> dict[str, Any]:
    """The checked way to load one rank's tensors (runtime, gate): verify, then load."""
    from safetensors.torch import load_file

    layout = layout_of(manifest)
    rl = layout.rank(tp_rank, pp_stage)
    res = verify_rank(manifest, Path(directory), layout, rl)
    problems = check_manifest_against_layout(manifest, layout) + res.problems
    if problems:
        raise VerifyMismatch(problems[0], hint="run shardc verify for the full report")
    return load_file(Path(directory) / rl.file, device=device)
