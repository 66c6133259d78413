"""The Checkpoint Loader's local read (docs/architecture.md §1.3): ``load_shard``, one rank's shard,
checked, as tensors on a device; ``load_for_verify``, the same read for ``verify --device``.

What was checked is what is returned: the shard is opened once, and its size (fstat), its header
check and the read that hashes it all go through that one descriptor into memory of the loader's
own (never a mapping, never a second open by name). A file replaced (``os.replace``), truncated or
rewritten after the read changes nothing returned; one rewritten in place while it is read either
changes bytes not yet read, which are then hashed (a digest mismatch), or bytes already read, which
are not what is returned; one that shrinks or grows while read is a mismatch of its own. The reads
(positioned, ``O_DIRECT``, each piece hashed right after its read) are loader/sources.py's; what is
done with the chunks, loader/sinks.py's; a shard without chunk digests is upgraded on read first
(loader/upgrade.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..digests import DEFAULT_CHUNK_DIGEST
from ..errors import LayoutError, ManifestError, VerifyMismatch
from ..formats.chunk_digests import CHUNK_SIZE
from ..formats.manifest import Manifest, ShardEntry
from ..layout.ranks import Layout, RankLayout
from .early_start import EarlyRead
from .rank_checks import FULL, check_arguments, header_check, rank_of
from .sinks import into_host, load_chunks
from .sources import FileChunkReads, HostReads
from .tensors import HeaderCheck, RawShard, nonfinite, tensors_of
from .upgrade import digest_pass


def load_shard(manifest: Manifest | dict[str, Any] | str | Path, tp_rank: int, pp_stage: int, *,
               device: str = "cuda", directory: str | Path | None = None, dp_rank: int = 0,
               early: EarlyRead | None = None, into: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One rank's tensors on ``device``, checked before any is returned.

    ``dp_rank``: the attention data-parallel group, for plans with dp_degree > 1 (each group's
    ranks hold their own routed experts).
    ``manifest``: a manifest dict, a manifest.json path or a build directory (the shards default to
    the manifest's directory; a dict needs ``directory``). ``device``: "cuda" is this process's GPU
    (cuda:LOCAL_RANK), "cuda:N" GPU N, or "cpu". Raises VerifyMismatch when the bytes, the header
    or the manifest disagree with the plan's Layout, ManifestError / LayoutError / DeviceError for
    bad input (arguments of the wrong type included: this is a library call, so they get the CLI's
    one-line errors rather than a TypeError from deep inside). ``early``: the facade's early start
    of this very read (loader/early_start.py), used only when it matches the validated entry; the
    caller closes it. ``into``: where some tensors are to land, name -> a contiguous CPU tensor of
    the shard's dtype and shape (an engine's parameters; device="cpu"): the bytes are read straight
    into it (loader/sinks.py ``into_host``) and the returned dict holds that very tensor. Its
    contents are unspecified when this raises.
    """
    check_arguments(tp_rank, pp_stage, device, directory, dp_rank)
    if into is not None and (not isinstance(into, Mapping) or device != "cpu"):
        raise LayoutError("takes a mapping of tensor names to CPU tensors, with device=\"cpu\"", key="into",
                          hint="load_shard(..., device=\"cpu\", into={name: tensor}), or load and copy on a GPU")
    manifest, directory = _manifest_and_directory(manifest, directory)
    manifest, layout, rank_layout, dev = rank_of(manifest, tp_rank, pp_stage, device, dp_rank)
    if into is not None:
        return _read_into(manifest, Path(directory), rank_layout, layout, into)
    return tensors_of(_read_checked(manifest, Path(directory), rank_layout, layout, dev, early))


def _manifest_and_directory(manifest: Any, directory: str | Path | None) -> tuple[Manifest, Any]:
    """The manifest (as given, validated when it is JSON data, or read from its path) and the
    directory its shards are in."""
    from ..formats.manifest import load

    if isinstance(manifest, (dict, Manifest)):
        if directory is None:
            raise ManifestError("load_shard of a manifest dict needs directory=", key="directory",
                                hint="pass the directory holding the shard files")
        return Manifest.from_dict(manifest) if isinstance(manifest, dict) else manifest, directory
    if not isinstance(manifest, (str, os.PathLike)):
        raise ManifestError(f"is {type(manifest).__name__}, expected a Manifest, a manifest dict or a path",
                            key="manifest", hint="pass the manifest.json that shardc build wrote, or its directory")
    text = os.fspath(manifest)
    if not isinstance(text, str) or "\0" in text or "\n" in text or text.lstrip().startswith("{"):
        raise ManifestError(f"is {str(text)[:40]!r}..., not a path", key="manifest",
                            hint="pass the path of manifest.json, or the parsed dict (json.loads) with directory=")
    path = Path(text.removeprefix("file://"))
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long for the file system: read() says it cannot be read
        is_dir = False
    path = path / "manifest.json" if is_dir else path
    return load(path), path.parent if directory is None else directory


def _read_checked(manifest: Manifest, directory: Path, rank_layout: RankLayout, layout: Layout, dev: str,
                  early: EarlyRead | None = None) -> RawShard:
    """Open the shard once; size, header and sha256 are checked on that descriptor's bytes, the
    header before the data is read (a wrong file fails before gigabytes are read). With ``early``
    reads that match the validated entry, the descriptor is theirs (opened the same way) and the
    reads already under way are the ones checked."""
    entry = manifest.shard(rank_layout.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = directory / rank_layout.file
    check_header = header_check(rank_layout, layout)
    started = None
    if early is not None and early.matches(file, entry.size, entry.chunk_size, entry.chunks, entry.chunk_digest):
        f, started = os.fdopen(early.take(), "rb", buffering=0), early.reads
    else:
        if early is not None:
            early.close()  # not what the checked manifest asks for: read as usual
        f = _open(file, rank_layout.file)
    with f:
        try:
            return _read_open(f, file, entry, rank_layout, check_header, dev, started)
        finally:
            if started is not None:
                started.close()  # before the descriptor closes: no read outlives it


def _read_into(manifest: Manifest, directory: Path, rank_layout: RankLayout, layout: Layout,
               into: Mapping[str, Any]) -> dict[str, Any]:
    """``load_shard(into=...)``: the shard opened once and checked as ``_read_open`` checks it, its
    chunks read into ``into``'s tensors (loader/sinks.py ``into_host``); a shard without chunk
    digests (a format_version 2 manifest) is upgraded first (loader/upgrade.py)."""
    entry = manifest.shard(rank_layout.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = directory / rank_layout.file
    check_header = header_check(rank_layout, layout)
    with _open(file, rank_layout.file) as f:
        _stat_checks(f, file, entry, rank_layout)
        chunk_size, chunks, digest = _chunks_of(f.fileno(), file, entry, rank_layout)
        source = FileChunkReads(f.fileno(), rank_layout.file, entry.size, chunk_size, chunks, digest, direct=False)
        source.where, source.derived = str(file), entry.chunk_size is None
        return into_host(source, check_header, into)


def _open(file: Path, name: str) -> Any:
    try:
        # O_NONBLOCK: a FIFO at the shard's name is refused below instead of blocking the open
        return open(file, "rb", buffering=0, opener=lambda p, fl: os.open(p, fl | os.O_NONBLOCK))  # noqa: SIM115
    except FileNotFoundError:
        raise VerifyMismatch(f"{name}: missing (expected at {file})", hint="shardc pull it, or pass directory=") from None
    except OSError as exc:
        raise VerifyMismatch(f"{name}: cannot be read ({exc.strerror})", hint="re-pull the shard") from None


def _stat_checks(f: Any, file: Path, entry: ShardEntry, rank_layout: RankLayout) -> None:
    """The open shard is a regular file of the manifest's size."""
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise VerifyMismatch(f"{rank_layout.file}: not a regular file (at {file})", hint="re-pull the shard")
    if st.st_size != entry.size:
        raise VerifyMismatch(f"{rank_layout.file}: size {st.st_size} bytes, expected {entry.size} (truncated or replaced?)",
                             hint="re-pull the shard")


def _read_open(f: Any, file: Path, entry: ShardEntry, rank_layout: RankLayout, check_header: HeaderCheck, dev: str,
               started: HostReads | None) -> RawShard:
    """The checks and the read on the open shard ``f``. ``started``: its chunk reads already under
    way, begun after the same two checks at the open (loader/early_start.py, against the size that
    ``matches`` compared): a size that changed since is a change while it was read. Every chunk is
    checked on every core; a bad one raises."""
    if started is None:
        _stat_checks(f, file, entry, rank_layout)
    chunk_size, chunks, digest = _chunks_of(f.fileno(), file, entry, rank_layout)
    return read_chunked(f.fileno(), rank_layout.file, entry.size, chunk_size, chunks, dev, on_header=check_header,
                        where=str(file), digest=digest, started=started, derived=entry.chunk_size is None)


def _chunks_of(fd: int, file: Path, entry: ShardEntry, rank_layout: RankLayout) -> tuple[int, Sequence[str], str]:
    """(chunk size, chunk digests, digest kind) the shard is read against: the manifest's, or for
    a shard without them (format_version 2) those of the upgrade's pass, whose whole-file sha256
    matched the manifest's (loader/upgrade.py)."""
    if entry.chunk_size is not None:
        return entry.chunk_size, entry.chunks, entry.chunk_digest
    sha256, chunks = digest_pass(fd, entry.size, str(file))
    if sha256 != entry.sha256:
        raise VerifyMismatch(f"{rank_layout.file}: sha256 {sha256[:16]}..., expected {entry.sha256[:16]}... "
                             "(corrupted bytes)", hint=FULL)
    return CHUNK_SIZE, chunks, DEFAULT_CHUNK_DIGEST


def read_chunked(fd: int, name: str, size: int, chunk_size: int, digests: Sequence[str], device: str,
                 on_header: HeaderCheck | None = None, *, where: str | None = None,
                 digest: str = DEFAULT_CHUNK_DIGEST, started: HostReads | None = None,
                 derived: bool = False) -> RawShard:
    """Read a shard of ``size`` bytes from ``fd`` (the caller's one descriptor, size already
    checked against the manifest) onto ``device`` ("cpu" or a resolved "cuda:N"), checking every
    chunk against ``digests``. Raises VerifyMismatch for a damaged chunk (naming the file as
    ``name``) or a file that changed size while it was read (naming it as ``where``, its path);
    ``on_header`` may raise to stop before the data is read. ``digest``: what ``digests`` are
    (the manifest entry's ``chunk_digest``). ``started``: these very reads, already under way on
    ``fd`` (the loader's early start, loader/early_start.py; its source is reused). ``derived``:
    ``digests`` are the upgrade's (loader/upgrade.py), not the manifest's."""
    source = started.source if started is not None else FileChunkReads(fd, name, size, chunk_size, digests, digest)
    source.where, source.derived = where or name, derived
    return load_chunks(source, device, on_header, started)


def load_for_verify(path: Path, entry: ShardEntry, device: str) -> RawShard | tuple[int, ...]:
    """``verify --device``'s one read of a shard: this loader's parallel read, then the non-finite
    tensors found (``RawShard.nonfinite``); damaged chunks are returned as their indices (verify
    reports them its own way, with the rest of its report). A shard without chunk digests
    (format_version 2) is upgraded first (loader/upgrade.py): ``RawShard.sha256`` is then its
    whole-file sha256, for verify to compare, and a shard whose sha256 differs is not loaded
    (``header`` None)."""
    with open(path, "rb", buffering=0) as f:
        if entry.chunk_size is None:
            sha256, chunks = digest_pass(f.fileno(), entry.size, str(path))
            if sha256 != entry.sha256:
                return RawShard(sha256, None, None)
            source = FileChunkReads(f.fileno(), path.name, entry.size, CHUNK_SIZE, chunks)
            source.where, source.derived = str(path), True
        else:
            sha256 = ""
            source = FileChunkReads(f.fileno(), path.name, entry.size, entry.chunk_size, entry.chunks,
                                    entry.chunk_digest)
            source.where, source.report_bad = str(path), True
        raw = load_chunks(source, device)
        raw.sha256 = sha256
    if source.bad:
        return source.bad
    if raw.header is not None:
        try:
            tensors = tensors_of(raw)
        except VerifyMismatch:  # the caller's own tensors_of reports it
            return raw
        dtypes = {k: v.get("dtype") for k, v in raw.header.items() if isinstance(v, dict)}
        raw.nonfinite = nonfinite(tensors, dtypes)
    return raw
