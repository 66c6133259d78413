"""The planner sizes a model in the form it is published in (#43): presets of checkpoints published
quantized carry their ``quantization_config`` and are sized at their stored bytes (``dtype:
source``, scales included) first, 16-bit and requantized forms beside them; defaults never exceed
the model's context; the table's columns never run together.

The two hand-worked figures below are arithmetic on the published configs written out here, not
the Layout's tensor records the planner reads, so a wrong record shows as a difference."""

from __future__ import annotations

import json
import math
import re

import pytest
from cli_run import one_line, shardc_in

from shardc.layout.model import PRESETS, load_model
from shardc.planner.formulas import Workload
from shardc.planner.gpus import GIB, Cluster, get_gpu
from shardc.planner.search import search


def _gpt_oss_120b_mxfp4_bytes() -> int:
    """openai/gpt-oss-120b as published: routed experts in MXFP4 (e2m1 values two to a byte in
    32-value blocks, one e8m0 scale byte per block, bias bf16), everything else bf16."""
    hidden, inter, layers, heads, kv, head_dim, vocab, experts = 2880, 2880, 36, 64, 8, 64, 201088, 128
    q, kvw = heads * head_dim, kv * head_dim
    attention = (q * hidden + q) + 2 * (kvw * hidden + kvw) + (hidden * q + hidden) + heads  # biases, sinks
    router = experts * hidden + experts

    def mxfp4(rows: int, cols: int) -> int:
        return rows * (cols // 32) * 16 + rows * (cols // 32)

    experts_bytes = experts * (mxfp4(2 * inter, hidden) + 2 * inter * 2) + experts * (mxfp4(hidden, inter) + hidden * 2)
    layer = (attention + router + 2 * hidden) * 2 + experts_bytes
    return layers * layer + (2 * vocab * hidden + hidden) * 2


def _deepseek_v3_fp8_bytes() -> int:
    """deepseek-ai/DeepSeek-V3 as published: every projection e4m3 with an fp32 scale per 128 x 128
    block (``weight_scale_inv``); embeddings, norms bf16; the router weight and its correction bias
    fp32 (as shardc's build keeps the router, transformers' keep-in-fp32 list); the MTP layer is not
    part of a build."""
    hidden, inter, moe_inter, experts, shared = 7168, 18432, 2048, 256, 1
    q_rank, kv_rank, nope, rope, v_head, heads, vocab, layers, dense = 1536, 512, 128, 64, 128, 128, 129280, 61, 3

    def fp8(out: int, inp: int) -> int:
        return out * inp + math.ceil(out / 128) * math.ceil(inp / 128) * 4

    attention = (fp8(q_rank, hidden) + q_rank * 2 + fp8(heads * (nope + rope), q_rank) + fp8(kv_rank + rope, hidden)
                 + kv_rank * 2 + fp8(heads * (nope + v_head), kv_rank) + fp8(hidden, heads * v_head))

    def mlp(width: int) -> int:
        return 2 * fp8(width, hidden) + fp8(hidden, width)

    norms = 2 * hidden * 2
    moe = experts * mlp(moe_inter) + mlp(moe_inter * shared) + experts * hidden * 4 + experts * 4
    return dense * (attention + norms + mlp(inter)) + (layers - dense) * (attention + norms + moe) + (2 * vocab * hidden + hidden) * 2


def test_presets_carry_their_published_quantization():
    assert PRESETS["gpt-oss-120b"]["quantization_config"]["quant_method"] == "mxfp4"
    assert PRESETS["deepseek-v3"]["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert PRESETS["qwen3-8b-fp8"]["quantization_config"]["quant_method"] == "fp8"
    assert "quantization_config" not in PRESETS["qwen3-8b"] and "quantization_config" not in PRESETS["llama-3.1-70b"]
    # the FP8 release is the 16-bit one's model
    assert {k: v for k, v in PRESETS["qwen3-32b-fp8"].items() if k != "quantization_config"} == PRESETS["qwen3-32b"]


def test_gpt_oss_120b_mxfp4_on_one_h100():
    """Published MXFP4, it fits one 80 GB card, as vLLM serves it: the pick is tp=1 source, its
    weights the stored bytes worked out by hand (60.77 GiB; 217.61 GiB at 16 bits)."""
    s = search(load_model("gpt-oss-120b"), Cluster(get_gpu("h100-sxm")), Workload(), model_name="gpt-oss-120b")
    c = s.recommended
    assert c is not None and (c.dtype, c.tp, c.pp, c.gpus) == ("source", 1, 1, 1)
    assert c.memory.weights == _gpt_oss_120b_mxfp4_bytes()
    assert round(c.memory.weights / GIB, 2) == 60.77
    sixteen = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("bf16", 1, 1))
    assert not sixteen.fits and "217.61 GiB" in sixteen.reasons[0]


def test_deepseek_v3_fp8_on_8_h200():
    """Published block FP8: sized at its stored bytes (627.12 GiB at tp=1, worked out by hand), and
    on 8 x H200 the pick is the FP8 checkpoint as published, not an int8 or fp8 requantization that
    ties with it on every figure."""
    model = load_model("deepseek-v3")
    s = search(model, Cluster(get_gpu("h200")), Workload(), model_name="deepseek-v3")
    c = s.recommended
    assert c is not None and c.dtype == "source" and c.gpus == 8
    one = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("source", 1, 1))
    assert f"{_deepseek_v3_fp8_bytes() / GIB:.2f} GiB" in one.reasons[0]
    assert f"{_deepseek_v3_fp8_bytes() / GIB:.2f}" == "627.12"
    twins = [x for x in s.candidates if x.fits and x.dtype in ("int8", "fp8") and (x.tp, x.pp, x.ep) == (c.tp, c.pp, c.ep)]
    assert len(twins) == 2 and all(f"{x.cost.dollars_per_mtok:.2f}" == f"{c.cost.dollars_per_mtok:.2f}" for x in twins)


def test_kimi_k2_fp8_on_8_h200_goes_to_stages():
    """moonshotai/Kimi-K2-Instruct (DeepSeek-V3's architecture, 384 experts, block FP8 as published) on
    8 x H200: every unit of 8 that fits has two or four stages, since one 131,072-token request's MLA
    latent (whole on every GPU under TP) no longer fits beside the weights at tp=8, while stages split
    it by layers. The card minimum counts the latent whole (9 cards), so the fit rules once tried only
    tp=8's stages (16 GPUs) and recommended nothing; the pick is tp=4 pp=2 as published."""
    model = load_model("kimi-k2")
    assert (model.num_layers, model.forward.moe.experts, PRESETS["kimi-k2"]["model_type"]) == (61, 384, "kimi_k2")
    s = search(model, Cluster(get_gpu("h200")), Workload(), model_name="kimi-k2")
    c = s.require_recommendation()
    assert (c.dtype, c.tp, c.pp, c.gpus) == ("source", 4, 2, 8)
    tp8 = next(x for x in s.candidates if (x.dtype, x.tp, x.pp, x.ep) == ("source", 8, 1, 1))
    assert not tp8.fits and "KV demand" in tp8.reasons[0]
    assert s.trails[0].minimum == 9


def test_qwen3_moe_fp8_presets_leave_the_router_in_16_bits():
    """Qwen/Qwen3-30B-A3B-FP8 and -235B-A22B-FP8: the 16-bit release's config plus block FP8 that leaves
    lm_head and every layer's router (mlp.gate) and norms out (145 and 283 entries, as published)."""
    for name, layers in (("qwen3-30b-a3b-fp8", 48), ("qwen3-235b-a22b-fp8", 94)):
        q = PRESETS[name]["quantization_config"]
        assert len(q["modules_to_not_convert"]) == 1 + 3 * layers and q["modules_to_not_convert"][:3] == [
            "lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate"]
        assert {k: v for k, v in PRESETS[name].items() if k != "quantization_config"} == PRESETS[name.removesuffix("-fp8")]
    s = search(load_model("qwen3-30b-a3b-fp8"), Cluster(get_gpu("h200")), Workload(), model_name="qwen3-30b-a3b-fp8")
    c = s.require_recommendation()
    assert (c.dtype, c.gpus) == ("source", 1)
    fp8 = next(x for x in s.candidates if (x.dtype, x.tp, x.pp, x.ep) == ("fp8", 1, 1, 1))
    # the same e4m3 values; the published form has one fp32 scale per 128 x 128 block, shardc's fp8
    # one per output row (48 x (128 experts x 3,584 + attention 7,168) rows x 4 B = 89,456,640 B against
    # 48 x (128 x 288 + 1,152) blocks x 4 B = 7,299,072 B)
    assert fp8.memory.weights - c.memory.weights == 82_157_568


def test_dtype_source_is_in_help_and_the_kv_line_names_a_real_dtype():
    help_text = " ".join(shardc_in("plan", "--help").stdout.split())
    assert "auto|source|fp16|bf16|int8|fp8" in help_text and "stored bytes" in help_text
    out = shardc_in("plan", "--model", "gpt-oss-120b", "--gpu", "h100-sxm", "--dtype", "source")
    assert out.returncode == 0, out.stderr
    assert "KV bf16 (2 B/value)" in out.stdout and "KV source" not in out.stdout


@pytest.fixture
def short_model(tmp_path):
    """A checkpoint config whose longest request (512 tokens) is shorter than the default average
    context (2,048: 1,536-token prompts and 1,024-token outputs)."""
    from shardc.compiler.synthetic import llama_config

    c = llama_config(num_layers=2, hidden_size=64, intermediate_size=96) | {"max_position_embeddings": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c))
    return path


def test_defaults_follow_a_short_model(short_model):
    """No error naming a flag the user did not give: the defaults shrink to 4/5 of the longest
    request and say where they come from."""
    out = shardc_in("plan", "--model", short_model, "--gpu", "l40s")
    assert out.returncode == 0, out.stderr
    serve = next(line for line in out.stdout.splitlines() if line.startswith("serve"))
    assert "isl 306 (3/4 of 409, 4/5 of the longest request)" in serve
    assert "osl 204 (1/2 of 409, 4/5 of the longest request)" in serve
    assert "avg context 409 (4/5 of the longest request)" in serve


def test_derived_figures_say_so():
    out = shardc_in("plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--avg-context", "4096")
    serve = next(line for line in out.stdout.splitlines() if line.startswith("serve"))
    assert "isl 3,072 (3/4 of avg context), osl 2,048 (1/2 of avg context), avg context 4,096," in serve
    out = shardc_in("plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--isl", "1000", "--osl", "200")
    serve = next(line for line in out.stdout.splitlines() if line.startswith("serve"))
    assert "isl 1,000, osl 200, avg context 1,100 (isl + osl/2)," in serve
    out = shardc_in("plan", "--model", "llama-3.1-8b", "--gpu", "l40s")
    assert "isl 1,536 (default), osl 1,024 (default), avg context 2,048 (default)," in out.stdout


def test_a_given_context_longer_than_the_model_is_still_refused(short_model):
    out = shardc_in("plan", "--model", short_model, "--gpu", "l40s", "--avg-context", "600")
    assert out.returncode == 2 and "--avg-context" in one_line(out)


@pytest.mark.parametrize("model", ["short", "llama-3.1-8b"])
def test_table_columns_never_run_together(short_model, model):
    """Every row splits into the header's columns: a one-digit candidate's 512-token max len beside
    hundreds of thousands of sequences included."""
    out = shardc_in("plan", "--model", short_model if model == "short" else model, "--gpu", "l40s")
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("candidate"))
    rows = []
    for line in lines[head + 1:]:
        if not re.match(r"[*+! ] (tp|ep)=", line):
            break
        rows.append(line)
    assert rows
    for line in rows:
        fields = line[2:].split()
        # label (3 words), GPUs, weights (2), KV need/pool, KV B/tok, max len, seqs, conc, TTFT, TPOT,
        # tok/s/GPU, $/Mtok, the memory bar
        assert len(fields) == 3 + 1 + 2 + 1 + 8 + 1, line


def test_json_recommended_is_the_candidate():
    out = shardc_in("plan", "--model", "gpt-oss-120b", "--gpu", "h100-sxm", "--json")
    data = json.loads(out.stdout)
    rec = data["recommended"]
    assert rec == data["candidates"][data["recommended_index"]]
    assert (rec["dtype"], rec["tp"], rec["pp"]) == ("source", 1, 1)
    assert data["alternative"] is None or data["alternative"] == data["candidates"][data["alternative_index"]]


def _qwen3_8b_fp4_bytes(fmt: str) -> int:
    """Qwen3-8B with every decoder projection in a 4-bit format (lm_head and embeddings bf16):
    NVFP4 stores two E2M1 values a byte, an fp8 scale per 16 values, an fp32 global scale per
    tensor (and, W4A4, an fp32 input global scale); MXFP4 a one-byte E8M0 scale per 32 values."""
    hidden, inter, layers, heads, kv, head_dim, vocab = 4096, 12288, 36, 32, 8, 128, 151936
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, heads * head_dim),
              (inter, hidden), (inter, hidden), (hidden, inter)]

    def fp4(out: int, inp: int) -> int:
        return out * inp // 2 + (out * inp // 16 + 4 + 4 if fmt == "nvfp4" else out * inp // 32)

    layer = sum(fp4(o, i) for o, i in shapes) + (2 * hidden + 2 * head_dim) * 2
    return layers * layer + (2 * vocab * hidden + hidden) * 2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_checkpoints_are_sized_at_their_stored_bytes(tmp_path, fmt):
    """A compressed-tensors NVFP4 (W4A4) or MXFP4 checkpoint of Qwen3-8B (its quantization_config
    as compressed-tensors' ModelCompressor writes it for the preset scheme): ``source`` comes first
    and is sized at the stored bytes, scales included, worked out by hand (5.96 / 5.76 GiB against
    15.26 GiB at 16 bits)."""
    scheme = "NVFP4" if fmt == "nvfp4" else "MXFP4A16"
    import compressed_tensors.quantization.quant_scheme as presets
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    group = QuantizationScheme(targets=["Linear"], **getattr(presets, scheme))
    block = QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"], format=f"{fmt}-pack-quantized",
                               quantization_status="compressed").model_dump(mode="json")
    block["config_groups"]["group_0"]["format"] = f"{fmt}-pack-quantized"
    cfg = dict(PRESETS["qwen3-8b"]) | {"quantization_config": block}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(tmp_path / "config.json")
    s = search(model, Cluster(get_gpu("h100-sxm")), Workload(), model_name="qwen3-8b-" + fmt)
    from shardc.planner.search import default_dtypes

    assert default_dtypes(model) == ("source", "bf16", "int8", "fp8")
    one = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("source", 1, 1))
    assert one.memory is not None and one.memory.weights == _qwen3_8b_fp4_bytes(fmt)
    assert f"{one.memory.weights / GIB:.2f}" == {"nvfp4": "5.96", "mxfp4": "5.76"}[fmt]
    sixteen = next(x for x in s.candidates if (x.dtype, x.tp, x.pp) == ("bf16", 1, 1))
    assert sixteen.memory is not None and f"{sixteen.memory.weights / GIB:.2f}" == "15.26"
