"""How a build's files reach their final names: two committers behind one interface, chosen once.

* ``FreshCommit``: no complete build in the directory. Each stage's shards are renamed into place
  when the stage is committed, each with a ``.done`` resume record, so a killed build resumes;
  manifest.json, written last, is the commit point.
* ``SwitchCommit``: a complete build is there. It stays untouched until this one is complete:
  every new file (side files and manifest included) waits durably at its temp name, then one
  journaled switch (compiler/switch.py) puts them all in place.

compile.py asks the committer at each step and never which one it has (docs/architecture.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import OutputError, ShardcError
from ..formats.files import final_name, fsync_dir, sha256_file, write_atomic, write_temp
from ..formats.manifest import SWITCH_JOURNAL, FileEntry, Manifest
from ..formats.manifest import load as load_manifest
from ..formats.safetensors import ShardWriter
from ..layout.plan import canonical_json
from ..layout.ranks import Layout, RankLayout
from .outputs import INDEX, done_path, remove_files, stage_side_files, write_side_files
from .source import Source
from .switch import apply_switch, write_journal


class Committer(Protocol):
    """The steps of a build that depend on whether a complete build is being replaced."""

    replacing: bool  # for the space check: the old build stays on disk until the switch
    disk_hint: str  # what an OSError while writing the shards leaves, for its message

    def in_the_way(self, todo: list[RankLayout]) -> list[Path]:
        """Old files to delete (on the commit thread) before a stage's shards are committed."""
        ...

    def shard(self, rank_layout: RankLayout, writer: ShardWriter) -> tuple[int, str]:
        """Make one written shard durable; its (size, sha256)."""
        ...

    def discard(self, files: list[str]) -> None:
        """Bad input mid-build: nothing of this run stays (``files``: the shards it committed)."""
        ...

    def disk_failed(self) -> None:
        """The disk failed while writing the shards: tidy up what must not stay."""
        ...

    def side_files(self, layout: Layout, source: Source) -> list[FileEntry]:
        """config.json, the HF index and tokenizer files, as the manifest records them."""
        ...

    def manifest(self, manifest: Manifest, layout: Layout) -> None:
        """The commit point: after it, the directory holds the new build."""
        ...


def choose_committer(out: Path, key: dict[str, Any]) -> Committer:
    """A switch when a complete build (its manifest) is there, else a fresh commit; ``key``: what a
    resume record must match."""
    return SwitchCommit(out) if (out / "manifest.json").is_file() else FreshCommit(out, key)


def output_error(out: Path, exc: OSError, what: str) -> OutputError:
    """A write that failed after the shards: one line naming the file, the same hint either way."""
    what = final_name(exc.filename) if exc.filename else what
    return OutputError(f"cannot write {what} in {out}: {exc.strerror or exc}",
                       hint="free space or fix the disk, then rerun the same build")


@dataclass
class FreshCommit:
    """Final names at once, a resume record per shard, manifest.json last (module doc)."""

    out: Path
    key: dict[str, Any]
    replacing = False
    disk_hint = "free space or fix the disk, then rerun the same build: finished stages are kept"

    def in_the_way(self, todo: list[RankLayout]) -> list[Path]:
        # slow on a filesystem mounted with discard: deleted while the stage is written
        return [self.out / rank_layout.file for rank_layout in todo if (self.out / rank_layout.file).exists()]

    def shard(self, rank_layout: RankLayout, writer: ShardWriter) -> tuple[int, str]:
        size, sha = writer.commit(rename=True)
        write_atomic(done_path(self.out, rank_layout.file), canonical_json({"key": self.key, "size": size, "sha256": sha}))
        return size, sha

    def discard(self, files: list[str]) -> None:
        for name in files:
            (self.out / name).unlink(missing_ok=True)
            done_path(self.out, name).unlink(missing_ok=True)

    def disk_failed(self) -> None:
        """The committed stages stay: a rerun resumes from them."""

    def side_files(self, layout: Layout, source: Source) -> list[FileEntry]:
        return write_side_files(layout, source, self.out)

    def manifest(self, manifest: Manifest, layout: Layout) -> None:
        try:
            manifest.save(self.out / "manifest.json")  # the commit point
        except OSError as exc:
            raise output_error(self.out, exc, "manifest.json") from None
        for rank_layout in layout.ranks:
            done_path(self.out, rank_layout.file).unlink(missing_ok=True)


@dataclass
class SwitchCommit:
    """Every new file at its temp name (``staged``: final -> temp), then the journaled switch."""

    out: Path
    staged: dict[Path, Path] = field(default_factory=dict)
    replacing = True
    disk_hint = "free space or fix the disk; the build already there is untouched"

    def in_the_way(self, todo: list[RankLayout]) -> list[Path]:
        return []  # the old build stays whole until the switch

    def shard(self, rank_layout: RankLayout, writer: ShardWriter) -> tuple[int, str]:
        size, sha = writer.commit(rename=False)  # durable at its temp name
        self.staged[self.out / rank_layout.file] = writer.tmp
        return size, sha

    def discard(self, files: list[str]) -> None:
        remove_files(list(self.staged.values()))

    def disk_failed(self) -> None:
        """This run's files go: the old build is still complete."""
        remove_files(list(self.staged.values()))

    def side_files(self, layout: Layout, source: Source) -> list[FileEntry]:
        """The side files at temp names too; their entries are their temp files' sizes and hashes
        under their final names."""
        try:
            staged = stage_side_files(layout, source, self.out)
        except BaseException:
            remove_files(list(self.staged.values()))
            raise
        self.staged.update(staged)
        return [FileEntry(final.name, tmp.stat().st_size, sha256_file(tmp)) for final, tmp in staged.items()]

    def manifest(self, manifest: Manifest, layout: Layout) -> None:
        """The new manifest is staged durably like every other file, then the journal makes the
        switch one that always finishes (compiler/switch.py). Until the journal is written the old
        build is complete and a failure removes this run's files; after it, a failure keeps them
        for the rerun, which finishes the switch first."""
        out, staged = self.out, list(self.staged.values())
        try:
            staged.append(tmp := write_temp(out / "manifest.json", manifest.dumps()))
            stale = _replaced_files(out, {p.name for p in self.staged})
            journal = write_journal(out, self.staged, tmp, stale)
        except BaseException as exc:
            # Interrupted before the switch began: the old build is all there is. A journal already
            # on disk (it is ours: the lock is held) goes first, so no rerun acts on it.
            remove_files([out / SWITCH_JOURNAL])
            fsync_dir(out)
            remove_files(staged)
            if isinstance(exc, OSError):
                what = final_name(exc.filename) if exc.filename else "manifest.json"
                raise OutputError(f"cannot write {what} in {out}: {exc.strerror or exc}",
                                  hint="free space or fix the disk; the build already there is untouched") from None
            raise
        try:
            apply_switch(out, *journal)
        except OSError as exc:
            raise OutputError(f"cannot switch the new build into {out}: {exc.strerror or exc}",
                              hint="fix the disk, then rerun the build: it finishes the switch first") from None


def _replaced_files(out: Path, new: set[str]) -> list[str]:
    """Files of the build being replaced that the new one does not have, removed by the switch: a
    tp 1 x pp 2 build rebuilt as tp 2 x pp 1 leaves no model-tp00-pp01 behind, a tp > 1 build no
    HF index. Names come from the old manifest (validated on read: plain names in ``out``)."""
    try:
        old = load_manifest(out / "manifest.json")
        names = {INDEX, *(s.file for s in old.shards), *(f.name for f in old.files)}
    except ShardcError:
        names = {INDEX}  # an unreadable old manifest: only what no new build can leave behind
    return sorted(n for n in names - new if n != "manifest.json")
