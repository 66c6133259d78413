#!/usr/bin/env python3
"""Benchmark shardc build and verify against plain-tool baselines measured in the same run.

On a synthetic checkpoint with real Llama-3-70B tensor shapes (embeddings, lm_head, N layers):
  build  (fp16 / int8 / fp8, tp4pp2) wall time     vs  `cp -r` of the same source   (target <= 1.5x)
  build peak RSS with 2N layers vs N layers                                          (target <= 1.10x)
  verify --all                                      vs  `sha256sum` over the shards  (target <= 0.6x)
  verify --rank 0                                   vs  `sha256sum` of that one file (target <= 1.1x)

Every timed command starts alike: dirty pages flushed, the source read into the page cache, an
empty destination. cp and each build run --repeat times (default 3) and medians are compared;
the cp baseline is re-measured next to each dtype because this VM's speed drifts over minutes.

Example (needs ~30 GB free disk, ~10 min):  python scripts/bench_build.py --layers 2
Quick smoke run on small shapes:            python scripts/bench_build.py --small --repeat 1
"""

from __future__ import annotations

import argparse
import functools
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

from shardc.synthetic import LLAMA3_70B_SHAPES, llama_config, write_checkpoint  # noqa: E402


def run(cmd: list[str], warm: list[Path] = ()) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB, as the kernel reports ru_maxrss) of one child process.

    Before it: dirty pages are flushed and the ``warm`` files read, so every command, cp or
    shardc, starts from the same state (source in the page cache, nothing left to write back).
    """
    subprocess.run(["sync"], check=True)
    for f in warm:
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass
    time.sleep(1)  # let discards and writeback of earlier deletions settle
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) not in (0,):
        raise SystemExit(f"command failed: {' '.join(cmd)}")
    return dt, usage.ru_maxrss


def repeat(n: int, cmd: list[str], warm: list[Path], after) -> tuple[list[float], int]:
    """``n`` timed runs of ``cmd`` (``after`` cleans up between them): the times, and the peak RSS."""
    times, rss = [], 0
    for _ in range(n):
        dt, r = run(cmd, warm)
        times.append(dt)
        rss = max(rss, r)
        after()
    return times, rss


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
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
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

        warm = sorted(src.iterdir())
        cp_dst = tmp / "cp"

        def rm_cp() -> None:
            shutil.rmtree(cp_dst)

        # Source sha256s are cached across builds (path, size, mtime, inode): the first build of a
        # checkpoint hashes it ("cold"), later plans from the same checkpoint do not ("warm").
        os.environ["SHARDC_CACHE_DIR"] = str(tmp / "hash-cache")
        for i, dtype in enumerate(a.dtypes.split(",")):
            # Baseline next to each dtype's builds (this VM's speed drifts over minutes): `cp -r`
            # into a new directory, and the durable `cp -r && sync` (shardc fsyncs every shard,
            # DESIGN §4; cp leaves its writes in the page cache).
            cp_t, _ = repeat(a.repeat, ["cp", "-r", str(src), str(cp_dst)], warm, rm_cp)
            cps_t, _ = repeat(a.repeat, ["sh", "-c", f"cp -r '{src}' '{cp_dst}' && sync"], warm, rm_cp)
            cp_s, cps_s = statistics.median(cp_t), statistics.median(cps_t)
            print(f"[{dtype}] cp -r                 {spread(cp_t)}")
            print(f"[{dtype}] cp -r && sync         {spread(cps_t)}")
            results.update({f"cp_seconds_{dtype}": cp_s, f"cp_sync_seconds_{dtype}": cps_s})
            pf = plan_file(tmp, dtype)
            out = tmp / f"out-{dtype}"
            # like cp -r, every timed build writes into an empty directory: deleting old shards
            # is the filesystem's cost (0.4 s per GB with `discard`), not the build's
            cmd = shardc + ["build", str(pf), "--out", str(out), "--manifests-dir", str(tmp / "m"),
                            "--quiet", "--source", str(src)]
            if i == 0:
                dt, rss = run(cmd, warm)
                results[f"build_{dtype}_cold_seconds"] = dt
                results[f"build_{dtype}_cold_ratio_vs_cp"] = dt / cp_s
                print(f"[{dtype}] build tp4pp2, cold    {dt:6.2f} s  {dt / cp_s:5.2f}x cp -r  "
                      f"{dt / cps_s:5.2f}x cp+sync   (hashes the source too; later builds reuse it)")
                shutil.rmtree(out)
            bt, rss = repeat(a.repeat, cmd, warm, functools.partial(shutil.rmtree, out))
            dt = statistics.median(bt)
            results.update({f"build_{dtype}_seconds": dt, f"build_{dtype}_ratio_vs_cp": dt / cp_s,
                            f"build_{dtype}_ratio_vs_cp_sync": dt / cps_s})
            print(f"[{dtype}] build tp4pp2          {spread(bt)}")
            print(f"[{dtype}]   = {dt / cp_s:.2f}x cp -r (target <= 1.5), {dt / cps_s:.2f}x cp -r && sync;"
                  f" peak RSS {rss / 2**20:.2f} GiB")
            # one more build, kept for the verify timings
            run(cmd, warm)
            if i == 0:
                files = sorted(out.glob("*.safetensors"))
                sha_all, _ = run(["sha256sum", *map(str, files)])
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
            _, rss2 = run(shardc + ["build", str(pf), "--out", str(out2), "--manifests-dir",
                                    str(tmp / "m"), "--quiet", "--source", str(srcs[2 * a.layers])])
            results[f"rss_{dtype}_gib"] = rss / 2**20
            results[f"rss_{dtype}_2x_layers_ratio"] = rss2 / rss
            print(f"[{dtype}] peak RSS {2 * a.layers} vs {a.layers} layers  {rss2 / 2**20:.2f} / "
                  f"{rss / 2**20:.2f} GiB = {rss2 / rss:5.3f}x (target <= 1.10)")
            shutil.rmtree(out2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
