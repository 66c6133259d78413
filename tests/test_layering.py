"""The package layering holds: no import cycle, nothing imports a layer above its own.

Every module of shardc is parsed (not imported) and every static import counts, function-local
ones included: a lazy import upward is still a dependency upward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardc

PKG = Path(shardc.__file__).resolve().parent

# Lower number = lower layer. A module may import its own layer's siblings within its package
# and anything in a lower layer; store, runtime and planner sit side by side and never import
# each other; planner uses layout only.
LAYERS = {
    "shardc.version": 0, "shardc.errors": 0, "shardc.results": 0,
    "shardc.layout": 1, "shardc.formats": 2, "shardc.compiler": 3, "shardc.verify": 4,
    "shardc.store": 5, "shardc.runtime": 5, "shardc.planner": 5,
    "shardc.commands": 6, "shardc.cli": 7,
    "shardc": 8,  # the facade (shardc/__init__: shardc.load_shard) sits above every package
}
# Known violations, each to be removed by the change that fixes it (the goal is none).
KNOWN_UPWARD: set[str] = set()
KNOWN_CYCLES: set[str] = set()
ALLOWED_ONLY = {"shardc.planner": {"shardc", "shardc.errors", "shardc.layout", "shardc.planner"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str) -> set[str]:
    """Absolute names of the shardc modules ``path`` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    # imports under `if TYPE_CHECKING:` never run: annotations may name a module that imports this one
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            # "from . import x" / "from .pkg import mod": x may be a module
            found |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in found if m == "shardc" or m.startswith("shardc.")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path, name) if m in files and m != name}
    return graph


def _group(mod: str) -> str:
    """The layer a module belongs to: its subpackage, or itself for top-level modules."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else mod


def test_no_upward_imports():
    graph = _graph()
    bad = []
    for mod, deps in sorted(graph.items()):
        g = _group(mod)
        assert g in LAYERS, f"{mod} is in no layer: add its package to LAYERS"
        for dep in sorted(deps):
            d = _group(dep)
            if d == g:
                continue
            if g in ALLOWED_ONLY and d not in ALLOWED_ONLY[g]:
                bad.append(f"{mod} -> {dep}")
            elif LAYERS[d] >= LAYERS[g] and d not in ("shardc.version", "shardc.errors"):
                bad.append(f"{mod} -> {dep}")
    bad = [b for b in bad if b not in KNOWN_UPWARD]
    assert not bad, "imports across the layering:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    cycles = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_package_seams_are_light_and_complete():
    """Each package's __init__ names its public seam in __all__; importing the packages imports
    nothing heavy, and every name in a seam resolves."""
    import subprocess
    import sys

    code = ("import sys, importlib\n"
            "pkgs = ['shardc.layout', 'shardc.formats', 'shardc.compiler', 'shardc.verify']\n"
            "mods = [importlib.import_module(p) for p in pkgs]\n"
            "heavy = [m for m in ('numpy', 'torch', 'numba') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "missing = [f'{m.__name__}.{n}' for m in mods for n in m.__all__ if not hasattr(m, n)]\n"
            "assert not missing, missing\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
