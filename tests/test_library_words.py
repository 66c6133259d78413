"""#44 item 4: the library speaks fields, the CLI speaks flags. No error the library raises names a
command-line flag (key, message or hint): it names the field of its call or plan, quoting a call's
field in backticks (``give `source` ...``), and the CLI (commands/output.py ``error_line``) says the
running command's flag for it. A flag in the library would be wrong for the other callers: the
Python API, another command with another flag, vLLM's load format."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardc
from shardc import errors

PKG = Path(shardc.__file__).resolve().parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")
# other programs' flags, named in a command line of theirs ("hf download REPO --local-dir DIR")
OTHERS = {"--local-dir", "--nproc-per-node"}


def _error_classes() -> set[str]:
    """shardc's errors (errors.py) and every library class derived from one, by name."""
    names = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, Exception)}
    classes = [n for p in PKG.rglob("*.py") for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)]
    while True:
        more = {c.name for c in classes if c.name not in names
                and any((b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) in names for b in c.bases)}
        if not more:
            return names
        names |= more


ERRORS = _error_classes()


def _library() -> list[Path]:
    """Every module but the CLI's (commands/, cli.py) and vLLM's plugin (serving/: its errors reach
    a vLLM user, and the flags they name are vLLM's)."""
    return [p for p in sorted(PKG.rglob("*.py"))
            if p.relative_to(PKG).parts[0] not in ("commands", "cli.py", "serving")]


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _flags_in_errors(path: Path) -> list[str]:
    """``file:line: text`` for every flag in the arguments of a shardc error raised in ``path``, and
    in the module-level string constants those calls use as hints (NAME = "... --flag ...")."""
    tree = ast.parse(path.read_text(), str(path))
    consts = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name not in ERRORS:
            continue
        parts = [*node.args, *(k.value for k in node.keywords)]
        texts = [s for p in parts for s in _strings(p)]
        texts += [s for p in parts for n in ast.walk(p) if isinstance(n, ast.Name) and n.id in consts
                  for s in _strings(consts[n.id])]
        found += [f"{path.relative_to(PKG)}:{node.lineno}: {t!r}" for t in texts
                  if set(FLAG.findall(t)) - OTHERS]
    return found


def test_no_library_error_names_a_flag():
    bad = [line for p in _library() for line in _flags_in_errors(p)]
    assert not bad, "library errors that name a flag (name the field; the CLI maps it):\n" + "\n".join(bad)


def test_the_cli_says_the_flag_for_a_field():
    import click

    from shardc.commands.output import error_line
    from shardc.errors import PlanError

    cmd = click.Command("x", params=[click.Option(["--out"]), click.Option(["--source"])])
    exc = PlanError("the output directory d is the input build's own directory", key="out",
                    hint="give `source` another checkpoint, or `out` another directory; `deep` stays")
    assert error_line(exc, cmd) == ("--out: the output directory d is the input build's own directory (hint: give "
                                    "--source another checkpoint, or --out another directory; `deep` stays)")
    assert exc.one_line() == ("out: the output directory d is the input build's own directory (hint: give `source` "
                              "another checkpoint, or `out` another directory; `deep` stays)")
