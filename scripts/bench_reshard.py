#!/usr/bin/env python3
"""Benchmark shardc reshard against shardc build of the same target, measured in the same run.

On a seeded synthetic checkpoint (Llama-like shapes, --layers N):
  reshard tp8pp1 -> TARGET wall time   vs  `shardc build TARGET` from the checkpoint (target <= 1.2x);
      the build baseline runs both with its source-hash cache warm (a rebuild) and cold (a first
      build, which hashes the source like reshard must hash its input)
  reshard peak RSS with 2N layers vs N layers                                      (target <= 1.10x)
  reshard from s3:// (moto on 127.0.0.1): bytes fetched vs the input build's bytes (target <= 1.05x)

--cpus N pins the timed children to N cores (os.sched_setaffinity): the reshard's extra work is
hashing its input, which runs on cores the build leaves idle, so the ratio falls as cores are added.

Every timed command is a child process (`python -m shardc.cli ...`), started alike: dirty pages
flushed, an empty destination, the inputs read into the page cache. Runs interleave, --repeat
times each, and medians are compared (this VM's speed drifts over minutes).

Example:     python scripts/bench_reshard.py --layers 4 --repeat 3
Quick smoke: python scripts/bench_reshard.py --small --repeat 1
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
sys.path.insert(0, str(ROOT / "tests"))

# make_synthetic.py options; kv heads = 8 = the input's tp: no KV replicas in the input
SHAPES = ["--hidden", "2048", "--intermediate", "5632", "--heads", "16", "--kv-heads", "8", "--vocab", "32000"]
SMALL = ["--hidden", "512", "--intermediate", "1536", "--heads", "8", "--kv-heads", "8", "--vocab", "8000"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


CPU: dict[str, list[float]] = {}  # kind -> CPU seconds (user + sys) of each timed child
CPUS: set[int] | None = None  # cores the timed children may run on (--cpus); None: all


def run(cmd: list[str], warm: list[Path], env: dict | None = None, kind: str = "") -> tuple[float, int, str]:
    """Wall seconds, peak RSS (KiB, ru_maxrss) and stdout of one child, after flushing dirty pages
    and reading ``warm`` into the page cache (its CPU seconds go to ``CPU[kind]``)."""
    subprocess.run(["sync"], check=True)
    time.sleep(0.5)
    for f in warm:
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        pin = (lambda: os.sched_setaffinity(0, CPUS)) if CPUS else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env or ENV, preexec_fn=pin)
        _, status, usage = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        CPU.setdefault(kind, []).append(usage.ru_utime + usage.ru_stime)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"command failed: {' '.join(cmd)}\n{err.read().decode()}")
        return dt, usage.ru_maxrss, out.read().decode()


def plan_file(d: Path, name: str, ckpt: Path, tp: int, pp: int, dtype: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(yaml.safe_dump({
        "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                          "gpus_per_replica": tp * pp},
        "model": {"source": str(ckpt)},
    }))
    return p


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardc.cli", *args]


def files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--target", default="4x2:bf16", help="TPxPP:dtype of the output [4x2:bf16]")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--cpus", type=int, help="pin the timed children to this many cores [all]")
    ap.add_argument("--dir", type=Path, help="work directory [a temporary one]")
    args = ap.parse_args()
    shapes = SMALL if args.small else SHAPES
    global CPUS
    if args.cpus:
        CPUS = set(sorted(os.sched_getaffinity(0))[: args.cpus])
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-reshard-"))
    work.mkdir(parents=True, exist_ok=True)
    degrees, dtype = args.target.split(":")
    tp, pp = map(int, degrees.split("x"))
    report: dict = {"shapes": " ".join(shapes), "layers": args.layers, "target": args.target,
                    "cpus": len(CPUS or os.sched_getaffinity(0))}
    try:
        # checkpoints are written by a child: this process stays small, because a child's
        # ru_maxrss starts from its parent's RSS at fork time
        ck = {}
        for n in (args.layers, 2 * args.layers):
            ck[n] = work / f"ck{n}"
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic.py"), str(ck[n]), "--layers",
                            str(n), "--files", "2", *shapes], check=True, env=ENV, stdout=subprocess.DEVNULL)
        ins = {}
        for n, c in ck.items():
            a = plan_file(work, f"in{n}", c, 8, 1, "bf16")
            subprocess.run(cli("build", str(a), "--out", str(work / f"in{n}"), "--manifests-dir",
                               str(work / "m"), "-q"), check=True, env=ENV)
            ins[n] = work / f"in{n}"
        n = args.layers
        target = plan_file(work, "target", ck[n], tp, pp, dtype)
        src_files = files(ck[n])
        in_bytes = sum(p.stat().st_size for p in files(ins[n]))
        report["input_bytes"] = in_bytes
        times: dict[str, list[float]] = {"build_warm_cache": [], "build_cold_cache": [], "reshard": []}
        rss: dict[str, list[int]] = {"build": [], "reshard": []}
        warm_cache = work / "hash-cache-warm"
        # a first build fills the warm hash cache
        subprocess.run(cli("build", str(target), "--out", str(work / "o"), "--manifests-dir", str(work / "m"),
                           "-q"), check=True, env={**ENV, "SHARDC_CACHE_DIR": str(warm_cache)})
        for i in range(args.repeat):
            for kind in ("build_warm_cache", "reshard", "build_cold_cache"):
                shutil.rmtree(work / "o", ignore_errors=True)
                if kind == "reshard":
                    cmd = cli("reshard", "--manifest", str(ins[n] / "manifest.json"), "--plan", str(target),
                              "--out", str(work / "o"), "--manifests-dir", str(work / "m"), "-q")
                    dt, peak, _ = run(cmd, files(ins[n]), kind=kind)
                    rss["reshard"].append(peak)
                else:
                    cache = warm_cache if kind == "build_warm_cache" else work / f"hash-cache-cold-{i}"
                    cmd = cli("build", str(target), "--out", str(work / "o"), "--manifests-dir",
                              str(work / "m"), "-q")
                    dt, peak, _ = run(cmd, src_files, {**ENV, "SHARDC_CACHE_DIR": str(cache)}, kind=kind)
                    rss["build"].append(peak)
                times[kind].append(dt)
                print(f"  run {i + 1} {kind:<17} {dt:6.2f} s  CPU {CPU[kind][-1]:5.2f} s  peak RSS "
                      f"{peak / 1024:7.1f} MiB  (load average {os.getloadavg()[0]:.1f})", flush=True)
        report["seconds"] = {k: med(v) for k, v in times.items()}
        report["cpu_seconds"] = {k: med(CPU[k]) for k in times}
        report["reshard_vs_build_warm_cache"] = med(times["reshard"]) / med(times["build_warm_cache"])
        report["reshard_vs_build_cold_cache"] = med(times["reshard"]) / med(times["build_cold_cache"])

        # peak RSS when the layer count doubles
        peaks = {}
        for layers in (n, 2 * n):
            ps = []
            for _ in range(args.repeat):
                shutil.rmtree(work / "o", ignore_errors=True)
                t = plan_file(work, f"target{layers}", ck[layers], tp, pp, dtype)
                _, peak, _ = run(cli("reshard", "--manifest", str(ins[layers] / "manifest.json"), "--plan",
                                     str(t), "--out", str(work / "o"), "--manifests-dir", str(work / "m"), "-q"),
                                 files(ins[layers]))
                ps.append(peak)
            peaks[layers] = med(ps)
            print(f"  reshard {layers} layers: peak RSS {peaks[layers] / 1024:.1f} MiB", flush=True)
        report["peak_rss_mib"] = {str(k): round(v / 1024, 1) for k, v in peaks.items()}
        report["peak_rss_2n_vs_n"] = peaks[2 * n] / peaks[n]

        if not args.no_s3:
            report["s3"] = bench_s3(work, ins[n], target)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    print(f"reshard / build (warm hash cache): {report['reshard_vs_build_warm_cache']:.2f}x   "
          f"reshard / build (cold hash cache): {report['reshard_vs_build_cold_cache']:.2f}x   (target <= 1.2x)")
    print(f"peak RSS 2N / N layers: {report['peak_rss_2n_vs_n']:.3f}x (target <= 1.10x)")
    if "s3" in report:
        print(f"s3 bytes fetched / input bytes: {report['s3']['fetched_vs_input']:.4f}x; "
              f"/ output bytes: {report['s3']['fetched_vs_output']:.4f}x (target <= 1.05x)")


def bench_s3(work: Path, inp: Path, target: Path) -> dict:
    """Push the input to moto, reshard from s3://, count the bytes fetched."""
    from s3server import S3Server

    from shardc.formats.manifest import load
    from shardc.store.push import push_build

    env = {**ENV, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "AWS_EC2_METADATA_DISABLED")})
    server = S3Server().start()
    try:
        server.client().create_bucket(Bucket="bench")
        push_build(inp / "manifest.json", "s3://bench/in", endpoint_url=server.endpoint)
        shutil.rmtree(work / "o", ignore_errors=True)
        dt, peak, out = run(cli("reshard", "--manifest", "s3://bench/in/manifest.json", "--plan", str(target),
                                "--out", str(work / "o"), "--manifests-dir", str(work / "m"), "--json",
                                "--endpoint-url", server.endpoint), [], env)
    finally:
        server.stop()
    summary = json.loads(out)
    m = load(inp / "manifest.json")
    input_bytes = m.total_bytes + sum(f.size for f in m.files)
    fetched = summary["input_bytes_fetched"]
    print(f"  reshard from s3: {dt:.2f} s, fetched {fetched} bytes for an input of {input_bytes}", flush=True)
    return {"seconds": dt, "bytes_fetched": fetched, "input_bytes": input_bytes,
            "output_bytes": summary["total_bytes"], "fetched_vs_input": fetched / input_bytes,
            "fetched_vs_output": fetched / summary["total_bytes"]}


if __name__ == "__main__":
    main()
