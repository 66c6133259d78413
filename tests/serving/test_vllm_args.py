"""`shardc plan --emit` writes launch lines vLLM accepts (#43): each is put through vLLM's own `vllm
serve` parser and ``EngineArgs.from_cli_args`` in vLLM's venv (tests/serving/vllm_args.py), and where
the model directory exists here, through ``create_engine_config`` (vLLM's engine-config validation).
One vLLM process for every case."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_run import shardc_in
from tiny_builds import tiny_build

pytestmark = pytest.mark.heavy
HERE = Path(__file__).resolve().parent
IMAGE = "registry.example.com/shardc-vllm:0.1"
L8 = ("--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--isl", "1536", "--osl", "1024", "--max-model-len", "2560")


def _line(*args: object) -> list[str]:
    r = shardc_in("plan", *args, "--emit", "vllm")
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.replace("\\\n", ""))


def _pod(*args: object) -> list[str]:
    r = shardc_in("plan", *args, "--emit", "k8s", "--image", IMAGE, "--manifest-uri", "s3://b/m.json")
    assert r.returncode == 0, r.stderr
    (ct,) = yaml.safe_load(r.stdout)["spec"]["containers"]
    return [*ct["command"], *ct["args"]]


@pytest.fixture(scope="module")
def verdicts(vllm_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-args")
    build = tiny_build(tmp, "args")
    src = build.parent / "src"
    cases = {
        "fp8 line": {"argv": _line(*L8, "--dtype", "fp8", "--tp", "2")},
        "fp8 pod": {"argv": _pod(*L8, "--dtype", "fp8", "--tp", "2")},
        "ep pod": {"argv": _pod("--model", "mixtral-8x7b", "--gpu", "a100-40gb", "--dtype", "bf16")},
        "source line": {"argv": _line("--model", "gpt-oss-120b", "--gpu", "h100-sxm")},
        "local line": {"argv": _line("--model", src, "--gpu", "l40s", "--dtype", "bf16", "--tp", "1"), "config": True},
        "build line": {"argv": _line("--model", build), "config": True},
    }
    job, out = tmp / "cases.json", tmp / "out.json"
    job.write_text(json.dumps(list(cases.values())))
    run = subprocess.run([str(vllm_python), str(HERE / "vllm_args.py"), str(job), str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return dict(zip(cases, json.loads(out.read_text()), strict=True)), cases


def test_the_sources_line_is_vllms(verdicts):
    got, cases = verdicts
    v = got["fp8 line"]
    assert "error" not in v, v
    assert (v["model"], v["tensor_parallel_size"], v["quantization"]) == ("meta-llama/Llama-3.1-8B-Instruct", 2, "fp8")
    argv = cases["fp8 line"]["argv"]
    assert v["max_num_seqs"] == int(argv[argv.index("--max-num-seqs") + 1]) and v["max_model_len"] == 2560


def test_the_pod_serves_the_build_through_the_load_format(verdicts):
    got, _ = verdicts
    v = got["fp8 pod"]
    assert "error" not in v, v
    assert v["load_format"] == "shardc" and v["quantization"] is None and v["dtype"] == "bfloat16"
    assert v["tensor_parallel_size"] == 2 and v["model"].startswith("/models/")
    ep = got["ep pod"]
    assert (ep["data_parallel_size"], ep["enable_expert_parallel"], ep["load_format"]) == (4, True, "shardc")


def test_a_published_quantized_pick_passes_no_quantization(verdicts):
    got, _ = verdicts
    v = got["source line"]
    assert "error" not in v and v["model"] == "openai/gpt-oss-120b" and v["quantization"] is None


def test_engine_config_validation_passes_where_the_model_is_here(verdicts):
    """A pick on a local checkpoint, and a build's own launch (the shardc load format registered by
    the entry point, as in `vllm serve`), pass vLLM's engine-config validation on this CPU host."""
    got, _ = verdicts
    for name in ("local line", "build line"):
        v = got[name]
        assert "engine_config_error" not in v and "error" not in v, (name, v.get("engine_config_error"), v.get("error"))
        assert v["engine_config"]["tp"] == v["tensor_parallel_size"]
    assert got["build line"]["engine_config"]["load_format"] == "shardc"
