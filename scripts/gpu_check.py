#!/usr/bin/env python3
"""Every CUDA path of issue 16 in one run, with its figures; run by scripts/gpu_check.sh.

DEVICE=cuda (default) SIZE=8b: a synthetic Llama-8B-shaped model (8 layers, hidden 4096, GQA 32/8,
vocab 128256, bf16; about 5.6 GB) built as bf16 tp1, int8, fp8 and bf16 tp4pp2, then:
  verify --device of every build (tp4pp2: all eight ranks in one process), a flipped byte exits 1;
  the GPU-count line for plans larger than the node (run and gate of tp4pp2; verify --distributed);
  torchrun verify --distributed --device cuda of tp1;
  decode: 128 greedy tokens scored by teacher forcing (scripts/decode_score.py: each token
  transformers' argmax on shardc's own prefix, or within a stated bf16 near-tie margin; only a real
  mismatch fails), tokens/s against transformers' generate; prefill scoring of 8 x 512 against
  transformers' forward (ratio);
  load_shard's chunked read (issue 30: pinned staging, per-worker copy streams) equal to
  load_file, a flipped byte naming its chunk;
  load_shard / verify --device of one rank against hashlib + safetensors load_file + isfinite;
  gate bf16 vs int8 on the device, then again from --baseline-cache (same numbers, time ratio).
DEVICE=cpu SIZE=tiny runs the same steps on a 2-layer toy in well under a minute (CI: the script
never rots). Figures are ratios measured in the same run. Results: $OUT/gpu_check.json and a log
on stdout. Exit 1 when a correctness check fails (figures never fail the run), 0 otherwise.
Steps still pending when BUDGET_S (default 270 s) is spent are skipped and reported as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
DEVICE = os.environ.get("DEVICE", "cuda")
SIZE = os.environ.get("SIZE", "8b" if DEVICE.startswith("cuda") else "tiny")
BUDGET_S = float(os.environ.get("BUDGET_S", "270"))
SHAPES = {
    "8b": {"layers": 8, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256,
           "window": 512, "windows": 8, "gate_tokens": 2048, "decode": 128},
    "tiny": {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 8, "kv_heads": 4, "vocab": 512,
             "window": 64, "windows": 8, "gate_tokens": 256, "decode": 16},
}[SIZE]
T0 = time.monotonic()
RESULTS: dict[str, Any] = {"device": DEVICE, "size": SIZE, "steps": {}, "figures": {}}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def step(name: str, fn: Any, *args: Any) -> Any:
    """Run one step; record ok / failed (with the error) / skipped (budget spent)."""
    if time.monotonic() - T0 > BUDGET_S:
        RESULTS["steps"][name] = {"status": "skipped", "why": f"budget of {BUDGET_S:.0f}s spent"}
        log(f"SKIP {name}")
        return None
    t = time.monotonic()
    try:
        out = fn(*args)
        RESULTS["steps"][name] = {"status": "ok", "seconds": round(time.monotonic() - t, 2)}
        log(f"ok   {name} ({time.monotonic() - t:.1f}s)")
        return out
    except Exception as exc:
        RESULTS["steps"][name] = {"status": "failed", "error": f"{exc.__class__.__name__}: {exc}"[:2000]}
        log(f"FAIL {name}: {exc.__class__.__name__}: {exc}")
        traceback.print_exc()
        return None


def figure(name: str, value: Any, text: str) -> None:
    RESULTS["figures"][name] = value
    log(f"  {text}")


class Ran:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    """``shardc ARGS`` in this process (click's runner: no interpreter start-up per call)."""
    from click.testing import CliRunner

    from shardc.cli import main

    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(main, list(args), env=env, catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Ran(r.exit_code, r.stdout, r.stderr)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# -- steps -----------------------------------------------------------------------------------------------
def make_model(work: Path) -> Path:
    s = SHAPES
    src = work / f"synthetic-{SIZE}"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic.py"), str(src),
                    "--layers", str(s["layers"]), "--hidden", str(s["hidden"]),
                    "--intermediate", str(s["intermediate"]), "--heads", str(s["heads"]),
                    "--kv-heads", str(s["kv_heads"]), "--vocab", str(s["vocab"])],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.runtime.gate import golden_text

    vocab = {"[UNK]": 0}
    for w in golden_text("pydoc")[0].split():  # a word-level tokenizer so the gate has real text
        if len(vocab) >= s["vocab"]:
            break
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(src / "tokenizer.json"))
    return src


def build_one(src: Path, work: Path, tp: int, pp: int, dtype: str) -> Path:
    from shardc.compiler.compile import build
    from shardc.layout.plan import plan_from_dict

    name = f"gpucheck-tp{tp}pp{pp}-{dtype}"
    plan = plan_from_dict({"replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                                             "gpus_per_replica": tp * pp}, "model": {"source": str(src)}})
    return build(plan, out_dir=work / name).manifest_path


def verify_all(manifests: dict[str, Path]) -> None:
    for label, m in manifests.items():
        t = time.monotonic()
        p = cli("verify", "--manifest", str(m), "--device", DEVICE)
        expect(p.returncode == 0, f"verify --device {DEVICE} of {label}: exit {p.returncode}: {p.stdout}{p.stderr}")
        figure(f"verify_{label}_s", round(time.monotonic() - t, 2),
               f"verify --device {DEVICE} {label}: ok in {time.monotonic() - t:.1f}s (in-process CLI)")


def flipped_byte(manifest: Path) -> None:
    from shardc.formats.manifest import load

    f = manifest.parent / load(manifest).to_layout().ranks[0].file
    with open(f, "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))
    try:
        p = cli("verify", "--manifest", str(manifest), "--rank", "0", "--device", DEVICE)
        expect(p.returncode == 1 and "sha256" in p.stderr, f"flipped byte: exit {p.returncode}: {p.stderr}")
    finally:
        with open(f, "r+b") as fh:
            fh.seek(-5, os.SEEK_END)
            fh.write(b)


def gpu_count_lines(big: Path, small: Path) -> None:
    """Plans larger than the node: one line, exit 2, before anything loads."""
    from shardc.loader.devices import visible_gpus

    have = visible_gpus()
    figure("visible_gpus", have, f"visible GPUs: {have}")
    if have >= 8:
        return
    want = f"needs 8 GPUs on this node; {have} {'is' if have == 1 else 'are'} visible"
    for args in (("run", "--manifest", str(big), "--prompt-ids", "1,2", "--device", "cuda"),
                 ("gate", "--baseline", str(small), "--candidate", str(big), "--device", "cuda")):
        p = cli(*args)
        expect(p.returncode == 2 and want in p.stderr and len(p.stderr.strip().splitlines()) == 1,
               f"{args[0]} of tp4pp2: exit {p.returncode}: {p.stderr}")
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    p = cli("verify", "--manifest", str(big), "--distributed", "--device", "cuda", env=env)
    expect(p.returncode == 2 and want in p.stderr, f"verify --distributed of tp4pp2: {p.returncode}: {p.stderr}")


def torchrun_verify(manifest: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--master-port", "29556", "-m", "shardc.cli", "verify", "--manifest", str(manifest),
                        "--distributed", "--device", DEVICE], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    expect(p.returncode == 0, f"torchrun verify --distributed: exit {p.returncode}: {p.stdout}{p.stderr}")


def hf_model(src: Path) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    return model


def sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def decode(src: Path, manifest: Path, model: Any) -> None:
    """shardc's greedy decode, each token scored by teacher forcing: ONE transformers forward over the
    prompt and shardc's tokens, and every position's choice against its logits (exact, a bf16
    near-tie, or a real mismatch, which alone fails the step). transformers' own generate is timed
    for the speed figure; how long its free-running tokens stay equal to shardc's is logged, not
    checked (random weights give near-ties, where two right answers part ways)."""
    import torch
    from decode_score import score_tokens

    from shardc.runtime.api import generate, open_build

    n = SHAPES["decode"]
    prompt = [(7 * i + 3) % SHAPES["vocab"] for i in range(16)]
    res = generate(open_build(manifest), [prompt], n, eos=[], device=DEVICE, timeout_s=300)
    assert res is not None
    ours = list(res.tokens[0])
    expect(len(ours) == n, f"decode returned {len(ours)} tokens, asked for {n}")
    with torch.inference_mode():
        out = model(torch.tensor([prompt + ours[:-1]], device=DEVICE)).logits
        logits = out[0, len(prompt) - 1:].float().cpu()  # row i: the position that chose ours[i]
    scored = score_tokens(ours, logits)
    figure("decode_teacher_forced", scored.as_dict(), f"decode: {scored.line()}")

    def hf(k: int) -> tuple[list[int], float]:
        with torch.inference_mode():
            sync()
            t = time.perf_counter()
            out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False, pad_token_id=0)
            sync()
            return out[0, len(prompt):].tolist(), time.perf_counter() - t

    hf(4)  # warm-up
    ref, t_n = hf(n)
    _, t_1 = hf(1)
    same = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), n)
    figure("decode_tokens_identical", same, f"decode: {same} of {n} free-running greedy tokens equal to "
           "transformers' generate (logged only: near-ties part two right answers)")
    assert res.decode_seconds is not None
    ours_rate = (n - 1) / res.decode_seconds
    hf_rate = (n - 1) / max(t_n - t_1, 1e-9)
    figure("decode_tokens_per_s", {"shardc": ours_rate, "transformers": hf_rate, "ratio": ours_rate / hf_rate},
           f"decode (batch 1): shardc {ours_rate:.1f} tok/s, transformers eager generate {hf_rate:.1f} tok/s "
           f"= {ours_rate / hf_rate:.2f}x")
    expect(scored.ok, scored.failure())


def prefill(manifest: Path, model: Any) -> None:
    import torch

    from shardc.runtime.api import open_build, score

    w, t = SHAPES["windows"], SHAPES["window"]
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, SHAPES["vocab"], (2 * w, t), generator=g)
    res = score(open_build(manifest), windows, micro_batch=w, device=DEVICE, timeout_s=300)
    assert res is not None
    ours = float(res.batch_seconds[-1])  # the second batch: warm
    x = windows[:w].to(DEVICE)
    with torch.inference_mode():
        model(x)
        sync()
        t0 = time.perf_counter()
        model(x)
        sync()
        hf = time.perf_counter() - t0
    figure("prefill_seconds", {"shardc": ours, "transformers": hf, "ratio": hf / ours},
           f"prefill scoring {w} x {t}: shardc {ours * 1e3:.1f} ms (NLL included), transformers forward "
           f"{hf * 1e3:.1f} ms = {hf / ours:.2f}x transformers' speed")


def load_bench(manifest: Path) -> None:
    from bench_loader import measure

    r = measure(manifest, 0, DEVICE, repeat=3)
    base = "hashlib + load_file + isfinite" if DEVICE.startswith("cuda") else "hashlib 1 MiB + safe_open"
    figure("load_one_rank", r, f"one rank ({r['bytes'] / 2**30:.2f} GiB): {base} {r['baseline_s']:.2f}s, "
           f"load_shard {r['load_shard_s']:.2f}s = {r['load_shard_ratio']:.2f}x, "
           f"verify --device {r['verify_s']:.2f}s = {r['verify_ratio']:.2f}x")


def chunked_load(manifest: Path) -> None:
    """load_shard's chunked read (format_version 3, loader/sinks.py; on CUDA through pinned
    staging buffers and per-worker copy streams): the tensors equal safetensors' load_file of the
    file, and a flipped byte is a VerifyMismatch naming its chunk."""
    import torch
    from safetensors.torch import load_file

    import shardc
    from shardc.errors import VerifyMismatch
    from shardc.formats.manifest import load

    m = load(manifest)
    rl = m.to_layout().ranks[0]
    entry = m.shard(rl.file)
    expect(entry is not None and entry.chunk_size is not None, "the build's manifest has no chunk digests")
    f = manifest.parent / rl.file
    got = shardc.load_shard(manifest, rl.tp_rank, rl.pp_stage, device=DEVICE)
    want = load_file(f)
    expect(sorted(got) == sorted(want) and all(
        torch.equal(got[k].cpu().view(torch.uint8), want[k].view(torch.uint8)) for k in want),
        "load_shard's chunked read differs from load_file")
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.seek(size - 5)
        b = fh.read(1)
        fh.seek(size - 5)
        fh.write(bytes([b[0] ^ 0x01]))
    try:
        try:
            shardc.load_shard(manifest, rl.tp_rank, rl.pp_stage, device=DEVICE)
            expect(False, "a flipped byte loaded")
        except VerifyMismatch as exc:
            chunk = (size - 5) // entry.chunk_size
            expect(f"chunk {chunk} " in exc.message, f"flipped byte: {exc.message}")
    finally:
        with open(f, "r+b") as fh:
            fh.seek(size - 5)
            fh.write(b)
    figure("chunked_load", {"chunks": len(entry.chunks), "chunk_size": entry.chunk_size},
           f"chunked load_shard on {DEVICE}: {len(entry.chunks)} chunk(s) equal to load_file; a flipped byte "
           "names its chunk")


def gate(base: Path, cand: Path, work: Path) -> None:
    from shardc.results import to_json
    from shardc.runtime.gate import run_gate

    cache = work / "baseline-cache.safetensors"
    kw = {"max_tokens": SHAPES["gate_tokens"], "window": SHAPES["window"], "device": DEVICE, "timeout_s": 300.0,
          "baseline_cache": cache}
    t = time.monotonic()
    first = to_json(run_gate(base, cand, **kw))  # the report's JSON form, what --json prints
    t1 = time.monotonic() - t
    t = time.monotonic()
    second = to_json(run_gate(base, cand, **kw))
    t2 = time.monotonic() - t
    same = {k: v for k, v in first.items() if k not in ("seconds", "baseline_cache")} == \
           {k: v for k, v in second.items() if k not in ("seconds", "baseline_cache")}
    expect(first["baseline_cache"]["status"] in ("new", "stale") and second["baseline_cache"]["status"] == "hit",
           f"cache statuses {first['baseline_cache']} {second['baseline_cache']}")
    expect(same, "numbers from the baseline cache differ from the fresh gate")
    figure("gate", {"ppl_delta_pct": first["ppl_delta_pct"], "kl_mean": first["kl_mean"],
                    "top1": first["top1_agreement"], "fresh_s": t1, "cached_s": t2, "ratio": t2 / t1},
           f"gate bf16 vs int8 on {DEVICE}: delta {first['ppl_delta_pct']:+.4f}%, KL {first['kl_mean']:.2e}, "
           f"top-1 {first['top1_agreement']:.3f}; fresh {t1:.1f}s, from cache {t2:.1f}s = {t2 / t1:.2f}x")


def main() -> int:
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(os.environ.get("WORK") or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    RESULTS["torch"] = torch.__version__
    RESULTS["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    log(f"DEVICE={DEVICE} SIZE={SIZE} torch {torch.__version__} gpu {RESULTS['gpu']} work {work}")
    src = step("make synthetic model", make_model, work)
    builds: dict[str, Path] = {}
    if src is not None:
        builds["bf16"] = step("build bf16 tp1", build_one, src, work, 1, 1, "bf16")
    model = step("load transformers model", hf_model, src) if src is not None else None
    if builds.get("bf16") and model is not None:
        step("decode vs transformers", decode, src, builds["bf16"], model)
        step("prefill vs transformers", prefill, builds["bf16"], model)
    del model
    if DEVICE.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the workers of later steps get the memory back
    if src is not None:
        builds["int8"] = step("build int8 tp1", build_one, src, work, 1, 1, "int8")
        builds["fp8"] = step("build fp8 tp1", build_one, src, work, 1, 1, "fp8")
        builds["tp4pp2"] = step("build bf16 tp4pp2", build_one, src, work, 4, 2, "bf16")
    builds = {k: v for k, v in builds.items() if v is not None}
    step("verify --device, every build", verify_all, builds)
    if "tp4pp2" in builds:
        step("flipped byte exits 1", flipped_byte, builds["tp4pp2"])
        step("GPU-count line", gpu_count_lines, builds["tp4pp2"], builds.get("bf16", builds["tp4pp2"]))
        step("chunked load_shard equals load_file, names a flipped chunk", chunked_load, builds["tp4pp2"])
        step("load_shard / verify of one rank vs load_file", load_bench, builds["tp4pp2"])
    if "bf16" in builds:
        step("torchrun verify --distributed", torchrun_verify, builds["bf16"])
    if "bf16" in builds and "int8" in builds:
        step("gate with baseline cache", gate, builds["bf16"], builds["int8"], work)
    RESULTS["seconds"] = round(time.monotonic() - T0, 1)
    failed = [k for k, v in RESULTS["steps"].items() if v["status"] == "failed"]
    RESULTS["ok"] = not failed
    text = json.dumps(RESULTS, indent=2, default=str)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(text)
    print(text)
    log("FAILED: " + ", ".join(failed) if failed else "all steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
