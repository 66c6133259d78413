"""The bundled demo model (SmolLM2-135M) builds with the shipped plans and reassembles exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from reassemble import load_source, reassemble

from shardc.compiler.compile import BuildResult, build
from shardc.compiler.quantize import quantize
from shardc.formats.manifest import load
from shardc.layout.plan import load_plan
from shardc.verify.checks import verify_build

# The Llama family's linear projections, written out as the oracle (the code reads them from the
# family's tensor table).
QUANTIZABLE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")

PLANS = Path(__file__).resolve().parents[2] / "plans"
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def demo_src(demo_model_dir):
    return demo_model_dir, load_source(demo_model_dir)


@pytest.fixture(scope="module")
def built(demo_model_dir, tmp_path_factory):
    """built(plan_name): the shipped plan's build, made once for the tests here, which only read it
    (reassembled, verified, its manifest's bytes against the committed one)."""
    out = tmp_path_factory.mktemp("demo-builds")
    done: dict[str, BuildResult] = {}

    def get(plan_name: str) -> BuildResult:
        if plan_name not in done:
            done[plan_name] = build(load_plan(PLANS / f"{plan_name}.yaml"), out / plan_name)
        return done[plan_name]

    return get


@pytest.mark.parametrize("plan_name", ["demo-tp1pp1-bf16", "demo-tp3pp2-bf16"])
def test_demo_16bit_reassembles(demo_src, built, plan_name):
    ckpt, src = demo_src
    plan = load_plan(PLANS / f"{plan_name}.yaml")
    assert Path(plan.source) == ckpt.resolve()
    res = built(plan_name)
    rebuilt = reassemble(res.out_dir)
    for name, t in src.items():
        assert torch.equal(rebuilt[name].view(torch.uint8), t.view(torch.uint8)), name
    if plan.pp > 1:  # tied embeddings: the last stage carries lm_head cut from the embedding
        assert torch.equal(rebuilt["lm_head.weight"], src["model.embed_tokens.weight"])
    report = verify_build(load(res.manifest_path), res.out_dir)
    assert report.ok, report.problems
    assert (res.out_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("plan_name", ["demo-tp3pp1-int8", "demo-tp3pp1-fp8"])
def test_demo_quantized_reassembles(demo_src, built, plan_name):
    ckpt, src = demo_src
    plan = load_plan(PLANS / f"{plan_name}.yaml")
    res = built(plan_name)
    rebuilt = reassemble(res.out_dir)
    scheme = plan.dtype
    names = sorted(n for n in src if QUANTIZABLE.fullmatch(n))  # the oracle: written out here
    assert len(names) == 30 * 7
    for name in names[::17]:  # a spread of layers and projections, exact against the pure function
        q, s, _ = quantize(name, src[name], scheme)
        assert torch.equal(rebuilt[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(rebuilt[name + "_scale"], s), name
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(rebuilt[name], src[name])
    stats = [t["stats"] for sh in res.manifest.shards for t in sh.tensors.values() if "stats" in t]
    assert stats and max(s["rel_rms_err"] for s in stats) < (0.02 if scheme == "int8" else 0.06)


DEMO_MANIFESTS = PLANS.parent / "tests" / "data" / "demo-manifests"


@pytest.mark.parametrize("plan_name", sorted(p.stem for p in DEMO_MANIFESTS.glob("demo-*.json")))
def test_committed_demo_manifests_are_current(built, plan_name):
    """tests/data/demo-manifests/*.json are the demo builds' records, kept as golden files: a
    build today writes exactly those bytes. (manifests/, where builds put their rollout records
    by default, is untracked: the README's examples write there.)"""
    res = built(plan_name)
    assert res.manifest_path.read_bytes() == (DEMO_MANIFESTS / f"{plan_name}.json").read_bytes()
