"""verify catches what only one check can catch: each case keeps every other check green.

A tampered file gets its manifest entry re-hashed, so size and sha256 pass and only the check under
test stands between the damage and "all good". Each case first shows that verify *without* that
check passes, where the CLI allows it (no --device, no --deep).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from manifest_edits import reseal
from plan_helpers import plan
from safetensors import safe_open
from safetensors.torch import save_file

from shardc.cli import main
from shardc.compiler.compile import build

# vocab 10 at tp=4: 12 padded rows, rank 3 holds row 9 and two zero rows; 2 KV heads replicated.
CFG = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=10)


def _plan(tp: int, pp: int, dtype: str):
    return plan(tp, pp, dtype, name=f"o-tp{tp}pp{pp}-{dtype}")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("verify-oracle")
    src = write_checkpoint(root / "src", llama_config(**CFG))
    out = {"src": src}
    for tp, pp, dtype in ((2, 2, "bf16"), (4, 1, "bf16"), (4, 1, "int8"), (4, 1, "fp8")):
        out[tp, pp, dtype] = build(_plan(tp, pp, dtype).with_source(str(src)), root / f"{tp}{pp}{dtype}").out_dir
    return out


@pytest.fixture
def copy_of(builds, tmp_path):
    def make(key) -> Path:
        shutil.copytree(builds[key], tmp_path / "copy")
        return tmp_path / "copy"
    return make


def verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


def rewrite(d: Path, file: str, edit=None, meta_edit=None) -> None:
    """Rewrite one shard (tensors and/or metadata) and make the manifest's size and sha256 agree."""
    with safe_open(d / file, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if edit:
        edit(tensors)
    if meta_edit:
        meta_edit(meta)
    save_file(tensors, str(d / file), metadata=meta)
    m = json.loads((d / "manifest.json").read_text())
    reseal(m["shards"][file], (d / file).read_bytes())  # format_version 2 on: shards keyed by file name
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(("key", "value"), [("shardc.tp_rank", "0"), ("shardc.pp_stage", "0"), ("shardc.rank", "0")])
def test_each_rank_field_of_the_metadata_is_checked(copy_of, key, value):
    """tp01-pp01 is global rank 3; claiming tp_rank 0, stage 0 or rank 0 is a file in the wrong place."""
    d = copy_of((2, 2, "bf16"))
    f = "model-tp01-pp01.safetensors"
    rewrite(d, f, meta_edit=lambda m: m.__setitem__(key, value))
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1, r.output
    assert f"{f}: metadata {key} is '{value}'" in r.stderr


def test_swapped_same_shape_shards_are_caught_by_their_metadata(copy_of):
    """tp00 and tp01 of a stage have identical shapes: only the recorded ranks tell them apart."""
    d = copy_of((2, 2, "bf16"))
    a, b = d / "model-tp00-pp01.safetensors", d / "model-tp01-pp01.safetensors"
    tmp = d / "swap"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    m = json.loads((d / "manifest.json").read_text())
    for file, s in m["shards"].items():
        p = d / file
        reseal(s, p.read_bytes())
    (d / "manifest.json").write_text(json.dumps(m))
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1
    assert "model-tp00-pp01.safetensors: metadata shardc.tp_rank is '1', expected '0'" in r.stderr


@pytest.mark.parametrize("field", ["tp_rank", "pp_stage", "rank"])
def test_manifest_ranks_are_checked_against_the_layout(copy_of, field):
    d = copy_of((2, 2, "bf16"))
    m = json.loads((d / "manifest.json").read_text())
    entry = m["shards"]["model-tp01-pp01.safetensors"]
    entry[field] = 0
    (d / "manifest.json").write_text(json.dumps(m))
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1
    assert "manifest entry model-tp01-pp01.safetensors has the wrong ranks" in r.stderr


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_device_load_finds_non_finite_values(copy_of, bad):
    d = copy_of((2, 2, "bf16"))
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        t[name] = t[name].clone()
        t[name][3, 5] = bad
    rewrite(d, "model-tp00-pp01.safetensors", poison)
    assert verify("--manifest", str(d / "manifest.json")).exit_code == 0  # bytes as the manifest says
    r = verify("--manifest", str(d / "manifest.json"), "--device", "cpu")
    assert r.exit_code == 1
    assert f"model-tp00-pp01.safetensors: tensor {name} holds NaN or Inf on cpu" in r.stderr


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_deep_finds_non_zero_vocab_padding(builds, copy_of, name):
    d = copy_of((4, 1, "bf16"))

    def fill_pad(t):
        t[name] = t[name].clone()
        t[name][2, 7] = 0.5  # rank 3: row 0 is vocab row 9, rows 1-2 are padding
    rewrite(d, "model-tp03-pp00.safetensors", fill_pad)
    assert verify("--manifest", str(d / "manifest.json")).exit_code == 0
    r = verify("--manifest", str(d / "manifest.json"), "--deep", str(builds["src"]))
    assert r.exit_code == 1
    assert f"tensor {name}: padded vocab rows are not zero" in r.stderr


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("what", ["weight", "scale"])
def test_deep_checks_quantized_weights_and_scales(builds, copy_of, dtype, what):
    d = copy_of((4, 1, dtype))
    # int8 is stored pack-quantized: four int8 values + 128 per int32 of X.weight_packed
    name = "model.layers.0.self_attn.k_proj.weight" + {"scale": "_scale", "weight": "_packed" if dtype == "int8" else ""}[what]

    def nudge(t):
        x = t[name].clone()
        if what == "scale":
            x[0, 0] *= 1.5
        else:  # one quantized step in the raw bytes: int8 +1 (a low byte of the pack), fp8 the next code
            raw = x.view(torch.uint8)
            raw[1, 2] = raw[1, 2] ^ 1
        t[name] = x
    rewrite(d, "model-tp02-pp00.safetensors", nudge)
    assert verify("--manifest", str(d / "manifest.json")).exit_code == 0
    r = verify("--manifest", str(d / "manifest.json"), "--deep", str(builds["src"]))
    assert r.exit_code == 1
    assert f"tensor {name} differs from source" in r.stderr
