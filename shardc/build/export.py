"""Export: a build back to one Hugging Face checkpoint (tp=1, pp=1, HF file naming).

It is reshard to one rank, through the same BuildSource and the same Layout, only written the way
``save_pretrained`` shards a model: ``model-0000i-of-0000n.safetensors`` files of at most
``max_shard_size`` bytes each (a larger tensor gets a file of its own), tensors in name order,
``model.safetensors.index.json`` (written last: the commit point), config.json and the tokenizer.
A 16-bit export holds the build's tensors bit for bit; a quantized one keeps the build's
quantized values and scales as they are, in compressed-tensors' form (int8 pack-quantized: the
tensors a tp=1 build of the same dtype holds; config.json carries the quantization_config).
The tensors are produced by the build's own Materializer, so an export is what ``shardc build``
would write for the checkpoint at tp=1, only named and grouped into files the HF way.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ..errors import ManifestError, OutputError, ShardcError
from ..formats.files import copy_atomic, safe_name, write_atomic
from ..formats.manifest import Manifest
from ..formats.safetensors import ShardWriter
from ..spec.layout import TensorSpec, build_layout
from ..spec.model import model_from_config
from ..spec.plan import plan_from_dict
from .inputs import BuildInput
from .materialize import Materializer, stream_region
from .outputs import INDEX, TOKENIZER_FILES, output_config
from .reshard import BuildSource

DEFAULT_MAX_SHARD = "5GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_HF_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20 (decimal and binary units, as transformers reads them)."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ManifestError(f"--max-shard-size {text!r} is not a size", key="max_shard_size",
                            hint="use a number with a unit: 5GB, 500MB, 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def export_plan(manifest: Manifest):
    """The input's plan at tp=1, pp=1: same dtype, quantization ignore list and base dtype."""
    data = json.loads(json.dumps(manifest.plan))
    rg = data["replica_group"]
    rg.update(tp_degree=1, pp_degree=1, gpus_per_replica=1)
    rg.get("checkpoint", {}).pop("shard_prefix", None)
    data["model"].pop("pp_layers", None)
    return plan_from_dict(data)


def _groups(specs: tuple[TensorSpec, ...], limit: int) -> list[list[TensorSpec]]:
    """Tensors in name order, a new file whenever the next one would cross the limit."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in specs:
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def export(inp: BuildInput, out_dir: str | Path, *, max_shard_size: int = 5 * 10**9) -> dict[str, Any]:
    """Write the input build as one Hugging Face checkpoint in ``out_dir``."""
    t0 = time.perf_counter()
    try:
        plan = export_plan(inp.manifest)
        layout = build_layout(model_from_config(inp.manifest.config), plan)
        source = BuildSource(inp, layout)
        inp.prepare(inp.side_files())
        source.schedule(layout)
        out = Path(out_dir)
        existed = out.exists()
        written: list[Path] = []
        try:
            result = _write(inp, source, layout, out, max_shard_size, written)
        except (ShardcError, OSError) as exc:
            for p in written:
                p.unlink(missing_ok=True)
            if not existed and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            if isinstance(exc, OSError):
                raise OutputError(f"cannot write the export in {out}: {exc.strerror or exc}",
                                  hint="free space or fix the disk, then rerun") from None
            raise
    finally:
        inp.close()
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _write(inp: BuildInput, source: BuildSource, layout, out: Path, limit: int,
           written: list[Path]) -> dict[str, Any]:
    rl = layout.ranks[0]
    groups = _groups(rl.tensors, limit)
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)  # the old index no longer describes the directory
    meta = {"format": "pt", "shardc.export_of": inp.manifest_sha256}
    weight_map, files = {}, []
    mat = Materializer(source, layout)  # int8 packed again, X.weight_shape from the Layout
    for fname, group in zip(names, groups, strict=True):
        w = ShardWriter(out / fname, [(t.name, t.dtype, t.shape) for t in group], meta)
        try:
            for t in group:
                stream_region(w, mat.full(t), t)
                weight_map[t.name] = fname
            size, sha = w.commit()
        except BaseException:
            w.abort()
            raise
        written.append(out / fname)
        files.append({"name": fname, "size": size, "sha256": sha, "tensors": len(group)})
    for stale in out.glob("model-*-of-*.safetensors"):
        if _HF_FILE.match(stale.name) and stale.name not in names:
            stale.unlink()
    cfg = (json.dumps(output_config(layout), indent=1, sort_keys=True) + "\n").encode()
    write_atomic(out / "config.json", cfg)
    written.append(out / "config.json")
    for name in TOKENIZER_FILES:
        if (inp.directory / safe_name(name)).is_file() and name in inp.side_files():
            copy_atomic(inp.directory / name, out / name)
            written.append(out / name)
    total = sum(t.nbytes for t in rl.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return {"out_dir": str(out), "index": str(out / INDEX), "files": files, "total_bytes": total,
            "dtype": layout.plan.dtype, "source": {"uri": inp.uri, "manifest_sha256": inp.manifest_sha256}}
