#!/usr/bin/env python3
"""Loader speed (issue #30): shardc.load_shard against the fastest loaders, cold and warm, and
shardc's hashing throughput for verify/pull.

Every loader runs in a fresh process that has imported torch before the clock starts (what a
serving process at cold start has), on the same file in the same run; the loaders alternate
within each round so a noisy neighbour hits all alike, and medians are reported. Cold: the page
cache is dropped before each run (``echo 3 > /proc/sys/vm/drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` on the file, which needs no privilege). Ratios are against the fastest
*unchecked* loader (one that checks no digest) of the same temperature.

Loaders (CPU):
  shardc          shardc.load_shard(manifest, tp, pp, device="cpu"): every chunk's sha256 checked
  shardc-blake3   the same call on a build of the same tensors whose plan asks for blake3 chunk
                  digests (replica_group.checkpoint.chunk_digest: blake3): every chunk's blake3 checked
  sha256+safe_open  the design's checked loader: hashlib sha256 in 1 MiB reads, then safe_open + copy
  safetensors     safe_open + get_tensor + copy of every tensor (unchecked)
  fastsafetensors fastsafe_open(nogds=True) + get_tensor (unchecked; 0.5.0, `bench` extra)
  runai           Run:ai Model Streamer SafetensorsStreamer (unchecked; `bench` extra)
Loaders (CUDA only, skipped with a line on CPU):
  instanttensor   InstantTensor's safe_open(device=...) + tensors() (unchecked; 0.2.2, `bench` extra;
                  the loader vLLM and SGLang offer)
Peers not installed are skipped with a line. ``--device cuda`` is the indexed device shardc's
``cuda`` means (``cuda:LOCAL_RANK``, ``cuda:0`` outside torchrun), given to every loader alike
(fastsafetensors fails on a bare ``cuda``; InstantTensor reads the device's index). Also printed:
verify's hashing of the whole build in GB/s on 1 and on all cores (``verify_build(jobs=N)``, page cache warm), for each chunk digest. ``--s3``: the same shard
from the moto S3 server on 127.0.0.1, shardc.load_shard of the s3:// manifest against Run:ai's S3
streaming (``runai-model-streamer-s3``), throughput ratio (target >= 1.0).

Examples:
  pip install -e '.[bench]'                          # the peers
  python scripts/bench_loader.py                     # synthetic tp=1 build, ~1 GiB shard
  python scripts/bench_loader.py --layers 4 --hidden 1024 --repeat 3   # ~0.25 GiB, quicker
  python scripts/bench_loader.py --manifest build/x/manifest.json --rank 0
  python scripts/bench_loader.py --manifest b/manifest.json --manifest-blake3 b3/manifest.json
  python scripts/bench_loader.py --s3                 # also from the moto S3 server vs Run:ai's S3 streaming
  python scripts/bench_loader.py --device cuda       # CUDA (cuda:0): every loader, InstantTensor too
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOADERS = ["shardc", "shardc-blake3", "sha256+safe_open", "safetensors", "fastsafetensors", "runai",
           "instanttensor"]
UNCHECKED = {"safetensors", "fastsafetensors", "runai", "instanttensor"}
PEER_MODULE = {"fastsafetensors": "fastsafetensors", "runai": "runai_model_streamer",
               "instanttensor": "instanttensor"}
CUDA_ONLY = {"instanttensor"}  # its safe_open raises for any device but CUDA


# -- the loaders (each run in a child process) ----------------------------------------------------
def load(name: str, path: str, manifest: str, tp: int, pp: int, device: str) -> dict[str, Any]:
    """One loader's tensors for ``path`` (the shard of rank (tp, pp) of ``manifest``)."""
    if name in ("shardc", "shardc-blake3"):  # the same call; the blake3 build's manifest for the second
        import shardc

        return shardc.load_shard(manifest, tp, pp, device=device)
    if name == "sha256+safe_open":
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.hexdigest()
        return _safe_open(path, device)
    if name == "safetensors":
        return _safe_open(path, device)
    if name == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(filenames=[str(path)], nogds=True, device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if name == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_file(str(path), device=device)
            return dict(s.get_tensors())
    if name == "instanttensor":  # its default: Direct I/O reads into a GPU ring buffer, each tensor cloned out
        import torch
        from instanttensor import safe_open

        with safe_open(str(path), framework="pt", device=torch.device(device)) as f:
            return dict(f.tensors())
    if name == "shardc-s3":  # ``manifest`` is the s3:// URI; AWS_ENDPOINT_URL names the server
        import shardc

        return shardc.load_shard(str(manifest), tp, pp, device=device)
    if name == "runai-s3":  # ``path`` is the shard's s3:// URI
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_file(str(path), device=device)
            return {k: t.clone() for k, t in s.get_tensors()}  # its buffer is reused once closed
    raise SystemExit(f"unknown loader {name}")


def _safe_open(path: Path | str, device: str) -> dict[str, Any]:
    """safe_open + get_tensor + a copy: on CPU get_tensor returns a view of safetensors' mapping of
    the file (nothing read yet; a later write to the file shows through), so the copy is what
    makes it loaded memory, as the other loaders' is."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118


def child(name: str, path: str, manifest: str, tp: int, pp: int, device: str) -> None:
    """Import torch, collect its import's garbage, then time one load; print the seconds as JSON.

    Why the collection: importing torch leaves a full (generation 2) garbage collection of its
    objects pending, and the first loader to allocate enough after it pays it inside its timing
    (0.1-0.3 s here; shardc's imports trigger it, fastsafetensors' happen not to). A serving
    process has long paid it by the time it loads weights, so every loader starts without it."""
    import gc

    import torch

    gc.collect()
    t0 = time.perf_counter()
    out = load(name, path, manifest, tp, pp, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "tensors": len(out)}))


# -- the harness ------------------------------------------------------------------------------------
def drop_cache(path: Path) -> str:
    """Drop the page cache (all of it as root, else the file's pages); says which was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def warm_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def run_child(name: str, path: Path | str, manifest: Path | str, tp: int, pp: int, device: str,
              extra_env: dict[str, str] | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(extra_env or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode goes to main()'s PYTHONPYCACHEPREFIX
    p = subprocess.run([sys.executable, __file__, "--child", name, "--path", str(path), "--manifest", str(manifest),
                        "--tp", str(tp), "--pp", str(pp), "--device", device],
                       capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        raise RuntimeError(f"{name}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def indexed(device: str) -> str:
    """The device every loader gets: shardc's own reading of ``device`` (``cuda`` -> ``cuda:LOCAL_RANK``,
    0 outside torchrun; ``cuda:N`` and ``cpu`` unchanged). fastsafetensors 0.5.0 passes the device
    to ``torch.cuda.set_device``, which refuses a bare ``cuda`` (the failed run of issue #41), and
    InstantTensor takes the device's index; one indexed GPU for all keeps the comparison fair."""
    from shardc.loader.devices import resolve_device

    out = resolve_device(device)
    assert out is not None
    return out


def available(names: list[str], device: str = "cpu") -> list[str]:
    """The loaders of ``names`` that can run on ``device``; each one left out is a printed line."""
    import importlib.util

    out = []
    for n in names:
        if n in CUDA_ONLY and not device.startswith("cuda"):
            print(f"  ({n} skipped: it loads to CUDA only; run with --device cuda)")
            continue
        mod = PEER_MODULE.get(n)
        if mod and importlib.util.find_spec(mod) is None:
            print(f"  ({n} not installed: pip install -e '.[bench]')")
            continue
        out.append(n)
    return out


def compare(manifest: Path, rank: int, device: str, repeat: int, loaders: list[str],
            blake3_manifest: Path | None = None) -> dict[str, Any]:
    """Median seconds per loader, cold and warm, and ratios against the fastest unchecked one.
    ``shardc-blake3`` loads rank ``rank`` of ``blake3_manifest`` (the same tensors, its own build);
    every other loader the file of ``manifest``."""
    from shardc.formats.manifest import load

    rl = load(manifest).to_layout().ranks[rank]
    path = manifest.parent / rl.file
    files = {n: (path, manifest) for n in loaders}
    if blake3_manifest is not None:
        files["shardc-blake3"] = (blake3_manifest.parent / rl.file, blake3_manifest)
    elif "shardc-blake3" in loaders:
        print("  (shardc-blake3 needs --manifest-blake3 with --manifest)")
        loaders = [n for n in loaders if n != "shardc-blake3"]
    results: dict[str, Any] = {"bytes": path.stat().st_size, "file": rl.file}
    for n in loaders:  # untimed: each loader's bytecode compiled, its code paths run once
        run_child(n, *files[n], rl.tp_rank, rl.pp_stage, device)
    for temp in ("cold", "warm"):
        times: dict[str, list[float]] = {n: [] for n in loaders}
        how = ""
        for r in range(repeat):
            order = loaders if r % 2 == 0 else loaders[::-1]  # alternate who goes first
            for n in order:
                if temp == "cold":
                    how = drop_cache(files[n][0])
                else:
                    warm_cache(files[n][0])
                times[n].append(run_child(n, *files[n], rl.tp_rank, rl.pp_stage, device))
        med = {n: statistics.median(v) for n, v in times.items()}
        fastest = min((med[n] for n in med if n in UNCHECKED), default=None)
        results[temp] = {"median_s": med, "all_s": times, "cache": how or "warm",
                         "ratio": {n: (s / fastest if fastest else None) for n, s in med.items()}}
    return results


def compare_s3(manifest: Path, rank: int, device: str, repeat: int) -> dict[str, Any]:
    """The same shard from the moto S3 server on 127.0.0.1: shardc.load_shard of the s3://
    manifest (parallel ranged GETs, chunks checked) against Run:ai's S3 streaming of the object
    (unchecked), each in a fresh process, alternating; medians and shardc's throughput over Run:ai's."""
    import importlib.util
    import logging

    from moto.server import ThreadedMotoServer

    from shardc.formats.manifest import load
    from shardc.store import push_build

    if importlib.util.find_spec("runai_model_streamer_s3") is None:
        print("  (runai-model-streamer-s3 not installed: pip install -e '.[bench]')")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
               "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        os.environ.update(env)
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        push_build(manifest, "s3://bench/b")
        rl = load(manifest).to_layout().ranks[rank]
        uri, obj = "s3://bench/b/manifest.json", f"s3://bench/b/{rl.file}"
        loaders = ["shardc-s3", "runai-s3"]
        times: dict[str, list[float]] = {n: [] for n in loaders}
        failed: dict[str, str] = {}  # a peer that fails on this server is reported, not fatal to the run
        for r in range(repeat):
            for n in (loaders if r % 2 == 0 else loaders[::-1]):
                try:
                    times[n].append(run_child(n, obj, uri, rl.tp_rank, rl.pp_stage, device, env))
                except RuntimeError as exc:
                    failed[n] = str(exc).strip().splitlines()[-1][:300]
    finally:
        server.stop()
    med = {n: statistics.median(v) for n, v in times.items() if v}
    ratio = med["runai-s3"] / med["shardc-s3"] if len(med) == 2 else None
    return {"median_s": med, "all_s": times, "failed": failed, "throughput_vs_runai": ratio}


def hashing_rates(manifest: Path) -> dict[str, float]:
    """verify's hashing of the whole build, GB/s, on 1 core and on every core (page cache warm)."""
    from shardc.formats.chunk_digests import workers
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    m = load(manifest)
    for s in m.shards:
        warm_cache(manifest.parent / s.file)
    out = {}
    for jobs in sorted({1, workers()}):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            r = verify_build(m, manifest.parent, jobs=jobs)
            best = min(best, time.perf_counter() - t0)
            assert r.ok, r.problems
        out[f"{jobs}_core"] = m.total_bytes / best / 1e9
    return out


def measure(manifest: Path, rank: int, device: str, repeat: int = 5) -> dict[str, float]:
    """In-process, warm, best of ``repeat`` (scripts/gpu_check.py's figure): the design's checked
    loader (hashlib sha256 + load_file, + isfinite on CUDA), load_shard and verify --device."""
    import torch

    import shardc
    from shardc.formats.manifest import load
    from shardc.verify.checks import verify_build

    device = indexed(device)
    m = load(manifest)
    rl = m.to_layout().ranks[rank]
    path = manifest.parent / rl.file

    def baseline() -> Any:
        from safetensors.torch import load_file

        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        out = load_file(path, device=device) if device.startswith("cuda") else _safe_open(path, device)
        if device.startswith("cuda"):
            flags = [torch.isfinite(t).all() for t in out.values() if t.is_floating_point()
                     and t.dtype != torch.float8_e4m3fn]
            if flags:
                torch.stack(flags).all().item()
        return out

    def verify() -> Any:
        r = verify_build(m, manifest.parent, [rl], device=device)
        assert r.ok, r.problems
        return r

    runs = {"baseline_s": baseline,
            "load_shard_s": lambda: shardc.load_shard(manifest, rl.tp_rank, rl.pp_stage, device=device),
            "verify_s": verify}

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        del out
        return seconds

    for fn in runs.values():  # warm the page cache, CUDA and every code path first
        timed(fn)
    best = {k: min(timed(fn) for _ in range(max(1, repeat))) for k, fn in runs.items()}
    return {"bytes": path.stat().st_size, **best, "load_shard_ratio": best["load_shard_s"] / best["baseline_s"],
            "verify_ratio": best["verify_s"] / best["baseline_s"]}


def synthetic(root: Path, layers: int, hidden: int, tp: int) -> tuple[Path, Path]:
    """A synthetic checkpoint built twice, with sha256 chunk digests (the default) and with blake3:
    the two manifests."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    src = write_checkpoint(root / "src", llama_config(num_layers=layers, hidden_size=hidden,
                                                      intermediate_size=4 * hidden, num_heads=16,
                                                      num_kv_heads=4, vocab_size=32000))
    out = []
    for digest, d in (("sha256", "b"), ("blake3", "b3")):
        plan = plan_from_dict({"replica_group": {"name": "bench-loader", "tp_degree": tp, "pp_degree": 1,
                                                 "dtype": "bf16", "gpus_per_replica": tp,
                                                 "checkpoint": {"chunk_digest": digest}},
                               "model": {"source": str(src)}})
        out.append(build(plan, out_dir=root / d).manifest_path)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", help="manifest.json (a path; for the --child runs also an s3:// URI)")
    ap.add_argument("--manifest-blake3", help="with --manifest: a build of the same model with blake3 chunk digests")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cuda: cuda:0 outside torchrun)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6, help="synthetic model: layers (without --manifest)")
    ap.add_argument("--hidden", type=int, default=2048, help="synthetic model: hidden size")
    ap.add_argument("--tp", type=int, default=1, help="synthetic model: TP degree (rank 0 is loaded)")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--s3", action="store_true", help="also from the moto S3 server: shardc vs Run:ai's S3 streaming")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # the manifest and path stay strings: an s3:// URI is not a Path
        child(a.child, a.path, a.manifest, a.tp, a.pp, a.device)
        return
    from shardc.errors import ShardcError

    try:
        a.device = indexed(a.device)
    except ShardcError as exc:  # the library names its field (device); this script's flag is --device
        ap.error(f"--device {exc.message}")
    with tempfile.TemporaryDirectory(prefix="bench-loader-", dir=os.environ.get("BENCH_DIR")) as tmp:
        # compiled bytecode of every loader's modules, kept for the run: an installed package (the
        # peers; shardc from a wheel) has its .pyc files, but a checkout run with
        # PYTHONDONTWRITEBYTECODE=1 would compile shardc's ~40 modules from source in every timed
        # process (0.1-0.2 s of CPU), which no user's process does
        os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        if a.manifest:
            manifest, b3 = Path(a.manifest), Path(a.manifest_blake3) if a.manifest_blake3 else None
        else:
            manifest, b3 = synthetic(Path(tmp), a.layers, a.hidden, a.tp)
        loaders = available([n.strip() for n in a.loaders.split(",") if n.strip()], a.device)
        r = compare(manifest, a.rank, a.device, a.repeat, loaders, b3)
        r["hashing_gb_s"] = {}
        for digest, m in (("sha256", manifest), ("blake3", b3)):
            if a.device == "cpu" and m is not None:
                r["hashing_gb_s"].update({f"{digest} {k}": v for k, v in hashing_rates(m).items()})
        if a.s3:
            r["s3"] = compare_s3(manifest, a.rank, a.device, a.repeat)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['file']}: {r['bytes'] / 1e9:.2f} GB on {a.device}, medians of {a.repeat} fresh processes "
          f"(torch imported first), loaders alternating")
    for temp in ("cold", "warm"):
        t = r[temp]
        print(f"  {temp} ({t['cache']}):")
        for n, s in sorted(t["median_s"].items(), key=lambda kv: kv[1]):
            ratio = t["ratio"][n]
            tag = "" if n in UNCHECKED else "  checked"
            print(f"    {n:18s} {s:6.3f}s  {r['bytes'] / s / 1e9:5.2f} GB/s"
                  + (f"  {ratio:4.2f}x the fastest unchecked" if ratio else "") + tag)
    for k, v in r["hashing_gb_s"].items():
        print(f"  verify hashing ({k.replace('_', ' ')}), whole build: {v:.2f} GB/s")
    if "s3" in r:
        m, failed = r["s3"]["median_s"], r["s3"]["failed"]
        for n, why in failed.items():
            print(f"  from moto S3: {n} failed in {'some' if r['s3']['all_s'][n] else 'every'} run(s): {why}")
        if r["s3"]["throughput_vs_runai"] is not None:
            print(f"  from moto S3 (127.0.0.1): shardc {m['shardc-s3']:.3f}s, Run:ai {m['runai-s3']:.3f}s: shardc's "
                  f"throughput {r['s3']['throughput_vs_runai']:.2f}x Run:ai's")


if __name__ == "__main__":
    main()
