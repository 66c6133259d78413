"""Library entry points of the runtime: open a build, generate, score, compare two builds.

Each call builds a job and runs it on tp x pp processes (or, under torchrun, as this process's rank).
The tokenizer travels with the shards (build copies tokenizer.json and records its sha256 in the
manifest), so nothing here needs the source checkpoint or the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..formats.manifest import TOKENIZER, Manifest
from .api_results import CompareResult, GenerateResult, ScoreResult, Wire

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class BuildRef:
    """A manifest and the directory holding its shard files."""

    manifest_path: Path
    directory: Path
    manifest: Manifest

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    def wire_entry(self, name: str | None = None) -> dict[str, str]:
        """This build as a job's replica entry: JSON that crosses to the rank processes (job.json)."""
        return {"manifest": str(self.manifest_path), "dir": str(self.directory), "name": name or self.name}


def open_build(manifest: str | Path, directory: str | Path | None = None) -> BuildRef:
    """A manifest.json (or a build directory holding one); shards default to the manifest's directory."""
    from ..formats.manifest import load

    path = Path(str(manifest).removeprefix("file://"))
    if path.is_dir():
        path = path / "manifest.json"
    m = load(path)
    from ..layout.model import model_from_config
    from .support import check_stages, check_supported

    model = model_from_config(m.config)
    check_supported(model)  # before any rank starts: never another model
    check_stages(model, {s.layers[0] for s in m.shards})
    d = Path(directory) if directory is not None else path.parent
    missing = [s.file for s in m.shards if not (d / s.file).is_file()]
    if missing:
        name = m.name
        raise ManifestError(
            f"{len(missing)} shard file(s) of plan {name} are not in {d} (first: {missing[0]})",
            hint=f"give `directory`, the one holding them, "
                 f"e.g. build/{name}, or shardc pull them first",
        )
    return BuildRef(path.resolve(), d.resolve(), m)


def eos_ids(ref: BuildRef) -> list[int]:
    eos = ref.manifest.config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_tokenizer(ref: BuildRef, override: str | Path | None = None) -> Any:
    """The build's tokenizer.json (checked against the manifest's sha256), or one from ``override``."""
    from tokenizers import Tokenizer

    if override is not None:
        p = Path(override)
        p = p / TOKENIZER if p.is_dir() else p
        if not p.is_file():
            raise ManifestError(f"no tokenizer.json at {override}", hint="pass a tokenizer.json or its directory")
        return Tokenizer.from_file(str(p))
    p = ref.directory / TOKENIZER
    if not p.is_file():
        raise ManifestError(
            f"the build at {ref.directory} has no tokenizer.json",
            hint="build from a checkpoint with tokenizer files, give `tokenizer`, or give token ids",
        )
    from ..formats.files import sha256_file

    want = ref.manifest.tokenizer_sha256
    if want is not None and sha256_file(p) != want:
        raise ManifestError(f"{p} does not match the sha256 in the manifest", hint="re-pull or rebuild")
    return Tokenizer.from_file(str(p))


def _job_wire(kind: str, refs: list[BuildRef], names: list[str] | None, timeout_s: float, device: str,
              **extra: Any) -> dict[str, Any]:
    """A job as the rank processes read it (plain JSON: written to job.json, see runtime/worker.py)."""
    names = names or [None] * len(refs)  # type: ignore[list-item]
    return {
        "kind": kind,
        "replicas": [r.wire_entry(n) for r, n in zip(refs, names, strict=True)],
        "timeout_s": float(timeout_s),
        "device": device,
        **extra,
    }


def generate(ref: BuildRef, prompts: list[list[int]], max_new_tokens: int = 32, *,
             eos: list[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
             device: str = "cpu") -> GenerateResult | None:
    """Greedy generation of ``max_new_tokens`` per prompt (None under torchrun on the ranks that do
    not hold the tokens)."""
    from .launch import run_job

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ManifestError("every prompt needs at least one token")
    job = _job_wire("generate", [ref], None, timeout_s, device, generate={
        "prompts": [list(map(int, p)) for p in prompts], "max_new_tokens": int(max_new_tokens),
        "eos": eos_ids(ref) if eos is None else list(eos),
    })
    wire = run_job(job)
    return GenerateResult.from_wire(wire) if wire is not None else None


def score(ref: BuildRef, windows: Any, *, micro_batch: int = 1, return_logits: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu") -> ScoreResult | None:
    """Forward [N, T] token windows; per-position NLL (and optionally fp32 logits) of the last stage."""
    from .launch import run_job

    job = _job_wire("score", [ref], None, timeout_s, device,
               score={"windows": _as_lists(windows), "micro_batch": micro_batch,
                      "return_logits": return_logits})
    return _score_result(ref, run_job(job))


def _score_result(ref: BuildRef, wire: Wire | None) -> ScoreResult | None:
    lay = ref.manifest.layout
    return ScoreResult.from_wire(wire, lay.tp_degree, lay.pp_degree) if wire is not None else None


def save_baseline(ref: BuildRef, windows: Any, path: str | Path, key: dict[str, Any], *,
                  micro_batch: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                  device: str = "cpu", threads: int | None = None) -> ScoreResult | None:
    """The gate's baseline pass: score ``windows`` and write the logits (what KL and top-1 need) to
    ``path``, a safetensors file whose metadata holds ``key``. Written atomically. ``threads``:
    CPU threads per rank (default: the cores shared out over the ranks)."""
    from .launch import run_job

    extra = {"threads": threads} if threads else {}
    job = _job_wire("score", [ref], None, timeout_s, device, phase="baseline", **extra,
               score={"windows": _as_lists(windows), "micro_batch": micro_batch,
                      "save_logits": str(path), "cache_key": key})
    return _score_result(ref, run_job(job))


def score_against(candidate: BuildRef, windows: Any, baseline_logits: str | Path, *,
                  micro_batch: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                  device: str = "cpu", threads: int | None = None) -> CompareResult | None:
    """The gate's candidate pass: per-position NLL of both, KL(baseline || candidate) and top-1
    agreement against the baseline logits saved by ``save_baseline``."""
    from .launch import run_job

    extra = {"threads": threads} if threads else {}
    job = _job_wire("against", [candidate], ["candidate"], timeout_s, device, phase="candidate", **extra,
               score={"windows": _as_lists(windows), "micro_batch": micro_batch,
                      "baseline_logits": str(baseline_logits)})
    wire = run_job(job)
    return CompareResult.from_wire(wire) if wire is not None else None


def compare(baseline: BuildRef, candidate: BuildRef, windows: Any, *, micro_batch: int = 1,
            timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu") -> CompareResult | None:
    """Score the baseline, then the candidate, on the same devices (max of their GPUs, not the
    sum): per-position NLL, KL and top-1 agreement. The baseline's logits go through a scratch file."""
    from .launch import in_torchrun

    path = scratch_path(in_torchrun())
    try:
        save_baseline(baseline, windows, path, {}, micro_batch=micro_batch, timeout_s=timeout_s,
                      device=device)
        return score_against(candidate, windows, path, micro_batch=micro_batch,
                             timeout_s=timeout_s, device=device)
    finally:
        if not in_torchrun():  # under torchrun the reading rank may still be at it: the OS tmp cleans up
            path.unlink(missing_ok=True)


def scratch_path(torchrun: bool) -> Path:
    """Where an uncached gate keeps the baseline's logits: every rank of a torchrun job derives the
    same path (one node); the built-in launcher's gate gets a fresh one."""
    import os
    import tempfile
    import uuid

    if torchrun:
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'env')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    else:
        run = uuid.uuid4().hex[:12]
    return Path(tempfile.gettempdir()) / f"shardc-gate-{run}.safetensors"


def _as_lists(windows: Any) -> list[list[int]]:
    rows = windows.tolist() if hasattr(windows, "tolist") else windows
    if not rows or not all(len(r) == len(rows[0]) and len(r) > 1 for r in rows):
        raise ManifestError("token windows must be equal-length rows of at least 2 tokens")
    return [list(map(int, r)) for r in rows]
