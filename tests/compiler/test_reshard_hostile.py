"""Hostile input for ``shardc reshard`` (issue #25): a second reshard into the same new directory,
files the input manifest never listed, links, shards that verify rejects but whose manifest was
re-hashed to match, an S3 manifest replaced mid-run, and the spools of killed S3 reshards.

Real parts only: safetensors files edited byte by byte here, real ``shardc`` subprocesses (killed
with SIGKILL where a run dies), the moto S3 server and the fault proxy of tests/conftest.py. The
expected lines are written out by hand from what the test planted; the byte offsets in them come
from the test's own parse of the header (json), never from shardc.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from manifest_edits import reseal
from plan_helpers import plan_data as shared_plan_data

from shardc.compiler.build_files import SPOOL_PREFIX, Spool, open_local_input
from shardc.compiler.compile import build
from shardc.compiler.reshard import reshard
from shardc.compiler.synthetic import llama_config, write_checkpoint
from shardc.errors import VerifyMismatch
from shardc.layout.plan import plan_from_dict

ROOT = Path(__file__).resolve().parents[2]
GQA = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=100)
TOKENIZER = b'{"version": "1.0", "model": {"type": "test"}}\n'  # a listed side file, bytes of ours
LOCK_HINT = "wait for it to finish"
DAMAGED_HINT = "the input build is damaged; run shardc verify on it"


def plan_data(ckpt: Path, tp: int, pp: int, name: str = "t") -> dict:
    return shared_plan_data(tp, pp, name=name, source=ckpt)


@pytest.fixture(autouse=True)
def _tmpdir(monkeypatch, tmp_path):
    """The shardc subprocesses' temporary directory (a local input's spool) is the test's own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One checkpoint (with a tokenizer file), its tp2 x pp2 build A (the input every test copies)
    and the plan file of the tp1 x pp2 output."""
    root = tmp_path_factory.mktemp("hostile")
    ckpt = write_checkpoint(root / "ck", llama_config(**GQA), seed=0)
    (ckpt / "tokenizer.json").write_bytes(TOKENIZER)
    a = build(plan_from_dict(plan_data(ckpt, 2, 2)), root / "a")
    plan = root / "p.yaml"
    plan.write_text(yaml.safe_dump(plan_data(ckpt, 1, 2)))
    return {"root": root, "ckpt": ckpt, "a": a.out_dir, "plan": plan}


def copy_input(work, tmp_path: Path) -> Path:
    return Path(shutil.copytree(work["a"], tmp_path / "in"))


def shardc(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """A real ``shardc`` process (this worktree's code)."""
    return subprocess.run([sys.executable, "-c", "from shardc.cli import main; main()", *map(str, args)],
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def start_shardc(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from shardc.cli import main; main()", *map(str, args)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def reshard_args(inp, out: Path, plan: Path, *extra) -> list:
    return ["reshard", "--manifest", inp, "--plan", plan, "--out", out, "--manifests-dir", out.parent / "m",
            "-q", *extra]


def snapshot(d: Path) -> dict[str, bytes]:
    """Every entry of a directory, hidden ones included, with its bytes (a link: its target)."""
    return {p.name: (os.readlink(p).encode() if p.is_symlink() else p.read_bytes()) for p in sorted(d.iterdir())}


def spools(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir() if p.name.startswith(SPOOL_PREFIX)}


# --- header surgery: the test's own parser and writer of the safetensors layout ----------------

def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    path.write_bytes(struct.pack("<Q", len(js)) + js + data)


def rehash(build_dir: Path, name: str) -> None:
    """Make the manifest agree with the edited file (size and sha256): only the header checks can
    see the edit then."""
    m = json.loads((build_dir / "manifest.json").read_text())
    data = (build_dir / name).read_bytes()
    reseal(m["shards"][name], data)
    (build_dir / "manifest.json").write_text(json.dumps(m))


def by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


# --- item 2: two reshards into the same new directory ------------------------------------------

def take_over(out: Path) -> int:
    """Be the winner of ``out``: create it, hold its build lock (flock, as a running build does),
    write a temp file and a resume record. Returns the lock's fd."""
    out.mkdir()
    lock = os.open(out / ".shardc-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    (out / ".model-tp00-pp00.safetensors.0123456789abcdef.tmp").write_bytes(b"half a shard")
    (out / ".model-tp00-pp00.safetensors.done.json").write_bytes(b'{"key": 1}')
    return lock


def test_a_reshard_that_loses_the_lock_removes_nothing(work, tmp_path):
    """In-process and fast: a real local input whose side files are read (after the reshard found
    no output directory) while another run takes the directory over."""
    from shardc.compiler.build_files import LocalBuildInput
    from shardc.errors import ShardcError

    out = tmp_path / "r"
    locks = []

    class WinnerArrives(LocalBuildInput):
        def side_directory(self) -> Path:
            locks.append(take_over(out))
            return super().side_directory()

    inp = WinnerArrives(work["a"] / "manifest.json")
    try:
        with pytest.raises(ShardcError) as exc:
            reshard(inp, plan_from_dict(plan_data(work["ckpt"], 1, 2)), out)
        assert exc.value.one_line() == f"another shardc build is writing to {out} (hint: {LOCK_HINT})"
        assert exc.value.exit_code == 2
        assert snapshot(out) == {".shardc-build.lock": b"", ".model-tp00-pp00.safetensors.0123456789abcdef.tmp":
                                 b"half a shard", ".model-tp00-pp00.safetensors.done.json": b'{"key": 1}'}
        assert os.fstat(locks[0]).st_ino == os.stat(out / ".shardc-build.lock").st_ino
    finally:
        for fd in locks:
            os.close(fd)
    # the winner gone (its lock released), a failed run into a new directory removes all it made
    shutil.rmtree(out)
    bad = copy_input(work, tmp_path)
    victim = bad / "model-tp01-pp01.safetensors"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(VerifyMismatch):
        reshard(open_local_input(bad), plan_from_dict(plan_data(work["ckpt"], 1, 2)), out)
    assert not out.exists()


@pytest.mark.heavy
def test_the_loser_of_the_lock_touches_nothing_of_the_winner(work, tmp_path, s3, aws):
    """The loser found no output directory when it started, and is held (a stalled S3 download of
    its side files) while the winner creates the directory, takes the build lock (flock, as a
    running build does) and writes a temp file and a resume record. Released, the loser exits 2
    with one line and leaves all of it: the directory, the lock file, every byte."""
    server, proxy = s3
    uri = push(work, server, "loser")
    out = tmp_path / "r"
    proxy.clear()
    proxy.faults = faults(stall="loser/tokenizer.json")
    loser = start_shardc(*reshard_args(uri, out, work["plan"], "--endpoint-url", proxy.endpoint))
    lock = -1
    try:
        assert proxy.wait_for(lambda log: any("tokenizer.json" in r.path for r in log), 60), winner_error(loser)
        assert not out.exists()
        lock = take_over(out)
        before = snapshot(out)
        proxy.faults = faults()
        _, stderr = loser.communicate(timeout=120)
        assert loser.returncode == 2, stderr
        assert stderr == f"error: another shardc build is writing to {out} (hint: {LOCK_HINT})\n"
        assert snapshot(out) == before
        assert os.fstat(lock).st_ino == os.stat(out / ".shardc-build.lock").st_ino  # the same lock file
        assert not spools(tmp_path)  # its own temporary copies are gone
    finally:
        proxy.faults = faults()
        if lock >= 0:
            os.close(lock)
        if loser.poll() is None:
            loser.kill()
            loser.communicate()


@pytest.mark.heavy
def test_a_real_winner_finishes_while_the_loser_fails(work, tmp_path, s3, aws):
    """Two real reshards from S3 into one new directory, each held by its own fault proxy: the
    loser after it found no directory (its side files stalled), the winner mid-run (its first
    stage committed, the lock held, its second stage's input stalled). The loser, released, gets
    one line, exit 2, and changes nothing; the winner, released, completes a build that verifies."""
    from s3server import FaultProxy

    server, proxy = s3
    uri = push(work, server, "race")
    out = tmp_path / "r"
    proxy.clear()
    proxy.faults = faults(stall="race/tokenizer.json")
    other = FaultProxy(server.endpoint).start()
    other.faults = faults(stall="race/model-tp00-pp01")
    loser = start_shardc(*reshard_args(uri, out, work["plan"], "--endpoint-url", proxy.endpoint))
    winner = None
    try:
        assert proxy.wait_for(lambda log: any("tokenizer.json" in r.path for r in log), 60), winner_error(loser)
        winner = start_shardc(*reshard_args(uri, out, work["plan"], "--endpoint-url", other.endpoint))
        done = out / ".model-tp00-pp00.safetensors.done.json"
        assert wait(lambda: done.is_file(), winner), winner_error(winner)
        before = snapshot(out)
        proxy.faults = faults()
        _, stderr = loser.communicate(timeout=120)
        assert loser.returncode == 2, stderr
        assert stderr == f"error: another shardc build is writing to {out} (hint: {LOCK_HINT})\n"
        assert snapshot(out) == before
        other.faults = faults()
        _, stderr = winner.communicate(timeout=120)
        assert winner.returncode == 0, stderr
    finally:
        proxy.faults = faults()
        other.faults = faults()
        for p in (loser, winner):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
        other.stop()
    res = shardc("verify", "--manifest", out / "manifest.json")
    assert res.returncode == 0, res.stdout + res.stderr


# --- item 3: only what the input manifest lists, never through a link --------------------------

def test_unlisted_files_and_links_never_reach_the_output(work, tmp_path):
    inp = copy_input(work, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not part of any build\n")
    (inp / "generation_config.json").write_bytes(b'{"do_sample": true}\n')  # a regular file, unlisted
    (inp / "special_tokens_map.json").symlink_to(secret)  # a link at a tokenizer name, unlisted
    out = tmp_path / "r"
    res = shardc(*reshard_args(inp, out, work["plan"]))
    assert res.returncode == 0, res.stderr
    listed = {f["name"] for f in json.loads((out / "manifest.json").read_text())["files"]}
    assert listed == {"config.json", "model.safetensors.index.json", "tokenizer.json"}
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER
    assert not (out / "generation_config.json").exists() and not (out / "special_tokens_map.json").exists()
    assert b"not part of any build" not in b"".join(p.read_bytes() for p in out.iterdir() if p.is_file())
    res = shardc("verify", "--manifest", out / "manifest.json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not spools(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "model-tp01-pp01.safetensors"])
def test_a_link_at_a_listed_name_is_refused(work, tmp_path, name):
    """Even a link to the very bytes the manifest hashed: a build's files are its own regular files."""
    inp = copy_input(work, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (inp / name).rename(elsewhere)
    (inp / name).symlink_to(elsewhere)
    out = tmp_path / "r"
    res = shardc(*reshard_args(inp, out, work["plan"]))
    assert res.returncode == 1, res.stderr
    assert res.stderr == (f"error: input file {inp / name} is a symbolic link (hint: a build's files are "
                          "regular files; restore it (shardc pull) or rebuild it)\n")
    assert not out.exists() and not spools(tmp_path)


# --- item 4: what verify rejects is refused; what was hashed is what is used -------------------

def _overlap(path: Path) -> str:
    """Point the last tensor at the bytes of the one before it (same dtype and shape)."""
    header, data = read_raw(path)
    names = by_offset(header)
    last = names[-1]
    prev = next(n for n in reversed(names[:-1]) if header[n]["shape"] == header[last]["shape"]
                and header[n]["dtype"] == header[last]["dtype"])
    b, e = header[prev]["data_offsets"]
    header[last]["data_offsets"] = [b, e]
    write_raw(path, header, data)
    first, second = sorted([prev, last])
    # sorted by (offsets, name): the second of the two at [b, e] starts where the first ended
    return f"safetensors data layout: tensor {second}: data starts at {b}, expected {e} (overlapping the previous tensor)"


def _past_the_end(path: Path) -> str:
    """Shift the last tensor's offsets 64 bytes on: its mapping would run past the end of the file."""
    header, data = read_raw(path)
    last = by_offset(header)[-1]
    b, e = header[last]["data_offsets"]
    header[last]["data_offsets"] = [b + 64, e + 64]
    write_raw(path, header, data)
    return f"safetensors data layout: tensor {last}: data starts at {b + 64}, expected {b} (a gap)"


def _other_rank(path: Path) -> str:
    """The metadata of another rank (a file copied from tp rank 0, say)."""
    header, data = read_raw(path)
    header["__metadata__"]["shardc.tp_rank"] = "0"
    write_raw(path, header, data)
    return "metadata shardc.tp_rank is '0', expected '1' (a shard of another plan or rank?)"


@pytest.mark.parametrize("edit", [_overlap, _past_the_end, _other_rank], ids=["overlap", "past-eof", "metadata"])
def test_a_shard_verify_rejects_is_refused_with_verify_s_line(work, tmp_path, edit):
    """The manifest is re-hashed to the edited file: only the header checks can see the edit.
    verify rejects it; reshard (and export, which reads through the same BuildSource) refuse it
    with verify's own words, exit 1, no traceback, and leave no directory or lock behind."""
    from shardc.compiler.export import export
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    inp = copy_input(work, tmp_path)
    victim = inp / "model-tp01-pp01.safetensors"
    problem = edit(victim)
    rehash(inp, victim.name)
    report = verify_build(load(inp / "manifest.json"), inp)
    assert list(report.problems) == [f"{victim.name}: {problem}"]
    out = tmp_path / "r"
    res = shardc(*reshard_args(inp, out, work["plan"]))
    assert res.returncode == 1, res.stderr
    assert res.stderr == f"error: input file {victim}: {problem} (hint: {DAMAGED_HINT})\n"
    assert not out.exists() and not spools(tmp_path)
    with pytest.raises(VerifyMismatch) as exc:
        export(open_local_input(inp), tmp_path / "hf")
    assert exc.value.message == f"input file {victim}: {problem}"
    # the lock went with the directory: a good input reshards into the same place at once
    assert reshard(open_local_input(work["a"]), plan_from_dict(plan_data(work["ckpt"], 1, 2)), out).built


def test_an_s3_manifest_replaced_mid_reshard_is_refused(work, tmp_path, s3, aws):
    """The input's manifest is read when the reshard starts; then another build (same plan, other
    weights) is pushed to the same prefix. Every file the reshard pulls now matches the new
    manifest, so only comparing manifests can see it: refused, exit 1, nothing left."""
    from shardc.store.reshard_input import RemoteBuildInput

    server, _ = s3
    uri = push(work, server, "swap")
    inp = RemoteBuildInput(uri, endpoint_url=server.endpoint, spool_parent=tmp_path)
    first = inp.manifest_sha256
    other_ckpt = write_checkpoint(tmp_path / "ck2", llama_config(**GQA), seed=1)
    (other_ckpt / "tokenizer.json").write_bytes(TOKENIZER)
    other = build(plan_from_dict(plan_data(other_ckpt, 2, 2)), tmp_path / "a2")
    from shardc.store.push import push_build

    # another source's build over the prefix: push says --replace (#25 item 12)
    push_build(other.manifest_path, uri.removesuffix("/manifest.json"), endpoint_url=server.endpoint,
               replace=True)
    second = hashlib.sha256(other.manifest_path.read_bytes()).hexdigest()
    assert first != second
    out = tmp_path / "r"
    with pytest.raises(VerifyMismatch) as exc:
        reshard(inp, plan_from_dict(plan_data(work["ckpt"], 1, 2)), out)
    assert exc.value.message == (f"the input manifest {uri} changed while it was read (sha256 {second[:16]}..., "
                                 f"first read as {first[:16]}...)")
    assert exc.value.exit_code == 1
    assert not out.exists() and not spools(tmp_path)


# --- item 10a: the spools of killed S3 reshards ------------------------------------------------

def test_a_dead_process_s_spool_is_removed_and_a_live_one_kept(tmp_path):
    """Spools held by real processes: one killed with SIGKILL, one alive; a new spool in the same
    parent removes the first only."""
    code = ("import sys, time\nfrom shardc.compiler.build_files import Spool\ns = Spool(sys.argv[1])\n"
            "(s.path / 'partial').write_bytes(b'x' * 4096)\nprint(s.path, flush=True)\ntime.sleep(120)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(2)]
    try:
        dead, live = (Path(p.stdout.readline().strip()) for p in procs)
        assert (dead / "partial").is_file() and (live / "partial").is_file()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        mine = Spool(tmp_path)
        try:
            assert spools(tmp_path) == {live.name, mine.path.name}
            assert (live / "partial").read_bytes() == b"x" * 4096
        finally:
            mine.close()
        assert spools(tmp_path) == {live.name}
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
            p.stdout.close()


@pytest.mark.heavy
@pytest.mark.parametrize("stall", ["model-tp00-pp00", "model-tp01-pp01"], ids=["before-shards", "mid-stages"])
def test_a_rerun_removes_the_spool_of_a_killed_s3_reshard(work, tmp_path, s3, aws, stall):
    """A real S3 reshard killed with SIGKILL while a download is held (before any shard arrived, or
    after the first stage is spooled and committed); another reshard is still running with its own
    spool. The rerun completes, removes the killed run's spool and leaves the running one's."""
    server, proxy = s3
    uri = push(work, server, "kill")
    out = tmp_path / "r"
    proxy.clear()
    proxy.faults = faults(stall=f"kill/{stall}")
    held = lambda log: sum(stall in r.path and r.end == 0.0 for r in log)  # noqa: E731
    killed = start_shardc(*reshard_args(uri, out, work["plan"], "--endpoint-url", proxy.endpoint))
    running = None
    try:
        assert proxy.wait_for(lambda log: held(log) >= 1, timeout=60), winner_error(killed)
        left = spools(tmp_path)
        assert len(left) == 1 and any((tmp_path / n).iterdir() for n in left)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        n = held(proxy.log)
        running = start_shardc(*reshard_args(uri, tmp_path / "other", work["plan"], "--endpoint-url",
                                             proxy.endpoint))
        assert proxy.wait_for(lambda log: held(log) > n, timeout=60), winner_error(running)
        live = spools(tmp_path) - left
        assert len(live) == 1
        res = shardc(*reshard_args(uri, out, work["plan"], "--endpoint-url", server.endpoint))
        assert res.returncode == 0, res.stderr
        assert spools(tmp_path) == live  # the killed run's spool is gone, the running one's kept
    finally:
        proxy.faults = faults()
        for p in (killed, running):
            if p is not None and p.poll() is None:
                p.wait(timeout=120)
    assert running.returncode == 0, running.stderr.read()
    assert not spools(tmp_path)
    res = shardc("verify", "--manifest", out / "manifest.json")
    assert res.returncode == 0, res.stdout + res.stderr


# --- S3 helpers ---------------------------------------------------------------------------------

@pytest.fixture
def aws(aws_env):
    """conftest's dummy credentials (for this process and the shardc subprocesses); three attempts."""
    aws_env.setenv("SHARDC_S3_MAX_ATTEMPTS", "3")


def push(work, server, prefix: str) -> str:
    """Build A in the bucket under ``prefix``; returns its manifest URI."""
    from shardc.store.push import push_build

    client = server.client()
    if "hostile" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket="hostile")
    push_build(work["a"] / "manifest.json", f"s3://hostile/{prefix}", endpoint_url=server.endpoint)
    return f"s3://hostile/{prefix}/manifest.json"


def faults(**kw):
    from s3server import Faults

    return Faults(**kw)


def wait(predicate, proc: subprocess.Popen, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def winner_error(proc: subprocess.Popen) -> str:
    return proc.stderr.read() if proc.poll() is not None else "the process did not get there in time"


# --- mutation-testing kills (docs/mutation-testing.md, compiler/reshard.py) ------------------------

def test_int8_weight_shape_values_are_checked(work, tmp_path):
    """int8's X.weight_shape holds the [out, in] of the rank's slice; a tp1 input whose value was
    edited (manifest re-hashed: the header is unchanged) would unpack the packed values at another
    width: refused, naming the tensor, its values and the Layout's."""
    import numpy as np

    a = build(plan_from_dict({**plan_data(work["ckpt"], 1, 1), "replica_group": {
        **plan_data(work["ckpt"], 1, 1)["replica_group"], "dtype": "int8"}}), tmp_path / "a8")
    victim = a.out_dir / "model-tp00-pp00.safetensors"
    header, data = read_raw(victim)
    name = "model.layers.1.mlp.down_proj.weight_shape"
    b, e = header[name]["data_offsets"]
    assert header[name]["dtype"] == "I64"
    want = np.frombuffer(data[b:e], "<i8").tolist()
    assert want == [GQA["hidden_size"], GQA["intermediate_size"]]  # [out, in] of down_proj
    got = [want[0], want[1] + 4]
    write_raw(victim, header, data[:b] + np.array(got, "<i8").tobytes() + data[e:])
    rehash(a.out_dir, victim.name)
    plan = plan_from_dict({**plan_data(work["ckpt"], 1, 2), "replica_group": {
        **plan_data(work["ckpt"], 1, 2)["replica_group"], "dtype": "int8"}})
    with pytest.raises(VerifyMismatch) as exc:
        reshard(open_local_input(a.out_dir), plan, tmp_path / "r")
    assert exc.value.message == f"tensor {name} of {victim.name} is {got}, the input layout says {want}"
    assert exc.value.hint == "the input build was not written by shardc build"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("form", ["directory", "file-uri", "file-uri-directory", "checkpoint", "dequantized"])
def test_verify_deep_takes_every_form_of_reference(work, tmp_path, form):
    """``verify --deep REF``: a build directory, a file:// manifest URI, the checkpoint itself, or
    (for a --dequantize reshard) the quantized build it came from; another build's weights fail."""
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    ckpt = work["ckpt"]
    if form == "dequantized":
        int8 = plan_from_dict({**plan_data(ckpt, 2, 1), "replica_group": {**plan_data(ckpt, 2, 1)["replica_group"],
                                                                        "dtype": "int8"}})
        src = build(int8, tmp_path / "a8").out_dir
        out = reshard(open_local_input(src), plan_from_dict(plan_data(ckpt, 1, 2)), tmp_path / "r",
                      dequantize=True).out_dir
    else:
        src, out = work["a"], reshard(open_local_input(work["a"]), plan_from_dict(plan_data(ckpt, 1, 2)),
                                      tmp_path / "r").out_dir
    ref = {"directory": str(src), "file-uri": f"file://{src / 'manifest.json'}", "file-uri-directory": f"file://{src}",
           "checkpoint": str(ckpt), "dequantized": str(src)}[form]
    report = verify_build(load(out / "manifest.json"), out, deep=ref)
    assert report.ok, report.problems
    assert all("deep" in r.checks for r in report.ranks)
    other = write_checkpoint(tmp_path / "other", llama_config(**GQA), seed=3)
    report = verify_build(load(out / "manifest.json"), out, deep=str(other))
    assert not report.ok and "deep check" in report.problems[0]


def test_ranks_that_hold_only_vocabulary_padding(tmp_path):
    """Vocabulary 9 at tp 8 is padded to 16 rows: ranks 5-7 hold two padding rows of the embedding
    and lm_head each, no real row. Resharded to tp 1, the output is byte for byte the tp 1 build of
    the checkpoint."""
    ckpt = write_checkpoint(tmp_path / "ck", llama_config(**dict(GQA, num_layers=2, vocab_size=9)), seed=0)
    a = build(plan_from_dict(plan_data(ckpt, 8, 1)), tmp_path / "a")
    got = reshard(open_local_input(a.out_dir), plan_from_dict(plan_data(ckpt, 1, 1)), tmp_path / "r")
    want = build(plan_from_dict(plan_data(ckpt, 1, 1)), tmp_path / "b")
    for s in want.manifest.shards:
        assert hashlib.sha256((got.out_dir / s.file).read_bytes()).hexdigest() == s.sha256
