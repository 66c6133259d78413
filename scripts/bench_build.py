#!/usr/bin/env python3
"""Benchmark shardc build and verify against plain-tool baselines measured in the same run.

On a synthetic checkpoint with real Llama-3-70B tensor shapes (embeddings, lm_head, N layers):
  build  (fp16 / int8 / fp8, tp4pp2) wall time     vs  `cp -r` of the same source   (target <= 1.5x)
  build peak RSS with 2N layers vs N layers                                          (target <= 1.10x)
  verify --all                                      vs  `sha256sum` over the shards  (target <= 0.6x)
  verify --rank 0                                   vs  `sha256sum` of that one file (target <= 1.1x)

Every timed command starts alike: dirty pages flushed, an empty destination, and the source
either read into the page cache ("warm") or evicted from it ("cold", needs root: the state a
140 GB checkpoint is always in, since it never fits in memory). cp -r, cp -r && sync and the
build run interleaved, --repeat times each (default 3), and medians are compared: this VM's
speed drifts over minutes, so each ratio compares neighbours.

Example (needs ~30 GB free disk, ~15 min):  python scripts/bench_build.py --layers 2
Quick smoke run on small shapes:            python scripts/bench_build.py --small --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardc.compiler.synthetic import LLAMA3_70B_SHAPES, llama_config, write_checkpoint  # noqa: E402


def drop_page_cache() -> bool:
    """Empty the page cache (root only): the state a 140 GB checkpoint is always in."""
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def run(cmd: list[str], source: list[Path] = (), cache: str = "warm") -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB, as the kernel reports ru_maxrss) of one child process.

    Before it, dirty pages are flushed and the ``source`` files are read into the page cache
    (``cache="warm"``) or the page cache is emptied (``"cold"``), so cp and shardc start alike.
    """
    subprocess.run(["sync"], check=True)
    time.sleep(1)  # let discards and writeback of earlier deletions settle
    if cache == "cold":
        drop_page_cache()
    else:
        for f in source:
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) not in (0,):
        raise SystemExit(f"command failed: {' '.join(cmd)}")
    return dt, usage.ru_maxrss


def spread(ts: list[float]) -> str:
    return f"median {statistics.median(ts):6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in ts)})"


def plan_file(d: Path, dtype: str) -> Path:
    p = d / f"bench-{dtype}.yaml"
    p.write_text(yaml.safe_dump({
        "replica_group": {"name": f"bench-{dtype}", "tp_degree": 4, "pp_degree": 2, "dtype": dtype,
                          "gpus_per_replica": 8},
        "model": {"source": "synthetic-llama3-70b-shapes"},
    }))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a smoke run")
    ap.add_argument("--dtypes", default="fp16,int8,fp8")
    ap.add_argument("--workdir", default=None, help="where to put the checkpoints [default: build/bench]")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per command; medians are compared")
    ap.add_argument("--cache", choices=["warm", "cold", "both"], default="both",
                    help="source in the page cache, or not (cold needs root) [default: both]")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.layers < 2:  # before minutes of writing sources: the plan is tp4pp2, a stage per layer at least
        ap.error(f"--layers {a.layers}: the tp4pp2 plan needs at least 2 layers (use --layers 2)")
    shardc = [sys.executable, "-m", "shardc.cli"]
    work = Path(a.workdir or ROOT / "build" / "bench")
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=work))
    shapes = LLAMA3_70B_SHAPES if not a.small else dict(
        hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, vocab_size=32000)
    results: dict[str, float] = {}
    try:
        srcs = {}
        for n in (a.layers, 2 * a.layers):
            srcs[n] = write_checkpoint(tmp / f"src-{n}", llama_config(num_layers=n, **shapes), num_files=2)
        src = srcs[a.layers]
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"source: {size / 2**30:.2f} GiB, {a.layers} layers (+ a {2 * a.layers}-layer copy for RSS)")

        files = sorted(src.iterdir())
        cp_dst = tmp / "cp"
        caches = ["warm", "cold"] if a.cache == "both" else [a.cache]
        if "cold" in caches and not drop_page_cache():
            print("cannot empty the page cache (needs root): warm-cache runs only")
            caches = ["warm"]

        # Source sha256s are cached across builds (path, size, mtime, inode): the first build of a
        # checkpoint hashes it, later plans from the same checkpoint do not.
        os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
        for i, dtype in enumerate(a.dtypes.split(",")):
            pf = plan_file(tmp, dtype)
            out = tmp / f"out-{dtype}"
            # like cp -r, every timed build writes into an empty directory: deleting old shards
            # is the filesystem's cost (0.4 s per GB with `discard`), not the build's
            cmd = shardc + ["build", str(pf), "--out", str(out), "--manifests-dir", str(tmp / "m"),
                            "--quiet", "--source", str(src)]
            if i == 0:
                dt, _ = run(cmd, files)
                results["first_build_seconds"] = dt
                print(f"[{dtype}] first build (hashes the source too)  {dt:6.2f} s")
                shutil.rmtree(out)
            rss = 0
            for cache in caches:
                # cp -r, the durable cp -r && sync (shardc fsyncs every shard, docs/architecture.md §6; cp
                # leaves its writes in the page cache) and the build, interleaved: this VM's
                # speed drifts over minutes, and each ratio should compare neighbours
                times: dict[str, list[float]] = {"cp": [], "cp+sync": [], "build": []}
                for _ in range(a.repeat):
                    times["cp"].append(run(["cp", "-r", str(src), str(cp_dst)], files, cache)[0])
                    shutil.rmtree(cp_dst)
                    times["cp+sync"].append(run(["sh", "-c", f"cp -r '{src}' '{cp_dst}' && sync"], files, cache)[0])
                    shutil.rmtree(cp_dst)
                    dt, r = run(cmd, files, cache)
                    times["build"].append(dt)
                    rss = max(rss, r)
                    shutil.rmtree(out)
                cp_s, cps_s, dt = (statistics.median(times[k]) for k in ("cp", "cp+sync", "build"))
                print(f"[{dtype}, {cache} page cache] cp -r          {spread(times['cp'])}")
                print(f"[{dtype}, {cache} page cache] cp -r && sync  {spread(times['cp+sync'])}")
                print(f"[{dtype}, {cache} page cache] build tp4pp2   {spread(times['build'])}")
                print(f"[{dtype}, {cache} page cache]   = {dt / cp_s:.2f}x cp -r (target <= 1.5), "
                      f"{dt / cps_s:.2f}x cp -r && sync")
                results.update({f"{dtype}_{cache}_cp_seconds": cp_s, f"{dtype}_{cache}_cp_sync_seconds": cps_s,
                                f"{dtype}_{cache}_build_seconds": dt, f"{dtype}_{cache}_ratio_vs_cp": dt / cp_s,
                                f"{dtype}_{cache}_ratio_vs_cp_sync": dt / cps_s})
            if i == 0:  # one more build, kept for the verify timings
                run(cmd, files)
                shards = sorted(out.glob("*.safetensors"))
                sha_all, _ = run(["sha256sum", *map(str, shards)])
                ver_all, _ = run(shardc + ["verify", "--manifest", str(out / "manifest.json")])
                one = str(out / "model-tp00-pp00.safetensors")
                sha_one, _ = run(["sha256sum", one])
                ossl_one, _ = run(["openssl", "dgst", "-sha256", one])
                ver_one, _ = run(shardc + ["verify", "--manifest", str(out / "manifest.json"), "--rank", "0"])
                results.update(verify_all_ratio=ver_all / sha_all, verify_rank_ratio=ver_one / sha_one,
                               verify_rank_ratio_vs_openssl=ver_one / ossl_one)
                print(f"sha256sum all shards       {sha_all:7.2f} s")
                print(f"verify --all               {ver_all:7.2f} s   {ver_all / sha_all:5.2f}x sha256sum (target <= 0.6)")
                print(f"sha256sum one shard        {sha_one:7.2f} s")
                print(f"openssl sha256 one shard   {ossl_one:7.2f} s")
                print(f"verify --rank 0            {ver_one:7.2f} s   {ver_one / sha_one:5.2f}x sha256sum (target <= 1.1), "
                      f"{ver_one / ossl_one:5.2f}x openssl")
                shutil.rmtree(out)  # disk: the 2x-layer output and source are the biggest of all
            out2 = tmp / f"out-{dtype}-2x"
            # its own record directory: the same plan name from another source is another build,
            # whose record the build refuses to replace without --replace (#41)
            _, rss2 = run(shardc + ["build", str(pf), "--out", str(out2), "--manifests-dir",
                                    str(tmp / "m-2x"), "--quiet", "--source", str(srcs[2 * a.layers])])
            results[f"rss_{dtype}_gib"] = rss / 2**20
            results[f"rss_{dtype}_2x_layers_ratio"] = rss2 / rss
            print(f"[{dtype}] peak RSS {2 * a.layers} vs {a.layers} layers: {rss2 / 2**20:.2f} / "
                  f"{rss / 2**20:.2f} GiB = {rss2 / rss:5.3f}x (target <= 1.10)")
            shutil.rmtree(out2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
