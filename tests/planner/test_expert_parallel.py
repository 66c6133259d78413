"""The planner's MoE rules (#29): expert parallelism tried first, the EP ladder, the KV split by
request, --explain / --json / --out for EP units.

Expected numbers are worked out here by hand from the published config.json values (the family
modules' presets), not by calling the planner. Mixtral-8x7B: hidden 4,096, 32 layers, 32 heads /
8 KV heads x 128, vocab 32,000 (untied), 8 experts (top 2) of intermediate 14,336.

  non-expert parameters: embed + lm_head 2 x 32,000 x 4,096 = 262,144,000; final norm 4,096;
    per layer q 4,096^2 = 16,777,216, k and v 1,024 x 4,096 = 4,194,304 each, o 16,777,216,
    2 norms 8,192, router 8 x 4,096 = 32,768 -> 41,984,000 x 32 = 1,343,488,000
    -> 1,605,636,096 parameters x 2 B = 3,211,272,192 B, whole on every EP rank
  one expert: 3 x 14,336 x 4,096 = 176,160,768 per layer x 32 = 5,637,144,576 x 2 B = 11,274,289,152 B
  EP=2: 4 experts per GPU -> 3,211,272,192 + 45,097,156,608 = 48,308,428,800 B (44.99 GiB)
  EP=4: 2 experts        -> 3,211,272,192 + 22,548,578,304 = 25,759,850,496 B (23.99 GiB)
  EP=8: 1 expert         -> 3,211,272,192 + 11,274,289,152 = 14,485,561,344 B (13.49 GiB)

A100-40GB (42,298,834,944 B as CUDA reports it), utilization 0.9: budget 38,068,951,449.6 B; in it
activations 256 MiB + NCCL 128 MiB = 402,653,184 B; the CUDA context and graphs (1 GiB) in the
headroom. EP=2: 48.3 GB of weights > the 38.07 GB budget: does not fit. EP=4: the KV pool is
38,068,951,449.6 - 25,759,850,496 - 402,653,184 = 11,906,447,769.6 B (11.09 GiB, under the 20 GiB
cap); KV per token whole on each rank (split by request, not by head): 2 x 32 x 8 x 128 x 2 B =
131,072 B; one 32,768-token request = 4 GiB <= the pool: fits; in use 25,759,850,496 + 1.375 GiB of
overheads + the pool = 39,142,693,273.6 B = 92.5 % of the card (<= 95 %). EP=4 is the pick.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cli_run import shardc_in
from click.testing import CliRunner

from shardc.cli import main
from shardc.layout.model import load_model, model_from_config
from shardc.layout.plan import load_plan, plan_from_dict
from shardc.layout.ranks import build_layout
from shardc.layout.tensors import tensor_table
from shardc.planner.ep import EpWeights, ep_degrees, ep_weights, linear_block
from shardc.planner.formulas import Workload
from shardc.planner.gpus import GIB, Cluster, get_gpu
from shardc.planner.models import resolve_model
from shardc.planner.search import search
from shardc.planner.weights import plan_dict

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = load_model("mixtral-8x7b")
A100_40 = Cluster(get_gpu("a100-40gb"))
NON_EXPERT = 3_211_272_192
EXPERT = 11_274_289_152
BUDGET = 42_298_834_944 * 0.9
IN_BUDGET = 268_435_456 + 134_217_728


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def _eps(s):
    return {c.ep: c for c in s.candidates if c.ep > 1}


def test_mixtral_bf16_a100_40gb_ladder_by_hand():
    s = search(MIXTRAL, A100_40, dtypes=["bf16"])
    eps = _eps(s)
    assert sorted(eps) == [2, 4, 8]  # powers of two up to min(8 experts, the 8-GPU NVLink domain)
    assert NON_EXPERT == (2 * 32_000 * 4_096 + 4_096 + 32 * 41_984_000) * 2
    assert EXPERT == 3 * 14_336 * 4_096 * 32 * 2
    assert {n: c.memory.weights for n, c in eps.items()} == {
        2: NON_EXPERT + 4 * EXPERT, 4: NON_EXPERT + 2 * EXPERT, 8: NON_EXPERT + EXPERT}
    assert eps[2].memory.weights == 48_308_428_800 and eps[4].memory.weights == 25_759_850_496
    assert eps[2].reasons and eps[2].reasons[0].startswith("does not fit: weights 44.99 GiB")
    four = eps[4]
    assert four.fits and (four.tp, four.pp, four.dp, four.gpus) == (1, 1, 4, 4)
    assert four.memory.kv_budget == pytest.approx(BUDGET - 25_759_850_496 - IN_BUDGET)  # 11.09 GiB
    assert four.kv.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072  # whole: the KV splits by request
    assert four.kv.demand_bytes == 32_768 * 131_072 == 4 * GIB
    assert four.kv.blocks == 5_677  # floor(11,906,447,769.6 / (16 x 131,072))
    assert four.kv.sequences == 4 * (5_677 // 128)  # 44 sequences of 2,048 tokens on each of 4 GPUs
    assert four.memory.used_fraction == pytest.approx(0.9254, abs=1e-4)
    assert s.recommended is four  # the smallest EP degree that fits wins, before the dense TP path
    trail = s.trails[0]
    assert [label for label, *_ in trail.ep_ladder] == ["ep=2 dp=2 bf16", "ep=4 dp=4 bf16"]
    assert trail.chosen == "ep=4 dp=4 bf16"
    # on H100-80GB EP=2 fits: 48,308,428,800 + 402,653,184 < 85,028,896,768 x 0.9 = 76.5 GB
    assert search(MIXTRAL, Cluster(get_gpu("h100-sxm")), dtypes=["bf16"]).recommended.label == "ep=2 dp=2 bf16"


def test_linear_block_is_the_layouts_placement():
    moe = MIXTRAL.forward.moe
    for experts in (8, 60, 128, 7):
        m = dataclasses.replace(moe, experts=experts)
        for n in (1, 2, 3, 4, 8):
            if n > experts:
                continue
            held = [linear_block(experts, n, r) for r in range(n)]
            assert [e for r in held for e in r] == list(range(experts))
            assert all(m.owner(e, n) == r for r in range(n) for e in held[r])
            assert len(held[0]) == -(-experts // n)  # rank 0 holds the largest share


def _qwen2_moe_small() -> dict:
    """A Qwen2-MoE config mixing dense and sparse layers (mlp_only_layers, decoder_sparse_step)."""
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": False, "num_experts": 6,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2, "mlp_only_layers": [3], "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8"])
def test_ep_weights_equal_the_full_layout(dtype):
    """The probe (one layer of each kind) against the full tp=1 Layout with experts placed by vLLM's
    rule: every rank's bytes, for a model whose layers are dense (0, 2, 3, 4) and sparse (1, 5)."""
    model = model_from_config(_qwen2_moe_small())
    assert model.forward.moe.sparse == (False, True, False, False, False, True)
    ew = ep_weights(model, dtype)
    table = tensor_table(model)
    full = build_layout(model, plan_from_dict(plan_dict("t", "src", 1, 1, dtype))).ranks[0].tensors
    for n in (2, 4):
        for r, rw in enumerate(ew.rank_weights(n)):
            mine = linear_block(6, n, r)
            want = sum(t.nbytes for t in full if table[t.source].expert is None or table[t.source].expert in mine)
            assert rw.nbytes == want, (n, r)
    assert ew.moe_layers == 2 and len(set(ew.expert_bytes)) == 1


def test_kv_is_split_by_request_and_one_stream_never_splits():
    # 10 requests of 4,096 tokens on EP=4: ceil(10 / 4) = 3 per GPU = 12,288 tokens, more than one
    # 8,192-token request; EP=8: ceil(10 / 8) = 2 x 4,096 = 8,192 = one request of the max length.
    w = Workload(max_model_len=8192, concurrency=10, avg_context=4096)
    s = search(MIXTRAL, Cluster(get_gpu("h100-sxm")), w, dtypes=["bf16"])
    eps = _eps(s)
    assert eps[4].kv.demand_tokens == 12_288 and eps[4].kv.demand_bytes == 12_288 * 131_072
    assert eps[8].kv.demand_tokens == 8_192
    # a max-length request is never split: at EP=8 one GPU still holds all 32,768 tokens of it
    s = search(MIXTRAL, Cluster(get_gpu("h100-sxm")), Workload(), dtypes=["bf16"])
    assert _eps(s)[8].kv.demand_tokens == 32_768


def test_one_card_beats_ep_and_the_dense_path_when_no_ep_fits():
    # Qwen3-30B-A3B fp8 (30.5 B parameters, ~31 GB) fits one H200: no EP unit is needed
    s = search(load_model("qwen3-30b-a3b"), Cluster(get_gpu("h200")), dtypes=["fp8"])
    assert s.recommended.label == "tp=1 pp=1 fp8" and not s.trails[0].ep_ladder
    # Mixtral bf16 on L40S (PCIe: the EP domain, like TP, is 4 cards): EP=2 44.99 GiB and EP=4
    # 23.99 GiB of weights; the 44.31 GiB card x 0.9 = 39.88 GiB holds EP=4's weights but not with the
    # 4 GiB request (23.99 + 0.38 + 4 < 39.88: it fits); on 24 GiB cards nothing of the ladder fits
    small = Cluster(dataclasses.replace(get_gpu("l40s"), memory=24 * GIB))
    s = search(MIXTRAL, small, Workload(max_model_len=4096), dtypes=["bf16"])
    assert ep_degrees(s) == [2, 4]
    assert all(c.reasons for c in _eps(s).values())
    assert s.recommended is None or s.recommended.ep == 1  # the dense TP/PP path
    assert [label for label, *_ in s.trails[0].ep_ladder] == ["ep=2 dp=2 bf16", "ep=4 dp=4 bf16"]


def test_qwen3_235b_and_the_ep_domain():
    # Qwen3-235B-A22B bf16 on H200: 128 experts, the ladder stops at the 8-GPU NVLink domain;
    # on a rack-scale NVLink domain (72 GPUs per node) it goes on to 64, the smallest that fits wins
    m = load_model("qwen3-235b-a22b")
    s = search(m, Cluster(get_gpu("h200")), dtypes=["bf16"])
    assert ep_degrees(s) == [2, 4, 8]
    rack = search(m, Cluster(get_gpu("h200"), gpus_per_node=72), dtypes=["bf16"], objective="fit")
    assert ep_degrees(rack) == [2, 4, 8, 16, 32, 64]
    fitting = [c.ep for c in rack.candidates if c.ep > 1 and c.fits]
    assert rack.recommended.ep == min(fitting)


def test_deepseek_v3_ep_from_its_layout_with_the_latent_whole():
    model = resolve_model("deepseek-v3")[0]
    s = search(model, Cluster(get_gpu("h200")), dtypes=["fp8"])
    eps = _eps(s)
    assert sorted(eps) == [2, 4, 8]
    # one routed expert, fp8: gate and up 2,048 x 7,168 + a float32 scale per row (2,048 x 4 B), down
    # 7,168 x 2,048 + 7,168 x 4 B = 44,040,192 + 16,384 + 28,672 = 44,085,248 B per layer x 58 MoE layers
    per = 44_085_248 * 58
    ew: EpWeights = eps[8].ep_detail
    assert ew.expert_bytes == (per,) * 256 and ew.moe_layers == 58
    assert eps[8].memory.weights - eps[4].memory.weights == -32 * per  # 32 experts per GPU at 8, 64 at 4
    assert eps[8].kv.bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # the latent, whole on every GPU
    assert s.recommended is eps[8] and s.to_json()["plan"]["replica_group"]["dp_degree"] == 8


def test_json_carries_ep_and_dp_for_every_candidate():
    for model in ("mixtral-8x7b", "llama-3.1-8b"):
        r = _run("--model", model, "--gpu", "a100-40gb", "--dtype", "bf16", "--json")
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        for c in data["candidates"]:
            assert {"ep", "dp"} <= set(c)
            if c["tp"] != 1 or c["ep"] == 1:
                assert (c["ep"], c["dp"]) == (1, 1)
        eps = [c for c in data["candidates"] if c["ep"] > 1]
        assert bool(eps) == (model == "mixtral-8x7b")
    rec = data_rec = json.loads(_run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16",
                                     "--json").stdout)
    rec = data_rec["recommended"]
    assert (rec["ep"], rec["dp"], rec["tp"], rec["gpus"]) == (4, 4, 1, 4)
    assert data_rec["plan"]["replica_group"]["dp_degree"] == 4
    assert data_rec["plan"]["replica_group"]["expert_parallel"] is True


def test_explain_shows_the_ladder_and_the_table_marks_ep():
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16", "--explain")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "EP ladder (powers of two up to min(8 experts, the 8-GPU EP domain" in out
    assert "ep=2 dp=2 bf16: weights 44.99 GiB per GPU" in out and "does not fit" in out
    assert "ep=4 dp=4 bf16: weights 23.99 GiB per GPU" in out
    assert "rank 0 experts 0-1 (ceil(8 / 4) = 2, the largest share)" in out
    assert "all-to-all" in out and "plan dp_degree 4, tp_degree 1, expert_parallel" in out
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16")
    assert "* ep=4 dp=4 bf16       4 23.99 GiB" in r.stdout
    assert "ep=N dp=N: expert parallel on N GPUs" in r.stdout


def test_out_writes_an_ep_plan(tmp_path):
    out = tmp_path / "mixtral.yaml"
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert (plan.tp, plan.pp, plan.dp, plan.expert_parallel, plan.dtype) == (1, 1, 4, True, "bf16")
    assert plan.data["replica_group"]["gpus_per_replica"] == 4
    assert plan.shard_name(0, 0, 3) == "model-dp03-tp00-pp00.safetensors"
    assert plan.source == "hf://mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert "on 4 x a100-40gb, ep=4 dp=4 bf16" in out.read_text()
    # an MLA model's EP unit is a plan like any other (DeepSeek-V3 builds from its family)
    r = _run("--model", "deepseek-v3", "--gpu", "h200", "--dtype", "fp8", "--out", str(tmp_path / "v3.yaml"))
    assert r.exit_code == 0, r.output
    v3 = load_plan(tmp_path / "v3.yaml")
    assert (v3.tp, v3.dp, v3.expert_parallel, v3.source) == (1, 8, True, "hf://deepseek-ai/DeepSeek-V3")


def test_out_ep_plan_passes_build_dry_run(tmp_path):
    """`shardc build --dry-run` accepts the EP plan and lays out 4 ranks (dp_degree 4: the EP group is
    the stage's dp x tp ranks), each with the bytes the planner counted."""
    out = tmp_path / "mixtral.yaml"
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16", "--out", str(out))
    assert r.exit_code == 0, r.output
    p = shardc_in("build", out, "--dry-run", "--model", "mixtral-8x7b", "--json")
    assert p.returncode == 0, p.stderr
    ranks = json.loads(p.stdout)["ranks"]
    assert len(ranks) == 4
    assert sorted(r["bytes"] for r in ranks) == [NON_EXPERT + 2 * EXPERT] * 4
