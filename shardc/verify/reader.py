"""One pass over a shard file for the Checkpoint Loader (docs/architecture.md §2): one rank's shard, checked, as tensors on a device.

``load_shard`` is the library call a serving runtime makes at cold start. Nothing is returned before
the whole file has been checked: the manifest against the Layout recomputed from its plan, the file's
size and sha256 against the manifest, and the safetensors header (metadata, tensor set, every dtype
and shape) against the Layout. Problems raise ShardcError subclasses; nothing exits.

Each byte is read once, from one open file (``load_shard`` opens it once for the size, the header
check and the read; nothing is reopened by name), into memory of the loader's own: the tensors are
exactly the bytes that were hashed. On CPU the data section is read piece by piece into one buffer;
a thread hashes each piece (hashlib releases the GIL) while the next is read and, for ``verify
--device``, checked for NaN/Inf. On CUDA it is read in large chunks into a ring of pinned host
buffers; a hashing thread hashes each chunk while the next one is read, and every chunk is copied to
the GPU asynchronously on a side stream from its pinned buffer, so reading, hashing and the copy
overlap. The tensors are views of one buffer holding the file's data section. The design's
reference loader (hash in 1 MiB chunks, then ``safe_open``) reads every byte twice;
scripts/bench_loader.py compares the two.

Finite checks (``verify --device``) take each float tensor's min and max on the device (one pass, no
fp32 copy; NaN and Inf propagate into them); on CUDA there is one host sync in all.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ShardFormatError, VerifyMismatch
from ..formats.safetensors import MAX_HEADER, METADATA, parse_header
from ..layout.dtypes import DTYPE_BYTES, DTYPES

CHUNK = 32 << 20  # bytes per read / hash / copy step into pinned memory (CUDA)
HOST_CHUNK = 1 << 20  # bytes per read / hash step on CPU (stays in cache between the two)
HOST_RING = 3  # CPU: pieces being hashed (one thread) while the next are read and checked
PINNED_BUFFERS = 3  # ring of pinned staging buffers on CUDA: read, hash and copy in flight at once
FINITE_CHUNK = 1 << 22  # elements per finite-check step (bounds the temporaries)
# (header with its "__metadata__", or None; why it does not parse, or None; data section bytes)
HeaderCheck = Callable[[dict[str, Any] | None, str | None, int], None]

@dataclass
class RawShard:
    """What one pass over a shard file yields: its sha256, its parsed header (None when it does not
    parse) and its data section as one uint8 tensor on the target device."""

    sha256: str
    header: dict[str, Any] | None
    data: Any  # torch.Tensor (uint8)
    header_error: str | None = None
    nonfinite: list[str] = field(default_factory=list)  # with finite=True: tensors with NaN / Inf


def read_shard(source: Path | BinaryIO, device: str, *, finite: bool = False,
               on_header: HeaderCheck | None = None, keep: bool = True) -> RawShard:
    """Read a shard once: hash every byte and land the data section on ``device``; with ``finite``,
    also find the float tensors holding NaN or Inf (on CPU while hashing, on CUDA after the copy).

    ``source`` is a path or a file the caller opened (``load_shard``: one descriptor for every
    check and the read, so nothing is reopened by name). ``on_header(header, error, data_length)``
    runs once the header is parsed and before any data is read; it may raise to stop there. The
    data lands in memory of its own (never a mapping of the file): the tensors are the bytes that
    were hashed, whatever later happens to the file. ``keep=False`` (CPU only): nothing is kept,
    ``data`` is a ``meta`` tensor (for a check that returns no tensor)."""
    if not hasattr(source, "readinto"):  # a path: every binary file has readinto, no path does
        assert isinstance(source, (str, bytes, int, os.PathLike))  # what open() takes
        with open(source, "rb", buffering=0) as opened:
            return read_shard(opened, device, finite=finite, on_header=on_header, keep=keep)
    import torch

    assert not isinstance(source, Path)  # it has readinto: a file
    f = source
    size = os.fstat(f.fileno()).st_size
    h = hashlib.sha256()
    prefix = f.read(8)
    h.update(prefix)
    header, error, n = None, None, 0
    if len(prefix) == 8:
        (n,) = struct.unpack("<Q", prefix)
    if len(prefix) != 8 or n > min(MAX_HEADER, size - 8):
        error, n = "file shorter than its header length says", 0
        f.seek(8 if len(prefix) == 8 else len(prefix))
    else:
        head = f.read(n)
        h.update(head)
        try:
            tensors, meta = parse_header(head, Path(f.name).name)
            header = {**tensors, METADATA: meta}
        except ShardFormatError as exc:
            error = exc.message
    length = max(0, size - f.tell())
    if on_header is not None:
        on_header(header, error, length)
    dev = torch.device(device)
    bad: list[str] = []
    if dev.type == "cuda":
        with ThreadPoolExecutor(1, thread_name_prefix="shardc-hash") as hasher:
            data = _read_to_cuda(f, length, dev, h, hasher)
    else:
        data, bad = _read_to_host(f, length, h, header, finite, keep)
    raw = RawShard(h.hexdigest(), header, data, error)
    if finite and dev.type == "cuda" and header is not None:
        try:
            tensors = tensors_of(raw)
        except VerifyMismatch:
            tensors = {}
        bad = nonfinite(tensors, {k: v.get("dtype") for k, v in header.items() if isinstance(v, dict)})
    raw.nonfinite = bad
    return raw


def _read_to_host(f: Any, length: int, h: Any, header: dict[str, Any] | None,
                  finite: bool, keep: bool) -> tuple[Any, list[str]]:
    """Read the data section piece by piece; a thread hashes each piece (hashlib releases the GIL)
    while this one reads the next and, with ``finite``, checks it while it is in cache. Returns the
    data and the names of the tensors holding NaN or Inf.

    ``keep``: the pieces land in one buffer of the reader's own and the tensors are views of it,
    the hashed bytes themselves, so a file replaced, truncated or rewritten after the hash changes
    nothing they hold (a mapping of the file would show an in-place write and fault on a
    truncation). Otherwise (``verify --device cpu``, which returns no tensor) a small ring of
    buffers is reused and the data is a ``meta`` tensor of the right length: the tensors' offsets,
    dtypes and shapes are still checked, at no memory cost."""
    import torch

    data = torch.empty(length, dtype=torch.uint8, device="cpu" if keep else "meta")
    # ndarray.data: the array's memoryview (numpy's stubs give ndarray the buffer protocol on 3.12+ only)
    whole = data.numpy().data if keep and length else None
    ring = [memoryview(bytearray(HOST_CHUNK)) for _ in range(HOST_RING + 1)]
    bad: list[str] = []
    scratch: dict[str, Any] = {}
    pending: deque[Future[Any]] = deque()
    pos = i = 0
    with ThreadPoolExecutor(1, thread_name_prefix="shardc-hash") as hasher:
        for seg_end, name, dtype in _segments(header if finite else None, length):
            while pos < seg_end:
                end = min(pos + HOST_CHUNK, seg_end)
                # a ring slot is refilled only once its piece was hashed: at most HOST_RING are pending
                mv = whole[pos:end] if whole is not None else ring[i % len(ring)][: end - pos]
                k = _read_full(f, mv)
                if not k:
                    break
                pending.append(hasher.submit(h.update, mv[:k]))
                if len(pending) > HOST_RING:
                    pending.popleft().result()
                if dtype is not None and (not bad or bad[-1] != name) and _piece_bad(mv[:k], dtype, scratch):
                    assert name is not None  # a segment with a dtype is a tensor's
                    bad.append(name)
                pos += k
                i += 1
        while pending:
            pending.popleft().result()
    if pos != length or f.read(1):  # cut short, or longer than it was: rewritten while read
        raise VerifyMismatch(f"{f.name}: file changed size while it was read", hint="is something rewriting it?")
    return data, bad


def _segments(header: dict[str, Any] | None, length: int) -> list[tuple[int, str | None, str | None]]:
    """(end offset, tensor name, float dtype or None) covering the data section in order, so that
    reads start at tensor starts and every piece holds whole elements (1 MiB is a multiple of 4)."""
    if header is None:
        return [(length, None, None)]
    spans = []
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        try:
            s, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return [(length, None, None)]
        dtype = info.get("dtype")
        if dtype in _FLOAT and (e - s) % DTYPE_BYTES[dtype]:  # part of an element: hash only, tensors_of fails it
            return [(length, None, None)]
        spans.append((s, e, name, dtype if dtype in _FLOAT else None))
    out: list[tuple[int, str | None, str | None]] = []
    pos = 0
    for s, e, name, dtype in sorted(spans):
        if s < pos or e > length:  # overlapping or out of range: hash only; the header check fails it
            return [(length, None, None)]
        if s > pos:
            out.append((s, None, None))
        out.append((e, name, dtype))
        pos = e
    out.append((length, None, None))
    return out


# Float dtypes -> (unsigned view, exponent mask): every exponent bit set is Inf or NaN (e4m3fn has no
# Inf; its only non-finite values are the NaNs S.1111.111, the same test with the mantissa bits).
_FLOAT = {"BF16": ("uint16", 0x7F80), "F16": ("uint16", 0x7C00), "F32": ("uint32", 0x7F800000),
          "F8_E4M3": ("uint8", 0x7F)}


def _piece_bad(mv: memoryview, dtype: str, scratch: dict[str, Any]) -> bool:
    """Exponent bits of one cache-hot piece, with numpy (single-threaded: a thread pool's fork and
    join per 1 MiB piece costs more than the check on a busy machine) into a reused scratch array."""
    import numpy as np

    view, mask = _FLOAT[dtype]
    x = np.frombuffer(mv, dtype=view)
    tmp = scratch.get(view)
    if tmp is None or tmp.size < x.size:
        tmp = scratch[view] = np.empty(max(x.size, HOST_CHUNK // x.itemsize), dtype=view)
    out = tmp[: x.size]
    np.bitwise_and(x, mask, out=out)
    return bool(out.max() == mask)


def _read_full(f: Any, mv: memoryview) -> int:
    got = 0
    while got < len(mv):
        k = f.readinto(mv[got:])
        if not k:
            break
        got += k
    return got


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
    views = [b.numpy().data for b in ring]  # memoryviews, as in _read_to_host
    hashed: list[Future[Any] | None] = [None] * nbuf
    copied: list[Any] = [None] * nbuf
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # ``data``'s allocation is ordered first
    pos = i = 0
    while pos < length:
        j = i % nbuf
        if (pending := hashed[j]) is not None:
            pending.result()
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
    if pos != length or f.read(1):  # cut short, or longer than it was: rewritten while read
        raise VerifyMismatch(f"{f.name}: file changed size while it was read", hint="is something rewriting it?")
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
        try:
            dtype = getattr(torch, DTYPES[info["dtype"]].torch)
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise VerifyMismatch(f"tensor {name}: malformed header entry {str(info)[:200]}",
                                 hint="rebuild the shard") from None
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


def nonfinite(tensors: dict[str, Any], dtypes: dict[str, str | None]) -> list[str]:
    """Names of the float tensors holding NaN or Inf, without fp32 copies: a 16/32-bit float tensor's
    min and max (one reduction pass, no temporaries; NaN propagates into both) are finite exactly when
    all of it is; fp8 has no min/max kernel and is tested by its bits (e4m3fn's only non-finite
    values are the NaNs S.1111.111), in bounded chunks. Flags stay on the device until one final
    transfer (on CUDA: one host sync for the whole shard)."""
    import torch

    names, flags = [], []
    for name, t in tensors.items():
        dtype = dtypes.get(name, "")
        if t.numel() == 0 or dtype not in ("BF16", "F16", "F32", "F8_E4M3"):
            continue
        flat = t.reshape(-1)
        if dtype == "F8_E4M3":
            bits = flat.view(torch.uint8)
            parts = [(c & 0x7F).amax() == 0x7F for c in bits.split(FINITE_CHUNK)]
            bad = torch.stack(parts).any()
        else:
            lo, hi = torch.aminmax(flat)
            bad = ~torch.isfinite(torch.stack((lo, hi))).all()
        names.append(name)
        flags.append(bad)
    if not flags:
        return []
    hit = torch.stack(flags).cpu().tolist()
    return [n for n, bad in zip(names, hit, strict=True) if bad]
