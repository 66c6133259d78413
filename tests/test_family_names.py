"""No module outside ``layout/families/`` names a family's tensor (docs/architecture.md §8).

A family owns its tensors' names: its table (``Family.tensors``) and the names its runtime block
reads (``Forward.names``, ``Moe``'s templates). The runtime, the Layout, the planner, the
compiler and the vLLM mapping read them from there, so a family that stores a tensor under
another name is one module's change. This test reads every string constant in the package's code
(docstrings and comments explain, so they are not read) and fails on one that spells a family
tensor: a dotted run of two or more of a tensor name's segments (``self_attn.k_proj``,
``embed_tokens.weight``), or a whole constant that is an outer module's name (``"lm_head"``).
The decoder's role names (``gate``, ``q_norm``) are its own words and may coincide with a
segment; ``Names`` maps them to the family's tensors.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shardc.layout.families import FAMILIES
from shardc.layout.model import PRESETS, model_from_config
from shardc.layout.tensors import tensor_table

PKG = Path(__file__).resolve().parents[1] / "shardc"
OWNER = PKG / "layout" / "families"
# Segments every decoder's names share: they name no family's tensor on their own.
GENERIC = {"model", "layers", "N", "weight", "bias", "mlp", "self_attn", "experts"}
# A plan's vocabulary, not a family's: the plan document's default `quantization.ignore` (parts of
# module names, matched against whatever model the plan is built for; layout/plan.py).
ALLOWED = {("layout/plan.py", "lm_head"), ("layout/plan.py", "embed_tokens")}
DOTTED = re.compile(r"[A-Za-z0-9_{}*]+(?:\.[A-Za-z0-9_{}*]+)+")


def _normal(name: str) -> tuple[str, ...]:
    """Segments, a number or a placeholder as N; an f-string's ``{}`` before a segment dropped."""
    parts = (s.removeprefix("{}") if s != "{}" else s for s in name.split("."))
    return tuple("N" if s.isdigit() or s in ("{i}", "{e}", "{}") else s for s in parts)


def family_names() -> set[tuple[str, ...]]:
    """Every family's tensor names (layer and expert numbers as N), from every preset's table and
    the names each family's forward reads."""
    from family_models import MODELS, first_case

    names: set[tuple[str, ...]] = set()
    seen = set()
    # every preset, and the tiny model of a family with none (GLM-4.5: no published config.json here)
    tiny = [MODELS[f.name][first_case(f.name)].config_dict() for f in FAMILIES
            if f.name in MODELS and not f.presets]
    for cfg in [*PRESETS.values(), *tiny]:
        model = model_from_config(cfg)
        seen.add(model.family)
        names |= {_normal(n) for n in tensor_table(model)}
        f = model.forward
        outer = [f.names.embed, f.names.final_norm, f.names.lm_head]
        layer = [f.names.ln1, f.names.ln2, f.names.pre_mlp_norm, f.names.q_b, f.names.sinks]
        layer += [n for _, n in f.names.norms + f.names.latent]
        layer += [m + ".weight" for _, m in f.names.projections]
        if f.moe is not None:
            layer += [f.moe.router, *f.moe.expert, *(f.moe.shared or ()), *(f.moe.stacked or ())]
        names |= {_normal(n) for n in outer} | {_normal(f.names.layer(0) + n) for n in layer if n}
    missing = {f.name for f in FAMILIES} - seen
    assert not missing, f"families with no preset or tiny model to read names from: {sorted(missing)}"
    return names


def fragments(names: set[tuple[str, ...]]) -> tuple[set[tuple[str, ...]], set[str]]:
    """Dotted runs (two or more segments, one of them not generic) and distinctive segments."""
    runs, single = set(), set()
    for parts in names:
        for a in range(len(parts)):
            for b in range(a + 2, len(parts) + 1):
                if any(s not in GENERIC for s in parts[a:b]):
                    runs.add(parts[a:b])
        if "N" not in parts:  # the outer modules (embed_tokens, lm_head): also plain words
            single |= {s for s in parts if s not in GENERIC and s != "norm"}
    return runs, single


def code_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant but docstrings; an f-string's pieces joined by ``{}``."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, str(text)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append((node.lineno, node.value))
    return out


def offences(text: str, runs: set[tuple[str, ...]], single: set[str]) -> list[str]:
    found = [s for s in single if text == s]
    for dotted in DOTTED.findall(text):
        parts = _normal(dotted)
        found += [".".join(r) for r in runs for a in range(len(parts) - len(r) + 1)
                  if parts[a:a + len(r)] == r]
    return found


def test_no_module_outside_the_families_names_a_family_tensor():
    runs, single = fragments(family_names())
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if OWNER in path.parents:
            continue
        rel = path.relative_to(PKG).as_posix()
        for line, text in code_strings(ast.parse(path.read_text(), str(path))):
            hits = [h for h in offences(text, runs, single) if (rel, h) not in ALLOWED]
            if hits:
                bad.append(f"shardc/{rel}:{line}: {sorted(set(hits))[0]!r} in {text[:70]!r}")
    assert not bad, "family tensor names outside layout/families/:\n" + "\n".join(bad)


def test_the_check_finds_what_it_is_for():
    """The scan is not vacuous: the spellings this change removed from runtime/, layout/ranks.py
    and the planner are found, generic words are not."""
    runs, single = fragments(family_names())
    assert offences("model.embed_tokens.weight", runs, single)
    assert offences("self_attn.k_proj.weight", runs, single)
    assert offences("{}pre_feedforward_layernorm.weight", runs, single)
    assert offences("lm_head", runs, single)
    assert offences("mlp.experts.{e}.gate_proj.weight", runs, single)
    assert not offences("model.layers.{}.", runs, single)
    assert not offences("weight_scale", runs, single)
    assert not offences("error: lm_head is missing", runs, single)
