"""`shardc plan`'s workload (#33): --isl/--osl/--ttft-ms/--concurrency, the serving figures in --json,
the picture (--plot), and the launch configs that cannot disagree with the pick (--emit, --check).

The speed formulas themselves are worked by hand in test_planner.py; these check the surfaces."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from shardc.cli import main

L8 = ("--model", "llama-3.1-8b", "--gpu", "h100-sxm")
WORKLOAD = ("--isl", "1536", "--osl", "1024", "--max-model-len", "2560")


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_json_carries_the_serving_figures_of_every_candidate():
    r = _run(*L8, *WORKLOAD, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    fitting = [c for c in data["candidates"] if c["status"] in ("ok", "slow")]
    assert fitting
    for c in fitting:
        for key in ("ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "requests_per_s", "concurrency"):
            assert isinstance(c[key], (int, float)) and c[key] > 0, (c["tp"], key)
        # tokens/s per GPU = requests/s x osl / GPUs, and $/Mtok follows the served tokens
        assert c["tokens_per_s_per_gpu"] == pytest.approx(c["requests_per_s"] * 1024 / c["gpus"])
        assert c["cost"]["dollars_per_mtok"] == pytest.approx(2.80 * 1e6 / (c["tokens_per_s_per_gpu"] * 3600))
    rec = data["candidates"][data["recommended"]]
    assert rec["tpot_ms"] <= 25 and rec["serving"]["isl"] == 1536


def test_concurrency_fixes_it_and_a_looser_target_raises_it():
    fixed = json.loads(_run(*L8, *WORKLOAD, "--tp", "1", "--concurrency", "8", "--json").stdout)
    assert fixed["candidates"][0]["concurrency"] == 8
    tight = json.loads(_run(*L8, *WORKLOAD, "--tp", "1", "--target-tpot-ms", "12", "--json").stdout)
    loose = json.loads(_run(*L8, *WORKLOAD, "--tp", "1", "--target-tpot-ms", "50", "--json").stdout)
    assert tight["candidates"][0]["concurrency"] < loose["candidates"][0]["concurrency"]


@pytest.mark.parametrize("args, flag, words", [
    (("--isl", "0"), "--isl", "positive integer"),
    (("--isl", "200000"), "--isl", "is more than the model's max_position_embeddings 131,072"),
    (("--isl", "2000", "--osl", "1000", "--max-model-len", "2560"), "--osl", "keep --isl + --osl <= 2,560"),
    (("--ttft-ms", "1", *WORKLOAD), "--ttft-ms", "below one prefill of the 1,536-token prompt"),
])
def test_bad_workload_is_one_line_exit_2(args, flag, words):
    r = _run(*L8, *args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}:") and words in lines[0], lines
    assert "Traceback" not in r.output


def test_plot_renders_the_front_and_the_pick(tmp_path):
    out = tmp_path / "plan.svg"
    r = _run(*L8, *WORKLOAD, "--plot", str(out))
    assert r.exit_code == 0, r.output
    svg = out.read_text()
    assert out.stat().st_size > 10_000 and svg.lstrip().startswith(("<?xml", "<svg"))
    for text in ("Pareto front", "recommended: tp=1 pp=1", "output tokens/s per GPU", "memory per GPU",
                 "weights", "KV pool"):
        assert text in svg, text
    r = _run(*L8, *WORKLOAD, "--plot", str(tmp_path / "plan.gif"))
    assert r.exit_code == 2 and "error: --plot:" in r.stderr


def test_emit_vllm_and_k8s_agree_with_the_plan(tmp_path):
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--emit", "vllm")
    assert r.exit_code == 0, r.output
    cmd = r.stdout.strip()
    assert cmd.startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2 "
                          "--pipeline-parallel-size 1 --max-model-len 2560 ")
    assert "--quantization fp8" in cmd and "--gpu-memory-utilization 0.9" in cmd
    seqs = int(re.search(r"--max-num-seqs (\d+)", cmd).group(1))
    data = json.loads(_run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--json").stdout)
    assert seqs == data["candidates"][data["recommended"]]["concurrency"]
    pod_file = tmp_path / "pod.yaml"
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--emit", "k8s", "--manifest-uri", "s3://b/m.json")
    assert r.exit_code == 0, r.output
    pod_file.write_text(r.stdout)
    pod = yaml.safe_load(r.stdout)
    (ct,) = pod["spec"]["containers"]
    assert ct["resources"]["limits"]["nvidia.com/gpu"] == 2 and ct["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    init = pod["spec"]["initContainers"][0]["command"][-1]
    assert "shardc pull --manifest s3://b/m.json --rank 0 --rank 1" in init and "shardc verify" in init
    assert "--device cuda" in init
    assert pod["spec"]["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--check", str(pod_file))
    assert r.exit_code == 0 and "agrees with the plan" in r.stdout, r.output
    # the same pod against another pick: one line per disagreement, exit 1
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "4", "--check", str(pod_file))
    assert r.exit_code == 1, r.output
    lines = r.stdout.strip().splitlines()
    assert any("--tensor-parallel-size: the deployment has 2, the plan 4" in x for x in lines)
    assert any("--quantization: the deployment has fp8, the plan none" in x for x in lines)
    assert any("nvidia.com/gpu: the deployment requests 2, the plan needs 4" in x for x in lines)
    r = _run(*L8, *WORKLOAD, "--check", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2 and r.stderr.startswith("error: --check: cannot read")
    args_file = tmp_path / "args.yaml"  # bare vLLM arguments
    args_file.write_text(yaml.safe_dump(["--tensor-parallel-size", "4", "--max-model-len", "99999"]))
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "4", "--check", str(args_file))
    assert r.exit_code == 1 and "--max-model-len: the deployment asks 99999" in r.stdout


def test_emit_for_an_expert_parallel_pick():
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16", "--emit", "vllm")
    assert r.exit_code == 0, r.output
    assert "--tensor-parallel-size 1 --data-parallel-size 4 --enable-expert-parallel" in r.stdout
    pod = yaml.safe_load(_run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16",
                              "--emit", "k8s").stdout)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4  # tp 1 x pp 1 x dp 4
