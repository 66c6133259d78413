"""``gate --reference transformers`` with a baseline transformers cannot load (#41 item 7).

A gpt-oss build with its stacked experts over two DP ranks at tp = 1 passed the tp check, and
transformers then failed on a size mismatch: a traceback, exit 1. The reference now asks the rule
every HF claim follows (``compiler/outputs.py`` ``hf_checkpoint_problem``) before anything is
scored: one line naming the baseline, the reason and what works, exit 2; for a build of this
shardc (no index) and for one an older shardc gave an index alike. The model is a tiny gpt-oss
made by transformers; the refusal comes before any tokenizer or scoring.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from cli_run import one_line, shardc  # noqa: E402
from moe_plans import moe_plan  # noqa: E402

from shardc.compiler.compile import build  # noqa: E402
from shardc.compiler.outputs import INDEX  # noqa: E402
from shardc.formats.files import sha256_file  # noqa: E402
from shardc.formats.manifest import FileEntry, load  # noqa: E402

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=96, max_position_embeddings=256, initializer_range=0.2, intermediate_size=32,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=8)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gate_refusals")
    torch.manual_seed(5)
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(root / "src")
    ep = build(moe_plan(root / "src", 1, True, dp=2), root / "ep").out_dir
    old = root / "old"  # as an older shardc left it: an index, listed in the manifest
    shutil.copytree(ep, old)
    layout = load(old / "manifest.json").to_layout()
    stale = {"metadata": {"total_size": sum(rl.nbytes for rl in layout.ranks)},
             "weight_map": {t.name: rl.file for rl in layout.ranks for t in rl.tensors}}
    (old / INDEX).write_text(json.dumps(stale, indent=2) + "\n")
    m = load(old / "manifest.json")
    entry = FileEntry(INDEX, (old / INDEX).stat().st_size, sha256_file(old / INDEX))
    dataclasses.replace(m, files=[*m.files, entry]).save(old / "manifest.json")
    return {"ep": ep, "old": old, "tp1": build(moe_plan(root / "src", 1), root / "tp1").out_dir}


@pytest.mark.parametrize("baseline", ["ep", "old"])
def test_stacked_experts_over_dp_ranks_are_refused_as_the_reference(builds, baseline):
    """One line naming --reference, the baseline, the two files and the blocks of the first
    stacked tensor, and the way out (a tp=1 plan without dp_degree, or --reference shardc); exit
    2, nothing scored."""
    base = builds[baseline]
    r = shardc("gate", "--baseline", base, "--candidate", builds["tp1"], "--reference", "transformers",
               "--max-tokens", "64", "--window", "32")
    a, b = "model-dp00-tp00-pp00.safetensors", "model-dp01-tp00-pp00.safetensors"
    assert one_line(r) == (
        f"error: --reference: transformers cannot load the baseline src-tp1-dp2-ep-bf16 as a checkpoint: "
        f"{a} and {b} hold different parts of "
        "model.layers.0.mlp.experts.down_proj (dim 0 [0:2] and dim 0 [2:4]) under that one name (hint: reshard "
        f"the baseline ({base / 'manifest.json'}) to a plan with tp_degree: 1 and no dp_degree and gate against "
        "that build, or use --reference shardc)")
    assert r.stdout == ""
