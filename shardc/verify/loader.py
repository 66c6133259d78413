"""The Checkpoint Loader (docs/architecture.md §2): ``load_shard``, one rank's shard, checked, as
tensors on a device. The one-pass read (hash while reading, pinned copies on CUDA) is reader.py's.

What was checked is what is returned: the shard is opened once, and its size (fstat), its header
check and the read that hashes it all go through that one descriptor into memory of the loader's
own (never a mapping, never a second open by name). A file replaced (``os.replace``), truncated or
rewritten after the read changes nothing returned; one rewritten in place while it is read either
changes bytes not yet read, which are then hashed (a sha256 mismatch), or bytes already read, which
are not what is returned; one that shrinks or grows while read is a mismatch of its own.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import DeviceError, LayoutError, ManifestError, VerifyMismatch
from ..formats.chunk_reads import HostReads
from ..formats.manifest import Manifest, ShardEntry
from ..formats.prefetch import EarlyRead
from ..formats.safetensors import METADATA
from ..layout.ranks import Layout, RankLayout
from .reader import HeaderCheck, RawShard, read_shard, tensors_of

_FULL = "run shardc verify for the full report"


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
    of this very read (formats/prefetch.py), used only when it matches the validated entry; the
    caller closes it. ``into``: where some tensors are to land, name -> a contiguous CPU tensor of
    the shard's dtype and shape (an engine's parameters; device="cpu"): the bytes are read straight
    into it (verify/chunk_sinks.py ``into_host``) and the returned dict holds that very tensor. Its
    contents are unspecified when this raises.
    """
    _check_arguments(tp_rank, pp_stage, device, directory, dp_rank)
    if into is not None and (not isinstance(into, Mapping) or device != "cpu"):
        raise LayoutError("takes a mapping of tensor names to CPU tensors, with device=\"cpu\"", key="into",
                          hint="load_shard(..., device=\"cpu\", into={name: tensor}), or load and copy on a GPU")
    manifest, directory = _manifest_and_directory(manifest, directory)
    manifest, layout, rl, dev = rank_of(manifest, tp_rank, pp_stage, device, dp_rank)
    if into is not None:
        return _read_into(manifest, Path(directory), rl, layout, into)
    return tensors_of(_read_checked(manifest, Path(directory), rl, layout, dev, early))


def rank_of(manifest: Manifest, tp_rank: int, pp_stage: int, device: str,
            dp_rank: int = 0) -> tuple[Manifest, Layout, RankLayout, str]:
    """Everything checked before a shard's byte is read: the node's GPUs, the rank inside the
    plan, the manifest's records against the Layout recomputed from its plan, the shard's recorded
    size against the size the Layout gives it (a forged size is never read by). Returns the
    manifest, that Layout, the rank's part of it and the resolved device (store/stream.py's
    loader from object storage checks the same)."""
    from ..formats.manifest_checks import SIZE_HINT, size_problem
    from .checks import check_manifest_against_layout
    from .devices import check_gpus, resolve_device

    layout = manifest.to_layout()
    check_gpus(layout.plan.name, device, 1)
    dev = resolve_device(device)
    assert dev is not None
    rl = layout.rank(tp_rank, pp_stage, dp_rank)
    problems = check_manifest_against_layout(manifest, layout)
    if problems:
        raise VerifyMismatch(problems[0], hint=_FULL)
    entry = manifest.shard(rl.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    if (problem := size_problem(entry, layout, rl, manifest.shardc_version)) is not None:
        raise VerifyMismatch(problem, key=f"shards.{rl.file}.size", hint=SIZE_HINT)
    return manifest, layout, rl, dev


def header_check(rl: RankLayout, layout: Layout) -> HeaderCheck:
    """The check a shard's parsed header gets before its data is read: metadata, tensor set,
    dtypes and shapes against the Layout (the first problem raised as a VerifyMismatch)."""
    from .checks import RankResult, check_parsed_header

    def check(header: dict[str, Any] | None, error: str | None, data_length: int) -> None:
        res = RankResult(rl.file, rl.tp_rank, rl.pp_stage, rl.rank)
        if header is None:
            res.fail(f"safetensors header does not parse ({error})")
        else:
            tensors = {k: v for k, v in header.items() if k != METADATA}
            check_parsed_header(res, tensors, header[METADATA], data_length, rl, layout)
        if not res.ok:
            raise VerifyMismatch(res.problems[0], hint=_FULL)

    return check


def _check_arguments(tp_rank: Any, pp_stage: Any, device: Any, directory: Any, dp_rank: Any = 0) -> None:
    """Ranks are ints (not bools, floats or strings), ``device`` a string, ``directory`` a path."""
    for key, value in (("tp_rank", tp_rank), ("pp_stage", pp_stage), ("dp_rank", dp_rank)):
        if type(value) is not int:
            raise LayoutError(f"is {value!r} ({type(value).__name__}), expected an int", key=key,
                              hint="load_shard(manifest, tp_rank, pp_stage) takes the ranks as ints")
    if not isinstance(device, str):
        raise DeviceError(f"is {device!r} ({type(device).__name__}), expected a string", key="device",
                          hint='device="cuda", "cuda:N" or "cpu"')
    if directory is not None and (not isinstance(directory, (str, os.PathLike))
                                  or not isinstance(os.fspath(directory), str) or "\0" in os.fspath(directory)):
        raise ManifestError(f"is {directory!r} ({type(directory).__name__}), expected a path", key="directory",
                            hint="pass the directory holding the shard files")


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


def _read_checked(manifest: Manifest, directory: Path, rl: RankLayout, layout: Layout, dev: str,
                  early: EarlyRead | None = None) -> RawShard:
    """Open the shard once; size, header and sha256 are checked on that descriptor's bytes, the
    header before the data is read (a wrong file fails before gigabytes are read). With ``early``
    reads that match the validated entry, the descriptor is theirs (opened the same way) and the
    reads already under way are the ones checked."""
    entry = manifest.shard(rl.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = directory / rl.file
    check_header = header_check(rl, layout)
    started = None
    if early is not None and early.matches(file, entry.size, entry.chunk_size, entry.chunks, entry.chunk_digest):
        f, started = os.fdopen(early.take(), "rb", buffering=0), early.reads
    else:
        if early is not None:
            early.close()  # not what the checked manifest asks for: read as usual
        f = _open(file, rl.file)
    with f:
        try:
            return _read_open(f, file, entry, rl, check_header, dev, started)
        finally:
            if started is not None:
                started.close()  # before the descriptor closes: no read outlives it


def _read_into(manifest: Manifest, directory: Path, rl: RankLayout, layout: Layout,
               into: Mapping[str, Any]) -> dict[str, Any]:
    """``load_shard(into=...)``: the shard opened once and checked as ``_read_open`` checks it, its
    chunks read into ``into``'s tensors (verify/chunk_sinks.py ``into_host``); a shard without chunk
    digests (a format_version 2 manifest) is read whole and checked, then copied."""
    entry = manifest.shard(rl.file)
    assert entry is not None  # check_manifest_against_layout names a missing entry
    file = directory / rl.file
    check_header = header_check(rl, layout)
    with _open(file, rl.file) as f:
        if entry.chunk_size is None:
            tensors = tensors_of(_read_open(f, file, entry, rl, check_header, "cpu", None))
            from .chunk_sinks import check_into

            for name, t in into.items():
                if name not in tensors:
                    raise LayoutError(f"{name} is not a tensor of this shard", key="into",
                                      hint="into= names tensors of the rank's shard (shardc inspect lists them)")
                check_into(name, t, tensors[name].dtype, list(tensors[name].shape))
            for name, t in into.items():
                t.copy_(tensors[name])
            return {**tensors, **into}
        from ..formats.chunk_reads import FileChunkReads
        from .chunk_sinks import into_host

        _stat_checks(f, file, entry, rl)
        source = FileChunkReads(f.fileno(), rl.file, entry.size, entry.chunk_size, entry.chunks,
                                entry.chunk_digest, direct=False)
        source.where = str(file)
        return into_host(source, check_header, into)


def _open(file: Path, name: str) -> Any:
    try:
        # O_NONBLOCK: a FIFO at the shard's name is refused below instead of blocking the open
        return open(file, "rb", buffering=0, opener=lambda p, fl: os.open(p, fl | os.O_NONBLOCK))  # noqa: SIM115
    except FileNotFoundError:
        raise VerifyMismatch(f"{name}: missing (expected at {file})", hint="shardc pull it, or pass directory=") from None
    except OSError as exc:
        raise VerifyMismatch(f"{name}: cannot be read ({exc.strerror})", hint="re-pull the shard") from None


def _stat_checks(f: Any, file: Path, entry: ShardEntry, rl: RankLayout) -> None:
    """The open shard is a regular file of the manifest's size."""
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise VerifyMismatch(f"{rl.file}: not a regular file (at {file})", hint="re-pull the shard")
    if st.st_size != entry.size:
        raise VerifyMismatch(f"{rl.file}: size {st.st_size} bytes, expected {entry.size} (truncated or replaced?)",
                             hint="re-pull the shard")


def _read_open(f: Any, file: Path, entry: ShardEntry, rl: RankLayout, check_header: HeaderCheck, dev: str,
               started: HostReads | None) -> RawShard:
    """The checks and the read on the open shard ``f``. ``started``: its chunk reads already under
    way, begun after the same two checks at the open (formats/prefetch.py, against the size that
    ``matches`` compared): a size that changed since is a change while it was read."""
    if started is None:
        _stat_checks(f, file, entry, rl)
    if entry.chunk_size is not None:  # every chunk checked on every core; raises for a bad one
        from .local_read import read_chunked

        return read_chunked(f.fileno(), rl.file, entry.size, entry.chunk_size, entry.chunks, dev,
                            on_header=check_header, where=str(file), digest=entry.chunk_digest, started=started)
    raw = read_shard(f, dev, on_header=check_header)
    if raw.sha256 != entry.sha256:
        raise VerifyMismatch(f"{rl.file}: sha256 {raw.sha256[:16]}..., expected {entry.sha256[:16]}... "
                             "(corrupted bytes)", hint=_FULL)
    return raw
