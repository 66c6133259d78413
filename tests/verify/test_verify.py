"""shardc verify: every way a shard can be wrong is caught with exit 1 and a precise message."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from manifest_edits import reseal
from plan_helpers import plan as make_plan
from safetensors import safe_open
from safetensors.torch import save_file

from shardc.cli import main
from shardc.compiler.compile import build

CFG = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8,
           vocab_size=96)


def plan(tp: int, pp: int, dtype: str = "bf16"):
    return make_plan(tp, pp, dtype, name=f"v-tp{tp}pp{pp}-{dtype}")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("verify")
    ckpt = write_checkpoint(root / "src", llama_config(**CFG))
    out = {"src": ckpt}
    for tp, pp, dtype in ((4, 1, "bf16"), (8, 1, "bf16"), (2, 2, "bf16"), (2, 2, "int8"), (2, 2, "fp8")):
        out[tp, pp, dtype] = build(plan(tp, pp, dtype).with_source(str(ckpt)), root / f"b{tp}{pp}{dtype}").out_dir
    return out


@pytest.fixture
def copy_of(builds, tmp_path):
    def make(key) -> Path:
        d = tmp_path / "copy"
        shutil.copytree(builds[key], d)
        return d
    return make


def verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


def _rehash_entry(d: Path, file: str) -> None:
    """Make the manifest agree with a tampered file, so only the plan checks can catch it."""
    m = json.loads((d / "manifest.json").read_text())
    p = d / file
    reseal(m["shards"][file], p.read_bytes())
    (d / "manifest.json").write_text(json.dumps(m))


def _rewrite(d: Path, file: str, edit) -> None:
    with safe_open(d / file, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(d / file), metadata=meta)


@pytest.mark.parametrize("key", [(4, 1, "bf16"), (2, 2, "bf16"), (2, 2, "int8"), (2, 2, "fp8")])
def test_clean_builds_verify(builds, key):
    r = verify("--manifest", str(builds[key] / "manifest.json"), "--device", "cpu", "--deep", str(builds["src"]))
    assert r.exit_code == 0, r.output
    assert "all good" in r.output


@pytest.mark.parametrize(("file", "offset"), [("model-tp00-pp00.safetensors", -1),
                                              ("model-tp01-pp01.safetensors", 20),
                                              ("model-tp00-pp01.safetensors", 5000)])
def test_flipped_byte(copy_of, file, offset):
    d = copy_of((2, 2, "bf16"))
    data = bytearray((d / file).read_bytes())
    data[offset] ^= 0x01
    (d / file).write_bytes(bytes(data))
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1
    assert f"{file}: sha256" in r.stderr and "corrupted bytes" in r.stderr


def test_truncated_and_missing(copy_of):
    d = copy_of((2, 2, "bf16"))
    p = d / "model-tp01-pp00.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    (d / "model-tp00-pp01.safetensors").unlink()
    r = verify("--manifest", str(d / "manifest.json"), "--json")
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    assert not report["ok"]
    probs = "\n".join(report["problems"])
    assert "model-tp01-pp00.safetensors: size" in probs and "truncated" in probs
    assert "model-tp00-pp01.safetensors: missing" in probs
    assert [x["ok"] for x in report["ranks"]] == [True, False, False, True]


def test_extra_tensor_and_changed_dtype(copy_of):
    d = copy_of((2, 2, "bf16"))
    f0, f1 = "model-tp00-pp00.safetensors", "model-tp01-pp01.safetensors"
    _rewrite(d, f0, lambda t: t.__setitem__("model.layers.0.extra", torch.zeros(2)))
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(d, f1, lambda t: t.__setitem__(name, t[name].to(torch.float16)))
    _rehash_entry(d, f0)
    _rehash_entry(d, f1)
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1
    assert f"{f0}: unexpected tensor model.layers.0.extra" in r.stderr
    assert f"{f1}: tensor {name}: expected BF16[64, 64], found F16[64, 64]" in r.stderr


@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_tp8_shard_in_tp4_build(builds, copy_of, rewrite_manifest):
    d = copy_of((4, 1, "bf16"))
    f = "model-tp00-pp00.safetensors"
    shutil.copyfile(builds[8, 1, "bf16"] / f, d / f)
    if rewrite_manifest:
        _rehash_entry(d, f)
    r = verify("--manifest", str(d / "manifest.json"), "--rank", "0")
    assert r.exit_code == 1
    if rewrite_manifest:  # right bytes per the manifest, wrong plan: metadata and shapes say so
        assert "metadata shardc.tp_degree is '8', expected '4'" in r.stderr
        assert "tensor model.layers.0.self_attn.q_proj.weight: expected BF16[16, 64], found BF16[8, 64]" in r.stderr
    else:
        assert f"{f}: size" in r.stderr  # another plan's shard: caught by its size before hashing


def test_manifest_of_another_plan(builds):
    r = verify("--manifest", str(builds[8, 1, "bf16"] / "manifest.json"), "--dir", str(builds[4, 1, "bf16"]))
    assert r.exit_code == 1
    assert "model-tp04-pp00.safetensors: missing" in r.stderr


def test_manifest_tensor_list_disagrees_with_plan(copy_of):
    d = copy_of((2, 2, "bf16"))
    m = json.loads((d / "manifest.json").read_text())
    m["shards"]["model-tp00-pp00.safetensors"]["tensors"]["model.layers.0.mlp.up_proj.weight"]["shape"] = [32, 64]
    (d / "manifest.json").write_text(json.dumps(m))
    r = verify("--manifest", str(d / "manifest.json"))
    assert r.exit_code == 1 and "manifest entry model-tp00-pp00.safetensors tensor model.layers.0.mlp.up_proj.weight" in r.stderr


def test_plan_option_and_bad_input(builds, tmp_path):
    import yaml

    pf = tmp_path / "p.yaml"
    pf.write_text(yaml.safe_dump(plan(8, 1).data))
    r = verify("--manifest", str(builds[4, 1, "bf16"] / "manifest.json"), "--plan", str(pf))
    assert r.exit_code == 1 and "not of" in r.stderr  # another plan's file: a mismatch (#17)
    r = verify("--manifest", str(builds[4, 1, "bf16"] / "manifest.json"), "--plan", str(pf), "--json")
    report = json.loads(r.stdout)
    assert r.exit_code == 1 and report["ok"] is False and "not of" in report["problems"][0]
    r = verify("--manifest", str(tmp_path / "missing.json"))
    assert r.exit_code == 2 and "cannot read manifest" in r.stderr
    (tmp_path / "junk.json").write_text("{}")
    r = verify("--manifest", str(tmp_path / "junk.json"))
    assert r.exit_code == 2 and "not a shardc manifest" in r.stderr
    r = verify("--manifest", str(builds[4, 1, "bf16"] / "manifest.json"), "--rank", "9")
    assert r.exit_code == 2 and r.stderr.startswith("error: --rank: 9 is outside 0..3")
    r = verify("--manifest", str(builds[4, 1, "bf16"] / "manifest.json"), "--tp-rank", "4", "--pp-stage", "0")
    assert r.exit_code == 2 and r.stderr.startswith("error: --tp-rank: rank tp=4 pp=0 is outside")
    r = verify("--manifest", str(builds[4, 1, "bf16"] / "manifest.json"), "--tp-rank", "0")
    assert r.exit_code == 2 and "go together" in r.stderr and r.stderr.count("\n") == 1


def test_rank_selection_names_fields_not_flags(builds):
    """The library says which field is wrong; only the CLI speaks of flags."""
    from shardc.errors import LayoutError
    from shardc.formats.manifest import load

    layout = load(builds[2, 2, "bf16"] / "manifest.json").to_layout()
    assert [r.rank for r in layout.select([3, 1], [(1, 0)])] == [1, 3]
    assert [r.rank for r in layout.select()] == [0, 1, 2, 3]
    with pytest.raises(LayoutError) as exc:
        layout.select([4])
    assert exc.value.key == "rank" and "--" not in exc.value.one_line()


def test_deep_catches_wrong_source(builds, tmp_path):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    other = write_checkpoint(tmp_path / "other", llama_config(**CFG), seed=1)
    r = verify("--manifest", str(builds[2, 2, "int8"] / "manifest.json"), "--rank", "3", "--deep", str(other))
    assert r.exit_code == 1 and "differs from source" in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_load(builds):
    r = verify("--manifest", str(builds[2, 2, "fp8"] / "manifest.json"), "--device", "cuda", "--json")
    assert r.exit_code == 0, r.output
    assert all("load:cuda" in x["checks"] for x in json.loads(r.stdout)["ranks"])


# -- distributed mode: one real process per rank, a gloo group, bounded waits ---------------------

def _held_port() -> socket.socket:
    """A port that stays ours for the whole test, for rank 0's rendezvous store.

    Bound with SO_REUSEADDR and never listened on: Linux still lets the TCPStore that rank 0 starts
    bind and listen on the same port (c10d sets SO_REUSEADDR on its listening socket too, and only
    a *listening* socket conflicts with another reusable one), while no other process can take it
    meanwhile: a plain bind fails, and port-0 binds and outgoing connections skip a bound port. So
    there is no window between choosing the port and rank 0 listening on it, unlike binding,
    closing and reusing. Until rank 0 listens, a connection to it is refused.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def _launch(manifest: Path, ranks: list[int], world: int, timeout: float = 10.0):
    with _held_port() as held:
        procs = [_start_rank(manifest, r, world, held.getsockname()[1], timeout) for r in ranks]
        return [(p.wait(timeout=120), *p.communicate()) for p in procs]


def _start_rank(manifest: Path, rank: int, world: int, port: int, timeout: float) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    return subprocess.Popen(
        [sys.executable, "-m", "shardc.cli", "verify", "--manifest", str(manifest), "--distributed",
         "--timeout", str(timeout), "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


@pytest.mark.heavy
def test_distributed_all_good(builds):
    results = _launch(builds[2, 2, "bf16"] / "manifest.json", [0, 1, 2, 3], 4)
    for rc, out, err in results:
        assert rc == 0, err
        assert json.loads(out)["ok"]


@pytest.mark.heavy
def test_distributed_one_rank_corrupted(copy_of):
    d = copy_of((2, 2, "bf16"))
    p = d / "model-tp01-pp01.safetensors"  # global rank 3
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    for rc, out, _err in _launch(d / "manifest.json", [0, 1, 2, 3], 4):
        assert rc == 1
        report = json.loads(out)
        assert report["failed_ranks"] == [3]
        assert any("model-tp01-pp01.safetensors: sha256" in x for x in report["problems"])


@pytest.mark.heavy
def test_distributed_rank_never_joins(builds):
    t0 = time.monotonic()
    results = _launch(builds[2, 2, "bf16"] / "manifest.json", [0, 1, 2], 4, timeout=5)
    assert time.monotonic() - t0 < 90
    for rc, _out, err in results:
        assert rc == 1
        assert "rank(s) [3] never joined" in err, err


def _one_error_line(err: str) -> str:
    """The whole of stderr is one ``error:`` line: no traceback, no c10d log lines or C++ frames."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def _watch(port: int, procs: dict[int, subprocess.Popen] | None = None):
    """A client of the rendezvous store rank 0 hosts: the test waits on the ranks' own keys. Rank 0
    starts its store after its imports, which a loaded 2-core CI machine (a vLLM engine on the other
    worker) has stretched past 90 s: it gets 240. Should it never listen, the failure says what the
    ranks that ended printed."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        client = dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=timedelta(seconds=240))
    except dist.DistNetworkError:
        ended = {r: (p.returncode, p.stderr.read()[-800:] if p.stderr else "")
                 for r, p in (procs or {}).items() if p.poll() is not None}
        raise AssertionError(f"rank 0's store never listened on {port}; ranks that ended: {ended}") from None
    return dist.PrefixStore("shardc-verify", client)


def _json_error(out: str, err: str) -> dict:
    """With --json an error is also one JSON object on stdout (#26 item 3): the stderr line's
    message, exit code and hint as data."""
    obj = json.loads(out)
    assert set(obj) == {"error", "key", "hint", "exit"} and obj["error"] in err, (out, err)
    return obj


def _results(procs: dict[int, subprocess.Popen], skip: int | None = None) -> dict[int, tuple[int, str, str]]:
    """Wait for every rank but ``skip`` (one that hangs would fail the test through TimeoutExpired)."""
    return {r: (p.wait(timeout=120), *p.communicate()) for r, p in procs.items() if r != skip}


@contextlib.contextmanager
def _running() -> Iterator[dict[int, subprocess.Popen]]:
    """The rank processes a test starts; whatever still runs at the end (a stopped rank) is killed."""
    procs: dict[int, subprocess.Popen] = {}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait()
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


@pytest.mark.heavy
def test_distributed_rank0_never_starts(builds):
    """Rank 0 hosts the rendezvous: without it every other rank gives up within a bound (c10d
    retries the connection once after a random back-off, so up to about three times --timeout) with one line naming the rendezvous and
    the setting, exit 1."""
    manifest = builds[2, 2, "bf16"] / "manifest.json"
    t0 = time.monotonic()
    with _held_port() as held:  # nobody listens on it: rank 0, which would, never starts
        port = held.getsockname()[1]
        with _running() as procs:
            procs.update({r: _start_rank(manifest, r, 4, port, 4) for r in (1, 2, 3)})
            results = _results(procs)
    assert time.monotonic() - t0 < 60
    for r, (rc, out, err) in results.items():
        line = _one_error_line(err)
        assert rc == 1 and _json_error(out, err)["exit"] == 1
        assert f"rank {r}: cannot reach the rendezvous at 127.0.0.1:{port} within 4s" in line
        assert "Raise --timeout" in line


@contextlib.contextmanager
def _opens_wait(path: Path) -> Iterator[None]:
    """While inside, another process's open() of ``path`` waits: a Linux write lease, which the
    opener waits on until it is released (at most /proc/sys/fs/lease-break-time, 45 s by default).
    A rank then stops in the middle of verifying its shard, at a point the test controls, as on a
    stalled disk."""
    import fcntl
    import signal

    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break notice; by default it kills
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            pytest.skip(f"no write lease on {path} here ({exc})")
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, old)


@pytest.mark.heavy
def test_distributed_rank0_dies_after_joining(builds):
    """Rank 0 is killed once ranks 0-2 joined, while rank 1 is still verifying (its shard's open
    waits on a lease until rank 0 is gone), so rank 1 meets the dead store with its verdict in
    hand. Ranks 1 and 2 end with one line naming rank 0, rank 3 (started after) with the
    rendezvous it cannot reach; exit 1 each, within a bound. Ranks 0-2 wait up to 30 s for rank 3:
    with 5 s, on a loaded machine rank 0 gave up on rank 3 (and took its store along) before the
    test's own client had connected to watch the joins."""
    manifest = builds[2, 2, "bf16"] / "manifest.json"
    with _held_port() as held, _running() as procs:
        port = held.getsockname()[1]
        with _opens_wait(manifest.parent / "model-tp01-pp00.safetensors"):  # global rank 1
            procs.update({r: _start_rank(manifest, r, 4, port, 30) for r in (0, 1, 2)})
            _watch(port, procs).wait(["joined/0", "joined/1", "joined/2"])
            procs[0].kill()
            procs[0].wait()
        t0 = time.monotonic()
        procs[3] = _start_rank(manifest, 3, 4, port, 5)
        results = _results(procs, skip=0)
    assert time.monotonic() - t0 < 60
    for r in (1, 2):
        rc, out, err = results[r]
        assert rc == 1 and _json_error(out, err)["exit"] == 1
        line = _one_error_line(err)
        assert f"rank {r}: distributed verify failed" in line
        assert "rank 0 (which hosts the rendezvous) is gone or not answering" in line
    rc, _out, err = results[3]
    assert rc == 1 and "rank 3: cannot reach the rendezvous" in _one_error_line(err)


@pytest.mark.heavy
def test_distributed_peer_hangs_while_verifying(builds):
    """Rank 2 joins, then hangs reading its shard (its open waits on a lease): the other ranks
    report, wait --timeout for its verdict and end with one line naming it, exit 1."""
    manifest = builds[2, 2, "bf16"] / "manifest.json"
    with _held_port() as held, _running() as procs:
        port = held.getsockname()[1]
        with _opens_wait(manifest.parent / "model-tp00-pp01.safetensors"):  # global rank 2
            procs.update({r: _start_rank(manifest, r, 4, port, 5) for r in range(4)})
            _watch(port, procs).wait(["joined/2", "report/0", "report/1", "report/3"])
            t0 = time.monotonic()
            results = _results(procs, skip=2)
            elapsed = time.monotonic() - t0
    assert elapsed < 40  # --timeout, then rank 0 waits for the others' diagnosis
    for r, (rc, out, err) in results.items():
        assert rc == 1 and _json_error(out, err)["exit"] == 1
        line = _one_error_line(err)
        assert f"rank {r}: distributed verify failed after up to 5s: rank(s) [2] did not finish verifying" in line


@pytest.mark.heavy
@pytest.mark.parametrize("hung", [2, 0])
def test_distributed_peer_joins_then_hangs(builds, hung):
    """A rank verifies its shard and reports, then stops answering (SIGSTOP once ranks 0-2 have
    reported) before rank 3 starts, so it cannot have read the others' verdicts: every live rank
    ends within about --timeout with one line naming it, exit 1. A hung rank 0 takes the store it
    hosts with it (its TCPStore takes connections and never answers): ranks 1 and 2 say so after
    about three times --timeout, and so does rank 3, started after. With rank 2 hung, rank 3 must start and report within --timeout
    (the others wait that long for its verdict), hence 15 s there."""
    import signal

    manifest = builds[2, 2, "bf16"] / "manifest.json"
    timeout = 15 if hung else 5
    with _held_port() as held:
        port = held.getsockname()[1]
        with _running() as procs:
            procs.update({r: _start_rank(manifest, r, 4, port, timeout) for r in (0, 1, 2)})
            _watch(port, procs).wait(["report/0", "report/1", "report/2"])  # all three in the store's hands
            os.kill(procs[hung].pid, signal.SIGSTOP)
            t0 = time.monotonic()
            procs[3] = _start_rank(manifest, 3, 4, port, timeout)
            results = _results(procs, skip=hung)
            elapsed = time.monotonic() - t0
    assert elapsed < 75
    for r, (rc, out, err) in results.items():
        assert rc == 1 and _json_error(out, err)["exit"] == 1
        line = _one_error_line(err)
        if hung == 0 and r == 3:
            assert "rank 3: the rendezvous at" in line and "takes connections but does not answer" in line
            assert "Raise --timeout (now 5s)" in line
            continue
        expect = {2: "rank(s) [2] stopped answering after reporting (hung or killed)",
                  0: "rank 0 (which hosts the rendezvous) is gone or not answering"}[hung]
        assert f"rank {r}: distributed verify failed after up to {timeout}s: {expect}" in line, line
        assert f"--timeout (now {timeout}s)" in line


@pytest.mark.heavy
def test_under_torchrun(builds):
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "shardc.cli", "verify", "--manifest", str(builds[2, 2, "bf16"] / "manifest.json"),
         "--timeout", "30"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("all good") == 4
