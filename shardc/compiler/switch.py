"""Switching a rebuild into place, and finishing a switch a kill interrupted (roll forward).

A rebuild over a complete build writes every new file, the new manifest included, durably at an
exclusive temp name beside the old build. Then one small journal, ``.shardc-switch.json``, is
written atomically: the ordered renames ``[temp name, final name]`` (manifest.json last) and the
files to remove. From that moment the new build is complete on disk, only not at its final names,
so the switch can always be finished: the old manifest goes, each temp file is renamed into place,
the stale files go, the manifest is renamed last, and the journal is removed. A kill anywhere in
between leaves the journal; the next ``shardc build`` or ``shardc reshard`` into the directory
finishes the switch (``finish_switch``) before it looks at anything else. A multi-file directory
has no atomic switch, so a reader in that window sees no manifest.json (the readers say why:
``formats/manifest.py`` ``interrupted_switch``).

The journal is input like any other file in the directory: read bounded, never through a link,
and every name in it must be a plain name of this directory, at most ``NAME_MAX`` bytes: each final
and removed name a ``safe_name``, each temp name exactly ``formats/files.py``'s temp name of its own
final name (the whole string, not its last component), no name twice. Every named file that exists
must be a regular file (a directory or link at a removed or final name is refused, so a switch
never stops half done on one). Anything else is one error, and nothing is touched.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import ManifestError, OutputError, ShardcError
from ..formats.files import fsync_dir, safe_name, write_atomic
from ..formats.manifest import SWITCH_JOURNAL
from ..layout.plan import canonical_json
from ..layout.readfile import read_regular_file

MANIFEST = "manifest.json"
FORMAT = "shardc-switch"
JOURNAL_LIMIT = 4 << 20  # a few hundred bytes per file; a 4096-rank build stays far below
NAME_MAX = 255  # bytes in one directory entry's name (Linux): a longer name is none of ours
_FIX = "delete it and rebuild (`force`)"


def write_journal(out: Path, staged: dict[Path, Path], manifest: Path,
                  remove: list[str]) -> tuple[list[list[str]], list[str]]:
    """Write the journal of a switch, durably: ``staged`` maps final paths to their durable temp
    files, ``manifest`` is the new manifest's durable temp file, ``remove`` names files of the old
    build with no counterpart in the new one. From here the switch always finishes, so a name it
    could not finish on (a directory at a final or removed name) is refused first: an OutputError,
    and the caller removes its staged files, leaving the old build as it was."""
    _fault(-1)
    renames = [[tmp.name, final.name] for final, tmp in staged.items()] + [[manifest.name, MANIFEST]]
    if problem := _unswitchable(out, renames, remove):
        raise OutputError(f"cannot switch the new build into {out}: its switch {problem}",
                          hint="remove or rename it, then rerun; the build already there is untouched")
    removed = sorted(remove)
    journal = {"format": FORMAT, "version": 1, "renames": renames, "remove": removed}
    write_atomic(out / SWITCH_JOURNAL, canonical_json(journal))  # fsyncs the file and the directory
    return renames, removed


def finish_switch(out: Path) -> bool:
    """Finish a switch a kill interrupted in ``out`` (the caller holds the build lock). False when
    there is none. A journal that is malformed, or names anything but plain files of ``out``, is a
    ManifestError (exit 2) and nothing is touched; a disk failure is an OutputError (exit 1)."""
    path = out / SWITCH_JOURNAL
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {exc.strerror}", hint="fix the directory, then rerun") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(path, "is not a regular file (a link?)")
    renames, remove = _parse(path, read_regular_file(path, limit=JOURNAL_LIMIT, what="switch journal",
                                                      error=ManifestError, follow_links=False))
    if problem := _unswitchable(out, renames, remove):
        raise _bad(path, problem)
    try:
        apply_switch(out, renames, remove)
    except OSError as exc:
        raise OutputError(f"cannot finish the interrupted switch in {out}: {exc.strerror or exc}",
                          hint="fix the disk, then rerun the build: the switch is finished first") from None
    return True


def apply_switch(out: Path, renames: list[list[str]], remove: list[str]) -> None:
    """The switch a journal records, idempotent: what a kill left undone is done by running it
    again. Returns once the new build is in place and the journal gone."""
    *files, (manifest_tmp, _) = renames
    # The new manifest still at its temp name: the switch is not done. Once it is renamed, every
    # other rename and removal was done and made durable before it, so nothing is left but the
    # journal (and a journal whose files someone deleted removes nothing).
    pending = os.path.lexists(out / manifest_tmp)
    if pending:
        (out / MANIFEST).unlink(missing_ok=True)  # the old build ends here
    done = 0
    _fault(done)
    for tmp, final in files:
        if os.path.lexists(out / tmp):
            os.replace(out / tmp, out / final)
            done += 1
            _fault(done)
    if pending:
        for name in remove:
            (out / name).unlink(missing_ok=True)
        fsync_dir(out)  # every file in place before the manifest says so
        os.replace(out / manifest_tmp, out / MANIFEST)  # the new build's commit point
        _fault(done + 1)
    fsync_dir(out)
    (out / SWITCH_JOURNAL).unlink(missing_ok=True)
    fsync_dir(out)


def _unswitchable(out: Path, renames: list[list[str]], remove: list[str]) -> str | None:
    """Why the switch could not run to its end in ``out``, or None: every file of the new build is
    somewhere (at its temp or final name), and every named file that exists is a regular file, so
    no rename or removal fails on a directory after the old manifest is gone."""
    for tmp, final in renames:
        modes = {name: _mode(out, name) for name in (tmp, final)}
        for name, mode in modes.items():
            if mode is not None and not stat.S_ISREG(mode):
                return f"names {name}, which is not a regular file"
        if set(modes.values()) == {None}:
            return f"cannot be finished: neither {tmp} nor {final} exists"
    for name in remove:
        mode = _mode(out, name)
        if mode is not None and not stat.S_ISREG(mode):
            return f"removes {name}, which is not a regular file"
    return None


def _mode(out: Path, name: str) -> int | None:
    """``st_mode`` of ``out/name`` itself (a link is not followed), None when there is none."""
    try:
        return os.lstat(out / name).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"cannot read {out / name}: {exc.strerror}", hint="fix the directory, then rerun") from None


def _parse(path: Path, data: bytes) -> tuple[list[list[str]], list[str]]:
    """The journal's renames and removals, every name checked; ManifestError names what is wrong."""
    try:
        j: Any = json.loads(data)
    except (ValueError, RecursionError):
        raise _bad(path, "is not JSON") from None
    if not isinstance(j, dict) or j.get("format") != FORMAT or type(j.get("version")) is not int \
            or j["version"] != 1 or set(j) != {"format", "version", "renames", "remove"}:
        raise _bad(path, f"is not a {FORMAT} version 1 journal")
    renames, remove = j["renames"], j["remove"]
    if not isinstance(renames, list) or not renames or not isinstance(remove, list):
        raise _bad(path, "needs a non-empty list 'renames' and a list 'remove'")
    finals: list[str] = []
    for pair in renames:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
            raise _bad(path, f"has a rename that is not [temp name, final name]: {_short(pair)}")
        tmp, final = pair
        _name(path, final)
        if not _is_temp_of(tmp, final):
            raise _bad(path, f"has {_short(tmp)}, which is not a temp name of {final} in its directory")
        finals.append(final)
    if finals[-1] != MANIFEST or finals.count(MANIFEST) != 1 or len(set(finals)) != len(finals):
        raise _bad(path, "must rename each file once, manifest.json last")
    for i, name in enumerate(remove):
        if _name(path, name) in finals:
            raise _bad(path, f"both renames to and removes {name}")
        if name in remove[:i]:
            raise _bad(path, f"removes {name} twice")
    return renames, remove


def _name(path: Path, name: Any) -> str:
    """A final or removed name: a plain file name of the journal's own directory."""
    try:
        safe_name(name)
    except ShardcError:
        raise _bad(path, f"names {_short(name)}, which is not a plain file name of its directory") from None
    if len(os.fsencode(name)) > NAME_MAX:
        raise _bad(path, f"names {_short(name)}, longer than {NAME_MAX} bytes")
    return name


def _is_temp_of(tmp: str, final: str) -> bool:
    """Whether ``tmp`` is exactly ``create_temp``'s name for ``final`` (``.<final>.<16 hex>.tmp``):
    the whole string is matched, so no directory, ``..`` or absolute path can hide in front of a
    temp-looking last component. ``final`` is already a safe name."""
    return re.fullmatch(rf"\.{re.escape(final)}\.[0-9a-f]{{16}}\.tmp", tmp) is not None \
        and len(os.fsencode(tmp)) <= NAME_MAX


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(path: Path, what: str) -> ManifestError:
    return ManifestError(f"switch journal {path} {what}; nothing was changed",
                         hint=f"it records a rebuild interrupted while switching its files in; {_FIX}")


def _fault(renamed: int) -> None:
    """Fault injection for the switch tests: SHARDC_FAULT='switch:N' kills this process (SIGKILL)
    once N files are renamed (0: the journal is written and the old manifest removed, nothing
    renamed yet; -1: every new file is staged at its temp name, no journal written yet). Read only
    here, at these points."""
    spec = os.environ.get("SHARDC_FAULT")
    if not spec or not spec.startswith("switch:"):
        return
    if int(spec.split(":")[1]) == renamed:
        os.kill(os.getpid(), 9)
