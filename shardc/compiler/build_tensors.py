"""An existing build read as a ``Source`` (compiler/source.py) of an ordinary build: reshard,
export and ``verify --deep``'s reference.

``BuildSource`` answers the questions the compiler asks a checkpoint (``view``: the whole tensor;
``quantized``: values + scales already quantized) by reassembling tensors from the input ranks.
Where each rank tensor's bytes came from is read from the input's Layout (recomputed from its
plan and model config, like verify does), never re-derived here: a piece is one rank tensor with
its source tensor, role (weight or scale), sliced dim, start/stop and padding. So the compiler,
unchanged, cuts the output exactly as ``build`` cuts a checkpoint, and whenever the path is
lossless ``reshard(build(src, A), B)`` is byte-identical to ``build(src, B)`` by construction.

int8 is stored pack-quantized (``X.weight_packed``, four values per int32, row-parallel slices cut
in packed columns; ``X.weight_shape``, whose contents the Layout fixes; ``X.weight_scale``): the
packed pieces are put back together in packed columns and unpacked, so ``quantized`` hands the
compiler plain int8 values, which it packs again exactly as it packs a fresh quantization.

Checks on the way: every input file's sha256 before its first byte is used (BuildInput), every
input shard's header by verify's own checks (``inputs.shard_problems``: metadata, tensors, dtypes,
shapes, data layout) before it is mapped, replicas (KV heads at tp > kv_heads, replicated norms, a
tied lm_head copy) byte-identical, and the dtype rules (``check_dtypes``) up front.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from ..errors import ManifestError, PlanError, VerifyMismatch
from ..formats.manifest import Manifest, ReshardRecord, SourceRecord
from ..formats.safetensors import read_header
from ..layout.dtypes import DTYPE_BYTES
from ..layout.model import ModelSpec
from ..layout.quant_formats import SourceQuantization
from ..layout.ranks import Layout, TensorSpec
from ..layout.tensors import source_tensors
from .arrays import as_bytes, np_dtype
from .build_files import BuildInput, shard_problems
from .quantize import unpack_int8
from .quantized import QuantizedSource, quantization_of
from .source import Source, TensorInfo
from .stages import stage_order
from .tiles import Tiles


@dataclass(frozen=True)
class Piece:
    """One rank tensor of the input build (or one piece of a fused one, ``row0`` rows into the
    stored tensor): which file, and which part of which tensor it holds."""

    file: str
    spec: TensorSpec
    row0: int = 0

    @property
    def region(self) -> tuple:
        return (self.spec.dim, self.spec.start, self.spec.stop)


def _role(spec: TensorSpec) -> str:
    """Which full tensor a rank tensor is part of: the weight (16-bit, fp8 or int8's
    X.weight_packed), its scales (X.weight_scale), or int8's X.weight_shape (contents fixed by the
    Layout: checked against it, never needed to rebuild a tensor)."""
    if spec.scale_of:
        return "scale"
    return "shape" if spec.value is not None else "weight"


class BuildSource:
    """A build read as a checkpoint: full tensors reassembled from its ranks (see module doc).
    A ``Source``; a ``dtype: source`` input's quantized weights are read through ``as_source``."""

    # its stored quantization, if any, is QuantizedSource's to interpret (``as_source``)
    source_format: ClassVar[None] = None
    quantized_shapes: ClassVar[Mapping[str, tuple[int, ...]]] = MappingProxyType({})

    def __init__(self, inp: BuildInput, out_layout: Layout, *, dequantize: bool = False,
                 speculative: bool = False) -> None:
        self.input = inp
        # speculative (reshard): read a file while its hash is checked, confirm before commit;
        # otherwise (verify --deep's reference) every file is checked before it is read
        self._ready = inp.ready if speculative else inp.prepare
        self._speculative = speculative  # and hand 16-bit tensors to the writers as Tiles
        self.in_layout = inp.manifest.to_layout()
        _check_records(inp.manifest, self.in_layout)
        self.dequantize = dequantize
        model = self.in_layout.model
        self.uri, self.directory, self.config = inp.uri, inp.directory, model.config
        self.tensors: dict[str, TensorInfo] = {}
        self.pieces: dict[tuple[str, str], list[Piece]] = {}
        for rank_layout in self.in_layout.ranks:
            for t in rank_layout.tensors:
                row0 = 0
                for sub in t.split_pieces():  # a fused tensor: each source-row range on its own
                    self.pieces.setdefault((t.source, _role(t)), []).append(Piece(rank_layout.file, sub, row0))
                    row0 += sub.shape[0] if sub.shape else 1  # a scalar: one element
        self.in_quant = {src: p[0].spec.quant for (src, role), p in self.pieces.items()
                         if role == "weight" and p[0].spec.quant}
        self.kept_quantization = _kept_source_quantization(self, model, out_layout)
        kept = frozenset(self.kept_quantization[1]) if self.kept_quantization else frozenset()
        self.dequantized = check_dtypes(self.in_quant | dict.fromkeys(kept, "source"), out_layout, dequantize)
        # the quantization error stats the input recorded: a re-slice keeps them as they are
        self.stats = {rec["source"]: rec["stats"] for s in inp.manifest.shards
                      for rec in s.tensors.values() if "stats" in rec}
        for name, shape in ((t.name, t.shape) for t in source_tensors(model)):
            if (name, "weight") not in self.pieces and name in kept:
                continue  # stored only as its packed form (the stored tensors are added below)
            dtype = self.pieces[(name, "weight")][0].spec.dtype
            self.tensors[name] = TensorInfo("", "F32" if name in self.in_quant else dtype, shape)
        if self.kept_quantization is not None:  # a dtype: source input: its stored tensors are tensors too
            source_format, shapes = self.kept_quantization
            for name in kept:
                for st in source_format.stored(name):
                    if not st.value:  # the values too: packed ones are not the weight's shape
                        self.tensors[st.tensor(name)] = TensorInfo("", st.dtypes[0], st.shape(shapes[name]))
        self._offsets: dict[str, dict[str, tuple[int, str, list[int], int]]] = {}
        self._rank_of = {rank_layout.file: rank_layout for rank_layout in self.in_layout.ranks}
        self._lock = threading.Lock()

    def as_source(self) -> Source:
        """What the compiler reads: this build, or, for a ``dtype: source`` input, this build as a
        QuantizedSource (its stored weights dequantized by their format where a plan needs them dense)."""
        return self if self.kept_quantization is None else QuantizedSource(self, *self.kept_quantization)

    def schedule(self, out_layout: Layout) -> None:
        """Start checking the input files in the order the output build will need them."""
        self.input.schedule(_need_order(self, out_layout))

    # -- what the compiler asks ---------------------------------------------------------------
    def check(self, model: ModelSpec, quantized: Source | None = None) -> None:
        """The model is the input build's own (reshard checked the plan against it)."""

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Nothing to hold: the input's files are opened ``O_NOFOLLOW`` and hashed (``confirm``)."""
        yield

    def view(self, name: str) -> np.ndarray | Tiles:
        """The whole 16-bit tensor (or, with `dequantize`, q * scale in fp32); speculative, the input
        ranks' pieces side by side where they are mapped (Tiles), put together only where cut."""
        if name in self.in_quant:
            if not self.dequantize:  # check_dtypes refused such plans; a bug if we get here
                raise AssertionError(f"{name} is quantized in the input build")
            q, scale = self._assemble(name, "weight"), self._assemble(name, "scale")
            return np.multiply(q, scale, dtype=np.float32)  # as the runtime dequantizes: fp32 q * s
        return self._assemble_stored(name, "weight", tiles=self._speculative)

    def dense(self, name: str) -> np.ndarray | Tiles:
        """``view`` (a stored quantization is QuantizedSource's to dequantize: ``as_source``)."""
        return self.view(name)

    def holds_quantized(self, name: str, scheme: str) -> bool:
        return self.in_quant.get(name) == scheme

    def quantized(self, name: str, scheme: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """The input's quantized values (int8 unpacked) and scales, whole again: re-sliced, never
        requantized."""
        return self._assemble(name, "weight"), self._assemble(name, "scale"), dict(self.stats[name])

    def confirm(self) -> None:
        self.input.confirm()

    # -- identity -----------------------------------------------------------------------------
    def start_hashing(self) -> None:
        """Input files are checked by the BuildInput (see ``confirm``)."""

    def identity(self) -> SourceRecord:
        """Provenance, where a build records its Hugging Face source: the input manifest."""
        m = self.input.manifest
        return SourceRecord(self.input.uri, None, [], ReshardRecord(
            self.input.manifest_sha256, m.name, m.plan_sha256, m.layout.dtype, sorted(self.dequantized)))

    def fingerprint(self) -> list[list]:
        return [["manifest", self.input.manifest_sha256], ["dequantize", self.dequantize]]

    # -- reassembly ---------------------------------------------------------------------------
    def _check_values(self, name: str) -> None:
        """int8's X.weight_shape holds what the input's Layout says (the unpacked [out, in] of
        each rank's slice): a file whose packed values would be read at another width is refused."""
        for p in self.pieces.get((name, "shape"), []):
            assert p.spec.value is not None  # X.weight_shape's contents are in the Layout
            got = self._read(p).tolist()
            if got != list(p.spec.value):
                raise VerifyMismatch(f"tensor {p.spec.name} of {p.file} is {got}, the input layout says "
                                     f"{list(p.spec.value)}", hint="the input build was not written by shardc build")

    def _assemble(self, name: str, role: str) -> np.ndarray:
        """The full tensor from its pieces, int8 unpacked. One distinct piece without padding is
        returned as a mapped view (no copy); replicas of a piece must be byte-identical."""
        a = self._assemble_stored(name, role)
        assert isinstance(a, np.ndarray)  # no tiles asked for
        if not self.pieces[(name, role)][0].spec.pack:
            return a
        self._check_values(name)  # same files as the packed pieces: checked by _assemble_stored
        return unpack_int8(a)

    def _assemble_stored(self, name: str, role: str, tiles: bool = False) -> np.ndarray | Tiles:
        """The full tensor as the files store it (int8 still packed: slices of packed columns);
        with ``tiles``, pieces side by side are left where they are mapped (compiler/tiles.py)."""
        pieces = self.pieces[(name, role)]
        self._ready(sorted({p.file for p in pieces}))
        distinct: dict[tuple, tuple[Piece, np.ndarray]] = {}
        for p in pieces:
            a = self._read(p)
            first = distinct.get(p.region)
            if first is None:
                distinct[p.region] = (p, a)
            elif not np.array_equal(as_bytes(a), as_bytes(first[1])):
                raise VerifyMismatch(
                    f"tensor {p.spec.name} of {p.file} differs from its replica in {first[0].file} "
                    f"({name}{' scales' if role == 'scale' else ''})",
                    hint="the input build's replicas must be identical; it was not written by shardc build",
                )
        pack = pieces[0].spec.pack or 1
        shape = self._full_shape(name, role, pack)
        if len(distinct) == 1:
            (p, a), = distinct.values()
            if p.spec.dim is None or a.shape == shape:
                return a
        if tiles and pack == 1:
            # split pieces (dim set below) carry their bounds
            parts = sorted((p.spec.start or 0, p.spec.stop or 0, a) for p, a in distinct.values())
            dim = next(iter(distinct.values()))[0].spec.dim
            if dim is not None and _covers(parts, shape[dim]):
                return Tiles(shape, parts[0][2].dtype, dim, tuple(parts))
        out = np.empty(shape, next(iter(distinct.values()))[1].dtype)
        covered = 0
        for p, a in distinct.values():
            if p.spec.dim is None:
                raise ManifestError(f"tensor {name} is both whole and split in the input build")
            assert p.spec.start is not None and p.spec.stop is not None  # a split piece has its bounds
            per = pack if p.spec.dim == 1 else 1  # packed: start/stop count source columns
            out[(slice(None),) * p.spec.dim + (slice(p.spec.start // per, p.spec.stop // per),)] = a
            covered += p.spec.stop - p.spec.start
        dim = next(iter(distinct.values()))[0].spec.dim
        assert dim is not None  # the loop above refused whole pieces
        if covered != self.tensors[name].shape[dim]:
            raise ManifestError(f"the input ranks do not cover tensor {name} exactly")
        return out

    def _full_shape(self, name: str, role: str, pack: int = 1) -> tuple[int, ...]:
        shape = self.tensors[name].shape
        if role == "scale":
            return (shape[0], 1)
        return (shape[0], shape[1] // pack) if pack > 1 else shape

    def _read(self, p: Piece) -> np.ndarray:
        """A rank tensor as a read-only view of its mapped bytes, vocabulary padding stripped."""
        spec = p.spec
        # _header refused a file whose tensors, dtypes, shapes or byte spans are not the Layout's
        offset, dtype, _, _ = self._header(p.file)[spec.name]
        rows = spec.shape[0] - spec.pad_rows if spec.shape else 1
        count = math.prod(spec.shape[1:]) * rows if spec.shape else 1
        offset += p.row0 * math.prod(spec.shape[1:]) * DTYPE_BYTES[dtype]  # a fused tensor's piece
        if count == 0:
            return np.empty((0, *spec.shape[1:]), np_dtype(dtype))
        # A mapping of just this tensor, gone with the last array that views it: mapped pages
        # count in the RSS, so a mapping of the whole file would hold every page read so far.
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset - start + count * DTYPE_BYTES[dtype]
        fd = os.open(self.input.directory / p.file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        a = np.frombuffer(mm, dtype=np_dtype(dtype), count=count, offset=offset - start)
        return a.reshape((rows, *spec.shape[1:]) if spec.shape else ())

    def _header(self, file: str) -> dict[str, tuple[int, str, list[int], int]]:
        """name -> (absolute data offset, dtype, shape, byte length), from the one header parser,
        once the file passed verify's header checks (so no offset points outside its tensor)."""
        with self._lock:
            if file not in self._offsets:
                path = self.input.directory / file
                if problems := shard_problems(path, self.in_layout, self._rank_of[file]):
                    raise VerifyMismatch(f"input file {path}: {problems[0]}",
                                         hint="the input build is damaged; run shardc verify on it")
                tensors, _, start = read_header(path)
                self._offsets[file] = {k: (start + e["data_offsets"][0], e["dtype"], e["shape"],
                                           e["data_offsets"][1] - e["data_offsets"][0])
                                       for k, e in tensors.items()}
            return self._offsets[file]


def _covers(parts: list[tuple[int, int, np.ndarray]], n: int) -> bool:
    """Sorted (start, stop) ranges tile ``[0, n)`` exactly."""
    at = 0
    for start, stop, _ in parts:
        if start != at:
            return False
        at = stop
    return at == n


def _check_records(manifest: Manifest, layout: Layout) -> None:
    """The input manifest's tensor records must be what its own plan's Layout says (the pieces
    are read by the Layout; an edited manifest would point them at the wrong bytes)."""
    for rank_layout in layout.ranks:
        entry = manifest.shard(rank_layout.file)
        have = {n: {k: v for k, v in r.items() if k not in ("stats", "scale")}
                for n, r in (entry.tensors if entry else {}).items()}
        if (entry is None or have != {t.name: t.record() for t in rank_layout.tensors}
                or entry.experts != rank_layout.experts):
            raise ManifestError(f"the input manifest's record of {rank_layout.file} does not match its own plan",
                                hint="the manifest was edited or is damaged; run shardc verify on the input")
    if len(manifest.shards) != len(layout.ranks):
        raise ManifestError("the input manifest lists shards its plan does not have",
                            hint="the manifest was edited or is damaged; run shardc verify on the input")


def _need_order(src: BuildSource, out: Layout) -> list[str]:
    """Input files in the order the output build will first need them (stage by stage)."""
    order: dict[str, None] = {}
    for s in range(out.plan.pp):
        for t in stage_order(out.stage(s)):
            for role in ("weight", "scale"):
                for p in src.pieces.get((t.source, role), []):
                    order.setdefault(p.file)
    return list(order)


def _kept_source_quantization(src: BuildSource, model: ModelSpec,
                              out: Layout) -> tuple[SourceQuantization, dict[str, tuple[int, ...]]] | None:
    """A ``dtype: source`` input build holds its source's quantized weights as stored: the format
    (layout/quant_formats/) re-slices them for a ``dtype: source`` output, and dequantizes them as its
    reference does for any other (lossy: --dequantize, as for int8/fp8 inputs). Any other input
    no longer holds them, so a ``dtype: source`` output of it is refused."""
    held = src.in_layout.plan.dtype
    if held != "source":
        if out.plan.dtype == "source" and "quantization_config" in model.config:
            raise PlanError(f"needs the source's quantized tensors as stored, but the input build holds "
                            f"them as {held}", key="replica_group.dtype",
                            hint=f"reshard to dtype {held}, or build dtype: source from the source checkpoint")
        return None
    return quantization_of(src.config, model)


def check_dtypes(in_quant: dict[str, str], out: Layout, dequantize: bool) -> set[str]:
    """The dtype rules, for every output tensor: same 16-bit dtype, exact copy; 16-bit to another
    16-bit, build's cast; 16-bit to int8/fp8, quantized as build does (whole tensor); int8/fp8 to
    the same scheme, exact re-slice; int8/fp8 to anything else is refused (PlanError, exit 2)
    unless ``dequantize`` (q * scale in fp32, then cast or quantized: lossy). Returns the source
    tensors that get dequantized, which the manifest records."""
    lossy = set()
    for rank_layout in out.ranks:
        for t in rank_layout.tensors:
            held = in_quant.get(t.source)
            if held is None or t.scale_of or (t.quant == held) or (held == "source" == out.plan.dtype):
                continue
            if not dequantize:
                want = t.quant or t.dtype
                raise PlanError(
                    f"the input build holds {t.source} as {held}; a {out.plan.dtype} plan needs it as "
                    f"{want}, which means dequantizing (lossy)",
                    key="replica_group.dtype",
                    hint=f"reshard to dtype {held} (exact), or use `dequantize` to accept the loss",
                )
            lossy.add(t.source)
    return lossy
