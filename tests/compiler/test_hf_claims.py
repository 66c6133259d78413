"""A build directory says it is a Hugging Face checkpoint only when transformers loads it (#41 item 6).

A build says so three ways: ``model.safetensors.index.json`` on disk, the manifest listing it, and
``shardc inspect``'s ``hf index`` line; all follow one rule, ``compiler/outputs.py``
``hf_checkpoint_problem`` on the Layout. Each build kind here is made from a tiny model that
transformers made and saved, then either loaded by transformers' ``AutoModelForCausalLM`` (every
tensor read from the build: nothing missing, unexpected or mis-shaped) to the source's logits bit
for bit, or shown not to claim it, with the reason: gpt-oss's stacked experts placed over two DP
ranks of a stage, each file holding its block of the expert dimension under the tensor's full
name (bf16 and an MXFP4 ``dtype: source`` build). For those, the index an older shardc wrote is
planted back to show that transformers does refuse them (a size mismatch), so the rule is not
merely cautious, and verify and inspect name such a stale claim.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from moe_plans import moe_plan  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.compiler.outputs import INDEX, hf_checkpoint_problem, index_json  # noqa: E402
from shardc.formats.manifest import FileEntry, load  # noqa: E402
from shardc.verify.checks import check_side_files  # noqa: E402
from shardc.verify.inspect import describe  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=96, max_position_embeddings=256, initializer_range=0.2)
# config class, model class, the family's own keys; 4 experts: two per rank over 2 EP ranks
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # layer 1 dense (mlp_only_layers), layer 0 sparse with a shared expert
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=8)),
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
STACKED = "model.layers.0.mlp.experts.down_proj"


def _mxfp4_source(bf16: Path, out: Path) -> Path:
    """gpt-oss as OpenAI publishes it: the stacked experts as MXFP4 ``*_blocks`` [E, out, in/32, 16]
    and ``*_scales`` [E, out, in/32]. Their values are random bytes (scales near 2^0): the build
    copies them as they are, and transformers dequantizes the build's as it does the source's."""
    out.mkdir()
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    with safe_open(bf16 / "model.safetensors", "pt") as f:
        for k in f.keys():  # noqa: SIM118
            t = f.get_tensor(k)
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, i, o = t.shape
                tensors[k + "_blocks"] = torch.randint(0, 256, (e, o, i // 32, 16), generator=gen, dtype=torch.uint8)
                tensors[k + "_scales"] = torch.randint(124, 128, (e, o, i // 32), generator=gen, dtype=torch.uint8)
            else:
                tensors[k] = t
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((bf16 / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": MXFP4}))
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each family's source checkpoint, made by transformers when first asked for."""
    root = tmp_path_factory.mktemp("hf_claims")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            if name == "mxfp4":
                made[name] = _mxfp4_source(get("gpt_oss"), root / name)
            else:
                config_cls, model_cls, extra = MODELS[name]
                torch.manual_seed(5)
                cfg = getattr(transformers, config_cls)(**SHAPE, **extra)
                getattr(transformers, model_cls)(cfg).to(torch.bfloat16).save_pretrained(root / name)
                made[name] = root / name
        return made[name]

    return root, get


def _hf(directory: Path) -> torch.nn.Module:
    """transformers' model of a directory; every tensor of the model read from it."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def _logits(directory: Path) -> torch.Tensor:
    x = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return _hf(directory)(x).logits.float()


def _claim(out: Path) -> str | None:
    """What the build directory says of itself, each way it says it, all agreeing: the rule's
    verdict on its Layout (None: an HF checkpoint), the index on disk and in the manifest, and
    inspect's line. Returns the rule's reason it is not one."""
    m = load(out / "manifest.json")
    problem = hf_checkpoint_problem(m.to_layout())
    assert (out / INDEX).is_file() is (m.file(INDEX) is not None) is (problem is None)
    shown = [line for line in describe(out).lines if line.startswith("hf index")]
    assert shown == [f"hf index   {INDEX} (the directory loads as an HF checkpoint)" if problem is None else
                     f"hf index   none: the directory is not an HF checkpoint ({problem}); shardc export makes one"]
    return problem


# (family, tp, expert_parallel, dp, pp, dtype): the MXFP4 source is left to the full run (heavy)
LOADS = [("llama", 1, False, 1, 1, "bf16"), ("llama", 1, False, 1, 2, "bf16"), ("gpt_oss", 1, True, 1, 1, "bf16"),
         ("mixtral", 1, True, 2, 1, "bf16"), ("qwen2_moe", 1, True, 2, 1, "bf16"), ("gpt_oss", 1, False, 1, 2, "bf16"),
         ("mxfp4", 1, False, 1, 1, "source")]


@pytest.mark.parametrize("family, tp, ep, dp, pp, dtype", LOADS[:-1] + [
    pytest.param(*LOADS[-1], marks=pytest.mark.heavy)])
def test_a_build_that_claims_a_checkpoint_loads_in_transformers(sources, tmp_path, family, tp, ep, dp, pp, dtype):
    """Dense over 1 or 2 stages, Mixtral and Qwen2-MoE experts (a name per expert) over 2 DP
    ranks, gpt-oss's stacked experts on one EP rank or over 2 stages, an MXFP4 ``dtype: source``
    build: each claims a checkpoint, and transformers reads every tensor from it, to the
    source's logits exactly (the build holds the source's bytes; DP groups repeat identical
    tensors, the index naming one copy)."""
    _, get = sources
    src = get(family)
    out = build(moe_plan(src, tp, ep, dtype, dp=dp, pp=pp), tmp_path / "b").out_dir
    assert _claim(out) is None
    assert torch.equal(_logits(out), _logits(src))


# (source, dtype): the bf16 case stays in the fast loop
REFUSES = [("gpt_oss", "bf16"), ("mxfp4", "source")]


@pytest.mark.parametrize("family, dtype", REFUSES[:1] + [pytest.param(*REFUSES[1], marks=pytest.mark.heavy)])
def test_stacked_experts_over_dp_ranks_claim_no_checkpoint(sources, tmp_path, family, dtype):
    """gpt-oss with expert parallelism over 2 DP ranks at tp = 1: no index, nothing claims a
    checkpoint, and the reason names both files and the blocks. The index an older shardc wrote
    (every name -> a file) makes transformers read one rank's block [2, ...] as the whole
    [4, ...] tensor and refuse it; verify names that stale index, and so does inspect."""
    _, get = sources
    out = build(moe_plan(get(family), 1, True, dtype, dp=2), tmp_path / "ep").out_dir
    a, b = "model-dp00-tp00-pp00.safetensors", "model-dp01-tp00-pp00.safetensors"
    want = f"{a} and {b} hold different parts of {STACKED}{'' if dtype == 'bf16' else '_bias'} " \
           "(dim 0 [0:2] and dim 0 [2:4]) under that one name"
    assert _claim(out) == want
    old = tmp_path / "old"
    shutil.copytree(out, old)
    m = load(old / "manifest.json")
    layout = m.to_layout()
    stale = {"metadata": {"total_size": sum(rl.nbytes for rl in layout.ranks)},
             "weight_map": {t.name: rl.file for rl in layout.ranks for t in rl.tensors}}
    (old / INDEX).write_text(json.dumps(stale, indent=2) + "\n")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as exc:
        index_json(layout)
    assert str(exc.value) == f"no HF index for this build: {want}"
    listed = dataclasses.replace(m, files=[*m.files, FileEntry(INDEX, (old / INDEX).stat().st_size, "0" * 64)])
    assert check_side_files(listed, layout, old) == [
        f"manifest lists {INDEX}, but transformers cannot load this build as a checkpoint: {want} "
        "(an older shardc, or edited)"]
    listed.save(old / "manifest.json")
    assert f"hf index   {INDEX} is listed, but the directory is not an HF checkpoint: {want}" in describe(old).lines
