"""The gate's baseline cache (``shardc gate --baseline-cache``): the baseline's logits kept between
gates in a safetensors file sealed with a keyed digest, read back only when the digest and the key
match this run (runtime/gate.py uses it; docs/architecture.md §6 "run and gate").

The key is what the logits depend on (``cache_key``); the digest is an HMAC over the key, the
tensor table and the data bytes (``cache_digest``). A cache of another baseline is ``stale``, an
edited or damaged one a ``mismatch``: both are recomputed, never read. The file is never a build's
file or the golden text (``check_cache_location``), and it is written at a temp name, then renamed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import OutputError, ShardcError
from ..formats.files import create_temp, fsync_dir
from ..formats.safetensors import MAX_HEADER, extent_problem, header_bytes, parse_header
from ..layout.dtypes import DTYPE_BYTES


def cache_key(base: Any, text: str, window: int, max_tokens: int, windows: list[list[int]],
              threads: int | None = None, scored_by: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the baseline's logits depend on: the baseline build (its manifest's bytes pin every shard's
    sha256), the golden text and the window settings (the token windows themselves, hashed, also pin
    the tokenizer), the CPU threads per rank (None on a GPU), and what scored it: shardc's runtime
    (no ``reference`` entry, so caches written before the reference existed still hit) or
    ``scored_by`` (runtime/reference.py: transformers and torch versions). A cache of one reference
    is never read for the other: ``check_cache`` compares every entry either key has."""
    key: dict[str, Any] = {
        "cpu_threads": threads,
        "baseline_manifest_sha256": hashlib.sha256(base.manifest_path.read_bytes()).hexdigest(),
        "golden_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "window": int(window),
        "max_tokens": int(max_tokens),
        "windows_sha256": hashlib.sha256(json.dumps(windows).encode()).hexdigest(),
    }
    if scored_by is not None:
        key["reference"] = scored_by
    return key


CACHE_META = "shardc.baseline_cache"  # the key, as JSON (informative: the digest decides)
CACHE_DIGEST = "shardc.baseline_cache_hmac"
SECRET_ENV = "SHARDC_GATE_CACHE_SECRET"
_BLOCK = 8 << 20
NOTES = {"stale": "is of another baseline", "mismatch": "does not match its digest"}


class GateCacheError(ShardcError):
    """``--baseline-cache`` names what the gate must not read or overwrite: a build's file or a
    file in a build directory, the golden text, a directory or another non-regular file."""


def cache_digest(key: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """The keyed digest a cache carries, before its logits bytes are fed to it: HMAC-SHA256 keyed
    with this run's baseline manifest sha256 (plus ``SHARDC_GATE_CACHE_SECRET`` when set) over this
    run's key and the file's tensor table, then (``update``) the data bytes.

    What it stops: a cache of another baseline or golden text whose recorded key was edited to
    match (the digest is of this run's key, not the recorded one), edited or damaged logits, a
    tensor table changed to reinterpret the bytes, and a digest copied from another cache. What it
    cannot stop without the secret: someone who can write the cache file and read the baseline
    manifest can compute the digest of any logits they like, since the manifest is no secret; set
    ``SHARDC_GATE_CACHE_SECRET`` (for example a CI secret) and keep it from them, and a forged
    cache needs the secret. Either way a cache is only as trusted as the place it is kept, and a
    genuine cache of this very baseline, replayed, gives the same figures as a fresh pass."""
    material = bytes.fromhex(key["baseline_manifest_sha256"]) + os.environ.get(SECRET_ENV, "").encode()
    h = hmac.new(material, digestmod="sha256")
    h.update(json.dumps({"key": key, "tensors": tensors}, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    return h


def check_cache_location(path: Path, refs: list[Any], protected: list[Path]) -> None:
    """Refuse a cache path the gate would overwrite harmfully: one of the baseline's or the
    candidate's files, a file in a build directory (any directory holding a manifest.json), the
    golden text or tokenizer, a directory. Links are resolved: the rename lands at ``path`` (its
    own directory counts) and the bytes are read from its target (that directory counts too)."""
    target = Path(os.path.abspath(path))
    real = target.resolve()
    files = {p.resolve(): f"the golden text or tokenizer {p}" for p in protected}
    for ref in refs:
        files[ref.manifest_path.resolve()] = f"{ref.name}'s manifest"
        for name in [f.name for f in ref.manifest.files] + [s.file for s in ref.manifest.shards]:
            files[(ref.directory / name).resolve()] = f"{ref.name}'s {name}"
    hint = "keep baseline caches outside build directories, e.g. --baseline-cache caches/<baseline>.safetensors"
    for p in (target, real):
        if p in files:
            raise GateCacheError(f"baseline cache {path} is {files[p]}; the gate would overwrite it", hint=hint)
    builds = {d for ref in refs for d in (ref.directory, ref.manifest_path.parent)}
    for d in (target.parent, real.parent):
        if d.resolve() in builds or (d / "manifest.json").exists():
            raise GateCacheError(f"baseline cache {path} is in the build directory {d}", hint=hint)
    if real.is_dir():
        raise GateCacheError(f"baseline cache {path} is a directory", hint="name a file")


def check_cache(path: Path, key: dict[str, Any], copy_to: Path | None = None) -> tuple[str, str]:
    """("new", "") when there is no cache yet, ("hit", "") when it is this run's and its digest
    matches its bytes, ("stale", why) when it is another run's, unreadable or carries no digest,
    ("mismatch", why) when its digest does not match. ``copy_to``: on a hit, the checked bytes are
    there too (written as they are hashed), so later readers need not trust ``path`` again.
    Anything at ``path`` gives one of these or a GateCacheError (not a regular file, unreadable)."""
    if not path.exists():  # a dangling link too: the new cache replaces the link
        return "new", ""
    try:
        # O_NONBLOCK: a FIFO at the path must not block the open (reads of a regular file ignore it)
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise GateCacheError(f"baseline cache {path} is not a regular file", hint="name a file")
            return _check_open(f, path, key, copy_to)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise GateCacheError(f"cannot read baseline cache {path}{where}: {exc.strerror or exc}",
                             hint="check its permissions and free space in the temp directory") from None


def _check_open(f: Any, path: Path, key: dict[str, Any], copy_to: Path | None) -> tuple[str, str]:
    size = os.fstat(f.fileno()).st_size
    try:
        tensors, meta, start = _header(f, path.name, size)
    except ShardcError as exc:
        return "stale", f"unreadable: {exc.message}"
    try:
        found = json.loads(meta.get(CACHE_META, "null"))
    except (ValueError, RecursionError):
        found = None
    if not isinstance(found, dict):
        return "stale", "not a shardc baseline cache"
    for k in [*key, *(k for k in found if k not in key)]:  # an entry one side lacks differs too
        if found.get(k) != key.get(k):
            return "stale", f"{k} {_brief(k, found.get(k))} != {_brief(k, key.get(k))}"
    digest = meta.get(CACHE_DIGEST)
    if not isinstance(digest, str):
        return "stale", "it carries no digest (an older shardc's cache)"
    if problem := _layout_problem(tensors, size - start):
        return "mismatch", f"damaged: {problem}"
    h = cache_digest(key, tensors)
    out, tmp = _copy_target(copy_to)
    try:
        if out is not None:  # a header shardc wrote: what the candidate's reader parses is what was hashed
            out.write(_sealed_header(tensors, key, meta.get(CACHE_DIGEST, "")))
        f.seek(start)
        while chunk := f.read(_BLOCK):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
        # as bytes: compare_digest refuses a str with non-ASCII characters (a TypeError, not a verdict)
        if not hmac.compare_digest(h.hexdigest().encode(), digest.encode("utf-8", "surrogatepass")):
            return "mismatch", "edited or damaged since it was written"
        if out is not None:
            assert tmp is not None and copy_to is not None  # out is open only with a target (_copy_target)
            out.close()
            os.replace(tmp, copy_to)
            tmp = None
        return "hit", ""
    finally:
        if out is not None:
            out.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _brief(k: str, v: Any) -> str:
    """A key entry as a stale cache's line shows it: the reference by name (none is shardc's own)."""
    if k == "reference":
        return str(v.get("name")) if isinstance(v, dict) else "shardc" if v is None else str(v)[:12]
    return str(v)[:12]


def _layout_problem(tensors: dict[str, Any], data_len: int) -> str | None:
    """What keeps a header from being a cache's: one 3-D ``logits`` tensor of a known dtype that
    fills the data section exactly."""
    if set(tensors) != {"logits"}:
        return f"it holds the tensors {sorted(tensors)[:3]}, not logits alone"
    e = tensors["logits"]
    if e["dtype"] not in DTYPE_BYTES or len(e["shape"]) != 3:
        return f"logits are {e['dtype']}{e['shape']}, not a 3-D array of a known dtype"
    return extent_problem(tensors, data_len)


def _sealed_header(tensors: dict[str, Any], key: dict[str, Any], digest: str) -> bytes:
    """The header of a sealed cache (the tensors laid out in offset order, as a cache has them)."""
    order = sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"])
    layout = [(name, e["dtype"], e["shape"]) for name, e in order]
    return header_bytes(layout, {CACHE_META: json.dumps(key, sort_keys=True), CACHE_DIGEST: digest})


def _header(f: Any, name: str, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensors, metadata, data start) of an open safetensors file, bounded and checked."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ShardcError("shorter than a safetensors header")
    n = int.from_bytes(raw, "little")
    if n > min(MAX_HEADER, size - 8):
        raise ShardcError(f"header length {n} does not fit the file")
    tensors, meta = parse_header(f.read(n), name)
    return tensors, meta, 8 + n


def _copy_target(copy_to: Path | None) -> tuple[Any, Path | None]:
    if copy_to is None:
        return None, None
    fd, tmp = create_temp(copy_to)
    return open(fd, "wb"), tmp


def seal_cache(scratch: Path, path: Path, key: dict[str, Any]) -> None:
    """Write the baseline pass's logits file (``scratch``) to ``path`` with the key and its digest
    in the header (atomic: an exclusive temp file, fsynced, renamed). One pass over the bytes: the
    header is written with a placeholder digest of the same length and rewritten at the end. A
    disk that fails is OutputError (exit 1); the old cache, if any, stays as it was."""
    try:
        _seal(scratch, path, key)
    except OSError as exc:
        raise OutputError(f"cannot write baseline cache {path}: {exc.strerror or exc}",
                          hint="check free space and permissions, or name another file") from None


def _seal(scratch: Path, path: Path, key: dict[str, Any]) -> None:
    with open(scratch, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        tensors, _, start = _header(f, scratch.name, size)
        if problem := _layout_problem(tensors, size - start):
            raise ShardcError(f"the baseline pass wrote {scratch} wrongly: {problem}")
        h = cache_digest(key, tensors)
        fd, tmp = create_temp(path)
        try:
            with open(fd, "wb") as out:
                out.write(_sealed_header(tensors, key, "0" * 64))
                f.seek(start)
                while chunk := f.read(_BLOCK):
                    h.update(chunk)
                    out.write(chunk)
                out.seek(0)
                out.write(_sealed_header(tensors, key, h.hexdigest()))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(path.parent)
