"""MXFP4 sources (#29, #31): gpt-oss as OpenAI publishes it, experts as ``*_blocks`` / ``*_scales``.

transformers' MXFP4 quantizer needs triton kernels (no CPU path), so the source here is the tiny
gpt-oss transformers makes, its stacked experts written in the published layout by a plain
round-to-nearest MXFP4 quantizer below; transformers then is the oracle twice over: its
``convert_moe_packed_tensors`` for every (byte, scale) pair, and its own loader, which on CPU
dequantizes the checkpoint to bf16 (``Mxfp4Config(dequantize=True)``) and whose logits a bf16
build's runtime must equal bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_run import shardc_in

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from moe_plans import moe_plan as _plan  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import LayoutError, SourceError  # noqa: E402
from shardc.layout.quant_formats.mxfp4 import E2M1, MXFP4  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=96, max_position_embeddings=256, initializer_range=0.2, intermediate_size=32,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
QCONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
WIDE = 64  # an intermediate size tp = 2 cuts on whole 32-value blocks (CONFIG's 32 is one block)


def _to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] float -> (blocks [E, out, in/32, 16], scales [E, out, in/32]): each 32-value
    block's power of two such that its largest magnitude fits 6.0, values rounded to E2M1."""
    t = np.ascontiguousarray(np.swapaxes(w.astype(np.float32), 1, 2))  # [E, out, in]
    e, o, i = t.shape
    g = t.reshape(e, o, i // 32, 32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = g / np.ldexp(np.float32(1), exp)[..., None]
    lut = np.asarray(E2M1[:8], np.float32)
    idx = np.abs(np.abs(scaled)[..., None] - lut).argmin(-1) + 8 * (scaled < 0)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def _source(root: Path, **over) -> Path:
    """The tiny gpt-oss (CONFIG with ``over``) saved by transformers, its experts then written as
    MXFP4 in the published layout: ``root/mxfp4``."""
    torch.manual_seed(5)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **over})).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    src = root / "mxfp4"
    src.mkdir()
    tensors = {}
    with safe_open(root / "bf16" / "model.safetensors", "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = _to_mxfp4(t.float().numpy())
                tensors[k + "_blocks"], tensors[k + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            else:
                tensors[k] = t
    save_file(tensors, src / "model.safetensors")
    cfg = json.loads((root / "bf16" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": QCONFIG}))
    return src


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> Path:
    """Intermediate size 32: one 32-value block, which tp = 2 would cut in half."""
    return _source(tmp_path_factory.mktemp("mxfp4"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """Intermediate size 64: two 32-value blocks, one per rank at tp = 2."""
    return _source(tmp_path_factory.mktemp("mxfp4-wide"), intermediate_size=WIDE)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}



def test_dequantize_equals_transformers_for_every_byte_and_scale():
    """All 256 E8M0 scales x all 256 packed bytes, to float32 then bf16 / fp16: bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16), (1, 256, 1, 1))
    scales = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 256, 1), (1, 1, 16))
    sq = MXFP4.from_config(QCONFIG, {})
    got = sq.dequantize("w", (1, 512, 256), {"w_blocks": blocks, "w_scales": scales}.__getitem__)
    for tdt in (torch.bfloat16, torch.float16):
        want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdt)
        mine = torch.from_numpy(np.ascontiguousarray(got)).to(tdt)
        same = (mine.view(torch.int16) == want.view(torch.int16)) | (mine.isnan() & want.isnan())
        assert bool(same.all()), tdt


def test_bf16_build_runs_as_transformers_loads_the_mxfp4_source(mxfp4, tmp_path):
    """transformers loads the MXFP4 checkpoint on CPU by dequantizing it to bf16; a bf16 build of
    it (tp 1, and experts over 2 EP ranks) computes those logits bit for bit."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(mxfp4, dtype=torch.bfloat16,
                                                            experts_implementation="eager").eval()
    x = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    want = ref(x).logits.float()
    built = build(_plan(mxfp4, 1, dtype="bf16"), tmp_path / "bf16").manifest_path
    assert torch.equal(score(open_build(built), x, return_logits=True, timeout_s=120).logits, want)
    with safe_open(built.parent / "model-tp00-pp00.safetensors", "pt") as f:
        state = ref.state_dict()
        for k in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert torch.equal(f.get_tensor(k), state[k]), k


@pytest.mark.heavy
def test_keep_source_whole_experts_and_refusals(mxfp4, tmp_path):
    """``dtype: source``: tp 1 holds the source's tensors byte for byte and loads in transformers
    like the source; expert parallelism over 2 ranks cuts blocks and scales by whole experts, runs
    as the bf16 build of the same plan does (bit for bit), reshards back to tp 1 byte for byte and
    exports the source's tensors and quantization_config back; a TP cut inside a 32-value block is
    refused before anything is written, in words, and so is a scale grid that does not match the weight."""
    one = build(_plan(mxfp4, 1, dtype="source"), tmp_path / "tp1").manifest_path
    a, b = _tensors(mxfp4 / "model.safetensors"), _tensors(one.parent / "model-tp00-pp00.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((one.parent / "config.json").read_text())["quantization_config"] == QCONFIG
    ep = build(_plan(mxfp4, 2, True, dtype="source"), tmp_path / "ep").manifest_path
    with safe_open(ep.parent / "model-tp01-pp00.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks").shape == (2, 64, 2, 16)
    x = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    bf16 = build(_plan(mxfp4, 2, True, dtype="bf16"), tmp_path / "bf16").manifest_path
    want = score(open_build(bf16), x, return_logits=True, timeout_s=120).logits
    assert torch.equal(score(open_build(ep), x, return_logits=True, timeout_s=120).logits, want)
    plan = tmp_path / "tp1.yaml"
    plan.write_text(json.dumps(_plan(mxfp4, 1, dtype="source").data))
    r = shardc_in("reshard", "--manifest", ep, "--plan", plan, "--out", tmp_path / "back", "-q")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back" / "model-tp00-pp00.safetensors").read_bytes() == \
        (one.parent / "model-tp00-pp00.safetensors").read_bytes()
    r = shardc_in("export", "--manifest", ep, "--out", tmp_path / "export", "-q")
    assert r.returncode == 0, r.stderr
    out = _tensors(tmp_path / "export" / "model-00001-of-00001.safetensors")
    assert sorted(out) == sorted(a) and all(torch.equal(out[k], a[k]) for k in a)  # the source's format back
    assert json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"] == QCONFIG
    with pytest.raises(LayoutError) as e:  # intermediate 32 is one block: tp 2 would halve it
        build(_plan(mxfp4, 2, dtype="source"), tmp_path / "tp2")
    assert e.value.one_line() == (
        "replica_group.tp_degree: tensor model.layers.0.mlp.experts.down_proj [4, 32, 64]: each expert's "
        "intermediate size 32 is 1 32-value mxfp4 block (down_proj_blocks, down_proj_scales), cut only between "
        "blocks (vLLM pads a cut inside one with zeros into ranks of unequal size, which shardc does not make), "
        "and each rank would hold 16 values, 0.5 blocks at tp=2 (hint: tp_degree values that keep every mxfp4 "
        "(e2m1, 32-value blocks) cell whole: 1 (or dtype: bf16, which dequantizes))")
    assert not (tmp_path / "tp2").exists()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((mxfp4 / "config.json").read_text())
    t = _tensors(mxfp4 / "model.safetensors")
    t["model.layers.0.mlp.experts.gate_up_proj_scales"] = t["model.layers.0.mlp.experts.gate_up_proj_scales"][:, :, :1].clone()
    save_file(t, bad / "model.safetensors")
    with pytest.raises(SourceError) as e2:
        build(_plan(bad, 1, dtype="bf16"), tmp_path / "badbuild")
    assert "gate_up_proj_scales" in e2.value.message and "implies" in e2.value.message


# ---- TP on whole blocks (#46): intermediate size 64 at tp = 2 -----------------------------------

E, H = CONFIG["num_local_experts"], CONFIG["hidden_size"]


def _vllm_rank(inter: int, tp: int, r: int) -> tuple[int, int]:
    """The intermediate values [start, end) vLLM gives TP rank r of an MXFP4 gpt-oss, written out
    from vllm/model_executor/models/gpt_oss.py ``GptOssModel._load_weights_mxfp4``."""
    blocks = inter // 32
    per = -(-blocks // tp) * 32
    return r * per, min((r + 1) * per, inter)


@pytest.fixture(scope="module")
def wide_tp2(wide, tmp_path_factory) -> Path:
    return build(_plan(wide, 2, dtype="source"), tmp_path_factory.mktemp("wide-tp2") / "b").manifest_path


def test_tp2_holds_the_slices_vllm_loads_and_verifies_deep(wide, wide_tp2):
    """Each rank's blocks and scales are exactly what vLLM's MXFP4 loader narrows the source's to
    for that rank (w13: rows 2·start:2·end of blocks viewed [E, 2I, -1] and of scales; w2: blocks
    viewed [E, H, I/2] at start/2:end/2, scales at start/32:end/32), the biases as vLLM cuts them
    (w13's rows 2·start:2·end, w2's whole), nothing else cut; and ``verify --deep`` against the
    source passes."""
    src = _tensors(wide / "model.safetensors")
    for r in range(2):
        start, end = _vllm_rank(WIDE, 2, r)
        assert (start, end) == (32 * r, 32 * (r + 1))
        got = _tensors(wide_tp2.parent / f"model-tp{r:02d}-pp00.safetensors")
        assert sorted(got) == sorted(src)
        for layer in range(CONFIG["num_hidden_layers"]):
            x = f"model.layers.{layer}.mlp.experts."
            w13 = src[x + "gate_up_proj_blocks"].view(E, 2 * WIDE, -1)[:, 2 * start:2 * end, ...]
            assert got[x + "gate_up_proj_blocks"].shape == (E, 2 * (end - start), H // 32, 16)
            assert torch.equal(got[x + "gate_up_proj_blocks"].view(E, 2 * (end - start), -1), w13)
            assert torch.equal(got[x + "gate_up_proj_scales"], src[x + "gate_up_proj_scales"][:, 2 * start:2 * end, ...])
            w2 = src[x + "down_proj_blocks"].view(E, -1, WIDE // 2)[..., start // 2:end // 2]
            assert got[x + "down_proj_blocks"].shape == (E, H, (end - start) // 32, 16)
            assert torch.equal(got[x + "down_proj_blocks"].reshape(E, H, -1), w2)
            assert torch.equal(got[x + "down_proj_scales"], src[x + "down_proj_scales"][..., start // 32:end // 32])
            assert torch.equal(got[x + "gate_up_proj_bias"], src[x + "gate_up_proj_bias"][:, 2 * start:2 * end])
            assert torch.equal(got[x + "down_proj_bias"], src[x + "down_proj_bias"])
    r = shardc_in("verify", "--manifest", wide_tp2, "--deep", wide)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.heavy
def test_tp2_reshards_exports_and_runs_as_the_bf16_build(wide, wide_tp2, tmp_path):
    """tp 2 resharded to tp 1 is byte for byte the tp 1 build, expert parallelism resharded to
    tp 2 byte for byte the tp 2 build, the export the source's tensors and quantization_config;
    at tp 2 the runtime's logits are the bf16 build's of the same plan, bit for bit (each rank
    dequantizes its own blocks as transformers does the whole), and the tokens ``shardc run``
    generates are the ones the bf16 build's logits pick greedily."""
    def shards(directory: Path, tp: int) -> list[bytes]:
        return [(directory / f"model-tp{r:02d}-pp00.safetensors").read_bytes() for r in range(tp)]

    tp1 = build(_plan(wide, 1, dtype="source"), tmp_path / "tp1").manifest_path
    ep = build(_plan(wide, 2, True, dtype="source"), tmp_path / "ep").manifest_path
    for into, tp, want in ((wide_tp2, 1, tp1), (ep, 2, wide_tp2)):
        plan = tmp_path / f"tp{tp}.yaml"
        plan.write_text(json.dumps(_plan(wide, tp, dtype="source").data))
        r = shardc_in("reshard", "--manifest", into, "--plan", plan, "--out", tmp_path / f"to-tp{tp}", "-q")
        assert r.returncode == 0, r.stderr
        assert shards(tmp_path / f"to-tp{tp}", tp) == shards(want.parent, tp), tp
    r = shardc_in("export", "--manifest", wide_tp2, "--out", tmp_path / "export", "-q")
    assert r.returncode == 0, r.stderr
    src, out = _tensors(wide / "model.safetensors"), _tensors(tmp_path / "export" / "model-00001-of-00001.safetensors")
    assert sorted(out) == sorted(src) and all(torch.equal(out[k], src[k]) for k in src)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"] == QCONFIG
    r = shardc_in("run", "--manifest", wide_tp2, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    tokens = json.loads(r.stdout)["outputs"][0]["tokens"]
    assert len(tokens) == 4
    # row 0: the prompt and the tokens the run chose, so the bf16 build's logits say what greedy picks
    x = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    x[0, :8] = torch.tensor([5, 6, 7, 8, *tokens])
    bf16 = build(_plan(wide, 2, dtype="bf16"), tmp_path / "bf16").manifest_path
    want = score(open_build(bf16), x, return_logits=True, timeout_s=120).logits
    assert torch.equal(score(open_build(wide_tp2), x, return_logits=True, timeout_s=120).logits, want)
    assert want[0, 3:7].argmax(-1).tolist() == tokens
