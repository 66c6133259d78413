"""The Checkpoint Loader (docs/architecture.md §2): ``load_shard``, one rank's shard, checked, as
tensors on a device. The one-pass read (hash while reading, pinned copies on CUDA) is reader.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ManifestError, VerifyMismatch
from ..formats.manifest import Manifest
from .reader import read_shard, tensors_of


def load_shard(manifest: Manifest | dict[str, Any] | str | Path, tp_rank: int, pp_stage: int, *,
               device: str = "cuda", directory: str | Path | None = None) -> dict[str, Any]:
    """One rank's tensors on ``device``, checked before any is returned.

    ``manifest``: a manifest dict, a manifest.json path or a build directory (the shards default to
    the manifest's directory; a dict needs ``directory``). ``device``: "cuda" is this process's GPU
    (cuda:LOCAL_RANK), "cuda:N" GPU N, or "cpu". Raises VerifyMismatch when the bytes, the header
    or the manifest disagree with the plan's Layout, ManifestError / LayoutError / DeviceError for
    bad input.
    """
    from ..formats.manifest import read, typed
    from .checks import RankResult, _check_header, check_manifest_against_layout
    from .devices import check_gpus, resolve_device

    if isinstance(manifest, (dict, Manifest)):
        if directory is None:
            raise ManifestError("load_shard of a manifest dict needs directory=", key="directory",
                                hint="pass the directory holding the shard files")
    else:
        path = Path(str(manifest).removeprefix("file://"))
        path = path / "manifest.json" if path.is_dir() else path
        manifest = read(path)
        directory = path.parent if directory is None else directory
    manifest = typed(manifest)
    layout = manifest.to_layout()
    check_gpus(layout.plan.name, device, 1)
    dev = resolve_device(device)
    assert dev is not None
    rl = layout.rank(tp_rank, pp_stage)
    problems = check_manifest_against_layout(manifest, layout)
    if problems:
        raise VerifyMismatch(problems[0], hint="run shardc verify for the full report")
    entry = manifest.shard(rl.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = Path(directory) / rl.file
    res = RankResult(rl.file, rl.tp_rank, rl.pp_stage, rl.rank)
    if not file.is_file():
        raise VerifyMismatch(f"{rl.file}: missing (expected at {file})", hint="shardc pull it, or pass directory=")
    size = file.stat().st_size
    if size != entry.size:
        raise VerifyMismatch(f"{rl.file}: size {size} bytes, expected {entry.size} (truncated or replaced?)",
                             hint="re-pull the shard")
    _check_header(res, file, rl, layout)  # cheap (header only): fail before reading gigabytes
    if res.ok:
        raw = read_shard(file, dev)
        if raw.sha256 != entry.sha256:
            res.fail(f"sha256 {raw.sha256[:16]}..., expected {entry.sha256[:16]}... (corrupted bytes)")
        elif raw.header is None:
            res.fail(raw.header_error or "header does not parse")
    if not res.ok:
        raise VerifyMismatch(res.problems[0], hint="run shardc verify for the full report")
    return tensors_of(raw)
