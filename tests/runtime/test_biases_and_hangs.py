"""Runtime cases the README promises that no runtime test covered: models with biases (Llama
attention_bias + mlp_bias, Qwen2's q/k/v biases), linear rope scaling, and a rank that hangs inside
a tensor-parallel collective. The reference is transformers' own model of the source checkpoint.

Biases are scaled up (N(0, 1)) so that dropping one, adding a row-parallel bias once per rank, or
slicing a column bias wrongly moves the logits far beyond the bf16 tolerance (checked in-test).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import DistributedError  # noqa: E402
from shardc.runtime.api import generate, open_build, score  # noqa: E402

# tp1: same kernels as transformers; tp2: bf16 partial sums of the row-parallel projections.
ATOL = {1: 2e-3, 2: 0.02}


def _build(src: Path, out: Path, tp: int, pp: int = 1):
    name = f"{src.name}-tp{tp}pp{pp}"
    plan = make_plan(tp, pp, name=name, source=src)
    return open_build(build(plan, out / name).manifest_path)


def _checkpoint(root: Path, name: str, *, arch: str = "LlamaForCausalLM", bias_scale: float = 50.0, **cfg_extra) -> Path:
    from safetensors.torch import load_file, save_file

    from shardc.compiler.synthetic import llama_config, write_checkpoint

    cfg = llama_config(num_layers=2, vocab_size=64, architecture=arch,
                       **{k: v for k, v in cfg_extra.items() if k in ("rope_scaling", "max_position_embeddings")})
    cfg.update({k: v for k, v in cfg_extra.items() if k in ("attention_bias", "mlp_bias")})
    src = write_checkpoint(root / name, cfg, seed=4)
    sd = load_file(src / "model.safetensors")
    for k in sd:
        if k.endswith(".bias"):
            sd[k] = (sd[k].float() * bias_scale).to(torch.bfloat16)
    save_file(sd, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _hf(src: Path, zero_bias: bool = False):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    if zero_bias:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith(".bias"):
                    p.zero_()
    return m


def _hf_logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(x).logits.float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt-oracle")
    return {
        "llama-bias": _checkpoint(root, "llama-bias", attention_bias=True, mlp_bias=True),
        "qwen2": _checkpoint(root, "qwen2", arch="Qwen2ForCausalLM"),
        "linear-rope": _checkpoint(root, "linear-rope", rope_scaling={"rope_type": "linear", "factor": 4.0},
                                   max_position_embeddings=32),
        "out": root / "builds",
    }


def _ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind, tp", [("llama-bias", 2), ("qwen2", 2), ("llama-bias", 1)])
def test_biased_models_match_transformers(models, kind, tp):
    src = models[kind]
    names = json.loads((src / "config.json").read_text())
    x = _ids(20, seed=tp)
    want = _hf_logits(_hf(src), x)
    # the biases matter: without them the logits move far more than the tolerance
    assert (want - _hf_logits(_hf(src, zero_bias=True), x)).abs().max() > 0.5, names
    got = score(_build(src, models["out"], tp), x, return_logits=True, timeout_s=60).logits
    torch.testing.assert_close(got, want, rtol=0.01, atol=ATOL[tp])


def test_linear_rope_scaling_matches_transformers(models):
    src = models["linear-rope"]
    x = _ids(64, seed=5)
    want = _hf_logits(_hf(src), x)
    got = score(_build(src, models["out"], 1), x, return_logits=True, timeout_s=60).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL[1])


def test_hang_inside_a_tp_collective_times_out_and_is_named(models, monkeypatch):
    """tp=2, one stage: rank 1 stops at its third step, so rank 0 waits inside an all-reduce. The
    TP group's own timeout must end that wait ("timed out"), not the default 30 minutes."""
    ref = _build(models["qwen2"], models["out"], 2)
    monkeypatch.setenv("SHARDC_FAULT", "hang:1:3")
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(tp 1, pp 0\) hung") as err:
        generate(ref, [[1, 2, 3]], 8, eos=[], timeout_s=4)
    assert "timed out" in str(err.value)
    assert time.monotonic() - t0 < 4 + 30
