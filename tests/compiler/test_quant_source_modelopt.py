"""ModelOpt NVFP4 sources (#46): ``quant_method: modelopt``, ``quant_algo: NVFP4``, as NVIDIA's
published ``-NVFP4`` checkpoints store it. modelopt is not installed here, so the checkpoint is
written following its export's documented layout (tests/quant_sources.py ``modelopt_source``,
citing modelopt's ``NVFP4QTensor``): ``X.weight`` U8 two E2M1 values a byte, ``X.weight_scale``
F8_E4M3 per 16 values, ``X.weight_scale_2`` and ``X.input_scale`` F32 scalars; excluded modules
(vLLM's rule: equal, contained or an fnmatch wildcard) stay 16-bit. The oracle for the weights is
ModelOpt's own dequantization formula written out in torch (``modelopt_dequantize``), for the
cuts vLLM's: whole 16-value blocks, the per-tensor scales on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import shardc
from plan_helpers import plan, write_plan

torch = pytest.importorskip("torch")

from quant_sources import modelopt_dequantize, modelopt_source, save_tiny  # noqa: E402
from reassemble import load_source, reassemble  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.runtime.api import open_build, score  # noqa: E402

IGNORE = ("lm_head", "model.layers.0.self_attn*")  # a wildcard, as NVIDIA's lists have them
MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
X = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
Q = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modelopt")
    bf16 = save_tiny(root / "bf16")
    moe = save_tiny(root / "moe-bf16", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **MOE)
    return {"bf16": bf16, "nvfp4": modelopt_source(bf16, root / "nvfp4", IGNORE),
            "moe": modelopt_source(moe, root / "moe", ("lm_head", "*.mlp.gate"))}


@pytest.fixture(scope="module")
def builds(src, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """(dtype, tp) -> a build of the NVFP4 source, made when first asked for."""
    root = tmp_path_factory.mktemp("modelopt-builds")

    class Builds(dict):
        def __missing__(self, key: tuple[str, int]) -> Path:
            dtype, tp = key
            self[key] = root / f"{dtype}-{tp}"
            build(plan(tp, 1, dtype, name="mo", source=src["nvfp4"]), self[key])
            return self[key]

    return Builds()


def test_dequantized_build_is_modelopts_formula(src, builds):
    """To bf16: every quantized weight is ModelOpt's dequantization cast to bf16, bit for bit; the
    excluded modules (layer 0's attention by wildcard, lm_head) are the 16-bit source's."""
    raw, orig = load_source(src["nvfp4"]), load_source(src["bf16"])
    got = reassemble(builds["bf16", 1])
    n = 0
    for k, t in got.items():
        if k + "_scale_2" in raw:
            want = modelopt_dequantize(raw[k], raw[k + "_scale"], raw[k + "_scale_2"]).to(torch.bfloat16)
            assert torch.equal(t, want), k
            n += 1
        else:
            assert torch.equal(t, orig[k]), k
    assert n == 14 - 4  # layer 0's q, k, v, o excluded
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in raw


@pytest.mark.heavy
def test_kept_tp2_cuts_blocks_and_runs(src, builds, tmp_path):
    """Kept at tp=2: column-parallel weights and their block scales are the rank's rows,
    row-parallel ones its columns on whole blocks; ``weight_scale_2`` and ``input_scale`` are the
    source's scalars on both ranks. verify --deep passes, export is the source byte for byte, a
    reshard to tp=1 is the direct tp=1 build, and the kept build runs the weights the bf16 build
    holds (tp=1 and tp=2)."""
    from safetensors.torch import load_file

    raw = load_source(src["nvfp4"])
    out = builds["source", 2]
    assert json.loads((out / "config.json").read_text())["quantization_config"] == \
        json.loads((src["nvfp4"] / "config.json").read_text())["quantization_config"]
    checked = 0
    for r in range(2):
        shard = load_file(out / f"model-tp{r:02d}-pp00.safetensors")
        for k, t in shard.items():
            whole = raw[k]
            if k.endswith(("weight_scale_2", "input_scale")):
                assert t.shape == () and torch.equal(t, whole), k
            elif k.endswith(("proj.weight", "proj.weight_scale")) and k.removesuffix("_scale") + "_scale_2" in raw:
                if any(p in k for p in ("o_proj", "down_proj")):
                    c = whole.shape[1] // 2
                    want = whole[:, r * c:(r + 1) * c]
                else:
                    n = whole.shape[0] // 2
                    want = whole[r * n:(r + 1) * n]
                assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), k
            else:
                continue
            checked += 1
    assert checked == 2 * (10 * 3 + 10)
    assert shardc("verify", "--manifest", out / "manifest.json", "--deep", src["nvfp4"]).returncode == 0
    r = shardc("export", "--manifest", out / "manifest.json", "--out", tmp_path / "ex", "--quiet")
    assert r.returncode == 0, r.stderr
    back = load_source(tmp_path / "ex")
    assert sorted(back) == sorted(raw)
    assert all(back[k].shape == raw[k].shape and torch.equal(_bytes(back[k]), _bytes(raw[k])) for k in raw)
    r = shardc("reshard", "--manifest", out / "manifest.json", "--plan",
               write_plan(tmp_path / "p.yaml", 1, 1, "source", name="mo", source=src["nvfp4"]),
               "--out", tmp_path / "rs", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rs" / "model-tp00-pp00.safetensors").read_bytes() == \
        (builds["source", 1] / "model-tp00-pp00.safetensors").read_bytes()

    def logits(key):
        return score(open_build(builds[key]), X, return_logits=True, timeout_s=120).logits

    assert torch.equal(logits(("source", 1)), logits(("bf16", 1)))
    assert torch.equal(logits(("source", 2)), logits(("bf16", 2)))


@pytest.mark.heavy
def test_moe_kept_over_expert_parallel(src, tmp_path):
    """Qwen3-MoE with every expert in NVFP4 (the router excluded by a wildcard): kept over
    2 expert-parallel ranks and exported, it is the source byte for byte."""
    from moe_plans import moe_plan

    build(moe_plan(src["moe"], 2, True, dtype="source"), tmp_path / "ep")
    r = shardc("export", "--manifest", tmp_path / "ep" / "manifest.json", "--out", tmp_path / "ex", "--quiet")
    assert r.returncode == 0, r.stderr
    back, raw = load_source(tmp_path / "ex"), load_source(src["moe"])
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_2" in raw and raw["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert sorted(back) == sorted(raw)
    assert all(back[k].shape == raw[k].shape and torch.equal(_bytes(back[k]), _bytes(raw[k])) for k in raw)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # a scalar too


def _edited(src_dir: Path, tmp_path: Path, tensors=None, config=None) -> Path:
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(src_dir, bad)
    if tensors is not None:
        t = load_source(src_dir)
        tensors(t)
        save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((bad / "config.json").read_text())
        config(cfg["quantization_config"])
        (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize(("case", "words"), [
    ("algo", ("quantization_config.quant_algo: is 'FP8'; shardc reads ModelOpt's NVFP4",)),
    ("kv", ("quantization_config.kv_cache_scheme: is {'dynamic': False, 'num_bits': 4, 'type': 'float'}; "
            "shardc reads an FP8 KV cache (or none)",)),
    ("group", ("quantization_config.config_groups.group_0.weights.group_size: is 32; ModelOpt NVFP4 has 16",)),
    ("no-scale-2", (f"{Q}.weight_scale_2", "missing")),
    ("scale-shape", (f"{Q}.weight_scale", "has shape [128, 4]", "implies [128, 8]")),
    ("nan", (f"{Q}.weight_scale", "NaN block scale at [5, 1]")),
    ("scale-2-nan", (f"{Q}.weight_scale_2", "[nan]", "one finite positive number")),
])
def test_refusals(src, tmp_path, case, words):
    """One line, exit 2, no shard written: an algorithm or group size that is not NVFP4's, KV-cache
    scales, a missing or NaN per-tensor scale, a block-scale grid of the wrong shape, a NaN block
    scale (kept as stored and dequantized alike)."""
    edits = {
        "algo": dict(config=lambda q: q.update(quant_algo="FP8")),
        "kv": dict(config=lambda q: q.update(kv_cache_scheme={"dynamic": False, "num_bits": 4, "type": "float"})),
        "group": dict(config=lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32)),
        "no-scale-2": dict(tensors=lambda t: t.pop(Q + ".weight_scale_2")),
        "scale-shape": dict(tensors=lambda t: t.update({Q + ".weight_scale": t[Q + ".weight_scale"][:, :4].contiguous()})),
        "nan": dict(tensors=lambda t: t.update({Q + ".weight_scale": _nan_at(t[Q + ".weight_scale"], 5, 1)})),
        "scale-2-nan": dict(tensors=lambda t: t.update({Q + ".weight_scale_2": torch.tensor(float("nan"))})),
    }
    bad = _edited(src["nvfp4"], tmp_path, **edits[case])
    for dtype in ("source", "bf16") if case in ("nan", "scale-2-nan") else ("source",):
        out = tmp_path / f"out-{dtype}"
        r = shardc("build", write_plan(tmp_path / f"{dtype}.yaml", 2, 1, dtype, name="mo", source=bad),
                   "--out", out, "--quiet")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert all(w in lines[0] for w in words), lines[0]
        assert not out.exists() or not (list(out.glob("*.safetensors")) or (out / "manifest.json").exists())


def _nan_at(scale: torch.Tensor, i: int, j: int) -> torch.Tensor:
    s = scale.view(torch.uint8).clone()
    s[i, j] = 0x7F
    return s.view(torch.float8_e4m3fn)


def test_exclusion_follows_vllms_rule():
    """An entry excludes a module when equal to its name, contained in it, or an fnmatch wildcard
    of it (vLLM's ``is_layer_excluded``), nothing else."""
    from shardc.layout.quant_formats import detect_source

    fmt = detect_source({"quantization_config": {"quant_method": "modelopt", "quant_algo": "nvfp4",
                                                 "exclude_modules": ["lm_head", "model.layers.1*", "mlp.gate"]}})
    assert fmt.excluded("lm_head") and fmt.excluded("model.layers.1.self_attn.q_proj")
    assert fmt.excluded("model.layers.12.mlp.down_proj")  # fnmatch: 'model.layers.1*' is not segment-aligned
    assert fmt.excluded("model.layers.3.mlp.gate") and fmt.excluded("model.layers.3.mlp.gate_proj")  # contained
    assert not fmt.excluded("model.layers.2.self_attn.q_proj")


@pytest.mark.heavy
def test_legacy_hf_quant_config_is_read(src, builds, tmp_path):
    """ModelOpt's older exports keep the quantization in ``hf_quant_config.json`` (``producer``,
    ``quantization: {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}``) and none in
    config.json (DeepSeek-V3.1-NVFP4, Qwen3-235B-A22B-NVFP4): read as its quantization_config, the
    same checkpoint builds the same bytes; the file is part of the source's record, and a kept
    build's config.json carries the block in the form vLLM reads from config.json (``ignore``)."""
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(src["nvfp4"], legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg.pop("quantization_config")
    (legacy / "config.json").write_text(json.dumps(cfg))
    (legacy / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.22.1"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": list(IGNORE)}}))
    for dtype in ("bf16", "source"):
        build(plan(2, 1, dtype, name="mo", source=legacy), tmp_path / dtype)
        for r in range(2):
            f = f"model-tp{r:02d}-pp00.safetensors"
            a, b = load_source_file(tmp_path / dtype / f), load_source_file(builds[dtype, 2] / f)
            assert sorted(a) == sorted(b) and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)
    m = json.loads((tmp_path / "source" / "manifest.json").read_text())
    assert "hf_quant_config.json" in json.dumps(m["source"])
    block = json.loads((tmp_path / "source" / "config.json").read_text())["quantization_config"]
    assert block == {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                     "ignore": list(IGNORE), "producer": {"name": "modelopt", "version": "0.22.1"}}
    (legacy / "hf_quant_config.json").write_text(json.dumps({"producer": {}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4", "group_size": 16}}))
    r = shardc("build", write_plan(tmp_path / "kv.yaml", 1, 1, "bf16", name="mo", source=legacy),
               "--out", tmp_path / "kv", "--quiet")
    assert r.returncode == 2 and "quantization_config.kv_cache_quant_algo: is 'NVFP4'; shardc reads an FP8 KV cache" \
        in r.stderr, r.stderr


def load_source_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.heavy
def test_fp8_kv_cache_checkpoints_build_with_a_16_bit_kv_cache(src, builds, tmp_path):
    """NVIDIA's -NVFP4 releases all ask for an FP8 KV cache (``kv_cache_scheme``) and hold its
    calibrated ``k_proj.k_scale`` / ``v_proj.v_scale`` scalars, the excluded layer's too. They are
    not weights and no build holds them: a bf16 build and a kept (``dtype: source``) build hold the
    tensors of the same builds of the checkpoint without them; the kept build's config.json carries
    the source's block less its KV-cache key (with it vLLM's ``--kv-cache-dtype auto`` would run FP8
    on scales of 1), its export too, and its manifest says the KV cache is 16-bit; the planner sizes
    it as published,
    ``source`` first, with a 16-bit KV cache."""
    from shardc.layout.model import load_model
    from shardc.planner.formulas import Workload
    from shardc.planner.gpus import Cluster, get_gpu
    from shardc.planner.search import search

    kv = modelopt_source(src["bf16"], tmp_path / "kv", IGNORE, kv_fp8=True)
    raw = load_source(kv)
    assert "model.layers.0.self_attn.k_proj.k_scale" in raw and "model.layers.1.self_attn.v_proj.v_scale" in raw
    for dtype in ("bf16", "source"):
        build(plan(2, 1, dtype, name="mo", source=kv), tmp_path / dtype)
        for r in range(2):  # the same tensors (the header's plan hash names another source)
            f = f"model-tp{r:02d}-pp00.safetensors"
            a, b = load_source_file(tmp_path / dtype / f), load_source_file(builds[dtype, 2] / f)
            assert sorted(a) == sorted(b) and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)
    block = json.loads((kv / "config.json").read_text())["quantization_config"]
    kept = json.loads((tmp_path / "source" / "config.json").read_text())["quantization_config"]
    assert "kv_cache_scheme" in block and kept == {k: v for k, v in block.items() if k != "kv_cache_scheme"}
    m = json.loads((tmp_path / "source" / "manifest.json").read_text())
    assert m["source_quantization"]["kv_cache"] == \
        "the source's FP8 KV-cache scales are left out: the build's KV cache is 16-bit"
    r = shardc("export", "--manifest", tmp_path / "source" / "manifest.json", "--out", tmp_path / "ex", "--quiet")
    assert r.returncode == 0, r.stderr  # the source less its KV-cache scales, and the same block as the build's
    back = load_source(tmp_path / "ex")
    assert sorted(back) == sorted(k for k in raw if not k.endswith(("k_scale", "v_scale")))
    assert json.loads((tmp_path / "ex" / "config.json").read_text())["quantization_config"] == kept
    s = search(load_model(kv / "config.json"), Cluster(get_gpu("h100-sxm")), Workload(), model_name="kv")
    assert s.recommended is not None and s.recommended.dtype == "source" and s.workload.kv_bytes == 2
