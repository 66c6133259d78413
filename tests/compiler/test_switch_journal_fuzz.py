"""Property-based fuzzing (#25) of the switch journal, ``.shardc-switch.json``: whatever its bytes
and whatever the build directory holds (regular files, directories, links, FIFOs at the names it
lists, temp-looking files outside), ``finish_switch`` either finishes a valid switch or raises a
ManifestError having touched nothing, inside the directory or outside it.

The oracle is this file's own reading of the journal's rules (``acceptable``, written from the
contract in docs/architecture.md §6, not from compiler/switch.py) and its own model of what a finished
switch leaves (``switched``). Every example runs against real files in a fresh temp directory; the
whole tree (kinds, bytes, inodes, link targets) is compared before and after.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardc.compiler.switch import finish_switch
from shardc.errors import ManifestError

JOURNAL = ".shardc-switch.json"
FINALS = ["manifest.json", "config.json", "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors",
          "tokenizer.json"]
HEX = "0123456789abcdef"
TEMPS = [f".{f}.{HEX}.tmp" for f in FINALS] + [".config.json.fedcba9876543210.tmp"]
OUTSIDE_TEMP = f".config.json.{HEX}.tmp"  # one of the temp-looking files beside the build directory
HOSTILE = [
    "..", ".", "", "/", "a/b", "sub/config.json", "../victim.txt", "/etc/passwd", f"../{OUTSIDE_TEMP}",
    f"./.config.json.{HEX}.tmp", "config.json\n", "config.json\x00", "x\x00y", "a" * 300,
    "." + "a" * 240 + f".{HEX}.tmp", "a" * 240, ".shardc-build.lock", JOURNAL, "outside",
    f".manifest.json.{HEX.upper()}.tmp", f".config.json.{HEX[:15]}.tmp", "CON", "é.json",
]
# the absolute path of OUTSIDE_TEMP, and of the directory beside the build's, per example
ABSOLUTE = "<absolute outside temp>"
ABSOLUTE_DIR = "<absolute outside dir>"

PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


# ---- the oracle: the journal's rules and the switch's effect, written from the contract ----

def plain(name: Any) -> bool:
    return isinstance(name, str) and PLAIN.fullmatch(name) is not None and len(name.encode("utf-8", "replace")) <= 255


def temp_of(tmp: Any, final: str) -> bool:
    return (isinstance(tmp, str) and len(tmp.encode("utf-8", "replace")) <= 255 and tmp.startswith(f".{final}.")
            and tmp.endswith(".tmp") and re.fullmatch(r"[0-9a-f]{16}", tmp[len(final) + 2 : -4]) is not None)


def acceptable(data: bytes, state: dict[str, str]) -> bool:
    """Whether a journal with these bytes may be obeyed in a directory whose entries are
    ``state`` (name -> "file", "dir", "link" or "fifo")."""
    try:
        j = json.loads(data)
    except (ValueError, RecursionError):
        return False
    if not (isinstance(j, dict) and sorted(j) == ["format", "remove", "renames", "version"]
            and j["format"] == "shardc-switch" and type(j["version"]) is int and j["version"] == 1):
        return False
    renames, remove = j["renames"], j["remove"]
    if not (isinstance(renames, list) and renames and isinstance(remove, list)):
        return False
    finals = []
    for pair in renames:
        if not (isinstance(pair, list) and len(pair) == 2 and plain(pair[1]) and temp_of(pair[0], pair[1])):
            return False
        finals.append(pair[1])
    if finals[-1] != "manifest.json" or len(set(finals)) != len(finals):
        return False
    if not all(plain(n) for n in remove) or len(set(remove)) != len(remove) or set(remove) & set(finals):
        return False
    for tmp, final in renames:
        if tmp not in state and final not in state:
            return False
    named = [n for pair in renames for n in pair] + remove
    return all(state.get(n, "file") == "file" for n in named)


def switched(j: dict, before: dict[str, tuple]) -> dict[str, tuple]:
    """The directory's tree once an accepted journal's switch is finished: the old manifest gone
    if the new one is still at its temp name, each temp still there renamed to its final name,
    then (same condition) the removed names gone and the manifest renamed; the journal gone."""
    after = dict(before)
    *files, (manifest_tmp, _) = j["renames"]
    pending = manifest_tmp in after
    if pending:
        after.pop("manifest.json", None)
    for tmp, final in files:
        if tmp in after:
            after[final] = after.pop(tmp)
    if pending:
        for name in j["remove"]:
            after.pop(name, None)
        after["manifest.json"] = after.pop(manifest_tmp)
    after.pop(JOURNAL)
    return after


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` by relative path: kind and bytes + inode, link target, or mode
    (a FIFO is never opened)."""
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = ("file", p.read_bytes(), st_.st_ino)
        else:
            out[rel] = ("dir" if p.is_dir() else "other", st_.st_mode)
    return out


# ---- strategies ----

names = st.sampled_from(FINALS + TEMPS + HOSTILE + [ABSOLUTE]) | st.text(max_size=8)
valid_pairs = [[f".{f}.{HEX}.tmp", f] for f in FINALS[1:]] + [[".config.json.fedcba9876543210.tmp", "config.json"]]
pair = st.sampled_from(valid_pairs) | st.lists(names, min_size=2, max_size=2) \
    | st.tuples(names, st.sampled_from(FINALS)).map(lambda t: [t[0], t[1]])
json_value = st.recursive(st.none() | st.booleans() | st.integers(-2, 3) | st.floats() | names,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
                          max_leaves=10)


@st.composite
def journals(draw) -> Any:
    """Mostly journals of the right shape (so the name and file rules are what decides), with
    hostile names, versions and keys mixed in; sometimes any JSON value or any bytes."""
    kind = draw(st.sampled_from(["shaped"] * 6 + ["json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return draw(json_value)
    renames = draw(st.lists(pair, max_size=3))
    if draw(st.booleans()):
        renames.append([f".manifest.json.{HEX}.tmp", "manifest.json"])
    j: dict[str, Any] = {"format": draw(st.sampled_from(["shardc-switch"] * 4 + ["x"])),
                         "version": draw(st.sampled_from([1] * 6 + [2, True, 1.0, "1"])),
                         "renames": renames, "remove": draw(st.lists(names, max_size=3))}
    if draw(st.integers(0, 9)) == 0:
        j["extra"] = draw(json_value)
    return j


KINDS = st.sampled_from(["file"] * 5 + ["dir", "link", "fifo"])
ENTRY_NAMES = FINALS + TEMPS + ["model-tp00-pp01.safetensors"]
entries = st.dictionaries(st.sampled_from(ENTRY_NAMES), KINDS, max_size=8)


@st.composite
def cases(draw) -> tuple[Any, dict[str, str]]:
    """(journal, directory entries). Half are a journal a real rebuild could have written, over a
    directory where each file is at its temp or final name (a kill at any point), then one name
    or one entry perhaps spoilt; the other half are ``journals()`` over any entries."""
    if draw(st.booleans()):
        return draw(journals()), draw(entries)
    finals = draw(st.lists(st.sampled_from(FINALS[1:]), unique=True, max_size=4))
    renames = [[f".{f}.{draw(st.sampled_from([HEX, 'fedcba9876543210']))}.tmp", f] for f in finals]
    renames.append([f".manifest.json.{HEX}.tmp", "manifest.json"])
    remove = draw(st.lists(st.sampled_from([n for n in ENTRY_NAMES if n not in finals and n[0] != "."
                                            and n != "manifest.json"]), unique=True, max_size=2))
    state = {}
    for tmp, final in renames:
        for name in draw(st.sampled_from([[tmp], [final], [tmp, final]])):
            state[name] = "file"
    for name in remove:
        if draw(st.booleans()):
            state[name] = "file"
    j: Any = {"format": "shardc-switch", "version": 1, "renames": renames, "remove": remove}
    spoil = draw(st.sampled_from(["none"] * 4 + ["name", "path", "kind", "entry", "version"]))
    i = draw(st.integers(0, len(renames) - 1))
    if spoil == "name":  # any hostile name, anywhere
        if draw(st.booleans()):
            remove.append(draw(names))
        else:
            renames[i][draw(st.integers(0, 1))] = draw(names)
    elif spoil == "path":  # the right temp name as the last component of a path that leaves
        tmp = renames[i][0]
        renames[i][0] = draw(st.sampled_from([f"{ABSOLUTE_DIR}/{tmp}", f"../outside/{tmp}", f"../{tmp}",
                                              f"./{tmp}", f"{tmp}\n", f"{tmp}\x00"]))
        state.pop(tmp, None)
    elif spoil == "kind":  # a named file that is a directory, link or FIFO
        state[draw(st.sampled_from([n for pair in renames for n in pair] + remove))] = \
            draw(st.sampled_from(["dir", "link", "fifo"]))
    elif spoil == "entry":
        state[draw(st.sampled_from(ENTRY_NAMES))] = draw(KINDS)
    elif spoil == "version":
        j["version"] = draw(st.sampled_from([True, 1.0, "1", 2]))
    return j, state


def populate(out: Path, outside: Path, state: dict[str, str]) -> None:
    for name, kind in state.items():
        p = out / name
        if kind == "file":
            p.write_bytes(f"bytes of {name}".encode())
        elif kind == "dir":
            p.mkdir()
            (p / "inside").write_text("inside")
        elif kind == "link":
            p.symlink_to(outside / "victim.txt")
        else:
            os.mkfifo(p)


def substitute(j: Any, outside: Path) -> Any:
    """The journal with this example's absolute paths in place of their placeholders."""
    if isinstance(j, str):
        return str(outside / OUTSIDE_TEMP) if j == ABSOLUTE else j.replace(ABSOLUTE_DIR, str(outside))
    if isinstance(j, list):
        return [substitute(v, outside) for v in j]
    if isinstance(j, dict):
        return {substitute(k, outside): substitute(v, outside) for k, v in j.items()}
    return j


OUTCOMES: list[str] = []


@settings(max_examples=100, deadline=3000, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(["file"] * 8 + ["link", "dir", "absent"]))
def check_journal(case: tuple[Any, dict[str, str]], journal_kind: str) -> None:
    """One example: a directory, a journal, ``finish_switch``, and the oracle's verdict."""
    journal, state = case
    with tempfile.TemporaryDirectory(prefix="shardc-fuzz-switch-") as d:
        root = Path(d)
        out, outside = root / "out", root / "outside"
        out.mkdir()
        outside.mkdir()
        (outside / "victim.txt").write_bytes(b"precious")
        for name in TEMPS:  # temp-looking files outside, each a path that leaves could reach
            (outside / name).write_bytes(b"outside: " + name.encode())
            (root / name).write_bytes(b"beside the directory: " + name.encode())
        populate(out, outside, state)
        journal = substitute(journal, outside)
        data = journal if isinstance(journal, bytes) else json.dumps(journal).encode()
        if journal_kind == "file":
            (out / JOURNAL).write_bytes(data)
        elif journal_kind == "link":
            (outside / "journal.json").write_bytes(data)
            (out / JOURNAL).symlink_to(outside / "journal.json")
        elif journal_kind == "dir":
            (out / JOURNAL).mkdir()
        before = tree(root)
        try:
            finished = finish_switch(out)
        except ManifestError:
            assert journal_kind in ("link", "dir") or not acceptable(data, state), data
            assert tree(root) == before  # nothing renamed, removed or cleaned, inside or outside
            OUTCOMES.append("refused")
            return
        after = tree(root)
        if journal_kind == "absent":
            assert finished is False and after == before
            OUTCOMES.append("absent")
            return
        assert finished is True and journal_kind == "file" and acceptable(data, state), data
        outside_of = {k: v for k, v in before.items() if not k.startswith("out/") and k != "out"}
        assert {k: v for k, v in after.items() if not k.startswith("out/") and k != "out"} == outside_of
        inside = {k[4:]: v for k, v in before.items() if k.startswith("out/")}
        assert {k[4:]: v for k, v in after.items() if k.startswith("out/")} == switched(json.loads(data), inside)
        OUTCOMES.append("finished")


def test_any_journal_finishes_a_valid_switch_or_touches_nothing():
    OUTCOMES.clear()
    check_journal()
    # every end is reached, and a fair share of the journals is obeyed (the rules are not vacuous)
    assert {"refused", "finished"} <= set(OUTCOMES) and OUTCOMES.count("finished") >= 5, OUTCOMES
