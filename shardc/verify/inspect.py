"""Readable summaries of manifests and shard files (for `shardc inspect`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, ShardcError
from ..formats.files import human_size
from ..formats.manifest import Manifest, load
from ..formats.safetensors import read_header
from ..results import StrEnum, optional


class Described(StrEnum):
    """What ``describe`` was given: a manifest (or the build directory holding one), or one shard file."""

    MANIFEST = "manifest"
    SHARD = "shard"


@dataclass(frozen=True)
class Description:
    """``shardc inspect``'s result: the text lines and the tensor rows (JSON data as the manifest or
    the file's header holds them); a manifest's ``experts`` per file, a shard file's ``metadata``."""

    kind: Described
    lines: tuple[str, ...]
    tensors: tuple[dict[str, Any], ...]
    experts: dict[str, list[int]] | None = optional()  # kind MANIFEST only
    metadata: dict[str, str] | None = optional()  # kind SHARD only
    # kind MANIFEST only, the build as data (what `lines` says in words): the plan, its degrees and
    # dtypes, every shard, and what the directory loads as
    plan: dict[str, Any] | None = optional()
    shards: list[dict[str, Any]] | None = optional()
    loads_as: dict[str, Any] | None = optional()


def describe(path: Path) -> Description:
    """Lines of text plus the tensor list; a manifest path, a build dir, or a .safetensors file."""
    if path.is_dir():
        path = path / "manifest.json"
    if path.suffix == ".safetensors":
        return _describe_shard(path)
    m = load(path)
    lay, model = m.layout, m.model
    lines = [
        f"plan       {m.name}  (sha256 {m.plan_sha256[:12]})",
        f"layout     tp={lay.tp_degree} pp={lay.pp_degree} dtype={lay.dtype} "
        f"base={lay.base_dtype} stages={[list(s) for s in lay.stages]}",
        f"model      {model['architecture']} layers={model['num_layers']} hidden={model['hidden_size']} "
        f"heads={model['num_heads']}/{model['num_kv_heads']} vocab={model['vocab_size']}"
        f" (padded {model['padded_vocab_size']}) tied={model['tie_word_embeddings']}",
        f"source     {m.source.uri}" + (f" @ {m.source.revision}" if m.source.revision else "")
        + (f"  (build --source; the plan's own is {m.plan['model']['source']}, effective plan sha256 "
           f"{m.effective_sha256[:12]})" if "model.source" in m.overrides else ""),
        f"shards     {len(m.shards)} files, {human_size(m.total_bytes)}",
    ]
    stored = {"int8": "pack-quantized: X.weight_packed int32 + X.weight_shape + X.weight_scale",
              "fp8": "float-quantized: X.weight e4m3 + X.weight_scale"}
    if lay.dtype in stored:
        lines.append(f"quantized  {lay.dtype} weight-only per channel, compressed-tensors "
                     f"{stored[lay.dtype]}")
    hf, problem = _hf_line(m)
    if hf is not None:
        lines.append(hf)
    tensors = []
    for s in m.shards:
        lines.append(f"  {s.file}  rank {s.rank} (tp {s.tp_rank}, pp {s.pp_stage})  "
                     f"layers {s.layers[0]}:{s.layers[1]}  {len(s.tensors)} tensors  "
                     f"{human_size(s.size)}  {s.sha256[:12]}"
                     + (f"  experts {_ranges(s.experts)}" if s.experts else ""))
        for name, t in s.tensors.items():
            tensors.append({"file": s.file, "name": name, **t})
    plan = {"name": m.name, "sha256": m.plan_sha256, "effective_sha256": m.effective_sha256,
            "tp": lay.tp_degree, "pp": lay.pp_degree, "dp": lay.dp_degree,
            "expert_parallel": bool(m.plan["replica_group"].get("expert_parallel", False)),
            "dtype": lay.dtype, "base_dtype": lay.base_dtype, "stages": [list(x) for x in lay.stages],
            "architecture": model["architecture"], "source": m.source.uri}
    shards = [{"file": s.file, "rank": s.rank, "tp_rank": s.tp_rank, "pp_stage": s.pp_stage, "dp_rank": s.dp_rank,
               "layers": list(s.layers), "size": s.size, "sha256": s.sha256, "tensors": len(s.tensors),
               "experts": list(s.experts), "chunk_digest": s.chunk_digest if s.chunk_size else None}
              for s in m.shards]
    loads_as = {"hf_checkpoint": problem is None, "hf_checkpoint_why_not": problem, **_vllm(m)}
    return Description(Described.MANIFEST, tuple(lines), tuple(tensors),
                       experts={s.file: list(s.experts) for s in m.shards if s.experts},
                       plan=plan, shards=shards, loads_as=loads_as)


def _hf_line(m: Manifest) -> tuple[str | None, str | None]:
    """Whether the directory loads as an HF checkpoint, by the rule the index writer follows
    (``hf_checkpoint_problem`` on the Layout recomputed from the manifest), not by the index's
    presence alone: an older shardc wrote one for stacked experts over DP ranks, which
    transformers refuses. The line (none for a tp > 1 build without an index: no one expects
    one) and why the directory is not a checkpoint (None: it is)."""
    from ..compiler.outputs import INDEX, hf_checkpoint_problem

    listed = m.file(INDEX) is not None
    try:
        problem = hf_checkpoint_problem(m.to_layout())
    except ShardcError as exc:  # a manifest whose plan or config no longer lays out
        problem = f"its layout cannot be recomputed ({exc.message})"
    if problem is None and not listed:
        problem = "no model.safetensors.index.json listed (an older shardc, or edited)"
    if not listed and m.layout.tp_degree != 1:
        return None, problem
    if problem is None:
        return f"hf index   {INDEX} (the directory loads as an HF checkpoint)", None
    if not listed and "no model.safetensors.index.json" in problem:
        return "hf index   none listed, though this build should have one (an older shardc, or edited)", problem
    if listed:
        return f"hf index   {INDEX} is listed, but the directory is not an HF checkpoint: {problem}", problem
    return f"hf index   none: the directory is not an HF checkpoint ({problem}); shardc export makes one", problem


def _vllm(m: Manifest) -> dict[str, Any]:
    """Whether vLLM's `--load-format shardc` (shardc/serving/) takes the build: every family but
    one whose experts are stacked (gpt-oss: vLLM reorders them in its own loader)."""
    try:
        moe = m.to_layout().model.forward.moe
    except ShardcError as exc:
        return {"vllm_load_format": None, "vllm_why_not": f"its layout cannot be recomputed ({exc.message})"}
    if moe is not None and not moe.expert:
        return {"vllm_load_format": None, "vllm_why_not": "its experts are stacked, which vLLM reorders as it loads"}
    return {"vllm_load_format": "shardc", "vllm_why_not": None}


def _ranges(ids: tuple[int, ...]) -> str:
    """Expert ids as ranges: (0, 1, 2, 5) -> "0-2,5"."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _describe_shard(path: Path) -> Description:
    try:
        header, meta, _ = read_header(path)
    except OSError as exc:
        raise ManifestError(f"{path} is not a readable safetensors file ({exc.strerror})") from None
    size = path.stat().st_size
    lines = [f"file       {path.name}  {human_size(size)}  {len(header)} tensors"]
    if "shardc.plan" in meta:
        lines.append(f"plan       {meta['shardc.plan']}  (sha256 {meta.get('shardc.plan_sha256', '')[:12]})")
        lines.append(f"rank       {meta.get('shardc.rank')} (tp {meta.get('shardc.tp_rank')}/"
                     f"{meta.get('shardc.tp_degree')}, pp {meta.get('shardc.pp_stage')}/"
                     f"{meta.get('shardc.pp_degree')})  layers {meta.get('shardc.layers')}"
                     + (f"  experts {meta['shardc.experts']}" if "shardc.experts" in meta else ""))
    else:
        lines.append("plan       (no shardc metadata: not a shardc shard)")
    tensors = [{"name": n, "dtype": h["dtype"], "shape": h["shape"]} for n, h in sorted(header.items())]
    return Description(Described.SHARD, tuple(lines), tuple(tensors), metadata=meta)
