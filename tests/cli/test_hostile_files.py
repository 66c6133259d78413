"""Hostile input (#17): every bad file is one line on stderr, exit 2, no traceback, nothing written.

Real files, a real FIFO, real subprocess CLI runs. Each test names the item of #17 it covers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_run import one_line
from cli_run import shardc as run_shardc

from shardc.compiler.checkpoint import open_source
from shardc.errors import ShardcError, SourceError

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2, vocab_size=50)
PLAN = {
    "replica_group": {"name": "h", "tp_degree": 1, "pp_degree": 1, "dtype": "bf16", "gpus_per_replica": 1},
    "model": {"source": "SRC"},
}


def shardc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_shardc(*args, timeout=timeout)


def plan_file(tmp_path: Path, src: Path, **changes) -> Path:
    d = json.loads(json.dumps(PLAN))
    d["model"]["source"] = str(src)
    for dotted, value in changes.items():
        sec, key = dotted.split("__")
        d.setdefault(sec, {})[key] = value
    p = tmp_path / "plan.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def build(tmp_path: Path, plan: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    return shardc("build", str(plan), "--out", str(out), "--manifests-dir", str(tmp_path / "m"), "-q", *extra), out


def nothing_written(out: Path) -> None:
    assert not out.exists() or not [p for p in out.iterdir() if p.name != ".shardc-build.lock"]


# -- item 4 / 9: model configs --------------------------------------------------------------------

@pytest.mark.parametrize("key,value,needle", [
    ("num_hidden_layers", 1_000_000_000, "num_hidden_layers: config.json num_hidden_layers is 1000000000, above the limit of 4096"),
    ("vocab_size", 1 << 40, "vocab_size: config.json vocab_size is 1099511627776, above the limit"),
    ("rms_norm_eps", "abc", "rms_norm_eps: config.json rms_norm_eps must be a finite positive number below 1.0, found 'abc'"),
    ("rope_theta", [1], "rope_theta: config.json rope_theta must be a finite positive number"),
    ("head_dim", "8", "head_dim: config.json head_dim must be a positive integer"),
    ("tie_word_embeddings", "no", "tie_word_embeddings: config.json tie_word_embeddings must be true or false"),
    ("rope_scaling", 3, "rope_scaling: config.json rope_scaling must be an object or null"),
    ("architectures", [{"a": 1}], "unsupported architecture"),
])
def test_config_bounds_and_types(make_ckpt, tmp_path, key, value, needle):
    src = make_ckpt(**TINY)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    r = shardc("plan", "--model", str(src / "config.json"), "--gpu", "h100", timeout=30)
    one_line(r, needle)
    r, out = build(tmp_path, plan_file(tmp_path, src), "--dry-run")
    one_line(r, needle)
    r, out = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, needle)
    nothing_written(out)


def test_config_nan_and_deep_nesting(make_ckpt, tmp_path):
    src = make_ckpt(**TINY)
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace("{", '{"extra": NaN, ', 1))
    r, out = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, "NaN is not a JSON number")
    nothing_written(out)
    (src / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    r, out = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, "nested too deeply")


# -- item 5 / 9: YAML bombs, binary and deep plans ------------------------------------------------

BOMB = "\n".join(['a: &a ["x","x","x","x","x","x","x","x","x"]'] + [
    f'{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},'
    f'*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)}]' for i in range(8)])


@pytest.mark.parametrize("text,needle", [
    ("replica_group: {name: h}\nmodel: {source: s}\nautoscaling:\n  " + BOMB.replace("\n", "\n  "),
     "counting YAML aliases expanded"),
    ("a: &a [*a]\n", "counting YAML aliases expanded"),
    ("[" * 50_000 + "]" * 50_000, "plan"),
    ("x: " + "9" * 5000 + "\n", "cannot be read"),
])
def test_yaml_bounded_before_expansion(tmp_path, text, needle):
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    r, out = build(tmp_path, p)
    one_line(r, needle)
    nothing_written(out)


def test_binary_plan(tmp_path):
    p = tmp_path / "plan.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    r, out = build(tmp_path, p)
    one_line(r, "is not UTF-8 text")


@pytest.mark.parametrize("extra,needle", [
    ({"autoscaling": {"min": float("nan")}}, "autoscaling.min: must be a finite number"),
    ({"autoscaling": {"when": "DATE"}}, "autoscaling.when: must be a plain YAML value"),
])
def test_plan_values_are_json(make_ckpt, tmp_path, extra, needle):
    src = make_ckpt(**TINY)
    d = {**json.loads(json.dumps(PLAN).replace("SRC", str(src))), **extra}
    text = yaml.safe_dump(d).replace("DATE", "2024-01-01").replace("'2024-01-01'", "2024-01-01")
    (tmp_path / "plan.yaml").write_text(text)
    r, out = build(tmp_path, tmp_path / "plan.yaml")
    one_line(r, needle)
    nothing_written(out)


# -- item 10: plan validation agrees with the readers ---------------------------------------------

@pytest.mark.parametrize("field,value,needle", [
    ("checkpoint", {"shard_prefix": "my shard-{tp_rank}-{pp_stage}.safetensors"}, "no spaces"),
    ("checkpoint", {"shard_prefix": "s-{tp_rank:c}-{pp_stage}.safetensors"}, "may format a rank only as an integer"),
    ("checkpoint", {"shard_prefix": "s-{tp_rank:999999999}-{pp_stage}.safetensors"}, "only as an integer"),
    ("checkpoint", {"shard_prefix": "s-{tp_rank!r}-{pp_stage}.safetensors"}, "only as an integer"),
    ("checkpoint", {"shard_prefix": "s-{tp_rank}-{pp_stage}.safetensors{"}, "not a valid format string"),
    ("kv_cache_cap_gb", float("nan"), "kv_cache_cap_gb: must be a finite number"),
    ("kv_cache_cap_gb", float("inf"), "kv_cache_cap_gb: must be a finite number"),
])
def test_plan_validation_matches_readers(make_ckpt, tmp_path, field, value, needle):
    src = make_ckpt(**TINY)
    r, out = build(tmp_path, plan_file(tmp_path, src, **{f"replica_group__{field}": value}))
    one_line(r, needle)
    nothing_written(out)


def test_shard_prefix_collision(make_ckpt, tmp_path):
    """tp 1 / stage 11 and tp 11 / stage 1 would both be s111x: refused before the model is read."""
    src = make_ckpt(**TINY)
    p = plan_file(tmp_path, src, replica_group__tp_degree=12, replica_group__pp_degree=12,
                  replica_group__gpus_per_replica=144,
                  replica_group__checkpoint={"shard_prefix": "s{tp_rank}{pp_stage}x.safetensors"})
    r, out = build(tmp_path, p, "--dry-run")
    one_line(r, "replica_group.checkpoint.shard_prefix: gives two ranks the same file name")
    nothing_written(out)


# -- item 12: FIFOs, devices, oversized files ------------------------------------------------------

def test_fifo_and_devices_refused(make_ckpt, tmp_path):
    src = make_ckpt(**TINY)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    one_line(build(tmp_path, fifo)[0], "is not a regular file")
    one_line(build(tmp_path, Path("/dev/zero"))[0], "is not a regular file")
    one_line(shardc("verify", "--manifest", str(fifo), timeout=30), "is not a regular file")
    one_line(shardc("verify", "--manifest", "/dev/zero", timeout=30), "is not a regular file")
    one_line(shardc("plan", "--model", str(fifo), "--gpu", "h100", timeout=30), "is not a regular file")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    one_line(build(tmp_path, big)[0], "more than the limit of 1048576")
    # a FIFO as the source's config.json, index or weight file
    good = plan_file(tmp_path, src)
    for name in ("config.json", "model.safetensors.index.json", "zz.safetensors"):
        victim = src / name
        saved = victim.read_bytes() if victim.exists() else None
        victim.unlink(missing_ok=True)
        os.mkfifo(victim)
        r, out = build(tmp_path, good)
        one_line(r, "is not a regular file")
        nothing_written(out)
        victim.unlink()
        if saved is not None:
            victim.write_bytes(saved)


# -- item 9: source index.json ---------------------------------------------------------------------

@pytest.mark.parametrize("weight_map", [["model.safetensors"], "model.safetensors",
                                        {"a": {"b": "c"}}, "DEEP"])
def test_bad_source_index(make_ckpt, tmp_path, weight_map):
    src = make_ckpt(**TINY)
    text = json.dumps({"weight_map": weight_map})
    if weight_map == "DEEP":
        text = '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (src / "model.safetensors.index.json").write_text(text)
    r, out = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, "is not a valid safetensors index")
    nothing_written(out)


# -- item 6: a source that shrinks or is replaced under a build ------------------------------------

def test_truncated_source_is_an_error_not_sigbus(make_ckpt):
    src = make_ckpt(num_files=2, **TINY)
    source = open_source(str(src))
    by_file: dict[str, str] = {}
    for name, info in sorted(source.tensors.items(), key=lambda kv: -(kv[1].offset or 0)):
        by_file.setdefault(info.file, name)  # the tensor stored last in each file
    (fname, last), = [next(iter(by_file.items()))]
    assert source.view(last).size > 0  # readable before
    path = src / fname
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(SourceError, match=f"source file {fname} shrank from {size} to {size - 1} bytes"):
        source.view(last)
    fresh = path.with_name("fresh")
    fresh.write_bytes(path.read_bytes() + b"\0")  # same size, another file (a re-download)
    os.replace(fresh, path)
    with pytest.raises(SourceError, match=f"source file {fname} was replaced during the build"):
        source.view(last)


def test_truncated_source_during_build_cleans_up(make_ckpt, tmp_path):
    """End to end: a weight file cut short is one line, exit 2, and nothing is left behind (a
    shrink between indexing and reading is the test above, which needs no race)."""
    src = make_ckpt(**TINY)
    weights = next(src.glob("*.safetensors"))
    os.truncate(weights, weights.stat().st_size // 2)
    r, out = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, "safetensors")
    nothing_written(out)


# -- item 11: verify --plan of another plan ---------------------------------------------------------

def test_verify_plan_of_another_plan_is_a_mismatch(make_ckpt, tmp_path):
    src = make_ckpt(**TINY)
    p = plan_file(tmp_path, src)
    r, out = build(tmp_path, p)
    assert r.returncode == 0, r.stderr
    other = tmp_path / "other.yaml"
    d = yaml.safe_load(p.read_text())
    d["replica_group"]["name"] = "other"
    other.write_text(yaml.safe_dump(d))
    r = shardc("verify", "--manifest", str(out / "manifest.json"), "--plan", str(other), "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is False and "not of" in report["problems"][0] and "'other'" in report["problems"][0]
    assert all(rank["ok"] for rank in report["ranks"])  # the shards themselves are sound
    r = shardc("verify", "--manifest", str(out / "manifest.json"), "--plan", str(p))
    assert r.returncode == 0, r.stderr


def test_library_errors_are_shardc_errors(tmp_path):
    from shardc.layout.readfile import read_regular_file

    with pytest.raises(ShardcError, match="cannot read"):
        read_regular_file(tmp_path / "missing", limit=10, what="file")
    with pytest.raises(ShardcError, match="is not a regular file"):
        read_regular_file(tmp_path, limit=10, what="file")


@pytest.mark.heavy
@pytest.mark.parametrize("victim", ["a.safetensors", "b.safetensors"])
def test_source_truncated_during_build_subprocess(tmp_path, victim):
    """#17 item 6 end to end: the repro was SIGBUS, exit 135, nothing on stderr, a stale temp
    file. The source is split so ``model.norm.weight`` (read last: tensors go in name order) lives
    alone in b; a holds the rest and is being read when it is cut (the SIGBUS case). Either is
    cut by another process while the build writes its shard; the build's read lease holds the
    truncate back until the build has stopped reading and cleaned up (compiler/lease.py)."""
    import threading
    import time

    from safetensors.numpy import load_file, save_file

    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.formats.files import temp_files

    cfg = llama_config(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                       num_kv_heads=4, vocab_size=16000)
    src = write_checkpoint(tmp_path / "one", cfg)
    tensors = load_file(src / "model.safetensors")
    last = tensors.pop("model.norm.weight")
    save_file(tensors, src / "a.safetensors", metadata={"format": "pt"})
    save_file({"model.norm.weight": last}, src / "b.safetensors", metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    victim = src / victim
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardc.cli", "build", str(plan_file(tmp_path, src)), "--out", str(out),
         "--manifests-dir", str(tmp_path / "m"), "-q"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)

    def cut() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out.exists() and temp_files(out)):
            time.sleep(0.001)
        os.truncate(victim, 100)

    t = threading.Thread(target=cut)
    t.start()
    stdout, stderr = proc.communicate(timeout=120)
    t.join()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    one_line(r, f"source file {victim.name} is being truncated or rewritten by another process")
    assert not temp_files(out) and not (out / "manifest.json").exists()
    assert victim.stat().st_size == 100  # the other process went ahead once the build let go


def test_planted_lock_symlink_is_refused_not_followed(tmp_path):
    """#17 item 1: a symlink at <out>/.shardc-build.lock used to be opened with "w", truncating
    whatever it pointed at. Now the lock is opened without following links or truncating."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    src = write_checkpoint(tmp_path / "src", llama_config(**TINY))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".shardc-build.lock").symlink_to(victim)
    r, _ = build(tmp_path, plan_file(tmp_path, src))
    one_line(r, "cannot open the build lock", code=1)
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == [".shardc-build.lock"]  # nothing else written
    (out / ".shardc-build.lock").unlink()
    (out / ".shardc-build.lock").write_text("")  # a plain lock file left by an earlier run is fine
    r, _ = build(tmp_path, plan_file(tmp_path, src))
    assert r.returncode == 0, r.stderr


# -- #17 item 2: a rebuild never loses the complete build that is there ------------------------------
def _verify_ok(out: Path) -> bool:
    return shardc("verify", "--manifest", str(out / "manifest.json")).returncode == 0


def _two_sources(tmp_path: Path) -> tuple[Path, Path]:
    """Two checkpoints of one model with different weights (so a rebuild changes every shard)."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    cfg = llama_config(**TINY)
    return write_checkpoint(tmp_path / "a", cfg, seed=1), write_checkpoint(tmp_path / "b", cfg, seed=2)


def _fsize_limit(limit: int):
    """In the child: files it writes may not grow past ``limit`` bytes (EFBIG, a real write error
    from the kernel, like a full disk), and SIGXFSZ does not kill it."""
    import resource
    import signal

    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_rebuild_failing_mid_write_keeps_the_old_build(tmp_path):
    a, b = _two_sources(tmp_path)
    r, out = build(tmp_path, plan_file(tmp_path, a))
    assert r.returncode == 0, r.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    biggest = max(len(v) for k, v in before.items() if k.endswith(".safetensors"))
    r = run_shardc("build", plan_file(tmp_path, b), "--out", out, "--manifests-dir", tmp_path / "m", "-q",
                   timeout=120, preexec_fn=_fsize_limit(biggest // 2))
    one_line(r, "the build already there is untouched", code=1)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # every file of the old build, byte for byte; no temp file left
    assert _verify_ok(out)
    r, _ = build(tmp_path, plan_file(tmp_path, b))  # with room again, the rebuild goes through
    assert r.returncode == 0, r.stderr
    assert _verify_ok(out)
    assert (out / "model-tp00-pp00.safetensors").read_bytes() != before["model-tp00-pp00.safetensors"]


@pytest.fixture
def small_tmpfs(tmpfs):
    """A real filesystem too small for two copies of the tiny build (root only)."""
    return tmpfs("tmpfs", "160k")


def test_rebuild_that_does_not_fit_beside_the_old_one_is_refused_first(tmp_path, small_tmpfs):
    a, b = _two_sources(tmp_path)
    out = small_tmpfs / "out"
    args = ["--out", str(out), "--manifests-dir", str(tmp_path / "m"), "-q"]
    r = shardc("build", str(plan_file(tmp_path, a)), *args)
    assert r.returncode == 0, r.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert sum(len(v) for v in before.values()) * 2 > 160 * 1024  # a second copy cannot fit
    r = shardc("build", str(plan_file(tmp_path, b)), *args)
    one_line(r, "the build already there stays until the new one is complete", code=1)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert _verify_ok(out)


# -- #17 item 3: resume keeps only what it can prove ---------------------------------------------------
def _killed_state(out: Path, plan, src: Path, forge: dict[str, Path] | None = None) -> None:
    """Turn a complete build into what a build killed after writing its shards leaves: no manifest,
    and a resume record per shard (as the build writes them: its key, size and sha256). ``forge``
    puts another file under a shard's name first, with a record made to match it."""
    import hashlib

    from shardc.compiler.outputs import LAYOUT_REVISION, done_path
    from shardc.layout.plan import canonical_json
    from shardc.version import __version__

    (out / "manifest.json").unlink()
    key = {"plan_sha256": plan.sha256, "source": open_source(str(src)).fingerprint(), "shardc_version": __version__,
           "layout_revision": LAYOUT_REVISION}
    for name, other in (forge or {}).items():
        (out / name).write_bytes(other.read_bytes())
    for shard in sorted(out.glob("model-*.safetensors")):
        data = shard.read_bytes()
        done_path(out, shard.name).write_bytes(canonical_json(
            {"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def _plan(src: Path, name: str = "h", tp: int = 1, pp: int = 2):
    from shardc.layout.plan import plan_from_dict

    d = json.loads(json.dumps(PLAN))
    d["replica_group"].update(name=name, tp_degree=tp, pp_degree=pp, gpus_per_replica=tp * pp)
    d["model"]["source"] = str(src)
    return plan_from_dict(d)


def test_resume_keeps_an_untouched_shard_and_rebuilds_a_foreign_one(tmp_path):
    from shardc.compiler.compile import build

    a, _ = _two_sources(tmp_path)
    plan = _plan(a)
    clean = build(plan, tmp_path / "clean")
    other = build(_plan(a, name="other"), tmp_path / "other")  # same shapes, another plan's metadata
    out = tmp_path / "out"
    build(plan, out)
    _killed_state(out, plan, a)
    res = build(plan, out)  # an honest resume keeps both shards
    assert sorted(res.skipped) == ["model-tp00-pp00.safetensors", "model-tp00-pp01.safetensors"]
    _killed_state(out, plan, a, forge={"model-tp00-pp00.safetensors": other.out_dir / "model-tp00-pp00.safetensors"})
    res = build(plan, out)
    assert res.skipped == ["model-tp00-pp01.safetensors"] and res.built == ["model-tp00-pp00.safetensors"]
    assert (out / "manifest.json").read_bytes() == (clean.out_dir / "manifest.json").read_bytes()
    assert _verify_ok(out)


def test_resume_after_the_source_was_rewritten_with_its_old_size_and_mtime(tmp_path):
    """The rerun must not mix shards of two checkpoints: every kept shard came from these bytes."""
    from shardc.compiler.compile import build

    a, b = _two_sources(tmp_path)
    plan = _plan(a)
    out = tmp_path / "out"
    build(plan, out)
    _killed_state(out, plan, a)
    weights = a / "model.safetensors"
    st = os.stat(weights)
    new = (b / "model.safetensors").read_bytes()
    assert len(new) == st.st_size
    weights.write_bytes(new)  # same size; mtime put back below
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = build(plan, out)
    assert res.skipped == []
    want = build(plan, tmp_path / "fresh")  # the rewritten source, built from scratch
    for f in ("model-tp00-pp00.safetensors", "model-tp00-pp01.safetensors"):
        assert (out / f).read_bytes() == (want.out_dir / f).read_bytes(), f


def test_manifest_that_cannot_be_written_is_one_line_and_leaves_no_temp_file(tmp_path):
    """#17 item 2: the last write (the manifest) failing used to be a traceback and a temp file
    left forever. A model of many tiny layers has a manifest larger than any shard, so a file size
    limit between the two fails exactly that write (EFBIG, as a full disk would fail it)."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    src = write_checkpoint(tmp_path / "src", llama_config(hidden_size=8, intermediate_size=16, num_layers=24,
                                                          num_heads=2, num_kv_heads=1, vocab_size=16))
    plan = plan_file(tmp_path, src, replica_group__pp_degree=6, replica_group__gpus_per_replica=6)
    out = tmp_path / "probe"
    r = shardc("build", str(plan), "--out", str(out), "--manifests-dir", str(tmp_path / "m"), "-q")
    assert r.returncode == 0, r.stderr
    shard = max(p.stat().st_size for p in out.glob("model-*.safetensors"))
    manifest = (out / "manifest.json").stat().st_size
    assert shard < manifest
    out = tmp_path / "out"
    r = run_shardc("build", plan, "--out", out, "--manifests-dir", tmp_path / "m2", "-q",
                   timeout=120, preexec_fn=_fsize_limit((shard + manifest) // 2))
    one_line(r, "cannot write manifest.json", code=1)
    from shardc.formats.files import temp_files

    assert not temp_files(out) and not (out / "manifest.json").exists()
