"""The sharded runtime against transformers' LlamaForCausalLM, and TP x PP plans against each other.

Every run goes through the real path: shardc build -> shard files -> one OS process per rank, each
loading only its own file through verify's checked loader, gloo process groups, send/recv between
stages. References are transformers models of the same checkpoint.

Tolerances, in one place (the reasoning is in each test):
* tp1pp1 runs the very kernels transformers runs (bf16 GEMMs, SDPA, fp32 RMSNorm statistics) in the
  same order, so logits agree to the bit; EXACT_ATOL only leaves room for an equivalent kernel choice.
* tp > 1 changes shapes and order: a row-parallel projection (o_proj, down_proj) is the sum of tp partial
  GEMMs, each rounded to bf16 before the (fp32) all-reduce. A transformers model patched to sum its
  row-parallel projections in exactly that order is the summation-order reference: against it the
  sharded run must again agree to EXACT_ATOL. Against tp1 the drift is bf16 rounding noise, bounded
  by the model's own bf16-vs-fp32 noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import shardc, shardc_in
from golden_windows import golden_windows
from plan_helpers import plan as make_plan

torch = pytest.importorskip("torch")

from shardc.compiler.compile import build  # noqa: E402
from shardc.errors import DistributedError, ManifestError  # noqa: E402
from shardc.runtime.api import BuildRef, generate, open_build, score  # noqa: E402

EXACT_ATOL = 1e-3
ROOT = Path(__file__).resolve().parents[2]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def build_plan(src: Path, out: Path, tp: int, pp: int, dtype: str = "bf16") -> BuildRef:
    """Build a plan of ``src`` into ``out`` and open it (the same call `shardc build` makes)."""
    name = f"{src.name}-tp{tp}pp{pp}-{dtype}"
    plan = make_plan(tp, pp, dtype, name=name, source=src)
    res = build(plan, out_dir=out / name)
    return open_build(res.manifest_path)


def hf_model(src: Path, dtype: torch.dtype = torch.bfloat16, tp: int = 1,
             quant: str | None = None) -> torch.nn.Module:
    """transformers' LlamaForCausalLM. With tp > 1 every projection runs as a tp-way replica computes
    it: column-parallel q/k/v/gate/up and the vocab-parallel lm_head as one GEMM per rank slice
    (GEMM kernels block differently for different shapes, so slices can differ in the last bit from
    one big GEMM), row-parallel o/down as tp partial GEMMs rounded to bf16 and summed in fp32 in rank
    order. Same shapes, same order: the single-process reference for a sharded run. ``quant``
    replaces every projection weight by its int8/fp8 round trip (weight-only quantization)."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from shardc.compiler.quantize import dequantize, quantize

    model = LlamaForCausalLM.from_pretrained(src, dtype=dtype).eval()
    if quant:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.weight"):
                    q, scale, _ = quantize(name, p.detach(), quant)
                    p.copy_(dequantize(q, scale, p.dtype))
    if tp == 1:
        return model

    def column(lin: torch.nn.Linear, n: int, rows: int | None = None) -> None:
        w = lin.weight.detach()
        pad = (rows or w.shape[0]) - w.shape[0]  # vocab padding: zero rows, as the shards hold
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
        parts = [c.contiguous() for c in w.chunk(n, 0)]
        true = lin.weight.shape[0]
        lin.forward = lambda x: torch.cat([F.linear(x, c) for c in parts], -1)[..., :true]

    def row(lin: torch.nn.Linear, n: int) -> None:
        parts = [c.contiguous() for c in lin.weight.detach().chunk(n, 1)]

        def forward(x: torch.Tensor) -> torch.Tensor:
            xs = [c.contiguous() for c in x.chunk(n, -1)]
            total = F.linear(xs[0], parts[0]).float()
            for a, w in zip(xs[1:], parts[1:], strict=True):
                total += F.linear(a, w).float()
            return total.to(x.dtype)
        lin.forward = forward

    kv = model.config.num_key_value_heads
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        column(att.q_proj, tp)
        column(att.k_proj, min(tp, kv))  # tp > kv heads: each rank computes one whole KV head
        column(att.v_proj, min(tp, kv))
        column(mlp.gate_proj, tp)
        column(mlp.up_proj, tp)
        row(att.o_proj, tp)
        row(mlp.down_proj, tp)
    vocab = model.config.vocab_size
    column(model.lm_head, tp, -(-vocab // tp) * tp)
    return model


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x).logits.float()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, not stopping at EOS (the runtime is called with eos=[] to match)."""
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- the demo model (SmolLM2-135M, 30 layers, 9 heads / 3 KV heads, tied embeddings) ------------------
@pytest.fixture(scope="module")
def demo(demo_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-builds")
    return {
        "src": demo_model_dir,
        "tp1pp1": build_plan(demo_model_dir, out, 1, 1),
        "tp3pp2": build_plan(demo_model_dir, out, 3, 2),
    }


@pytest.fixture(scope="module")
def demo_windows(demo):
    # Two 64-token windows of real English: two micro-batches through the pipeline.
    return golden_windows(demo["tp1pp1"].directory / "tokenizer.json", 2, 64)


@pytest.fixture(scope="module")
def demo_hf(demo, demo_windows):
    """transformers' bf16 demo model and its logits of the windows: the oracle of both demo tests,
    loaded and run once."""
    ref = hf_model(demo["src"])
    return ref, hf_logits(ref, demo_windows)


@pytest.mark.heavy
def test_demo_tp1pp1_matches_transformers(demo, demo_windows, demo_hf):
    from tokenizers import Tokenizer

    ref, want = demo_hf
    got = score(demo["tp1pp1"], demo_windows, return_logits=True, timeout_s=60)
    assert got.logits.shape == want.shape == (2, 64, 49152)
    torch.testing.assert_close(got.logits, want, rtol=0, atol=EXACT_ATOL)
    nll = -torch.log_softmax(want[:, :-1], -1).gather(-1, demo_windows[:, 1:, None])[..., 0]
    torch.testing.assert_close(got.nll, nll.double(), rtol=0, atol=1e-4)

    tok = Tokenizer.from_file(str(demo["tp1pp1"].directory / "tokenizer.json"))
    prompt = tok.encode("The capital of France is").ids
    res = generate(demo["tp1pp1"], [prompt], 32, eos=[], timeout_s=60)
    assert res.tokens[0] == hf_greedy(ref, prompt, 32)  # 32 identical greedy steps (KV cache path)
    assert "Paris" in tok.decode(res.tokens[0])


@pytest.mark.heavy
def test_demo_tp3pp2_matches_tp1pp1(demo, demo_windows, demo_hf):
    from tokenizers import Tokenizer

    got = score(demo["tp3pp2"], demo_windows, return_logits=True, timeout_s=60).logits
    # Same summation order as a tp=3 replica: agreement to the bit (see the module docstring).
    same_order = hf_logits(hf_model(demo["src"], tp=3), demo_windows)
    torch.testing.assert_close(got, same_order, rtol=0, atol=EXACT_ATOL)
    # Against tp1pp1 the only difference is bf16 rounding of the partial sums: its size must stay
    # within the model's own bf16 noise (bf16 vs fp32 transformers on the same tokens).
    tp1 = demo_hf[1]
    noise = (tp1 - hf_logits(hf_model(demo["src"], torch.float32), demo_windows)).abs().mean()
    drift = (got - tp1).abs().mean()
    assert 0 < drift <= 2 * noise, (float(drift), float(noise))
    assert (got.argmax(-1) == tp1.argmax(-1)).float().mean() >= 0.9

    tok = Tokenizer.from_file(str(demo["tp3pp2"].directory / "tokenizer.json"))
    prompts = [tok.encode("The capital of France is").ids, tok.encode("def fibonacci(n):").ids]
    res = generate(demo["tp3pp2"], prompts, 8, eos=[], timeout_s=60)  # two sequences in the pipe
    assert "Paris" in tok.decode(res.tokens[0])
    assert len(res.tokens[1]) == 8


# -- synthetic models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("synth")
    # 4 heads / 2 KV heads: tp 4 holds one replicated KV head per rank; vocab 99 pads at tp 2 and 4.
    untied = write_checkpoint(root / "untied", llama_config(num_layers=4, vocab_size=99), seed=1)
    tied = write_checkpoint(root / "tied", llama_config(num_layers=4, vocab_size=99,
                                                        tie_word_embeddings=True), seed=2)
    rope = write_checkpoint(root / "llama3rope", llama_config(
        num_layers=2, vocab_size=128, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)), seed=3)
    return {"untied": untied, "tied": tied, "llama3rope": rope, "out": root / "builds"}


def _ids(n: int, t: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_llama3_rope_frequencies_match_transformers(synth):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardc.layout.model import load_model
    from shardc.runtime.rope import rope_inv_freq

    spec = load_model(synth["llama3rope"]).summary()
    ours, _ = rope_inv_freq(spec)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_pretrained(synth["llama3rope"]), "cpu")
    assert torch.equal(ours, theirs)
    plain, _ = rope_inv_freq({**spec, "rope_scaling": None})
    assert not torch.equal(ours, plain)  # the scaling is in effect for this config


def test_synthetic_llama3_rope_matches_transformers(synth):
    """llama3 rope scaling, 96 positions (past original_max_position_embeddings=64)."""
    ref = build_plan(synth["llama3rope"], synth["out"], 1, 1)
    hf = hf_model(synth["llama3rope"])
    x = _ids(1, 96, 128)
    got = score(ref, x, return_logits=True, timeout_s=60).logits
    torch.testing.assert_close(got, hf_logits(hf, x), rtol=0, atol=EXACT_ATOL)
    prompt = x[0, :40].tolist()
    res = generate(ref, [prompt], 32, eos=[], timeout_s=60)
    assert res.tokens[0] == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("kind,tp,pp", [("untied", 2, 1), ("tied", 2, 2), ("untied", 4, 1)])
def test_synthetic_tp_pp_against_reference(synth, kind, tp, pp):
    """tp 2 (KV heads split), tp 4 > 2 KV heads (replicated), tied embeddings with pp 2 (the last
    stage holds lm_head sliced from the embedding), vocab 99 padded to a multiple of tp."""
    src = synth[kind]
    ref = build_plan(src, synth["out"], tp, pp)
    x = _ids(3, 24, 99, seed=tp * 10 + pp)  # 3 micro-batches through the pipeline
    got = score(ref, x, return_logits=True, timeout_s=60).logits
    assert got.shape == (3, 24, 99)  # padded vocabulary rows dropped
    torch.testing.assert_close(got, hf_logits(hf_model(src, tp=tp), x), rtol=0, atol=EXACT_ATOL)
    # Drift from the tp1 reference is bf16 rounding of the partial sums: a few bf16 ulps of the
    # logits (|logit| < 1 here, ulp <= 2^-8).
    torch.testing.assert_close(got, hf_logits(hf_model(src), x), rtol=0, atol=4 * 2**-8)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_plans_dequantize_at_load(synth, dtype):
    """Weight-only int8/fp8: the runtime equals transformers running the dequantized weights."""
    src = synth["untied"]
    ref = build_plan(src, synth["out"], 2, 1, dtype)
    hf = hf_model(src, tp=2, quant=dtype)
    x = _ids(2, 16, 99, seed=7)
    got = score(ref, x, return_logits=True, timeout_s=60).logits
    torch.testing.assert_close(got, hf_logits(hf, x), rtol=0, atol=EXACT_ATOL)


# -- failures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe2(synth):
    return build_plan(synth["untied"], synth["out"], 1, 2)


def test_killed_rank_fails_fast_and_is_named(pipe2, monkeypatch):
    monkeypatch.setenv("SHARDC_FAULT", "kill:1:3")  # rank 1 dies at its third step
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(tp 0, pp 1\) was killed by SIGKILL"):
        generate(pipe2, [[1, 2, 3]], 8, eos=[], timeout_s=30)
    assert time.monotonic() - t0 < 30  # well inside the collective timeout: no hang


def test_hung_rank_times_out_and_is_named(pipe2, monkeypatch):
    monkeypatch.setenv("SHARDC_FAULT", "hang:0:3")  # rank 0 stops sending; rank 1 waits on recv
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 \(tp 0, pp 0\) hung") as err:
        generate(pipe2, [[1, 2, 3]], 8, eos=[], timeout_s=4)
    assert "timed out" in str(err.value)
    assert time.monotonic() - t0 < 4 + 30  # timeout + grace + process start-up


def test_missing_shards_are_bad_input(pipe2, tmp_path):
    (tmp_path / "manifest.json").write_bytes(pipe2.manifest_path.read_bytes())
    with pytest.raises(ManifestError, match="not in"):
        open_build(tmp_path / "manifest.json")


def test_tampered_shard_is_refused(synth, tmp_path):
    """A rank loads through verify: flipped bytes are a VerifyMismatch from that rank, not a model."""
    import shutil

    from shardc.errors import VerifyMismatch

    ref = build_plan(synth["untied"], synth["out"], 2, 1)
    bad = tmp_path / "bad"
    shutil.copytree(ref.directory, bad)
    f = bad / ref.manifest.shards[1].file
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(VerifyMismatch, match=r"rank 1 \(tp 1, pp 0\).*sha256"):
        generate(open_build(bad), [[1, 2]], 2, timeout_s=30)


# -- command line ----------------------------------------------------------------------------------------
def test_help_does_not_import_torch():
    code = "import sys, shardc.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert "--max-new-tokens" in shardc("run", "--help").stdout


@pytest.mark.heavy
def test_cli_run_demo(demo):
    t0 = time.perf_counter()
    p = shardc("run", "--manifest", str(demo["tp3pp2"].manifest_path), "--prompt",
               "The capital of France is", "--max-new-tokens", "6", "--json", timeout=300)
    took = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    out = data["outputs"][0]
    assert "Paris" in out["text"] and len(out["tokens"]) <= 6
    # the wall time a user waits, not only the generation: rank start-up and loads inside it
    assert data["seconds"] + data["load_seconds"] <= data["wall_seconds"] <= took
    assert 0 <= data["first_token_seconds"] <= data["seconds"]
    p = shardc_in("run", "--manifest", str(demo["tp1pp1"].manifest_path), "--prompt-ids", "1,x")
    assert p.returncode == 2 and "comma-separated" in p.stderr


@pytest.mark.heavy
def test_torchrun_launch(pipe2):
    """The same command under torchrun: every rank in-process, the last stage prints."""
    direct = generate(pipe2, [[5, 6, 7]], 4, eos=[], timeout_s=60).tokens[0]
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "shardc.cli", "run", "--manifest", str(pipe2.manifest_path), "--prompt-ids", "5,6,7",
         "--max-new-tokens", "4", "--json", "--timeout", "60"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["outputs"][0]["tokens"] == direct


def test_pipeline_keeps_micro_batches_in_flight(pipe2, tmp_path):
    """pp 2, 6 micro-batches: stage 0 starts micro-batch 1 while stage 1 has not even received
    micro-batch 0 (the sends are asynchronous), which is what makes the bubble (pp-1)/(M+pp-1)
    rather than (pp-1)/pp.

    Proved with events, not timestamps: stage 1 (rank 1) is held at its first step, before it
    receives micro-batch 0 (SHARDC_FAULT hang:1:1), and stage 0's heartbeat is read from the real
    rendezvous store, which this test hosts as the built-in launcher would. Stage 0 reaching its
    second step means it started micro-batch 1 with micro-batch 0 still in flight; a pipeline that
    waited for stage 1 before its next micro-batch stays at step 1 and the test fails at the deadline.
    """
    import os
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    job = {"id": "in-flight", "kind": "score", "replicas": [pipe2.wire_entry()], "timeout_s": 120.0,
           "device": "cpu", "threads": 1,
           "score": {"windows": _ids(6, 16, 99, seed=3).tolist(), "micro_batch": 1}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    host = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)  # port 0: the OS picks it, and it stays ours
    store = dist.PrefixStore(f"shardc/{job['id']}", host)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(host.port),
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "SHARDC_FAULT": "hang:1:1"}
    logs, procs = [tmp_path / f"rank{r}.log" for r in range(2)], []
    for r in range(2):
        with logs[r].open("wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shardc.runtime.worker", str(tmp_path / "job.json")],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, stdout=subprocess.DEVNULL,
                stderr=log))

    def step(rank: int) -> int:
        return int(store.get(f"beat/{rank}")) if store.check([f"beat/{rank}"]) else 0

    try:
        deadline = time.monotonic() + 120  # start-up and loading; the run itself takes milliseconds
        while step(0) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail(f"stage 0 never started micro-batch 1 while stage 1 held micro-batch 0 "
                            f"(stage 0 at step {step(0)}; exit codes {[p.poll() for p in procs]}): "
                            f"the pipeline waits for the next stage\n{logs[0].read_text()[-2000:]}")
            time.sleep(0.05)  # polling a condition; how long it takes does not matter
        assert step(1) == 0 and procs[1].poll() is None  # stage 1 still holds micro-batch 0, unreceived
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
