"""Phi-3 (issue #28): fused ``qkv_proj`` and ``gate_up_proj``, against transformers as the oracle.

The model is made and saved by transformers 5 (tiny, seeded, bf16, a sliding window shorter than
the test sequence). A column split of a fused tensor cuts each part (q, k, v; gate, up) by its own
rule and the rank holds its pieces end to end; the expected pieces are written out by hand below,
not derived from the Layout. Tolerances (stated, with the reason):

- tp=1: the runtime's logits equal transformers' bit for bit (same kernels, same order: the
  fused matmuls split into q/k/v and gate/up give the same rows);
- tp=2 and tp=4: the row-parallel o/down partial sums are reduced in another order and rounded
  to bf16, a few ulps per layer: atol 0.2 (0.10 measured), top-1 agreement >= 0.95.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from cli_run import shardc_in
from family_models import MODELS, PHI3_SHAPE, hf_logits, ids
from plan_helpers import plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from shardc.errors import ModelError  # noqa: E402
from shardc.layout.model import load_model, model_from_config  # noqa: E402
from shardc.layout.ranks import build_layout  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402
from shardc.runtime.support import check_supported  # noqa: E402

SHAPE = PHI3_SHAPE
PHI3 = MODELS["phi3"]["phi3"]  # tests/family_models.py: SHAPE with a window of 16
WINDOW = PHI3.keys["sliding_window"]
T = 40  # tokens per sequence: longer than the sliding window
ATOL = {1: 0.0, 2: 0.2, 4: 0.2}
TOP1 = {1: 1.0, 2: 0.95, 4: 0.95}
QKV = "model.layers.1.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"

# head_dim 16: qkv_proj rows are q [0, 64), k [64, 96), v [96, 128); gate_up_proj rows are
# gate [0, 128), up [128, 256). Each rank's pieces, written out:
PIECES = {
    2: {QKV: [[(0, 32), (64, 80), (96, 112)], [(32, 64), (80, 96), (112, 128)]],
        GATE_UP: [[(0, 64), (128, 192)], [(64, 128), (192, 256)]]},
    # tp 4 > 2 KV heads: q in quarters; ranks 0-1 hold KV head 0 whole, ranks 2-3 KV head 1
    4: {QKV: [[(0, 16), (64, 80), (96, 112)], [(16, 32), (64, 80), (96, 112)],
              [(32, 48), (80, 96), (112, 128)], [(48, 64), (80, 96), (112, 128)]],
        GATE_UP: [[(0, 32), (128, 160)], [(32, 64), (160, 192)], [(64, 96), (192, 224)],
                  [(96, 128), (224, 256)]]},
}


def _hf_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    return hf_logits(path, x)


def _plan(src: Path, tp: int, dtype: str = "bf16"):
    return plan(tp, 1, dtype, name=f"phi3-tp{tp}-{dtype}", source=src)


class _Built:
    """A build's directory and manifest (as ``build`` returns them), from the session's cache."""

    def __init__(self, manifest_path: Path) -> None:
        self.manifest_path, self.out_dir = manifest_path, manifest_path.parent


@pytest.fixture(scope="module")
def phi3(tiny_families, tmp_path_factory):
    """The source, its transformers logits, and one build per plan (made when first asked)."""
    src = tiny_families.source("phi3")
    x = ids(3, T, SHAPE["vocab_size"])

    def built(tp: int, dtype: str = "bf16") -> _Built:
        return _Built(tiny_families.build(_plan(src, tp, dtype)))

    return {"root": tmp_path_factory.mktemp("phi3"), "src": src, "x": x, "want": _hf_logits(src, x), "build": built}


def _cfg(**extra) -> dict:
    return dataclasses.replace(PHI3, keys=SHAPE).config_dict(**extra)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the Layout and the bytes of a fused split --------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
def test_fused_rank_slices_are_each_parts_slice_end_to_end(phi3, tp):
    src = load_file(phi3["src"] / "model.safetensors")
    built = phi3["build"](tp)
    for r in range(tp):
        shard = load_file(built.out_dir / f"model-tp{r:02d}-pp00.safetensors")
        for name, ranks in PIECES[tp].items():
            want = torch.cat([src[name][a:b] for a, b in ranks[r]])
            assert torch.equal(shard[name], want), (name, r)
    # the manifest records the pieces (and the replicated KV head), not a start/stop
    rec = json.loads(built.manifest_path.read_text())["shards"]["model-tp01-pp00.safetensors"]["tensors"]
    assert rec[QKV]["split"] == "fused" and rec[QKV]["dim"] == 0 and "start" not in rec[QKV]
    assert rec[QKV]["pieces"] == [list(p) for p in PIECES[tp][QKV][1]]
    assert rec[QKV]["shape"] == [sum(b - a for a, b in PIECES[tp][QKV][1]), 64]
    assert rec[QKV].get("kv_head") == (0 if tp == 4 else None)
    assert rec[GATE_UP]["pieces"] == [list(p) for p in PIECES[tp][GATE_UP][1]]


def test_the_real_size_preset_lays_out(phi3):
    model = load_model("phi-3-medium")
    assert (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim,
            model.intermediate_size, model.vocab_size) == (5120, 40, 40, 10, 128, 17920, 32064)
    assert model.forward.windows == (2047,) * 40
    layout = build_layout(model, dataclasses.replace(_plan(phi3["src"], 20), pp=2))
    rl = layout.rank(19, 1)
    qkv = rl.tensor("model.layers.39.self_attn.qkv_proj.weight")
    # q: 40 heads / 20 ranks = 2 heads; 10 KV heads < 20 ranks: rank 19 holds KV head 9 whole
    assert qkv.pieces == ((4864, 5120), (6272, 6400), (7552, 7680)) and qkv.kv_head == 9
    params = sum(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1)
                 for t in build_layout(model, _plan(phi3["src"], 1)).ranks[0].tensors)
    assert 13.9e9 < params < 14.0e9  # Phi-3-medium: 14B


def test_a_plan_for_the_hub_repo_dry_runs_offline(tmp_path):
    import yaml

    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"replica_group": {"name": "phi3m", "tp_degree": 2, "pp_degree": 1,
                                                      "dtype": "int8", "gpus_per_replica": 2},
                                    "model": {"source": "hf://microsoft/Phi-3-medium-4k-instruct"}}))
    res = shardc_in("build", plan, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Phi3ForCausalLM 40 layers" in res.stdout and "model-tp01-pp00.safetensors" in res.stdout


# --- the runtime against transformers -----------------------------------------------------------

def test_the_sliding_window_matters(phi3):
    """The same weights without the window give other logits at these positions (the runtime's
    logits equal transformers' past the window at tp 1 and 2: test_conformance.py)."""
    plain = dataclasses.replace(PHI3, keys=SHAPE).save(phi3["root"] / "no-window")
    assert not torch.equal(_hf_logits(plain, phi3["x"]), phi3["want"])


@pytest.mark.heavy
@pytest.mark.parametrize("tp", [4])
def test_tp_logits_agree_with_transformers(phi3, tp):
    got = score(open_build(phi3["build"](tp).manifest_path), phi3["x"], return_logits=True,
                timeout_s=60).logits
    want = phi3["want"]
    torch.testing.assert_close(got, want, rtol=0.01, atol=ATOL[tp])
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= TOP1[tp]


# --- interop: transformers loads a tp=1 build and an export; reshard ---------------------------

def test_reshard_tp2_to_tp1_is_the_direct_tp1_build(phi3, tmp_path):
    import yaml

    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"replica_group": {"name": "phi3-tp1-bf16", "tp_degree": 1, "pp_degree": 1,
                                                      "dtype": "bf16", "gpus_per_replica": 1},
                                    "model": {"source": str(phi3["src"])}}))
    out = tmp_path / "r"
    res = shardc_in("reshard", "--manifest", phi3["build"](2).manifest_path, "--plan", plan, "--out", out,
                    "--manifests-dir", tmp_path / "m")
    assert res.returncode == 0, res.stdout + res.stderr
    direct = phi3["build"](1).out_dir
    for f in ("model-tp00-pp00.safetensors", "config.json"):
        assert _sha(out / f) == _sha(direct / f), f


def test_export_of_a_tp2_build_is_the_fused_checkpoint(phi3, tmp_path):
    out = tmp_path / "hf"
    res = shardc_in("export", "--manifest", phi3["build"](2).manifest_path, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    src = load_file(phi3["src"] / "model.safetensors")
    got = {}
    for f in out.glob("model*.safetensors"):
        got |= load_file(f)
    assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)
    assert torch.equal(_hf_logits(out, phi3["x"]), phi3["want"])


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_quantized_build_verifies_deep(phi3, dtype):
    built = phi3["build"](4, dtype)  # tp 4 > 2 KV heads: replicated KV pieces and their scales
    res = shardc_in("verify", "--manifest", built.manifest_path, "--deep", phi3["src"], "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert all("deep" in r["checks"] for r in json.loads(res.stdout)["ranks"])
    rec = json.loads(built.manifest_path.read_text())["shards"]["model-tp02-pp00.safetensors"]["tensors"]
    weight = QKV + ("_packed" if dtype == "int8" else "")
    assert rec[QKV + "_scale"]["pieces"] == [list(p) for p in PIECES[4][QKV][2]]
    assert rec[weight]["pieces"] == rec[QKV + "_scale"]["pieces"]


def test_an_int8_reshard_reassembles_replicated_pieces(phi3, tmp_path):
    """int8 tp4 -> tp2: the packed values and scales come back from pieces (KV pieces held twice,
    checked identical) and re-slice to the direct int8 tp2 build, byte for byte."""
    from shardc.compiler.build_files import open_local_input
    from shardc.compiler.reshard import reshard

    r = reshard(open_local_input(phi3["build"](4, "int8").manifest_path), _plan(phi3["src"], 2, "int8"),
                tmp_path / "r")
    direct = phi3["build"](2, "int8").out_dir
    for rank in range(2):
        f = f"model-tp{rank:02d}-pp00.safetensors"
        assert _sha(r.out_dir / f) == _sha(direct / f), f


# --- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "key", "value"), [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor", "0.75"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "rope_parameters.partial_rotary_factor", "0.75"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}},
     "rope_parameters", "rope_type='longrope'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                "long_factor": [2.0] * 8}},
     "rope_scaling", "rope_type='su'"),
])
def test_what_the_runtime_does_not_compute_is_refused_in_one_line(extra, key, value):
    """Rope does not change the sharding: such a config builds (model_from_config accepts it), and
    run / gate refuse it before a rank starts with one line naming the key and value."""
    model = model_from_config(_cfg(**extra))
    with pytest.raises(ModelError) as exc:
        check_supported(model)
    line = exc.value.one_line()
    assert "\n" not in line and value in line and key in line, line
    assert exc.value.key == key
