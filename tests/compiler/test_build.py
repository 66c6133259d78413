"""shardc build: correctness of every slice, determinism, resume, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_run import shardc, shardc_in
from click.testing import CliRunner
from plan_helpers import plan_data
from reassemble import load_source, reassemble

from shardc.cli import main
from shardc.compiler.compile import build
from shardc.layout.plan import plan_from_dict

MODELS = {
    # 8 heads / 2 KV heads: tp=4,8 exceed the KV heads (replicated KV); vocab 100 pads at tp=8
    "gqa": dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
                vocab_size=100),
    # tied embeddings, MHA, vocab 97 pads at every tp > 1
    "tied": dict(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8, num_kv_heads=8,
                 vocab_size=97, tie_word_embeddings=True),
    # Qwen2 with q/k/v biases, a single KV head
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=1,
                  vocab_size=64, architecture="Qwen2ForCausalLM"),
}
MATRIX = [("gqa", tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3)]
MATRIX += [("tied", tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 3)]
MATRIX += [("qwen2", tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


def expected_shapes(cfg: dict, tp: int, pp: int) -> dict[tuple[int, int], dict[str, tuple]]:
    """Megatron rules written out independently of shardc.layout.ranks."""
    h, heads, kv = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"]
    hd, inter, v, n = h // heads, cfg["intermediate_size"], cfg["vocab_size"], cfg["num_layers"]
    vp = -(-v // tp)  # padded vocab rows per rank
    kv_rows = (kv // tp if kv >= tp else 1) * hd
    base, extra = divmod(n, pp)
    counts = [base + (s < extra) for s in range(pp)]
    bias = cfg.get("architecture") == "Qwen2ForCausalLM"
    out = {}
    for s in range(pp):
        first = sum(counts[:s])
        for r in range(tp):
            t = {}
            if s == 0:
                t["model.embed_tokens.weight"] = (vp, h)
            if s == pp - 1:
                t["model.norm.weight"] = (h,)
                if not (cfg.get("tie_word_embeddings") and pp == 1):
                    t["lm_head.weight"] = (vp, h)
            for i in range(first, first + counts[s]):
                p = f"model.layers.{i}."
                t[p + "input_layernorm.weight"] = (h,)
                t[p + "post_attention_layernorm.weight"] = (h,)
                t[p + "self_attn.q_proj.weight"] = (heads * hd // tp, h)
                t[p + "self_attn.k_proj.weight"] = (kv_rows, h)
                t[p + "self_attn.v_proj.weight"] = (kv_rows, h)
                t[p + "self_attn.o_proj.weight"] = (h, heads * hd // tp)
                t[p + "mlp.gate_proj.weight"] = (inter // tp, h)
                t[p + "mlp.up_proj.weight"] = (inter // tp, h)
                t[p + "mlp.down_proj.weight"] = (h, inter // tp)
                if bias:
                    t[p + "self_attn.q_proj.bias"] = (heads * hd // tp,)
                    t[p + "self_attn.k_proj.bias"] = (kv_rows,)
                    t[p + "self_attn.v_proj.bias"] = (kv_rows,)
            out[r, s] = t
    return out


@pytest.mark.parametrize(("model", "tp", "pp"), MATRIX)
def test_matrix_reassembles_and_shapes(make_ckpt, tmp_path, model, tp, pp):
    cfg = MODELS[model]
    ckpt = make_ckpt(model, num_files=2 if tp == 2 else 1, **cfg)
    res = build(plan_from_dict(plan_data(tp, pp)).with_source(str(ckpt)), tmp_path / "out")
    from safetensors import safe_open

    want = expected_shapes(cfg, tp, pp)
    for (r, s), tensors in want.items():
        path = tmp_path / "out" / f"model-tp{r:02d}-pp{s:02d}.safetensors"
        with safe_open(path, "pt") as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            meta = f.metadata()
        assert got == tensors, f"rank tp{r} pp{s}"
        assert meta["shardc.tp_rank"] == str(r) and meta["shardc.pp_stage"] == str(s)
    src = load_source(ckpt)
    rebuilt = reassemble(res.out_dir)
    for name, t in src.items():
        assert torch.equal(rebuilt[name].view(torch.uint8), t.view(torch.uint8)), name
    if cfg.get("tie_word_embeddings") and pp > 1:
        assert torch.equal(rebuilt["lm_head.weight"], src["model.embed_tokens.weight"])
    assert set(rebuilt) - {"lm_head.weight"} == set(src) - {"lm_head.weight"}
    assert len(list((tmp_path / "out").glob(".*.tmp"))) == 0


def test_fp16_plan_casts_bf16_source(make_ckpt, tmp_path):
    ckpt = make_ckpt(**MODELS["gqa"])
    res = build(plan_from_dict(plan_data(2, 1, "fp16")).with_source(str(ckpt)), tmp_path / "o")
    src, rebuilt = load_source(ckpt), reassemble(res.out_dir)
    for name, t in src.items():
        assert rebuilt[name].dtype == torch.float16
        assert torch.equal(rebuilt[name], t.to(torch.float16)), name
    assert json.loads((res.out_dir / "config.json").read_text())["torch_dtype"] == "float16"


def test_uneven_and_explicit_pp_layers(make_ckpt, tmp_path):
    ckpt = make_ckpt(**MODELS["gqa"])  # 4 layers
    res = build(plan_from_dict(plan_data(1, 3)).with_source(str(ckpt)), tmp_path / "a")
    assert [list(s.layers) for s in res.manifest.shards] == [[0, 2], [2, 3], [3, 4]]
    res = build(plan_from_dict(plan_data(2, 2, model={"pp_layers": [1, 3]})).with_source(str(ckpt)), tmp_path / "b")
    assert [list(s.layers) for s in res.manifest.shards] == [[0, 1], [0, 1], [1, 4], [1, 4]]


def _digest_tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir()) if not p.name.startswith(".")}


def _golden_ckpt(path: Path) -> Path:
    """A checkpoint from arange values: independent of any random number generator."""
    from safetensors.torch import save_file

    from shardc.compiler.synthetic import llama_config
    from shardc.layout.model import model_from_config
    from shardc.layout.ranks import source_tensors

    cfg = llama_config(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, vocab_size=10)
    path.mkdir()
    tensors = {}
    for i, t in enumerate(source_tensors(model_from_config(cfg))):
        n = 1
        for d in t.shape:
            n *= d
        tensors[t.name] = ((torch.arange(n, dtype=torch.float32) % 97 - 48 + i) / 64).reshape(t.shape).to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# sha256 of every shard of the golden checkpoint at tp=2 pp=2 bf16 (regenerate only on a
# deliberate format change, and say so in the commit).
GOLDEN = {
    "model-tp00-pp00.safetensors": "eecfc02a16eeaa2e7afc516da7eda6d438a5657c42c59445e65cb5c35d74c73b",
    "model-tp01-pp00.safetensors": "e0ffb31ec85a25ee4b2cdaabda77964fea1d0b5de6383def6ad98e84f543efcd",
    "model-tp00-pp01.safetensors": "a62cae4f31b68737c27c7554f11b3af26c310dd713b1b41a4ff4d89d2187370a",
    "model-tp01-pp01.safetensors": "ee21862955cb77e2510d87a2c1c59b7b7fb5c986c694c07f0ca5ff0fede9af57",
}


def test_determinism_and_golden_hashes(tmp_path):
    ckpt = _golden_ckpt(tmp_path / "src")
    plan = plan_from_dict(plan_data(2, 2, name="golden")).with_source(str(ckpt))
    a = build(plan, tmp_path / "a")
    b = build(plan, tmp_path / "b", force=True)
    assert _digest_tree(a.out_dir) == _digest_tree(b.out_dir)  # shards, config and manifest
    got = {s.file: s.sha256 for s in a.manifest.shards}
    if os.environ.get("SHARDC_PRINT_GOLDEN"):
        print(json.dumps(got, indent=1))
    assert got == GOLDEN


def test_up_to_date_and_force(make_ckpt, tmp_path):
    ckpt = make_ckpt(**MODELS["gqa"])
    plan = plan_from_dict(plan_data(2, 2)).with_source(str(ckpt))
    first = build(plan, tmp_path / "o")
    assert len(first.built) == 4 and not first.up_to_date
    again = build(plan, tmp_path / "o")
    assert again.up_to_date and again.built == []
    forced = build(plan, tmp_path / "o", force=True)
    assert len(forced.built) == 4
    assert forced.manifest == first.manifest


def test_manifest_copy_and_json_cli(make_ckpt, tmp_path):
    ckpt = make_ckpt(**MODELS["gqa"])
    plan_file = tmp_path / "p.yaml"
    import yaml

    plan_file.write_text(yaml.safe_dump(plan_data(2, 1, name="cli-plan")))
    r = CliRunner().invoke(main, ["build", str(plan_file), "--source", str(ckpt), "--out",
                                  str(tmp_path / "o"), "--manifests-dir", str(tmp_path / "m"), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["plan"] == "cli-plan" and len(summary["shards"]) == 2
    assert (tmp_path / "m" / "cli-plan.json").read_bytes() == (tmp_path / "o" / "manifest.json").read_bytes()


@pytest.mark.heavy
def test_kill_and_resume_is_byte_identical(tmp_path):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    # 4 stages; the size does not matter: the build is held after its first stage (below)
    cfg = llama_config(hidden_size=128, intermediate_size=256, num_layers=8, num_heads=8,
                       num_kv_heads=4, vocab_size=1000)
    ckpt = write_checkpoint(tmp_path / "src", cfg)
    import yaml

    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(yaml.safe_dump(plan_data(2, 4, name="resume")))
    args = ["build", str(plan_file), "--source", str(ckpt), "--out", str(tmp_path / "killed"),
            "--manifests-dir", str(tmp_path / "m"), "--quiet"]
    # The build runs under a wrapper that, once the first stage's resume record is in place, says so
    # on stdout and then blocks: the kill always lands mid-build, however fast the build is.
    wrapper = (
        "import os, sys\n"
        "real = os.replace\n"
        "def replace(src, dst, **kw):\n"
        "    real(src, dst, **kw)\n"
        "    if str(dst).endswith('.done.json'):\n"
        "        print('DONE', flush=True)\n"
        "        sys.stdin.read()\n"
        "os.replace = replace\n"
        "from shardc.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", wrapper, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "DONE", "the build ended before its first stage was done"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "killed" / "manifest.json").exists()  # no manifest before the end
    r = shardc_in(*args[:-1], "--json")
    assert r.returncode == 0, r.stderr
    resumed = json.loads(r.stdout)
    assert resumed["skipped"], "the rerun should keep the shards finished before the kill"
    clean = build(plan_from_dict(plan_data(2, 4, name="resume")).with_source(str(ckpt)), tmp_path / "clean")
    assert _digest_tree(tmp_path / "killed") == _digest_tree(clean.out_dir)


def test_cli_has_no_torch_import():
    code = "import sys; from shardc.cli import main; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    r = shardc("--help")
    assert r.returncode == 0 and "build" in r.stdout and "Examples" in r.stdout


def test_cli_starts_no_blas_threads():
    """numpy imported under the CLI starts no OpenBLAS workers (they spin, taking CPU from the
    hashing threads); a user's own OPENBLAS_NUM_THREADS is kept."""
    code = ("import os, shardc.cli, numpy; print(os.environ['OPENBLAS_NUM_THREADS'], "
            "len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["1", "1"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "OPENBLAS_NUM_THREADS": "3"})
    assert out.stdout.split()[0] == "3"


@pytest.mark.parametrize("plan_path", sorted((Path(__file__).parents[2] / "plans").glob("tp*.yaml")))
def test_shipped_70b_plans_validate_offline(plan_path):
    r = CliRunner().invoke(main, ["build", str(plan_path), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["valid"] and len(info["ranks"]) == int(plan_path.name[2]) * int(plan_path.name[5])


def test_source_hash_cache_follows_file_changes(make_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = make_ckpt(**MODELS["gqa"])
    plan = plan_from_dict(plan_data(2, 1)).with_source(str(ckpt))
    a = build(plan, tmp_path / "a")
    b = build(plan, tmp_path / "b")  # second plan from the same source: hashes come from the cache
    assert a.manifest.source == b.manifest.source
    sd = load_file(ckpt / "model.safetensors")
    sd["model.norm.weight"][0] += 1
    save_file(sd, str(ckpt / "model.safetensors"))
    c = build(plan, tmp_path / "a")
    assert not c.up_to_date and c.built
    fa = {f.name: f.sha256 for f in a.manifest.source.files}
    fc = {f.name: f.sha256 for f in c.manifest.source.files}
    assert fc["model.safetensors"] == hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert fa["model.safetensors"] != fc["model.safetensors"]
