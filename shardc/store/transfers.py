"""What push and pull return: frozen records of what moved (``shardc.results.to_json`` is their
``--json`` form; the words of a closed set are ``StrEnum``s, equal to the strings the JSON has)."""

from __future__ import annotations

from dataclasses import dataclass

from ..results import StrEnum
from ..verify.report import VerifyReport


class ObjectAction(StrEnum):
    """What push did with one file of the build."""

    UPLOADED = "uploaded"
    PRESENT = "present"  # the store already held it with the right sha256: skipped


class ManifestState(StrEnum):
    """What push did with the manifest (the commit point)."""

    UPLOADED = "uploaded"
    UNCHANGED = "unchanged"  # the store's manifest was already this one and nothing was missing


class FileAction(StrEnum):
    """What pull did with one file."""

    DOWNLOADED = "downloaded"
    PRESENT = "present"  # already in the destination with the manifest's sha256: kept


@dataclass(frozen=True)
class PushedObject:
    file: str  # name in the build (and in the manifest)
    object: str  # name in the store: ``<file>.zst`` when compressed
    size: int  # bytes stored (the compressed size for a .zst object)
    action: ObjectAction


@dataclass(frozen=True)
class PushResult:
    """A push: where to (``dest``, ``manifest_uri``), what it stored, what it removed (``--replace``:
    the objects of the build it replaced), and how long it took."""

    dest: str
    manifest_uri: str
    manifest: ManifestState
    compress: str | None
    objects: tuple[PushedObject, ...]
    uploaded: int
    present: int
    bytes_uploaded: int
    bytes_total: int
    removed: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class PulledFile:
    name: str
    size: int
    action: FileAction


@dataclass(frozen=True)
class PulledRank:
    file: str
    tp_rank: int
    pp_stage: int
    rank: int


@dataclass(frozen=True)
class PullResult:
    """A pull: the ranks fetched, every file and what was done with it, and the verify report of
    the pulled ranks (always ok: a mismatch raises instead)."""

    manifest_uri: str
    dest: str
    manifest: str  # the local manifest.json written
    ranks: tuple[PulledRank, ...]
    files: tuple[PulledFile, ...]
    downloaded: int
    present: int
    bytes_downloaded: int
    seconds: float
    verify: VerifyReport
