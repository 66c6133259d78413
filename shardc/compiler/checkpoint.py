"""Checkpoint readers: a local Hugging Face directory or ``hf://org/repo[@rev]``.

safetensors validates each file and lists its tensors; the build then reads a tensor as a
zero-copy view of a mapping of just that tensor's bytes (``CheckpointSource.view``), released with the
view, so the page-cache pages it pins in our RSS stay bounded by the largest tensor rather than
by the model. Pickled ``.bin`` checkpoints are refused unless explicitly allowed, and then loaded
with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from ..errors import SourceError
from ..formats.files import safe_name, sha256_file, write_atomic
from ..formats.manifest import FileEntry, SourceRecord
from ..formats.safetensors import read_header
from ..layout.dtypes import DTYPE_BYTES, SOURCE_DTYPES, from_torch_name
from ..layout.model import LEGACY_QUANT, ModelSpec, read_config
from ..layout.readfile import CONFIG_LIMIT, read_regular_file
from ..layout.tensors import source_tensors
from .arrays import from_torch, np_dtype
from .lease import Leases, read_leases
from .quantized import check_stored
from .source import Source, TensorInfo

_HF_RE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?\Z")
# Buffers some exporters leave in checkpoints; they are derived, not weights.
_BENIGN = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass
class CheckpointSource:
    """A resolved checkpoint: local directory, its config and a tensor index (names -> file).
    A ``Source`` (compiler/source.py); a quantized checkpoint is wrapped in a QuantizedSource."""

    uri: str
    directory: Path
    revision: str | None
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    files: list[str]
    pickled: bool = False
    _hashes: dict[str, Future] = field(default_factory=dict, repr=False)
    # (size, inode) of each weight file when it was indexed: a file that shrinks or is replaced
    # under a running build is an error before its bytes are mapped, not a SIGBUS (view)
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _leases: Leases | None = field(default=None, repr=False)
    # nothing stored quantized as such: QuantizedSource (compiler/quantized.py) says otherwise
    source_format: ClassVar[None] = None
    quantized_shapes: ClassVar[Mapping[str, tuple[int, ...]]] = MappingProxyType({})

    # -- validation ---------------------------------------------------------------------------
    def check(self, model: ModelSpec, quantized: Source | None = None) -> None:
        """Every tensor the model needs is there with the right shape; nothing unknown. A quantized
        checkpoint's stored tensors are checked against its format (``quantized``, the wrapper)."""
        expected = {t.name: t.shape for t in source_tensors(model)}
        known = check_stored(quantized, model, expected) if quantized is not None else expected
        skip = quantized.quantized_shapes if quantized is not None else {}
        for name, shape in expected.items():
            if name in skip:
                continue
            info = self.tensors.get(name)
            if info is None:
                raise SourceError(
                    f"tensor {name!r} is missing from the checkpoint at {self.uri}",
                    hint="the checkpoint does not match its config.json (layers, tied embeddings?)",
                )
            if info.shape != shape:
                raise SourceError(
                    f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(shape)}",
                    hint="the checkpoint does not match its config.json",
                )
            if info.dtype not in SOURCE_DTYPES:
                raise SourceError(
                    f"tensor {name!r} has dtype {info.dtype}; only F16, BF16 and F32 sources are read",
                    hint="start from the unquantized checkpoint",
                )
        unused = model.spec.unused
        for name in self.tensors:
            if name not in known and not _BENIGN.fullmatch(name) and not (unused and unused(model, name)):
                raise SourceError(
                    f"unexpected tensor {name!r} in the checkpoint (not a weight of "
                    f"{model.architecture} with this config)",
                    hint="check num_hidden_layers / tie_word_embeddings in config.json",
                )

    # -- reading ------------------------------------------------------------------------------
    def view(self, name: str) -> np.ndarray:
        """The tensor as a zero-copy, read-only numpy view of the source file's page cache.

        Only this tensor's bytes are mapped, and the mapping goes away with the last reference to
        the view, so peak memory stays bounded by the largest tensor. Readers slice and cast from
        it straight into their output buffers: no intermediate copy of the whole tensor. Pickled
        sources are loaded (``read``) instead.
        """
        info = self.tensors[name]
        if self.pickled or info.offset is None:
            return from_torch(self.read(name))
        count = math.prod(info.shape)
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        length = info.offset - start + count * DTYPE_BYTES[info.dtype]
        if self._leases is not None and self._leases.broken(info.file):
            raise SourceError(f"source file {info.file} is being truncated or rewritten by another process "
                              "during the build", hint="rerun the build once the checkpoint is complete")
        with open(self.directory / info.file, "rb") as f:
            self._check_unchanged(info.file, os.fstat(f.fileno()), start + length)
            mm = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, offset=start)
        a = np.frombuffer(mm, dtype=np_dtype(info.dtype), count=count, offset=info.offset - start)
        return a.reshape(info.shape)

    def _check_unchanged(self, fname: str, st: os.stat_result, need: int) -> None:
        """Touching a mapped page past the end of a truncated file is SIGBUS, which Python cannot
        catch (the process dies with exit 135 and no message). So every tensor's file is checked
        just before its bytes are mapped: same inode, not shorter than when it was indexed and
        long enough for the tensor. A truncation while one tensor is being copied is not caught
        by this (reading through pread instead would be, at 2-3x the read cost: see
        docs/architecture.md §6)."""
        size, ino = self.stamps.get(fname, (st.st_size, st.st_ino))
        if st.st_ino != ino:
            raise SourceError(f"source file {fname} was replaced during the build",
                              hint="rerun the build once the checkpoint is complete")
        if st.st_size < size or st.st_size < need:
            raise SourceError(f"source file {fname} shrank from {size} to {st.st_size} bytes during the build",
                              hint="rerun the build once the checkpoint is complete")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold read leases on the weight files while the build maps them, so another process
        truncating one is a SourceError in ``view`` instead of SIGBUS (compiler/lease.py)."""
        with read_leases([self.directory / f for f in self.files if f != "config.json"]) as self._leases:
            try:
                yield
            finally:
                self._leases = None

    def dense(self, name: str) -> np.ndarray:
        """``view``: a checkpoint's tensors are dense as stored (QuantizedSource dequantizes)."""
        return self.view(name)

    def read(self, name: str):
        """The whole tensor as a torch tensor (a copy; the file mapping is closed again)."""
        import torch
        from safetensors import safe_open

        info = self.tensors[name]
        path = self.directory / info.file
        if self.pickled:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return state[name].clone()
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    def holds_quantized(self, name: str, scheme: str) -> bool:
        """Whether ``quantized`` has this tensor already quantized (never, for a checkpoint)."""
        return False

    def quantized(self, name: str, scheme: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """Quantized values, scales and error stats held by the source (see holds_quantized)."""
        raise KeyError(name)

    def confirm(self) -> None:
        """Block until every byte read so far is known good; the compiler calls it before it
        commits anything derived from them. A checkpoint has nothing to check its bytes against;
        a build input (reshard) is hashed against its manifest while it is being used."""

    # -- identity -----------------------------------------------------------------------------
    def start_hashing(self) -> None:
        """Hash the source files in a background thread while the build runs."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardc-srchash")
        for name in self.files:
            self._hashes[name] = pool.submit(cached_sha256, self.directory / name)
        pool.shutdown(wait=False)

    def identity(self) -> SourceRecord:
        """uri, revision, and size + sha256 of every file read (config.json included)."""
        if not self._hashes:
            self.start_hashing()
        files = []
        for name in sorted(self._hashes):
            size, digest = self._hashes[name].result()
            files.append(FileEntry(name, size, digest))
        return SourceRecord(self.uri, self.revision, files)

    def fingerprint(self) -> list[list]:
        """Cheap identity for resume records (name, size, mtime, ctime, inode): a file replaced or
        rewritten between a killed build and its rerun changes ctime even when its size and mtime
        are put back, so no shard of the old bytes is kept. The manifest gets real hashes."""
        out = []
        for name in self.files:
            st = os.stat(self.directory / name)
            out.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        return out


def cache_dir() -> Path:
    """$SHARDC_CACHE_DIR, else $XDG_CACHE_HOME/shardc, else ~/.cache/shardc."""
    if env := os.environ.get("SHARDC_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardc"


_cache_lock = threading.Lock()


def cached_sha256(path: Path) -> tuple[int, str]:
    """(size, sha256) of a source file, remembered across builds by path, size, mtime, ctime and
    inode: building several plans from one checkpoint hashes its 140 GB once, not once per plan.
    ctime cannot be set back by a user (writing or touching a file moves it), so a file rewritten
    with its old size and mtime restored is hashed again."""
    path = Path(path).resolve()
    st = os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    db = cache_dir() / "source-sha256.json"
    with _cache_lock:
        try:
            entries = json.loads(db.read_text())
        except (OSError, json.JSONDecodeError):
            entries = {}
    hit = entries.get(str(path))
    if hit and hit.get("stamp") == stamp:
        return st.st_size, hit["sha256"]
    digest = sha256_file(path)
    with _cache_lock:
        try:
            entries = json.loads(db.read_text())
        except (OSError, json.JSONDecodeError):
            entries = {}
        entries[str(path)] = {"stamp": stamp, "sha256": digest}
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(db, json.dumps(entries, sort_keys=True).encode())
        except OSError:
            pass  # a read-only home only costs speed
    return st.st_size, digest


_hub_lock = threading.Lock()


def _resolve_hf(uri: str) -> tuple[Path, str]:
    m = _HF_RE.match(uri)
    if not m:
        raise SourceError(f"malformed hub source {uri!r}", hint="use hf://org/repo or hf://org/repo@revision")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SourceError("hf:// sources need huggingface_hub", hint="pip install 'shardc[hub]'") from None
    with _hub_lock:
        try:
            path = snapshot_download(
                m.group("repo"),
                revision=m.group("rev"),
                allow_patterns=["*.safetensors", "*.json", "tokenizer*"],
            )
        except Exception as exc:  # the hub raises many types; all mean "cannot fetch"
            from huggingface_hub.utils import LocalEntryNotFoundError

            if isinstance(exc, LocalEntryNotFoundError):  # offline, and no snapshot cached here
                raise SourceError(f"cannot fetch {uri}: the hub is not reachable from here and no "
                                  "snapshot of it is in the local Hugging Face cache",
                                  hint="download it where the hub is reachable (hf download REPO "
                                       "--local-dir DIR) and build from that directory (`source`)") from None
            detail = " ".join(str(exc).split())  # the hub's messages span lines; ours is one
            raise SourceError(f"cannot fetch {uri}: {detail[:300]}",
                              hint="check the repo id, revision and HF_TOKEN") from None
    return Path(path), Path(path).name  # snapshot dirs are named by commit hash


def open_source(uri: str, *, allow_pickle: bool = False) -> CheckpointSource:
    """Resolve a source URI and index its tensors (headers only; no tensor data is read). Errors
    are keyed ``model.source``, the plan's field, wherever the URI came from: a caller that
    overrode it (``Plan.with_source``) names its own flag."""
    revision = None
    if uri.startswith("hf://"):
        directory, revision = _resolve_hf(uri)
    elif "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise SourceError(
            f"unsupported source scheme {scheme!r} in {uri!r}",
            key="model.source",
            hint="use a local directory, file://DIR or hf://org/repo[@rev]",
        )
    else:
        directory = Path(uri.removeprefix("file://"))
    if not directory.is_dir():
        hint = ("run scripts/setup_demo.py for the demo model" if ".cache/demo" in str(directory)
                else "give a checkpoint directory that exists")
        raise SourceError(f"source directory {directory} does not exist", key="model.source", hint=hint)
    config = read_config(directory / "config.json", SourceError)

    files = _weight_files(directory)
    pickled = False
    if not files:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        if not bins:
            raise SourceError(f"no *.safetensors files in {directory}", key="model.source")
        if uri.startswith("hf://"):  # README: from the hub, only safetensors are ever read
            raise SourceError(f"{uri} holds only pickled .bin weights; shardc reads only safetensors "
                              "from the hub, even with `allow_pickle`", key="model.source",
                              hint="use a revision with safetensors weights, or download the repo and "
                                   "give its directory with `allow_pickle`")
        if not allow_pickle:
            raise SourceError(
                f"{directory} holds only pickled .bin weights, which can run code when loaded",
                hint="convert to safetensors, or use `allow_pickle` to load them with weights_only=True",
            )
        files, pickled = bins, True
    stamps = {}
    for fname in files:  # a FIFO or device named *.safetensors would block or never end
        try:
            st = os.stat(directory / fname)
        except OSError as exc:
            raise SourceError(f"cannot read source file {directory / fname}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"source file {directory / fname} is not a regular file", key="model.source")
        stamps[fname] = (st.st_size, st.st_ino)
    tensors = _index_pickles(directory, files) if pickled else _index_safetensors(directory, files)
    side = ["config.json", *([LEGACY_QUANT] if (directory / LEGACY_QUANT).exists() else [])]  # hashed too
    return CheckpointSource(uri, directory, revision, config, tensors, [*side, *files], pickled,
                            stamps=stamps)


def _weight_files(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = read_regular_file(index, limit=CONFIG_LIMIT, what="safetensors index", error=SourceError)
        try:
            weight_map = json.loads(data)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise SourceError(f"{index} is not a valid safetensors index",
                              hint="it needs a weight_map object from tensor names to file names")
        names = sorted({safe_name(f, "weight file name") for f in weight_map.values()})
        for n in names:
            if not (directory / n).is_file():
                raise SourceError(f"{index.name} names {n}, which is missing", hint="download all shards")
        return names
    return sorted(p.name for p in directory.glob("*.safetensors"))


def _index_safetensors(directory: Path, files: list[str]) -> dict[str, TensorInfo]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, TensorInfo] = {}
    for fname in files:
        try:
            with safe_open(directory / fname, framework="numpy") as f:
                offsets = data_offsets(directory / fname)
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    sl = f.get_slice(name)
                    if name in out:
                        raise SourceError(f"tensor {name!r} appears in {out[name].file} and {fname}")
                    out[name] = TensorInfo(fname, sl.get_dtype(), tuple(sl.get_shape()), offsets[name])
        except SafetensorError as exc:
            raise SourceError(f"{fname} is not a readable safetensors file: {exc}") from None
    return out


def data_offsets(path: Path) -> dict[str, int]:
    """Absolute byte offset of every tensor's data in a safetensors file, from its header.

    safetensors validates the file (``safe_open`` above) but does not expose offsets."""
    header, _, start = read_header(path)
    return {k: start + v["data_offsets"][0] for k, v in header.items()}


def _index_pickles(directory: Path, files: list[str]) -> dict[str, TensorInfo]:
    import torch

    out: dict[str, TensorInfo] = {}
    for fname in files:
        state = torch.load(directory / fname, map_location="cpu", weights_only=True, mmap=True)
        for name, t in state.items():
            out[name] = TensorInfo(fname, from_torch_name(str(t.dtype)) or str(t.dtype), tuple(t.shape))
    return out
