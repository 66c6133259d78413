"""What an output directory may hold before build, reshard or export writes into it (#41 item 8),
and when the rollout record ``<manifests dir>/<plan>.json`` may be replaced.

Checked before anything is written (plan first, execute second), again under the build lock:

* a directory of files that are not a build (anything but the names a build or an export writes,
  its temp files, resume records, lock and switch journal) is refused, ``--replace`` or not: a
  build would write beside a user's files and an export would delete their ``model-*-of-*``
  files, and deleting files shardc did not write is never safe;
* a directory holding a different build is refused unless ``replace``. For build and reshard a
  different build is a ``manifest.json`` whose plan name differs from the new plan's (a rebuild
  of the same plan, edited or with another ``--source``, is the ordinary rebuild and replaces it
  as before); with ``replace`` the journaled switch replaces it, so the two builds' files never
  mix. For export it is a complete export (an index) whose config.json differs from the new one's
  (another model or dtype: an export of any build of the same model and dtype is the same
  checkpoint); ``model-*-of-*.safetensors`` files that shardc's export did not write (no
  ``shardc.export_of`` in their metadata: a user's own checkpoint) are files that are not a build.

The rollout record is a copy of a build's manifest named after its plan, so two builds of one plan
in two directories would share it. It is replaced only by the same build (push's rule: the same
effective plan and the same source record), or when it is the record of the build the directory
held, or with ``replace``; otherwise the build is refused before it writes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import ShardcError
from ..formats.files import is_temp
from ..formats.manifest import SWITCH_JOURNAL, Manifest, SourceRecord, loads
from ..formats.safetensors import read_header
from .lock import LOCK
from .outputs import INDEX, SIDE_FILES, TOKENIZER_FILES

SHOWN = 3  # names quoted in the one line; the rest are counted
HF_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors\Z")  # an export's weights files
_OURS = {"manifest.json", LOCK, SWITCH_JOURNAL, *SIDE_FILES}
_EXPORT_OURS = {LOCK, "config.json", INDEX, *TOKENIZER_FILES}


class OccupiedOutput(ShardcError):
    """The output directory holds something the run would replace or write beside: exit 2."""


def _entries(out: Path) -> list[str]:
    """The names in ``out``; none where it cannot be listed (missing, not a directory, a link
    loop): creating the directory or its lock reports that in its own words."""
    try:
        return sorted(os.listdir(out))
    except OSError:
        return []


def _refuse_foreign(out: Path, foreign: list[str], what: str) -> None:
    if not foreign:
        return
    shown = ", ".join(foreign[:SHOWN]) + (f", … ({len(foreign) - SHOWN} more)" if len(foreign) > SHOWN else "")
    raise OccupiedOutput(f"{out} holds {len(foreign)} file(s) that are not {what}: {shown}",
                         hint="move them away or write into an empty directory (`out`); `replace` "
                              "never deletes files shardc did not write")


def _manifest(path: Path) -> Manifest | None:
    try:
        return loads(path.read_bytes(), str(path))
    except (OSError, ShardcError):
        return None


def check_build_dir(out: Path, plan_name: str, files: set[str], *, replace: bool) -> None:
    """Refuse ``out`` when it holds files that are not a build, or (unless ``replace``) another
    plan's build. ``files``: the shard files the new plan writes. A switch journal means a rebuild
    was interrupted; its names are the journal's to check (``finish_switch``, under the lock), so
    only the files are looked at after it is finished."""
    names = _entries(out)
    if not names:
        return
    old = _manifest(out / "manifest.json") if "manifest.json" in names else None
    if SWITCH_JOURNAL not in names:
        listed = {s.file for s in old.shards} | {f.name for f in old.files} if old else set()
        records = {n[1:-len(".done.json")] for n in names if n.startswith(".") and n.endswith(".done.json")}
        ours = _OURS | files | listed | records
        _refuse_foreign(out, [n for n in names if n not in ours and not is_temp(n)
                              and not (n.startswith(".") and n.endswith(".done.json"))], "a build")
    if "manifest.json" in names and not replace:
        if old is None:
            raise OccupiedOutput(f"{out} holds a manifest.json shardc cannot read; refusing to replace it "
                                 f"with plan '{plan_name}'",
                                 hint="use `replace` to replace it, or build into another directory (`out`)")
        if old.name != plan_name:
            raise OccupiedOutput(f"{out} holds build '{old.name}' (plan sha256 {old.plan_sha256[:12]}), not "
                                 f"plan '{plan_name}'",
                                 hint="use `replace` to replace it (the journaled switch: the old build "
                                      "stays whole until the new one is), or build into another directory (`out`)")


def check_export_dir(out: Path, config: bytes, *, replace: bool) -> None:
    """Refuse ``out`` when it holds files an export does not write (a shardc build is refused by
    the export itself, more precisely), or (unless ``replace``) a complete export of another model
    or dtype (its config.json is not ``config``)."""
    names = _entries(out)
    if not names or "manifest.json" in names or SWITCH_JOURNAL in names:
        return  # empty, or a shardc build: export's own refusal names it
    foreign = []
    for n in names:
        if n in _EXPORT_OURS or is_temp(n):
            continue
        if HF_FILE.match(n) and _exported(out / n):
            continue
        foreign.append(n)
    _refuse_foreign(out, foreign, "an export")
    if replace or INDEX not in names:
        return  # no index: an export killed while switching, written again as before
    try:
        same = (out / "config.json").read_bytes() == config
    except OSError:
        same = False
    if not same:
        raise OccupiedOutput(f"{out} holds an export of another model or dtype (its config.json differs "
                             f"from this export's)",
                             hint="use `replace` to replace it, or export into another directory (`out`)")


def _exported(path: Path) -> bool:
    """A weights file shardc's export wrote (its metadata names the build it came from). Only a
    regular file's bytes can be a user's: a link at the name is replaced, not followed, and a
    directory is refused by the switch (or, at a stale name, left alone)."""
    if path.is_symlink() or not path.is_file():
        return True
    try:
        _, meta, _ = read_header(path)
    except (OSError, ShardcError):
        return False
    return "shardc.export_of" in meta


def check_record(manifests_dir: str | Path | None, out: Path, plan_name: str, effective_sha256: str,
                 identity: Callable[[], SourceRecord], *, replace: bool) -> None:
    """Refuse a build whose record would replace the record of a different build of its plan.
    Allowed: no record yet; the record of the build in ``out`` (byte for byte its manifest.json);
    a directory with a switch journal (a rebuild interrupted there: the record is of the build it
    replaced); the same build (effective plan sha256 and source record: push's rule; ``identity``
    is asked for only then: it may wait for the source's hashes); or ``replace``."""
    if manifests_dir is None or replace:
        return
    record = Path(manifests_dir) / f"{plan_name}.json"
    try:
        data = record.read_bytes()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OccupiedOutput(f"cannot read the record {record}: {exc.strerror}",
                             hint="fix it, or keep this build's record elsewhere (`manifests_dir`)") from None
    try:
        if data == (out / "manifest.json").read_bytes():
            return
    except OSError:
        pass
    if (out / SWITCH_JOURNAL).exists():
        return
    try:
        prev = loads(data, str(record))
    except ShardcError:
        raise OccupiedOutput(f"the record {record} is not a manifest shardc can read; refusing to "
                             f"replace it with plan '{plan_name}'",
                             hint="use `replace` to replace it, or keep this build's record elsewhere "
                                  "(`manifests_dir`)") from None
    if prev.effective_sha256 == effective_sha256 and prev.source == identity():
        return
    raise OccupiedOutput(f"the record {record} is of another build of plan '{plan_name}' (effective plan "
                         f"sha256 {prev.effective_sha256[:12]}, source {prev.source.uri}), not the one in {out}",
                         hint="use `replace` to replace the record, or keep this build's record elsewhere "
                              "(`manifests_dir`)")
