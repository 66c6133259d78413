"""#27: the planner sizes the KV cache for the request; the cap is a ceiling on the pool, not a reservation.

Every expected number is worked out here by hand from the formulas written in the comments (vLLM's
accounting, the calculator rules), not by calling the planner's own functions. The measured deployment
is vLLM's Llama-3.3-70B bf16 at --tensor-parallel-size 2 on A100-80GB: 65.74 GiB of weights and a 5.63 GiB
KV budget per GPU (36,896 tokens), enough for one 32,768-token request.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shardc.cli import main
from shardc.compiler.synthetic import llama_config
from shardc.errors import PlanError
from shardc.layout.model import load_model, model_from_config
from shardc.planner.formulas import Workload
from shardc.planner.gpus import GIB, Cluster, get_gpu
from shardc.planner.models import resolve_model
from shardc.planner.search import search

L70 = load_model("llama-3.3-70b")
A100 = Cluster(get_gpu("a100-80gb"))
A100_MEM = 84_987_740_160  # 79.15 GiB, as CUDA (and vLLM's log) reports it
PCIE_MEM = 42_297_786_368  # A100-40GB PCIe
# overheads (named parameters): activations 256 MiB and NCCL 128 MiB come out of vLLM's budget
# (total x utilization); the CUDA context and the CUDA graphs (512 MiB each) sit in the headroom.
IN_BUDGET = 268_435_456 + 134_217_728  # 402,653,184 B
ALL_OVER = IN_BUDGET + 536_870_912 + 536_870_912  # 1,476,395,008 B
L70_BF16 = 70_553_706_496 * 2  # whole model, bf16
TP2_WEIGHTS = 70_555_025_408  # (L70_BF16 - 2,637,824 B of norms) / 2 + the norms whole
TP4_WEIGHTS = 35_278_831_616
TOKEN_ALL_HEADS = 2 * 80 * 8 * 128 * 2  # K and V x 80 layers x 8 KV heads x head_dim 128 x 2 B = 327,680


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_measured_deployment_recommends_tp2_at_32k():
    """The napkin-math deployment: 32k context on A100-80GB is two GPUs, as vLLM runs it."""
    s = search(L70, A100, Workload(max_model_len=32_768), dtypes=["bf16"], model_name="llama-3.3-70b")
    (trail,) = s.trails
    # demand: one 32,768-token request over all KV heads = 32,768 x 327,680 B = 10 GiB, sharded by head
    assert trail.demand_tokens == 32_768 and trail.kv_demand == 32_768 * TOKEN_ALL_HEADS == 10 * GIB
    # room per card: vLLM's budget less what it counts in it, 84,987,740,160 x 0.9 - 402,653,184 = 76,086,312,960 B
    room = A100_MEM * 0.9 - IN_BUDGET
    assert trail.room == room == 76_086_312_960
    # (141,107,412,992 + 10,737,418,240) / 76,086,312,960 = 1.996 -> 2 cards
    assert trail.sharded == L70_BF16 + 10 * GIB and trail.minimum == 2
    rec = s.recommended
    assert rec.label == "tp=2 pp=1 bf16" and rec.cost.gpus == 2
    # the pool: 76,488,966,144 - 70,555,025,408 - 402,653,184 = 5,531,287,552 B (below the cap: memory sets it)
    pool = A100_MEM * 0.9 - TP2_WEIGHTS - IN_BUDGET
    assert rec.kv.budget == pytest.approx(pool) and round(pool) == 5_531_287_552
    # demand per GPU: 32,768 tokens x (2 x 80 x 4 heads x 128 x 2 B = 163,840 B) = 5 GiB <= the pool
    assert rec.kv.demand_bytes == 32_768 * 163_840 == 5 * GIB
    # in use: weights + every overhead + the pool = 77,562,707,968 B = 91.3% of the card
    assert rec.memory.used == pytest.approx(TP2_WEIGHTS + ALL_OVER + pool)
    assert f"{rec.memory.used_fraction:.1%}" == "91.3%"
    # tokens: 16 x floor(5,531,287,552 / (16 x 163,840)) = 16 x 2,110 = 33,760
    assert rec.kv.tokens == 33_760
    # against vLLM's measurement: within 10% of 5.63 GiB and of 36,896 tokens (both 8.5% below)
    assert abs(rec.kv.budget / (5.63 * GIB) - 1) < 0.10 and abs(rec.kv.tokens / 36_896 - 1) < 0.10
    tp1 = next(c for c in s.candidates if c.label == "tp=1 pp=1 bf16")
    assert trail.rejected == [("tp=1 pp=1 bf16", tp1.reasons[0])] and tp1.reasons[0].startswith("does not fit")


def test_cap_is_a_ceiling_not_a_reservation():
    """tp=2 holds a pool of 5.15 GiB, a quarter of the 20 GiB cap, and still fits: the cap binds nothing."""
    c = search(L70, A100, Workload(max_model_len=32_768), dtypes=["bf16"], tps=[2], pps=[1]).candidates[0]
    assert c.fits and c.kv.budget < 20 * GIB / 3
    # a 4 GiB cap on tp=2: the pool is the cap (memory leaves 5.15 GiB), and 16 x floor(4 GiB / (16 x 163,840))
    # = 26,208 tokens < the 32,768 demanded: out, with the cap named as what limits the pool
    c = search(L70, A100, Workload(max_model_len=32_768, kv_cache_cap=4 * GIB), dtypes=["bf16"], tps=[2],
               pps=[1]).candidates[0]
    assert c.kv.budget == 4 * GIB and c.reasons == [
        "KV demand 5.00 GiB per GPU (one 32,768-token request: 32,768 tokens) > the 4.00 GiB KV pool "
        "(the 4.00 GiB cap; it holds 26,208)"]


def test_pcie_eight_cards_at_32k_is_tp4_pp2():
    """The rules' own TP4 x PP2 example: eight A100-40GB PCIe cards at 32k, with no cap flag."""
    s = search(L70, Cluster(get_gpu("a100-40gb-pcie")), Workload(max_model_len=32_768), dtypes=["bf16"])
    (trail,) = s.trails
    # room = 42,297,786,368 x 0.9 - 402,653,184 = 37,665,354,547.2 B;
    # (141,107,412,992 + 10 GiB) / 37,665,354,547.2 = 4.03 -> 5 cards; PCIe allows TP up to 4 -> pp = 2
    assert trail.room == pytest.approx(PCIE_MEM * 0.9 - IN_BUDGET) and trail.minimum == 5
    rec = s.recommended
    assert rec.label == "tp=4 pp=2 bf16"
    # tp=4 pp=1 is out: memory leaves 38,068,007,731.2 - 35,278,831,616 - 402,653,184 = 2,386,522,931 B per
    # GPU, below the 32,768 x 81,920 B = 2.5 GiB the request needs
    four = next(c for c in s.candidates if c.label == "tp=4 pp=1 bf16")
    assert four.kv.budget == pytest.approx(PCIE_MEM * 0.9 - TP4_WEIGHTS - IN_BUDGET) and not four.fits
    assert four.reasons[0].startswith("KV demand 2.50 GiB per GPU (one 32,768-token request: 32,768 tokens) > the 2.22 GiB")
    # stage 1 (40 layers + final norm + lm_head) holds 17,639,424,000 B; the pool, what memory leaves:
    # 38,068,007,731.2 - 17,639,424,000 - 402,653,184 = 20,025,930,547 B < the 20 GiB cap
    assert rec.kv.budget == pytest.approx(PCIE_MEM * 0.9 - 17_639_424_000 - IN_BUDGET)
    assert rec.kv.demand_bytes == 32_768 * 2 * 40 * 2 * 128 * 2  # 40 layers x 2 KV heads per rank
    # in use (17,639,424,000 + 1,476,395,008 + 20,025,930,547) / 42,297,786,368 = 92.5%
    assert f"{rec.memory.used_fraction:.1%}" == "92.5%"
    # --explain's "rejected" lines: every smaller unit worked out, with its reason or the rule that passed it
    rejected = dict(trail.rejected)
    assert rejected["tp=4 pp=1 bf16"] == four.reasons[0] and rejected["tp=1 pp=1 bf16"].startswith("does not fit")
    assert rejected["tp=2 pp=3 bf16"] == "fits, but stages go with the largest valid TP first (TP first, then PP)"
    assert all(a.split()[0] != "tp=4" or "pp=1" in a for a in rejected) and len(rejected) == 11


def test_default_context_stays_tp4():
    """No --max-model-len: vLLM's default, max_position_embeddings = 131,072 tokens; A100-80GB stays tp=4."""
    s = search(L70, A100, dtypes=["bf16"])
    (trail,) = s.trails
    # 131,072 x 327,680 B = 40 GiB; (141,107,412,992 + 42,949,672,960) / 76,086,312,960 = 2.42 -> 3 -> tp=4
    assert trail.demand_tokens == 131_072 and trail.kv_demand == 40 * GIB and trail.minimum == 3
    assert s.recommended.label == "tp=4 pp=1 bf16" and s.recommended.kv.demand_bytes == 10 * GIB


def test_concurrency_and_avg_context_make_the_demand():
    l8 = load_model("llama-3.1-8b")  # 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B per token at tp=1
    w = Workload(max_model_len=8192, concurrency=64, avg_context=4096, kv_cache_cap=20 * GIB)
    s = search(l8, A100, w, dtypes=["bf16"], tps=[1, 2], pps=[1])
    one, two = s.candidates
    # max(one 8,192-token request, 64 x 4,096) = 262,144 tokens; x 131,072 B = 32 GiB at tp=1, 16 GiB at tp=2
    assert one.kv.demand_tokens == two.kv.demand_tokens == 262_144
    assert (one.kv.demand_bytes, two.kv.demand_bytes) == (32 * GIB, 16 * GIB)
    # tp=1: memory leaves 76,488,966,144 - 16,060,522,496 - 268,435,456 = 60.2 GB, the cap limits the pool to 20 GiB
    assert one.kv.budget == 20 * GIB and "(64 requests of 4,096 tokens: 262,144 tokens) > the 20.00 GiB KV pool (the 20.00 GiB cap" \
        in one.reasons[0]
    assert two.fits and s.recommended is two
    # --concurrency without --avg-context: N requests of the max model length, 4 x 8,192 = 32,768 tokens
    c = search(l8, A100, Workload(max_model_len=8192, concurrency=4), dtypes=["bf16"], tps=[1], pps=[1]).candidates[0]
    assert c.kv.demand_tokens == 32_768 and c.kv.demand_bytes == 32_768 * 131_072
    # --avg-context alone leaves the demand at one max-length request (which always must fit); a request
    # of 1,000 tokens is paged in whole 16-token blocks: 3 x ceil(1,000 / 16) x 16 = 3,024 < 4,096
    c = search(l8, A100, Workload(max_model_len=4096, avg_context=1000, concurrency=3), dtypes=["bf16"], tps=[1],
               pps=[1]).candidates[0]
    assert c.kv.demand_tokens == 4096


def test_replicated_kv_heads_and_mla_latents_do_not_shrink_with_tp(tmp_path):
    # 4 heads / 2 KV heads, head_dim 16, 2 layers, max_position_embeddings 2,048 -> demand 2,048 tokens
    tiny = model_from_config(llama_config(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                          num_kv_heads=2, vocab_size=96))
    s = search(tiny, A100, dtypes=["bf16"], tps=[1, 2, 4], pps=[1])
    by_tp = {c.tp: c.kv.demand_bytes for c in s.candidates}
    # per GPU 2 x 2 layers x max(1, 2 // tp) heads x 16 x 2 B x 2,048 tokens: tp=4 keeps one (replicated) head
    assert by_tp == {1: 2048 * 256, 2: 2048 * 128, 4: 2048 * 128}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({  # a DeepSeek-V3-family model: MLA, 2 dense layers then 4 routed experts
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None,
        "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "first_k_dense_replace": 2,
        "n_group": 1, "topk_group": 1, "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    mla = resolve_model(str(cfg))[0]
    s = search(mla, Cluster(get_gpu("h100-sxm")), dtypes=["bf16"], tps=[1, 2, 4, 8], pps=[1])
    # the latent, whole on every GPU: 4,096 tokens x 4 layers x (128 + 32) x 2 B = 5,242,880 B at every tp
    assert {c.kv.demand_bytes for c in s.candidates} == {4096 * 4 * 160 * 2}
    (trail,) = s.trails
    assert (trail.kv_demand, trail.kv_replicated) == (0, 4096 * 4 * 160 * 2)  # replicated, not sharded


def test_explain_and_json_show_the_demand_and_the_rejections():
    args = ("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--max-model-len", "32768")
    r = _run(*args, "--explain")
    assert r.exit_code == 0, r.output
    for text in ("KV demand = one 32,768-token request: 32,768 tokens = 10.00 GiB over all KV heads (sharded "
                 "by KV head)", "sharded = weights 131.42 GiB + KV demand 10.00 GiB = 141.42 GiB",
                 "replicated per GPU = overheads 1.38 GiB", "minimum = ceil(141.42 / 70.86) = 2 GPUs",
                 "rejected tp=1 pp=1 bf16: does not fit", "KV pool = min(no cap, available 5.15 GiB) = "
                 "5.15 GiB", "recommended (fit): tp=2 pp=1 bf16 on 2 GPUs"):
        assert text in r.stdout, text
    r = _run(*args, "--json")
    data = json.loads(r.stdout)
    by_label = {(c["tp"], c["pp"]): c for c in data["candidates"] if c["pp"]}
    assert by_label[2, 1]["kv_demand_bytes"] == 32_768 * 163_840  # 4 KV heads per GPU
    assert by_label[4, 1]["kv_demand_bytes"] == 32_768 * 81_920  # 2 KV heads per GPU
    assert data["recommended"]["tp"] == 2 and data["fit"][0]["minimum"] == 2


@pytest.mark.parametrize("args, text", [
    (["--max-model-len", "0"], "error: --max-model-len: must be a positive integer, found '0'"),
    (["--concurrency", "-1"], "error: --concurrency: must be a positive integer, found '-1'"),
    (["--max-model-len", "200000"], "error: --max-model-len: 200,000 exceeds the model's max_position_embeddings "
     "131,072 (hint: use --max-model-len <= 131072, or --param allow_long_context=1 to go beyond it)"),
    (["--param", "allow_long_context=yes"], "error: --param: allow_long_context must be 0 or 1"),
])
def test_bad_demand_input_one_line_exit_2(args, text):
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", *args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(text), r.stderr


def test_long_context_with_the_opt_in():
    r = _run("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--max-model-len", "200000",
             "--param", "allow_long_context=1", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    rec = data["recommended"]
    # tp=4: 200,000 tokens x 81,920 B = 16,384,000,000 B <= the 20 GiB pool; capacity 16 x floor(20 GiB /
    # (16 x 81,920)) = 262,144 tokens, reported up to the 200,000 asked for
    assert rec["tp"] == 4 and rec["kv_demand_bytes"] == 200_000 * 81_920 and rec["kv"]["max_model_len"] == 200_000
    with pytest.raises(PlanError) as exc:
        search(L70, A100, Workload(concurrency=0))
    assert exc.value.key == "concurrency"
    with pytest.raises(PlanError) as exc:
        search(L70, A100, Workload(max_model_len=0))
    assert exc.value.key == "max_model_len"


def test_context_and_graphs_must_fit_the_headroom_not_a_share_of_the_card():
    """vLLM starts when what lives outside its budget fits memory x (1 - utilization)."""
    from shardc.planner.formulas import Overheads

    big = Overheads(cuda_graphs=4 * GIB)  # context 0.5 + graphs 4 = 4.5 GiB = 4,831,838,208 B outside the budget
    w = Workload(max_model_len=32_768, gpu_memory_utilization=0.95)
    # 0.95 leaves 84,987,740,160 x 0.05 = 4,249,387,008 B < 4,831,838,208 B: no unit starts, whatever its size
    s = search(L70, A100, w, dtypes=["bf16"], overheads=big, tps=[2, 4, 8], pps=[1])
    assert not s.fitting() and {c.reasons[0] for c in s.candidates} == {
        "vLLM would not start: CUDA context and graphs 4.50 GiB > the 3.96 GiB it leaves outside its budget "
        "(79.15 GiB x (1 - 0.95))"}
    assert s.trails[0].steps == [("*", "the CUDA context and graphs (4.50 GiB) do not fit the 3.96 GiB headroom: "
                                       "vLLM would not start")]
    with pytest.raises(PlanError) as exc:
        s.require_recommendation()
    # the most that leaves 4.5 GiB: 1 - 4,831,838,208 / 84,987,740,160 = 0.9431 -> 0.94
    assert exc.value.key == "gpu_memory_utilization" and exc.value.hint.startswith("use `gpu_memory_utilization` "
                                                                                   "0.94 or less")
    # 0.94 leaves 5,099,264,409.6 B >= 4.5 GiB: tp=2 starts, its card at (70,555,025,408 + 402,653,184 + 4.5 GiB
    # + the pool 84,987,740,160 x 0.94 - 70,555,025,408 - 402,653,184) / 84,987,740,160 = 0.94 + 4.5 GiB / card
    s = search(L70, A100, Workload(max_model_len=32_768, gpu_memory_utilization=0.94), dtypes=["bf16"],
               overheads=big, tps=[2], pps=[1])
    (two,) = s.candidates
    assert two.fits and two.memory.used_fraction == pytest.approx(0.94 + 4_831_838_208 / A100_MEM)
    assert two.memory.used_fraction > 0.99  # far above 95%, and what vLLM at 0.94 runs
