"""`shardc plan`'s workload (#33): --isl/--osl/--ttft-ms/--concurrency, the serving figures in --json,
the picture (--plot), and the launch configs that cannot disagree with the pick (--emit, --check).

The speed formulas themselves are worked by hand in planner/test_planner.py; these check the surfaces."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from shardc.cli import main
from shardc.layout.model import load_model
from shardc.planner.formulas import Workload
from shardc.planner.gpus import Cluster, get_gpu
from shardc.planner.search import search

L8 = ("--model", "llama-3.1-8b", "--gpu", "h100-sxm")
WORKLOAD = ("--isl", "1536", "--osl", "1024", "--max-model-len", "2560")
IMAGE = "registry.example.com/shardc-vllm:0.1"  # the pod's image: it holds shardc and vLLM


L70 = load_model("llama-3.3-70b")
A100 = Cluster(get_gpu("a100-80gb"))


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def _only(model, tp, pp, dtype, workload):
    (c,) = search(model, A100, workload, tps=[tp], pps=[pp], dtypes=[dtype]).candidates
    return c


def test_serving_interleaves_prefill_with_decode():
    """isl 1,536 / osl 1,024 at concurrency 64 (A100-80GB, 70B bf16 tp=4): the prompt fits one step
    (8,192-token budget), so a request has 1 prefill step and 1,023 decode steps, and a share
    64 x 1 / (1 + 1,023) = 1/16 of all steps carries a prompt; TPOT is the mean step;
    tokens/s = 64 / (TTFT + 1,023 x TPOT) x 1,024. TTFT: the wait under the scheduler, then the
    prompt's one mixed step (serving.py): the other 63 requests put a prompt in 63 / 1,024 of the steps."""
    w = Workload(isl=1536, osl=1024, concurrency=64, max_model_len=2560, target_tpot_ms=1000)
    c = _only(L70, 4, 1, "bf16", w)
    x = c.serving
    assert (x.concurrency, x.chunk, x.chunks) == (64, 1536, 1) and x.mixed_share == pytest.approx(1 / 16)
    assert x.mixed_step_s > 3 * x.decode_step_s  # the prompt's 1,536 tokens are compute-bound
    assert x.tpot_s == pytest.approx(x.mixed_step_s / 16 + x.decode_step_s * 15 / 16)
    m, d = x.mixed_step_s, x.decode_step_s
    s = 63 / 1024
    mean = s * m + (1 - s) * d
    residual = (s * m * m + (1 - s) * d * d) / (2 * mean)  # the step in progress, met in proportion to its length
    rho = s * m / mean  # the share of the time the others keep the unit prefilling
    ahead = rho ** 2 / (2 * (1 - rho))  # M/D/1's mean queue of prompts; (8,192 - 63) // 1,536 = 5 per step
    assert x.prefilling == pytest.approx(rho) and 0.2 < rho < 0.5
    assert x.wait_s == pytest.approx(residual + ahead * m / 5)
    assert x.ttft_s == pytest.approx(x.wait_s + m)
    # alone, a request finds the unit idle: its TTFT is one prefill
    one = _only(L70, 4, 1, "bf16", dataclasses.replace(w, concurrency=1)).serving
    assert one.ttft_s == one.prefill_s and one.wait_s == 0
    latency = x.ttft_s + 1023 * x.tpot_s
    assert x.tokens_per_s == pytest.approx(64 / latency * 1024) and c.speed.tokens_per_s == x.tokens_per_s
    assert x.tokens_per_s_per_gpu == pytest.approx(x.tokens_per_s / 4)
    assert x.requests_per_s == pytest.approx(64 / latency)
    # without the interference the TPOT would be the decode step: prefill costs every running sequence
    assert x.tpot_s > x.decode_step_s
    # a longer prompt than the budget left beside the decodes: chunked, 8,192 - 3 = 8,189 per step
    long = _only(L70, 4, 1, "bf16", dataclasses.replace(w, isl=20_000, concurrency=4, max_model_len=32_768))
    assert (long.serving.chunk, long.serving.chunks) == (8189, 3)


def test_concurrency_is_the_most_that_meets_the_targets():
    w = Workload(isl=1536, osl=1024, max_model_len=2560, target_tpot_ms=30)
    c = _only(L70, 4, 1, "bf16", w)
    n = c.serving.concurrency
    assert c.speed.limited_by == "tpot" and c.serving.tpot_s <= 0.030
    more = _only(L70, 4, 1, "bf16", dataclasses.replace(w, concurrency=n + 1, target_tpot_ms=1000))
    assert more.serving.tpot_s > 0.030
    looser = _only(L70, 4, 1, "bf16", dataclasses.replace(w, target_tpot_ms=50))
    assert looser.serving.concurrency > n  # a looser target is a larger batch, not the KV cap's
    free = dataclasses.replace(w, target_tpot_ms=1000)
    top = _only(L70, 4, 1, "bf16", free).serving  # the KV cache's concurrency, TTFT unbounded
    one = _only(L70, 4, 1, "bf16", dataclasses.replace(free, concurrency=1)).serving
    mid = (one.ttft_s + top.ttft_s) / 2 * 1e3  # TTFT grows with the decodes sharing its steps
    ttft = _only(L70, 4, 1, "bf16", dataclasses.replace(free, ttft_ms=mid))
    assert ttft.speed.limited_by == "ttft" and ttft.serving.ttft_s * 1e3 <= mid
    assert one.concurrency <= ttft.serving.concurrency < top.concurrency


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
    rec = data["recommended"]
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
                 "weights", "KV pool", "candidate at concurrency 1, 2, 4"):
        assert text in svg, text
    # the front over every candidate's concurrency sweep, worked by hand: (TPOT ms, tok/s/GPU)
    from shardc.planner.plot import pareto

    pts = [(10, 100, "a"), (12, 90, "b"), (12, 150, "a"), (20, 140, "b"), (30, 400, "b"), (25, 300, "c")]
    assert pareto(pts) == [(10, 100, "a"), (12, 150, "a"), (25, 300, "c"), (30, 400, "b")]
    r = _run(*L8, *WORKLOAD, "--plot", str(tmp_path / "plan.gif"))
    assert r.exit_code == 2 and "error: --plot:" in r.stderr


def test_emit_vllm_and_k8s_agree_with_the_plan(tmp_path):
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--emit", "vllm")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    # one option per line, each line but the last continued with a backslash, as sh reads it
    assert lines[0] == "vllm serve meta-llama/Llama-3.1-8B-Instruct \\"
    assert all(x.endswith(" \\") for x in lines[:-1]) and all(x.startswith("    --") for x in lines[1:])
    cmd = r.stdout.replace("\\\n", "")
    assert cmd.split()[:5] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "2"]
    argv = shlex.split(cmd)
    assert argv[argv.index("--quantization") + 1] == "fp8" and argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    seqs = int(argv[argv.index("--max-num-seqs") + 1])
    data = json.loads(_run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--json").stdout)
    rec = data["recommended"]
    # no concurrency or TPOT target given: what the KV pool holds at the average context
    assert seqs == max(rec["concurrency"], rec["kv"]["sequences"])
    pod_file = tmp_path / "pod.yaml"
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--emit", "k8s", "--manifest-uri", "s3://b/m.json",
             "--image", IMAGE)
    assert r.exit_code == 0, r.output
    pod_file.write_text(r.stdout)
    pod = yaml.safe_load(r.stdout)
    (ct,) = pod["spec"]["containers"]
    # the verified build is what vLLM serves, at tp=2 too: the shardc load format, no --quantization
    # (the fp8 build's config.json says how it is quantized)
    name = pod["metadata"]["name"]
    assert ct["resources"]["limits"]["nvidia.com/gpu"] == 2 and ct["args"][:3] == [f"/models/{name}", "--load-format",
                                                                                   "shardc"]
    assert "--quantization" not in ct["args"] and ct["args"][ct["args"].index("--dtype") + 1] == "bfloat16"
    assert ct["image"] == pod["spec"]["initContainers"][0]["image"] == IMAGE
    init = pod["spec"]["initContainers"][0]["command"][-1]
    assert f"shardc pull --manifest s3://b/m.json --all --dest /models/{name}" in init and "shardc verify" in init
    assert "--device cuda" in init
    assert pod["spec"]["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--check", str(pod_file))
    assert r.exit_code == 0 and "agrees with the plan" in r.stdout, r.output
    # the same pod against another pick: one line per disagreement, exit 1
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "4", "--check", str(pod_file))
    assert r.exit_code == 1, r.output
    lines = r.stdout.strip().splitlines()
    assert any("--tensor-parallel-size: the deployment has 2, the plan 4" in x for x in lines)
    assert any("nvidia.com/gpu: the deployment requests 2, the plan needs 4" in x for x in lines)
    # a --quantization beside the shardc load format contradicts the build's config.json: caught
    bad = yaml.safe_load(pod_file.read_text())
    bad["spec"]["containers"][0]["args"] += ["--quantization", "fp8"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--check", str(tmp_path / "bad.yaml"))
    assert r.exit_code == 1 and "--quantization: the deployment has fp8, the build's config.json says" in r.stdout
    # the source's vllm serve line, checked: its online --quantization fp8 is what the plan asks
    (tmp_path / "line.yaml").write_text(yaml.safe_dump(cmd))
    r = _run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--check", str(tmp_path / "line.yaml"))
    assert r.exit_code == 0 and "agrees with the plan" in r.stdout, r.output
    # one GPU: the same
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "1", "--emit", "k8s", "--manifest-uri", "s3://b/m.json",
             "--image", IMAGE)
    one = yaml.safe_load(r.stdout)
    assert one["spec"]["containers"][0]["args"][0] == one["spec"]["containers"][0]["env"][0]["value"] \
        == "/models/" + one["metadata"]["name"]
    # no image: one line naming --image, nothing printed
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "1", "--emit", "k8s")
    assert r.exit_code == 2 and r.stderr.startswith("error: --image:") and not r.stdout
    r = _run(*L8, *WORKLOAD, "--check", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2 and r.stderr.startswith("error: --check: cannot read")
    args_file = tmp_path / "args.yaml"  # bare vLLM arguments
    args_file.write_text(yaml.safe_dump(["--tensor-parallel-size", "4", "--max-model-len", "99999"]))
    r = _run(*L8, *WORKLOAD, "--dtype", "bf16", "--tp", "4", "--check", str(args_file))
    assert r.exit_code == 1 and "--max-model-len: the deployment asks 99999" in r.stdout


def test_max_num_seqs_is_the_concurrency_a_target_holds():
    """With a TPOT target (or a concurrency) the figures are at the plan's concurrency, and vLLM is
    held to it; a 70B fp8 on one H100 under the default target gets what its KV pool holds, not 1."""
    argv = shlex.split(_run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--target-tpot-ms", "20",
                            "--emit", "vllm").stdout.replace("\\\n", ""))
    data = json.loads(_run(*L8, *WORKLOAD, "--dtype", "fp8", "--tp", "2", "--target-tpot-ms", "20", "--json").stdout)
    assert int(argv[argv.index("--max-num-seqs") + 1]) == data["recommended"]["concurrency"]
    seventy = ("--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--dtype", "fp8", "--max-model-len", "8192")
    data = json.loads(_run(*seventy, "--json").stdout)
    argv = shlex.split(_run(*seventy, "--emit", "vllm").stdout.replace("\\\n", ""))
    assert data["recommended"]["tp"] == 1 and data["recommended"]["concurrency"] == 1
    assert int(argv[argv.index("--max-num-seqs") + 1]) == data["recommended"]["kv"]["sequences"] > 1


def test_emit_for_an_expert_parallel_pick():
    r = _run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16", "--emit", "vllm")
    assert r.exit_code == 0, r.output
    assert "--tensor-parallel-size 1 \\\n    --data-parallel-size 4 \\\n    --enable-expert-parallel" in r.stdout
    pod = yaml.safe_load(_run("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16",
                              "--emit", "k8s", "--image", IMAGE).stdout)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4  # tp 1 x pp 1 x dp 4


def test_nvlink_all_reduce_is_two_shot_not_a_ring():
    """vLLM's custom all-reduce on NVLink pays 2 latencies whatever the TP (a ring 2(n-1)); the
    bandwidth term is the ring's 2(n-1)/n x bytes / bandwidth (docs/performance.md)."""
    from shardc.planner.formulas import custom_allreduce_s, ring_allreduce_s

    assert custom_allreduce_s(8, 0, 1e9, 2e-6) == pytest.approx(4e-6)
    assert ring_allreduce_s(8, 0, 1e9, 2e-6) == pytest.approx(28e-6)
    assert custom_allreduce_s(4, 1e6, 1e9, 0) == ring_allreduce_s(4, 1e6, 1e9, 0) == pytest.approx(1.5e-3)
    assert custom_allreduce_s(1, 1e6, 1e9, 2e-6) == 0.0


def test_a_quantized_checkpoint_is_planned_at_its_stored_size(tmp_path):
    """#31: a checkpoint published block-FP8 (Llama-3.1-8B's shapes, 128 x 128 blocks) is planned
    as stored (``dtype: source``, offered first by --dtype auto) at its real bytes, worked by hand:
    per layer the seven projections hold 218,103,808 fp8 values (1 B) and 13,312 float32 block
    scales; embed_tokens and lm_head (128,256 x 4,096) and the norms stay bf16."""
    cfg = {**load_model("llama-3.1-8b").config,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = _run("--model", str(path), "--gpu", "h100-sxm", "--tp", "1", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    by = {c["dtype"]: c for c in data["candidates"] if c.get("tp") == 1 and c.get("pp") == 1}
    assert data["dtypes"][0] == "source" and set(by) >= {"source", "bf16"}
    per_layer = 218_103_808 + 13_312 * 4 + 2 * 4096 * 2
    want = 32 * per_layer + 2 * 128_256 * 4096 * 2 + 4096 * 2
    assert by["source"]["memory"]["weights"] == want == 9_082_904_576
    assert by["source"]["tokens_per_s_per_gpu"] > by["bf16"]["tokens_per_s_per_gpu"]  # fewer bytes a step
    r = _run("--model", str(path), "--gpu", "h100-sxm", "--tp", "1", "--dtype", "source", "--out", str(tmp_path / "p.yaml"))
    assert r.exit_code == 0, r.output
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["replica_group"]["dtype"] == "source"


@pytest.mark.parametrize("args", [
    ("--model", "llama-3.1-8b", "--gpu", "l40s", "--max-model-len", "8192", "--concurrency", "32",
     "--avg-context", "4096"),  # the README's L40S example: the two picks' points close together
    L8 + WORKLOAD,
    ("--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--dtype", "fp8", "--max-model-len", "8192"),
])
def test_plot_labels_never_overlap_and_every_curve_is_in_the_legend(args, tmp_path, monkeypatch):
    """#43: the tags of the recommendation and the fastest alternative are placed where their boxes
    overlap no other label, inside the axes; the grey sweeps, the front and the target are named in
    the legend, which sits outside the axes. The figure --plot renders, kept open to measure."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    import shardc.planner.plot as plot

    made = []
    real = plot.figure
    monkeypatch.setattr(plot, "figure", lambda s: made.append((s, real(s))) or made[-1][1])
    monkeypatch.setattr(plt, "close", lambda *a: None)
    r = _run(*args, "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 0, r.output
    (s, fig), = made
    monkeypatch.undo()
    try:
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        texts = [t for t in ax.texts if t.get_text()]
        tags = [t for t in texts if t.get_text().startswith(("recommended:", "fastest alternative:"))]
        assert len(tags) == 1 + (s.alternative is not None)
        frame = ax.get_window_extent(renderer)
        for t in tags:
            box = t.get_window_extent(renderer)
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            assert not any(box.overlaps(o.get_window_extent(renderer)) for o in texts if o is not t), t.get_text()
        names = [x.get_text() for x in ax.get_legend().get_texts()]
        assert names == ["candidate at concurrency 1, 2, 4, ...", "Pareto front", "TPOT target"]
        assert not ax.get_legend().get_window_extent(renderer).overlaps(frame)
    finally:
        plt.close(fig)


def test_an_int8_pick_has_no_source_line():
    """vLLM has no online int8: a `vllm serve` line of the 16-bit source would serve 16 bits. One line
    naming --emit and the way that works (the build's own launch, or the pod), exit 2, nothing printed."""
    r = _run(*L8, *WORKLOAD, "--dtype", "int8", "--emit", "vllm")
    assert r.exit_code == 2 and not r.stdout
    assert r.stderr.startswith("error: --emit: the pick tp=1 pp=1 int8 is int8, which vLLM cannot make from ")
    assert "--emit k8s" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _run(*L8, *WORKLOAD, "--dtype", "int8", "--emit", "k8s", "--image", IMAGE)
    assert r.exit_code == 0 and "--load-format" in r.stdout
