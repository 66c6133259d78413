"""The dense families beside Llama's block (#28): Qwen3, Granite, and sliding-window attention
(Mistral, Qwen2, Qwen3), against transformers as the oracle.

Each model is made and saved by transformers 5 (random weights, norms perturbed from 1 so that a
norm weight read into the wrong place shows, a fixed seed, bf16), and transformers' own forward
gives the logits shardc's runtime must reproduce: at tp=1 bit for bit (the same operations in the
same order: measured max |diff| 0), at tp=2 within the bf16 rounding of row-parallel partial sums
(measured up to 0.06 here; the bound is Llama's, tests/families/test_transformers5_configs.py). Each case
also shows that what differs from Llama matters: the same weights run as a Llama (no q/k norms,
no multipliers, no window) give logits beyond the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc_in
from family_models import DENSE_SHAPE as SHAPE
from family_models import MODELS, hf_logits, ids
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardc.compiler.compile import build  # noqa: E402
from shardc.layout.model import model_from_config  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402

T = 40  # tokens per sequence: past the sliding windows below
ATOL = {1: 0.0, 2: 0.2}
TOP1 = {1: 1.0, 2: 0.95}
# the dense cases of tests/family_models.py: Qwen3, Granite, and the sliding windows of Llama's block
CASES = {**MODELS["qwen3"], **MODELS["granite"],
         **{k: MODELS["llama"][k] for k in ("mistral-window", "qwen2-window")}}


def _hf_logits(src: Path, x: torch.Tensor, as_llama: bool = False) -> torch.Tensor:
    if as_llama:  # the same tensors read as a Llama: what running without the family's math gives
        cfg = json.loads((src / "config.json").read_text())
        keep = {k: cfg[k] for k in SHAPE if k in cfg} | {"head_dim": cfg.get("head_dim")}
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep, tie_word_embeddings=cfg.get(
            "tie_word_embeddings", False))).to(torch.bfloat16)
        m.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(src).state_dict(), strict=False)
        with torch.no_grad():
            return m.eval()(x).logits.float()
    return hf_logits(src, x)


def _build(src: Path, out: Path, tp: int) -> Path:
    name = f"{src.name}-tp{tp}"
    plan = make_plan(tp, name=name, source=src)
    return build(plan, out / name).manifest_path


@pytest.fixture(scope="module")
def saved(tiny_families):
    return tiny_families.root, {name: tiny_families.source(name) for name in CASES}


def _ids(seed: int) -> torch.Tensor:
    return ids(seed, T, SHAPE["vocab_size"])


def test_configs_read_as_their_families(saved):
    _, models = saved
    got = {name: model_from_config(json.loads((src / "config.json").read_text()))
           for name, src in models.items()}
    assert {n: m.family for n, m in got.items()} == {
        "qwen3": "qwen3", "qwen3-window": "qwen3", "granite": "granite", "mistral-window": "llama",
        "qwen2-window": "llama"}
    assert got["qwen3"].forward.qk_norm and not got["qwen3"].forward.windows
    # max_window_layers=1: layer 0 full, layer 1 windowed (transformers' own layer_types)
    assert got["qwen3-window"].forward.windows == (None, 12)
    assert got["qwen2-window"].forward.windows == (None, 12)
    assert got["mistral-window"].forward.windows == (12, 12)
    f = got["granite"].forward
    assert (f.embed_scale, f.residual_scale, f.attn_scale, f.logits_divisor) == (12.0, 0.22, 0.0078125, 16.0)


# the family's math matters: the same weights run as a Llama (no q/k norms, no multipliers, no
# window) give logits beyond the tolerance, on the inputs of each run (tests/families/test_conformance.py
# runs qwen3, granite and mistral-window at tp 1 and 2 against transformers)
@pytest.mark.heavy
@pytest.mark.parametrize("case, tp", [("qwen3", 1), ("qwen3", 2), ("granite", 1), ("granite", 2),
                                      ("mistral-window", 2)])
def test_the_familys_math_matters(saved, case, tp):
    _, models = saved
    x = _ids(seed=tp)
    assert (_hf_logits(models[case], x) - _hf_logits(models[case], x, as_llama=True)).abs().max() > 0.5


@pytest.mark.heavy
@pytest.mark.parametrize("case, tp", [("qwen3-window", 1), ("qwen2-window", 1)])
def test_runtime_matches_transformers(saved, tiny_families, case, tp):
    """The windowed cases beyond the conformance suite's (max_window_layers=1: layer 0 full)."""
    _, models = saved
    x = _ids(seed=tp)
    want = _hf_logits(models[case], x)
    assert (want - _hf_logits(models[case], x, as_llama=True)).abs().max() > 0.5  # the family's math matters
    got = score(open_build(tiny_families.build(make_plan(tp, name=f"{case}-tp{tp}", source=models[case]))), x,
                return_logits=True, timeout_s=60).logits
    torch.testing.assert_close(got, want, rtol=0.01 if tp > 1 else 0, atol=ATOL[tp])
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= TOP1[tp]


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["qwen3", "granite"])
def test_an_int8_build_quantizes_projections_and_keeps_norms_whole(tiny_families, case):
    """In an int8 tp=2 build (verified --deep with fp8 in test_conformance.py) q_norm / k_norm stay
    16-bit and whole on every rank; the projections are quantized."""
    manifest = tiny_families.built(case, 2, dtype="int8")
    m = json.loads(manifest.read_text())
    recs = {n: rec for s in m["shards"] for n, rec in s["tensors"].items()} if isinstance(
        m["shards"], list) else {n: rec for s in m["shards"].values() for n, rec in s["tensors"].items()}
    if case == "qwen3":
        norm = recs["model.layers.0.self_attn.q_norm.weight"]
        assert (norm["split"], norm["dtype"], norm["shape"]) == ("replicated", "BF16", [16])
    assert recs["model.layers.0.self_attn.q_proj.weight_packed"]["quant"] == "int8"


# preset, a tp its heads allow, the parameter count its model card states, the pick on H100s:
# Qwen3-32B's 61 GiB of bf16 weights leave one 80 GiB GPU a 10 GiB KV pool, short of one
# 40,960-token request (64 layers x 8 KV heads x 128 x 2 x 2 B = 256 KiB/token: 10 GiB), so tp=2;
# Granite's 15.2 GiB leave room for its 131,072-token request (160 KiB/token: 20 GiB) on one GPU.
@pytest.mark.parametrize("preset, tp, params, pick", [("qwen3-32b", 8, 32.8e9, 2),
                                                      ("granite-3.1-8b", 4, 8.17e9, 1)])
def test_real_size_presets_dry_run_and_plan(tmp_path, preset, tp, params, pick):
    """A real-size config of each family validates and plans without weights."""
    plan = tmp_path / "p.yaml"
    plan.write_text(json.dumps({
        "replica_group": {"name": preset, "tp_degree": tp, "pp_degree": 1, "dtype": "bf16",
                          "gpus_per_replica": tp}, "model": {"source": "/nonexistent"}}))
    r = shardc_in("build", plan, "--dry-run", "--model", preset, "--json")
    assert r.returncode == 0, r.stderr
    r = shardc_in("plan", "--model", preset, "--gpu", "h100-sxm", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert abs(out["model"]["params"] / params - 1) < 0.005
    assert out["recommended"]["tp"] == pick


@pytest.mark.heavy
def test_qwen3_reshard_and_gate_against_transformers(tmp_path, demo_model_dir):
    """A Qwen3 with the demo's tokenizer (vocab 49152): reshard tp1 -> tp2 gives the same shard
    bytes as a direct tp2 build, and gate scores that candidate against the tp1 baseline scored by
    transformers itself (--reference transformers): it passes, and the delta is the bf16 rounding
    of tp=2's partial sums only."""
    import hashlib

    from shardc.runtime.gate import run_gate

    torch.manual_seed(3)
    cfg = transformers.Qwen3Config(**{**SHAPE, "vocab_size": 49152}, head_dim=16)
    src = tmp_path / "qwen3-tok"
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((demo_model_dir / f).read_bytes())
    base = _build(src, tmp_path, 1)
    direct = _build(src, tmp_path / "direct", 2)
    plan = tmp_path / "qwen3-tok-tp2.yaml"
    plan.write_text(json.dumps({
        "replica_group": {"name": "qwen3-tok-tp2", "tp_degree": 2, "pp_degree": 1, "dtype": "bf16",
                          "gpus_per_replica": 2}, "model": {"source": str(src)}}))
    resharded = tmp_path / "resharded"
    r = shardc_in("reshard", "--manifest", base, "--plan", plan, "--out", resharded, "-q")
    assert r.returncode == 0, r.stderr

    def digests(d: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.safetensors"))}

    assert digests(resharded) == digests(direct.parent) and len(digests(direct.parent)) == 2
    report = run_gate(base, resharded / "manifest.json", max_tokens=256, window=128, timeout_s=60,
                      reference="transformers")
    assert report.passed and report.baseline.scored_by["name"] == "transformers"
    assert abs(report.ppl_delta_pct) < 0.5 and report.top1_agreement > 0.9
