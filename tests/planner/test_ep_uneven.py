"""The EP memory verdict on an uneven expert split (issue #41, item 13): 60 experts over 8 EP ranks
is ranks 0-3 with 8 experts and ranks 4-7 with 7 (vLLM's linear placement), and the fullest rank
decides whether the unit fits; the verdict says which ranks it is about.

Expected numbers are worked out here by hand from Qwen/Qwen1.5-MoE-A2.7B's config.json (the preset
``qwen1.5-moe-a2.7b``; transformers' Qwen2MoeConfig defaults are the same model: hidden 2,048,
24 layers, 16 heads / 16 KV heads x 128, vocab 151,936 untied, qkv_bias, 60 experts (top 4) of
moe_intermediate 1,408, a shared expert of 5,632 behind a sigmoid gate of 1 x 2,048), bf16:

  per layer, whole on every EP rank: q, k, v 3 x 2,048^2 + their biases 3 x 2,048, o 2,048^2,
    2 norms 2 x 2,048, router 60 x 2,048 = 122,880, shared expert 3 x 5,632 x 2,048 = 34,603,008,
    shared_expert_gate 2,048 -> 51,515,392 x 24 layers = 1,236,369,408
  embed + lm_head 2 x 151,936 x 2,048 = 622,329,856; final norm 2,048
  -> 1,858,701,312 parameters x 2 B = 3,717,402,624 B (NON_EXPERT)
  one routed expert: 3 x 1,408 x 2,048 = 8,650,752 per layer x 24 = 207,618,048 x 2 B = 415,236,096 B
  EP=8: divmod(60, 8) = (7, 4): ranks 0-3 hold 8 experts, ranks 4-7 hold 7
    fullest:  3,717,402,624 + 8 x 415,236,096 = 7,039,291,392 B (6.56 GiB)
    smallest: 3,717,402,624 + 7 x 415,236,096 = 6,624,055,296 B (6.17 GiB)
    mean (7.5 experts):                         6,831,673,344 B
  EP=4: 15 experts each (even): 3,717,402,624 + 15 x 415,236,096 = 9,945,944,064 B

In the budget besides the weights: activations 256 MiB + NCCL 128 MiB = 402,653,184 B; the CUDA
context and graphs (1 GiB) must fit in memory x (1 - utilization), so the cards below run at 0.8.
KV per token, whole on each EP rank: 2 x 24 layers x 16 KV heads x 128 x 2 B = 196,608 B.
"""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from shardc.cli import main
from shardc.layout.model import load_model
from shardc.planner.ep import ep_weights, linear_block
from shardc.planner.formulas import Workload
from shardc.planner.gpus import GIB, Cluster, get_gpu
from shardc.planner.search import search

QWEN = load_model("qwen1.5-moe-a2.7b")
NON_EXPERT = 3_717_402_624
EXPERT = 415_236_096
FULLEST = NON_EXPERT + 8 * EXPERT
SMALLEST = NON_EXPERT + 7 * EXPERT
MEAN = NON_EXPERT + 15 * EXPERT // 2
IN_BUDGET = 268_435_456 + 134_217_728
KV_PER_TOKEN = 196_608
WHERE = "on ranks 0-3, the fullest (8 of the 60 experts each; ranks 4-7 hold 7: weights 6.17 GiB)"


def _card(memory: int) -> Cluster:
    """Eight H100s with ``memory`` bytes each (as CUDA reports it)."""
    return Cluster(dataclasses.replace(get_gpu("h100-sxm"), memory=memory))


def _ep(memory: int, max_model_len: int, n: int = 8):
    w = Workload(max_model_len=max_model_len, avg_context=256, gpu_memory_utilization=0.8)
    s = search(QWEN, _card(memory), w, dtypes=["bf16"])
    return s, next(c for c in s.candidates if c.ep == n)


def test_the_hand_figures():
    assert NON_EXPERT == (24 * (3 * 2_048**2 + 3 * 2_048 + 2_048**2 + 2 * 2_048 + 60 * 2_048
                                + 3 * 5_632 * 2_048 + 2_048) + 2 * 151_936 * 2_048 + 2_048) * 2
    assert EXPERT == 3 * 1_408 * 2_048 * 24 * 2
    assert (FULLEST, SMALLEST, MEAN) == (7_039_291_392, 6_624_055_296, 6_831_673_344)
    assert KV_PER_TOKEN == 2 * 24 * 16 * 128 * 2


def test_every_rank_of_an_uneven_split_by_hand():
    ew = ep_weights(QWEN, "bf16")
    assert (ew.experts, ew.top_k, ew.moe_layers) == (60, 4, 24)
    assert ew.base_bytes == NON_EXPERT and ew.expert_bytes == (EXPERT,) * 60
    assert [len(linear_block(60, 8, r)) for r in range(8)] == [8, 8, 8, 8, 7, 7, 7, 7]
    eight = ew.rank_weights(8)
    assert [r.nbytes for r in eight] == [FULLEST] * 4 + [SMALLEST] * 4
    assert [r.expert_bytes for r in eight] == [8 * EXPERT] * 4 + [7 * EXPERT] * 4
    assert [r.nbytes for r in ew.rank_weights(4)] == [NON_EXPERT + 15 * EXPERT] * 4 == [9_945_944_064] * 4


def test_only_the_fullest_rank_does_not_hold_its_weights():
    """9.2 GB cards at 0.8: 7,360,000,000 B usable. Ranks 4-7 (and the mean) leave room for the KV
    pool; ranks 0-3 do not: 7,360,000,000 - 7,039,291,392 - 402,653,184 = -81,944,576 B."""
    usable = 9_200_000_000 * 0.8
    assert usable - SMALLEST - IN_BUDGET > 0 and usable - MEAN - IN_BUDGET > 0  # the mean would fit
    assert usable - FULLEST - IN_BUDGET == pytest.approx(-81_944_576)
    s, c = _ep(9_200_000_000, 512)
    assert not c.fits and c.memory.weights == FULLEST
    assert c.memory.kv_available == pytest.approx(-81_944_576)
    assert c.reasons == ["does not fit: weights 6.56 GiB + activations and NCCL 0.38 GiB > 6.85 GiB usable "
                         f"(8.57 GiB x 0.8) {WHERE}"]
    assert s.recommended is not None and s.recommended.ep == 1  # no EP unit: the dense path
    ladder = dict((label, verdict) for label, _w, _u, verdict in s.trails[0].ep_ladder)
    assert ladder["ep=8 dp=8 bf16"].endswith(WHERE)


def test_only_the_fullest_rank_pool_misses_the_demand():
    """Cards of 9,677,430,720 B at 0.8: 7,741,944,576 B usable. The fullest rank's pool is
    7,741,944,576 - 7,039,291,392 - 402,653,184 = 300,000,000 B: floor(300,000,000 / (16 x 196,608))
    = 95 blocks = 1,520 tokens, short of one 2,048-token request (402,653,184 B); the smallest rank's
    pool (715,236,096 B) and the mean's (507,618,048 B) hold it."""
    usable = 9_677_430_720 * 0.8
    assert usable - SMALLEST - IN_BUDGET == pytest.approx(715_236_096)
    assert usable - MEAN - IN_BUDGET == pytest.approx(507_618_048) and 507_618_048 > 2_048 * KV_PER_TOKEN
    s, c = _ep(9_677_430_720, 2_048)
    assert c.memory.weights == FULLEST and c.memory.kv_budget == pytest.approx(300_000_000)
    assert (c.kv.blocks, c.kv.tokens) == (300_000_000 // (16 * KV_PER_TOKEN), 1_520) == (95, 1_520)
    assert c.kv.demand_bytes == 2_048 * KV_PER_TOKEN == 402_653_184
    assert not c.fits
    assert c.reasons == ["KV demand 0.38 GiB per GPU (one 2,048-token request on one GPU: 2,048 tokens) > the "
                         f"0.28 GiB KV pool (what memory leaves; it holds 1,520) {WHERE}"]
    assert s.recommended is not None and s.recommended.ep == 1


def test_an_uneven_unit_that_fits_is_sized_by_its_fullest_rank():
    """H100-80GB (85,028,896,768 B) at 0.8: every EP degree fits; EP=8's pool and its share of the card
    are the fullest rank's: 68,023,117,414.4 - 7,039,291,392 - 402,653,184 = 60,581,172,838.4 B."""
    s, c = _ep(85_028_896_768, 2_048)
    assert c.fits and not c.reasons
    assert c.memory.weights == FULLEST
    assert c.memory.kv_budget == pytest.approx(85_028_896_768 * 0.8 - FULLEST - IN_BUDGET)
    # in use: weights + every overhead (in and outside the budget) + the pool = the budget + the headroom's part
    assert c.memory.used == pytest.approx(85_028_896_768 * 0.8 + GIB)


def test_an_even_split_names_no_rank():
    # 60 experts over 4 EP ranks: 15 each, one figure for every rank; the line is the plain verdict
    s, c = _ep(9_200_000_000, 512, n=4)
    assert c.reasons == ["does not fit: weights 9.26 GiB + activations and NCCL 0.38 GiB > 6.85 GiB usable "
                         "(8.57 GiB x 0.8)"]


def test_explain_prints_the_fullest_ranks_verdict():
    r = CliRunner().invoke(main, ["plan", "--model", "qwen1.5-moe-a2.7b", "--gpu", "h100-sxm", "--gpu-memory",
                                  "9200000000B", "--gpu-memory-utilization", "0.8", "--max-model-len", "512",
                                  "--avg-context", "256", "--dtype", "bf16", "--explain"])
    assert r.exit_code == 0, r.output
    assert ("      ep=8 dp=8 bf16: weights 6.56 GiB per GPU, in use 7.93 GiB: does not fit: weights 6.56 GiB + "
            f"activations and NCCL 0.38 GiB > 6.85 GiB usable (8.57 GiB x 0.8) {WHERE}\n") in r.stdout
