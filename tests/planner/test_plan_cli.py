"""`shardc plan` as a new user types it (#26 items 4, 5 and 7, and the #27 follow-up on
--gpu-memory-utilization): a real ``python -m shardc.cli plan`` subprocess, the exact line checked.

Every expected number is worked out here by hand from the presets and the model config, not by
calling the planner: A100-80GB has 84,987,740,160 B as CUDA reports it (79.15 GiB); L40S 864 GB/s of
HBM on PCIe 4.0 (5 us a hop); the default overheads are activations 256 MiB and NCCL 128 MiB inside
vLLM's budget, the CUDA context and graphs 512 MiB each in the headroom beyond it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_run import shardc_in

from shardc.planner.formulas import speed_for
from shardc.planner.gpus import get_gpu

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
A100_MEM = 84_987_740_160
IN_BUDGET = 268_435_456 + 134_217_728  # activations + NCCL
OUTSIDE = 536_870_912 + 536_870_912  # CUDA context + CUDA graphs
L70_TP2_WEIGHTS = 70_555_025_408  # Llama-3.3-70B bf16 per GPU at tp=2 (half the matrices, the norms whole)
L70_TP2_TOKEN = 2 * 80 * 4 * 128 * 2  # K and V x 80 layers x 4 KV heads x 128 x 2 B = 163,840 B
L70_32K = ("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--max-model-len", "32768")

# The demo model's config.json (SmolLM2-135M, what `.cache/demo/smollm2-135m` holds): 9 heads, 3 KV heads.
SMOLLM = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}


def plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return shardc_in("plan", *args, cwd=cwd)


def error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def line(r: subprocess.CompletedProcess, start: str) -> str:
    assert r.returncode == 0, r.stderr
    (found,) = [x for x in r.stdout.splitlines() if x.startswith(start)]
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like the demo checkpoint's (its config.json; the planner reads nothing else)."""
    root = tmp_path_factory.mktemp("demo")
    (root / "smollm2-135m").mkdir()
    (root / "smollm2-135m" / "config.json").write_text(json.dumps(SMOLLM))
    return root


# --- item 4: a TP that breaks the heads names the TPs that work, not more or larger GPUs ----------


def test_tp_that_does_not_divide_the_heads_names_the_tps_that_do(demo: Path):
    # 9 heads, 3 KV heads, intermediate 1,536, hidden 576: tp=1 and tp=3 divide all of them; tp=2, 4, 5, 6,
    # 7, 8 do not divide the 9 heads, and tp=9 does not divide the intermediate size (1,536 / 9 = 170.7)
    r = plan("--model", "smollm2-135m", "--gpu", "a100-80gb", "--tp", "2", cwd=demo)
    assert error_line(r) == (
        "error: --tp: smollm2-135m fits no candidate on 8 x a100-80gb; num_attention_heads=9 is not divisible by "
        "tp=2 (hint: give --tp 1 or 3: the TP degrees smollm2-135m splits into, up to 8)")
    assert "add GPUs" not in r.stderr and "larger" not in r.stderr
    # several, all broken: the same hint; up to the fabric's limit (PCIe: 4) on an L40S node
    r = plan("--model", "smollm2-135m", "--gpu", "l40s", "--tp", "2", "--tp", "4", cwd=demo)
    assert error_line(r).endswith("(hint: give --tp 1 or 3: the TP degrees smollm2-135m splits into, up to 4)")
    # a TP that works among them: no error, it is the pick
    r = plan("--model", "smollm2-135m", "--gpu", "a100-80gb", "--tp", "2", "--tp", "3", cwd=demo)
    assert line(r, "recommended").startswith("recommended (fit): tp=3 pp=1 bf16 on 3 GPUs")


def test_json_when_nothing_fits_is_one_document_with_the_error(demo: Path):
    r = plan("--model", "smollm2-135m", "--gpu", "a100-80gb", "--tp", "2", "--json", cwd=demo)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    data = json.loads(r.stdout)  # one document: a second one after it would not parse
    assert data["recommended"] is None and data["candidates"][0]["reasons"] == [
        "num_attention_heads=9 is not divisible by tp=2"]
    assert data["error"] == {"error": "smollm2-135m fits no candidate on 8 x a100-80gb; num_attention_heads=9 is "
                             "not divisible by tp=2", "key": "--tp", "exit": 2,
                             "hint": "give --tp 1 or 3: the TP degrees smollm2-135m splits into, up to 8"}


def test_memory_misses_still_suggest_more_gpus():
    # Llama-3.3-70B bf16 at tp=1 (a valid TP): 131 GiB of weights on an 80 GB card; more or larger GPUs help
    r = plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--tp", "1", "--pp", "1")
    assert error_line(r).startswith("error: --model: llama-3.3-70b fits no candidate on 8 x a100-80gb; closest is "
                                    "tp=1 pp=1 bf16: does not fit")
    assert "(hint: add GPUs (--nodes)" in r.stderr


# --- item 5: the "fastest alternative" is named only when it is faster ----------------------------


def test_no_alternative_when_more_gpus_are_slower(demo: Path):
    r = plan("--model", "smollm2-135m", "--gpu", "l40s", "--json", cwd=demo)
    data = json.loads(r.stdout)
    by_tp = {c["tp"]: c for c in data["candidates"] if c["pp"] == 1 and c["dtype"] == "bf16"
             and c["status"] != "infeasible"}
    assert sorted(by_tp) == [1, 3] and data["recommended"]["tp"] == 1
    # tp=1, batch 1: every weight is read once (tied embeddings serve as lm_head): 134,515,008 params x 2 B
    # = 269,030,016 B at 864 GB/s x hbm_efficiency, plus the KV of 2,048 tokens x (2 x 30 layers x 3 KV
    # heads x 64 x 2 B = 23,040 B) = 47,185,920 B at 864 GB/s x kv_hbm_efficiency (compute ~2 us hides
    # under it), plus 30 layers x layer_overhead_us and the step overhead; one step in 1,024 also carries
    # the 1,536-token prompt (1/1,024 of a ~2 ms prefill: within the 1 %)
    sp = speed_for(get_gpu("l40s"))  # L40S's own fitted efficiencies (gpus.CALIBRATED)
    step = (269_030_016 / (864e9 * sp.hbm_efficiency) + 47_185_920 / (864e9 * sp.kv_hbm_efficiency)
            + 30 * sp.layer_overhead_us * 1e-6 + sp.step_overhead_ms * 1e-3)
    assert by_tp[1]["speed"]["tpot1_s"] == pytest.approx(step, rel=1e-2)
    # tp=3 reads a third but all-reduces twice a layer over PCIe (a ring): at least 2 x 30 x [2(3-1)/3 x
    # 1,152 B / 24 GB/s + 2(3-1) x 5 us] = 1.2019 ms more, so tp=3 is slower at batch 1 whatever it reads
    assert by_tp[3]["speed"]["tpot1_s"] > by_tp[1]["speed"]["tpot1_s"]
    assert by_tp[3]["speed"]["allreduce_s"] > 2 * 30 * (4 / 3 * 1152 / 24e9 + 4 * 5e-6)
    assert data["alternative"] is None
    r = plan("--model", "smollm2-135m", "--gpu", "l40s", cwd=demo)
    assert line(r, "fastest alternative") == ("fastest alternative: none: no single-node TP unit with more GPUs "
                                              f"is faster than the pick ({by_tp[1]['speed']['tpot1_s'] * 1e3:.1f} ms "
                                              "TPOT at batch 1)")
    assert "+ tp=3" not in r.stdout  # no "+" row in the table either


def test_alternative_is_named_when_faster():
    r = plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--json")
    data = json.loads(r.stdout)
    rec, alt = data["recommended"], data["alternative"]
    assert (rec["tp"], alt["tp"]) == (4, 8) and alt["speed"]["tpot1_s"] < rec["speed"]["tpot1_s"]
    r = plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16")
    got = line(r, "fastest alternative")
    assert got.startswith("fastest alternative: tp=8 pp=1 bf16 on 8 GPUs: ")
    shown = float(got.split(": ")[2].split(" ms")[0])
    picked = float(got.split("(recommended: ")[1].split(" ms")[0])
    assert shown < picked


def test_nothing_with_more_gpus_fits_says_so():
    # A100-80GB PCIe: TP up to 4, and at 131,072 tokens tp=4 is the pick: no single-node TP unit with more
    r = plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb-pcie", "--dtype", "bf16")
    assert line(r, "fastest alternative") == "fastest alternative: none (no single-node TP unit with more GPUs fits)"


# --- item 7: --gpus N, the GPUs of the node ---------------------------------------------------------


def test_gpus_is_the_node_size():
    r = plan(*L70_32K, "--gpus", "4")
    assert line(r, "gpus ").startswith("gpus    4 x a100-80gb (1 node x 4): ")
    assert line(r, "recommended").startswith("recommended (fit): tp=2 pp=1 bf16 on 2 GPUs")
    # the same as --gpus-per-node: the same bytes out
    assert plan(*L70_32K, "--gpus", "4", "--json").stdout == plan(*L70_32K, "--gpus-per-node", "4", "--json").stdout
    # with --nodes: that many nodes of --gpus each
    assert line(plan(*L70_32K, "--gpus", "4", "--nodes", "2"), "gpus ").startswith(
        "gpus    8 x a100-80gb (2 nodes x 4): ")
    # both given and equal is fine
    assert plan(*L70_32K, "--gpus", "4", "--gpus-per-node", "4").returncode == 0


def test_gpus_and_gpus_per_node_that_disagree_are_one_line():
    r = plan(*L70_32K, "--gpus", "4", "--gpus-per-node", "8")
    assert error_line(r) == ("error: --gpus: --gpus 4 and --gpus-per-node 8 disagree (hint: --gpus is the GPUs "
                             "of one node, the same as --gpus-per-node: give one of them)")
    assert r.stdout == ""
    assert error_line(plan(*L70_32K, "--gpus", "0")) == "error: --gpus: must be a positive integer, found '0'"
    # two GPUs cannot hold 131,072 tokens next to the 70B (the pick needs four): no recommendation
    r = plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16", "--gpus", "2")
    assert "fits no candidate on 2 x a100-80gb" in error_line(r)


def test_help_documents_gpus():
    r = plan("--help")
    text = " ".join(r.stdout.split())
    assert "--gpus N The GPUs of your node" in text and "both given must agree" in text
    assert "[default: 8; gb200, gb300: 72, the NVL72 rack]" in text.split("--gpus-per-node N")[1].split("--gpus N")[0]


# --- #27 follow-up: --gpu-memory-utilization 0.95 follows vLLM's accounting -------------------------


def test_utilization_095_recommends_tp2_at_32k():
    """vLLM at 0.95 starts tp=2: the context and graphs fit the 5% headroom, though the card is above 95%."""
    r = plan(*L70_32K, "--gpu-memory-utilization", "0.95", "--json")
    data = json.loads(r.stdout)
    rec = data["recommended"]
    assert (rec["tp"], rec["pp"], rec["dtype"]) == (2, 1, "bf16")
    # budget 84,987,740,160 x 0.95 = 80,738,353,152 B; the pool = 80,738,353,152 - 70,555,025,408 weights
    # - 402,653,184 (activations + NCCL) = 9,780,674,560 B (below the 20 GiB cap: memory sets it)
    pool = 80_738_353_152 - L70_TP2_WEIGHTS - IN_BUDGET
    assert A100_MEM * 0.95 == 80_738_353_152 and pool == 9_780_674_560
    assert rec["kv"]["budget"] == pytest.approx(pool)
    # 16 x floor(9,780,674,560 / (16 x 163,840)) = 16 x 3,731 = 59,696 tokens >= the 32,768 asked for
    assert rec["kv"]["tokens"] == 16 * (pool // (16 * L70_TP2_TOKEN)) == 59_696
    # in use: weights + every overhead + the pool = 81,812,094,976 B = 96.3% of the card, above 95%, and
    # still what vLLM starts: context + graphs 1,073,741,824 B <= the headroom 84,987,740,160 x 0.05
    used = L70_TP2_WEIGHTS + IN_BUDGET + OUTSIDE + pool
    assert used == 81_812_094_976 and rec["memory"]["used"] == pytest.approx(used)
    assert rec["memory"]["used_fraction"] > 0.95 and OUTSIDE <= A100_MEM * 0.05
    # the fit rules: room = 80,738,353,152 - 402,653,184 = 80,335,699,968; (141,107,412,992 + 10 GiB) /
    # 80,335,699,968 = 1.89 -> 2 cards
    assert data["fit"][0]["room"] == pytest.approx(80_335_699_968) and data["fit"][0]["minimum"] == 2
    r = plan(*L70_32K, "--gpu-memory-utilization", "0.95")
    assert line(r, "recommended").startswith("recommended (fit): tp=2 pp=1 bf16 on 2 GPUs: ")
    assert line(r, "recommended").endswith("max model length 32,768 (the length asked for; its KV pool holds "
                                           "59,696 tokens)")


def test_utilization_that_leaves_no_room_for_the_context_is_one_line():
    # 0.99 leaves 84,987,740,160 x 0.01 = 849,877,402 B = 0.79 GiB, less than the 1 GiB of context and graphs:
    # vLLM refuses to start (free memory below the budget) or runs out capturing the graphs, at any unit;
    # the most that leaves 1 GiB is 1 - 1,073,741,824 / 84,987,740,160 = 0.987 -> 0.98
    r = plan(*L70_32K, "--gpu-memory-utilization", "0.99")
    assert error_line(r) == (
        "error: --gpu-memory-utilization: llama-3.3-70b fits no candidate on 8 x a100-80gb; vLLM would not start: "
        "CUDA context and graphs 1.00 GiB > the 0.79 GiB it leaves outside its budget (79.15 GiB x (1 - 0.99)) "
        "(hint: use --gpu-memory-utilization 0.98 or less: vLLM needs 1.00 GiB outside its budget for the CUDA "
        "context and graphs)")
    r = plan(*L70_32K, "--gpu-memory-utilization", "0.98")  # 1.58 GiB of headroom: it starts
    assert line(r, "recommended").startswith("recommended (fit): tp=2 pp=1 bf16 on 2 GPUs")


def test_default_utilization_keeps_the_27_picks():
    # 0.9: the 32k pick stays tp=2, the default 131,072 context tp=4, eight A100-40GB PCIe at 32k TP4 x PP2
    assert line(plan(*L70_32K), "recommended").startswith("recommended (fit): tp=2 pp=1 bf16")
    assert line(plan("--model", "llama-3.3-70b", "--gpu", "a100-80gb", "--dtype", "bf16"),
                "recommended").startswith("recommended (fit): tp=4 pp=1 bf16")
    assert line(plan("--model", "llama-3.3-70b", "--gpu", "a100-40gb-pcie", "--dtype", "bf16", "--max-model-len",
                     "32768"), "recommended").startswith("recommended (fit, uncalibrated): tp=4 pp=2 bf16")


def test_a_size_of_bytes_typed_without_its_unit_is_refused_not_planned():
    """9,200,000,000 meant as bytes once planned a 9.2-billion-GiB card (a bare number was GiB) and
    printed a pool of billions of GiB, exit 0. One unit rule now (shardc/units.py): a size names its
    unit, in every command. Nothing this planner sizes reaches a PiB."""
    r = plan(*L70_32K, "--gpu-memory", "9200000000")
    assert error_line(r) == ("error: --gpu-memory: needs a unit (20GiB, 5.63GiB, 512MiB, 80GB or 1000B): a bare "
                             "number could be bytes, GiB or GB, found '9200000000'")
    assert error_line(plan(*L70_32K, "--kv-cache-cap", "20")).startswith("error: --kv-cache-cap: needs a unit")
    assert r.stdout == ""
    assert error_line(plan(*L70_32K, "--gpu-memory", "2PiB")).startswith("error: --gpu-memory: must be")
    assert error_line(plan(*L70_32K, "--gpu-memory", "2000TiB")) == (
        "error: --gpu-memory: must be at most 1 PiB, found '2000TiB'")
    assert plan(*L70_32K, "--gpu-memory", "84987740160B").returncode == 0
