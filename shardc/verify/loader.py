"""The Checkpoint Loader (DESIGN.md): one rank's shard, checked, as tensors on a device.

``load_shard`` is the library call a serving runtime makes at cold start. Nothing is returned before
the whole file has been checked: the manifest against the Layout recomputed from its plan, the file's
size and sha256 against the manifest, and the safetensors header (metadata, tensor set, every dtype
and shape) against the Layout. Problems raise ShardcError subclasses; nothing exits.

Each byte is read once. The file is read in large chunks straight into the destination buffer (CPU)
or into a ring of pinned host buffers (CUDA); a hashing thread (hashlib releases the GIL) hashes each
chunk while the next one is read, and on CUDA every chunk is copied to the GPU asynchronously on a
side stream from its pinned buffer, so reading, hashing and the copy overlap. The tensors are views
of one device buffer holding the file's data section. The design's reference loader (hash in 1 MiB
chunks, then ``safe_open``) reads every byte twice; scripts/bench_loader.py compares the two.

Finite checks (``verify --device``) look at the exponent bits of each float tensor in bounded
chunks, on the device: no fp32 copy of a tensor is made, and on CUDA there is one host sync in all.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, VerifyMismatch

MAX_HEADER = 100 << 20
CHUNK = 32 << 20  # bytes per read / hash / copy step
PINNED_BUFFERS = 3  # ring of pinned staging buffers on CUDA: read, hash and copy in flight at once
FINITE_CHUNK = 1 << 22  # elements per finite-check step (bounds the temporaries)

# Exponent-all-ones masks per safetensors dtype: (integer view, mask). A value with every exponent
# bit set is Inf or NaN (float8_e4m3fn has no Inf: S.1111.111 is its NaN, the same test).
_NONFINITE_MASK = {"BF16": ("int16", 0x7F80), "F16": ("int16", 0x7C00),
                   "F32": ("int32", 0x7F800000), "F8_E4M3": ("uint8", 0x7F)}
_TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I8": "int8",
                "F8_E4M3": "float8_e4m3fn", "U8": "uint8", "I16": "int16", "I32": "int32",
                "I64": "int64"}


def shard_entries(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shard file name -> its manifest entry, for format_version 1 (a list of entries carrying
    "file") and 2 (a mapping keyed by file name)."""
    shards = manifest["shards"]
    if isinstance(shards, dict):
        return {name: {"file": name, **entry} for name, entry in shards.items()}
    return {s["file"]: s for s in shards}


@dataclass
class RawShard:
    """What one pass over a shard file yields: its sha256, its parsed header (None when it does not
    parse) and its data section as one uint8 tensor on the target device."""

    sha256: str
    header: dict[str, Any] | None
    data: Any  # torch.Tensor (uint8)
    header_error: str | None = None


def read_shard(path: Path, device: str) -> RawShard:
    """Read ``path`` once: hash every byte and land the data section on ``device``."""
    import torch

    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        prefix = f.read(8)
        h.update(prefix)
        header, error, n = None, None, 0
        if len(prefix) == 8:
            (n,) = struct.unpack("<Q", prefix)
        if len(prefix) != 8 or n > min(MAX_HEADER, size - 8):
            error, n = "file shorter than its header length says", 0
            f.seek(8 if len(prefix) == 8 else len(prefix))
        else:
            raw = f.read(n)
            h.update(raw)
            try:
                header = json.loads(raw)
                if not isinstance(header, dict):
                    header, error = None, "header is not a JSON object"
            except (ValueError, UnicodeDecodeError) as exc:
                error = f"header does not parse ({exc})"
        length = max(0, size - f.tell())
        dev = torch.device(device)
        with ThreadPoolExecutor(1, thread_name_prefix="shardc-hash") as hasher:
            if dev.type == "cuda":
                data = _read_to_cuda(f, length, dev, h, hasher)
            else:
                data = _read_to_host(f, length, h, hasher)
    return RawShard(h.hexdigest(), header, data, error)


def _read_to_host(f: Any, length: int, h: Any, hasher: ThreadPoolExecutor) -> Any:
    """Read into the destination tensor itself; hash chunk i while chunk i+1 is read."""
    import torch

    data = torch.empty(length, dtype=torch.uint8)
    mv = memoryview(data.numpy()) if length else memoryview(b"")
    pos, pending = 0, None
    while pos < length:
        k = f.readinto(mv[pos : pos + CHUNK])
        if not k:
            break
        if pending is not None:
            pending.result()
        pending = hasher.submit(h.update, mv[pos : pos + k])
        pos += k
    if pending is not None:
        pending.result()
    if pos != length:
        raise VerifyMismatch(f"{f.name}: file shrank while it was read", hint="is something rewriting it?")
    return data


def _read_to_cuda(f: Any, length: int, dev: Any, h: Any, hasher: ThreadPoolExecutor) -> Any:
    """Read into a ring of pinned buffers; hash each on the hashing thread and copy it to the GPU on
    a side stream. A buffer is refilled only once its hash and its copy are done."""
    import torch

    data = torch.empty(length, dtype=torch.uint8, device=dev)
    if not length:
        return data
    nbuf = min(PINNED_BUFFERS, -(-length // CHUNK))
    size = min(CHUNK, length)
    ring = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    views = [memoryview(b.numpy()) for b in ring]
    hashed: list[Future[Any] | None] = [None] * nbuf
    copied: list[Any] = [None] * nbuf
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # ``data``'s allocation is ordered first
    pos = i = 0
    while pos < length:
        j = i % nbuf
        if hashed[j] is not None:
            hashed[j].result()
        if copied[j] is not None:
            copied[j].synchronize()
        k = f.readinto(views[j][: min(size, length - pos)])
        if not k:
            break
        hashed[j] = hasher.submit(h.update, views[j][:k])
        with torch.cuda.stream(stream):
            data[pos : pos + k].copy_(ring[j][:k], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        copied[j] = ev
        pos += k
        i += 1
    for fut in hashed:
        if fut is not None:
            fut.result()
    stream.synchronize()
    if pos != length:
        raise VerifyMismatch(f"{f.name}: file shrank while it was read", hint="is something rewriting it?")
    return data


def tensors_of(raw: RawShard) -> dict[str, Any]:
    """Views of the data buffer, one per header entry (a misaligned tensor is copied instead)."""
    import torch

    assert raw.header is not None
    out = {}
    length = raw.data.numel()
    for name, info in raw.header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _TORCH_DTYPE[info["dtype"]])
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(s) for s in info["shape"]]
        item = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= start <= end <= length or end - start != numel * item:
            raise VerifyMismatch(f"tensor {name}: data_offsets {info['data_offsets']} do not fit "
                                 f"{info['dtype']}{shape} in the file", hint="rebuild the shard")
        part = raw.data[start:end]
        if start % item:
            part = part.clone()
        out[name] = part.view(dtype).reshape(shape)
    return out


def nonfinite(tensors: dict[str, Any], dtypes: dict[str, str]) -> list[str]:
    """Names of the float tensors holding NaN or Inf, found from their exponent bits in chunks (no
    fp32 copies); on CUDA the per-chunk flags stay on the device until one final transfer."""
    import torch

    names, flags = [], []
    for name, t in tensors.items():
        rule = _NONFINITE_MASK.get(dtypes.get(name, ""))
        if rule is None or t.numel() == 0:
            continue
        view, mask = rule
        bits = t.reshape(-1).view(getattr(torch, view))
        parts = [((c & mask) == mask).any() for c in bits.split(FINITE_CHUNK)]
        names.append(name)
        flags.append(torch.stack(parts).any() if len(parts) > 1 else parts[0])
    if not flags:
        return []
    hit = torch.stack(flags).cpu().tolist()
    return [n for n, bad in zip(names, hit, strict=True) if bad]


def load_shard(manifest: dict[str, Any] | str | Path, tp_rank: int, pp_stage: int, *,
               device: str = "cuda", directory: str | Path | None = None) -> dict[str, Any]:
    """One rank's tensors on ``device``, checked before any is returned.

    ``manifest``: a manifest dict, a manifest.json path or a build directory (the shards default to
    the manifest's directory; a dict needs ``directory``). ``device``: "cuda" is this process's GPU
    (cuda:LOCAL_RANK), "cuda:N" GPU N, or "cpu". Raises VerifyMismatch when the bytes, the header
    or the manifest disagree with the plan's Layout, ManifestError / LayoutError / DeviceError for
    bad input.
    """
    from ..formats.manifest import layout_of, read_manifest
    from .checks import RankResult, _check_header, check_manifest_against_layout
    from .devices import check_gpus, resolve_device

    if isinstance(manifest, dict):
        if directory is None:
            raise ManifestError("load_shard of a manifest dict needs directory=", key="directory",
                                hint="pass the directory holding the shard files")
    else:
        path = Path(str(manifest).removeprefix("file://"))
        path = path / "manifest.json" if path.is_dir() else path
        manifest = read_manifest(path)
        directory = path.parent if directory is None else directory
    layout = layout_of(manifest)
    check_gpus(layout.plan.name, device, 1)
    dev = resolve_device(device)
    assert dev is not None
    rl = layout.rank(tp_rank, pp_stage)
    problems = check_manifest_against_layout(manifest, layout)
    if problems:
        raise VerifyMismatch(problems[0], hint="run shardc verify for the full report")
    entry = shard_entries(manifest).get(rl.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = Path(directory) / rl.file
    res = RankResult(rl.file, rl.tp_rank, rl.pp_stage, rl.rank)
    if not file.is_file():
        raise VerifyMismatch(f"{rl.file}: missing (expected at {file})", hint="shardc pull it, or pass directory=")
    size = file.stat().st_size
    if size != entry["size"]:
        raise VerifyMismatch(f"{rl.file}: size {size} bytes, expected {entry['size']} (truncated or replaced?)",
                             hint="re-pull the shard")
    _check_header(res, file, rl, layout)  # cheap (header only): fail before reading gigabytes
    if res.ok:
        raw = read_shard(file, dev)
        if raw.sha256 != entry["sha256"]:
            res.fail(f"sha256 {raw.sha256[:16]}..., expected {entry['sha256'][:16]}... (corrupted bytes)")
        elif raw.header is None:
            res.fail(raw.header_error or "header does not parse")
    if not res.ok:
        raise VerifyMismatch(res.problems[0], hint="run shardc verify for the full report")
    return tensors_of(raw)
