#!/usr/bin/env python
"""Benchmark shardc push/pull against plain boto3 upload_file/download_file, same files, same run.

A synthetic checkpoint is built into shards, a moto S3 server is started on 127.0.0.1 (in its own
process, so it does not share the client's GIL), and each round measures, in alternating order:

  baseline push: boto3 ``upload_file`` of every file of the build (one after another)
  shardc push:   ``push_build`` (hash check against the manifest, SHA-256 part checksums, metadata,
                 HEAD checks, manifest last)
  baseline pull: boto3 ``download_file`` of every file
  shardc pull:   ``pull_build --all`` (streamed sha256 of every byte, atomic rename, verify)

Both sides use the same TransferConfig (threshold, part size, concurrency). Reported: MB/s per side
and the ratio shardc/baseline (target >= 0.9), from the best round of each side and from the medians.
Every phase starts after os.sync(), so no side pays for dirty pages another phase left behind.

  python scripts/bench_store.py                                   # small, < 2 minutes
  python scripts/bench_store.py --llama3-70b-shapes --layers 2    # the real figure (~7.6 GB x2)
  python scripts/bench_store.py --zstd                            # zstd ratio/speed on bf16/int8/fp8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardc.store import S3Settings, pull_build, push_build  # noqa: E402

SMALL = dict(hidden_size=1024, intermediate_size=4096, num_heads=8, num_kv_heads=4, vocab_size=32000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int, tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}  # moto spills large objects to temp files
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from moto.server import main; main(sys.argv[1:])",
         "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def make_build(work: Path, args: argparse.Namespace, dtype: str, tp: int, pp: int) -> Any:
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import LLAMA3_70B_SHAPES, llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    shapes = LLAMA3_70B_SHAPES if args.llama3_70b_shapes else SMALL
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        t = time.perf_counter()
        write_checkpoint(ckpt, llama_config(num_layers=args.layers, **shapes), seed=0)
        print(f"checkpoint: {time.perf_counter() - t:.1f}s", file=sys.stderr)
    name = f"bench-{dtype}-tp{tp}pp{pp}"
    plan = plan_from_dict({
        "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                          "gpus_per_replica": tp * pp},
        "model": {"source": str(ckpt)},
    })
    t = time.perf_counter()
    res = build(plan, out_dir=work / name)
    print(f"build {name}: {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return res


def files_of(manifest: dict[str, Any]) -> list[str]:
    return [f["name"] for f in manifest["files"]] + [s["file"] for s in manifest["shards"]]


def clear_prefix(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents") or []]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs})


def bench_transfer(args: argparse.Namespace) -> dict[str, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    work = Path(args.work or tempfile.mkdtemp(prefix="shardc-bench-store-", dir=ROOT / ".cache"
                                               if (ROOT / ".cache").is_dir() else None))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    tp, pp = (4, 2) if args.llama3_70b_shapes else (2, 2)
    res = make_build(work, args, "bf16", args.tp or tp, args.pp or pp)
    names = files_of(res.manifest)
    total = sum((res.out_dir / n).stat().st_size for n in names) + res.manifest_path.stat().st_size

    port = free_port()
    moto_tmp = work / "moto-tmp"
    moto_tmp.mkdir(exist_ok=True)
    server = start_moto(port, moto_tmp)
    endpoint = f"http://127.0.0.1:{port}"
    settings = S3Settings.from_env()
    tconf = TransferConfig(multipart_threshold=settings.multipart_threshold,
                           multipart_chunksize=settings.multipart_chunksize,
                           max_concurrency=settings.max_concurrency, preferred_transfer_client="classic")
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    times: dict[str, list[float]] = {"base_push": [], "ours_push": [], "base_pull": [], "ours_pull": []}
    try:
        for rep in range(args.repeat):
            order = ("base", "ours") if rep % 2 == 0 else ("ours", "base")
            for side in order:
                prefix, dl = f"{side}-{rep}", work / f"dl-{side}-{rep}"
                os.sync()  # no dirty pages of an earlier phase (or of moto's storage) left to pay
                t = time.perf_counter()
                if side == "base":  # a plain script makes its client too, as push_build does
                    base = boto3.client("s3", endpoint_url=endpoint)
                    for n in names + ["manifest.json"]:
                        base.upload_file(str(res.out_dir / n), "bench", f"{prefix}/{n}", Config=tconf)
                else:
                    push_build(res.manifest_path, f"s3://bench/{prefix}", endpoint_url=endpoint,
                               settings=settings)
                times[f"{side}_push"].append(time.perf_counter() - t)
                os.sync()
                t = time.perf_counter()
                if side == "base":
                    dl.mkdir()
                    base = boto3.client("s3", endpoint_url=endpoint)
                    for n in names + ["manifest.json"]:
                        base.download_file("bench", f"{prefix}/{n}", str(dl / n), Config=tconf)
                else:
                    out = pull_build(f"s3://bench/{prefix}/manifest.json", dl, endpoint_url=endpoint,
                                     settings=settings)
                    assert out.verify.ok
                times[f"{side}_pull"].append(time.perf_counter() - t)
                shutil.rmtree(dl)
                clear_prefix(client, "bench", prefix)
                print(f"round {rep} {side}: push {times[f'{side}_push'][-1]:.2f}s "
                      f"pull {times[f'{side}_pull'][-1]:.2f}s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    mbps = {k: total / 1e6 / min(v) for k, v in times.items()}
    med = {k: total / 1e6 / statistics.median(v) for k, v in times.items()}
    return {
        "shapes": "llama3-70b" if args.llama3_70b_shapes else "small",
        "layers": args.layers, "tp": args.tp or tp, "pp": args.pp or pp, "bytes": total,
        "files": len(names) + 1,
        "settings": {"multipart_threshold": settings.multipart_threshold,
                     "multipart_chunksize": settings.multipart_chunksize,
                     "max_concurrency": settings.max_concurrency},
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "MBps_best": {k: round(v, 1) for k, v in mbps.items()},
        "MBps_median": {k: round(v, 1) for k, v in med.items()},
        "ratio_push": round(mbps["ours_push"] / mbps["base_push"], 3),
        "ratio_pull": round(mbps["ours_pull"] / mbps["base_pull"], 3),
        "ratio_push_median": round(med["ours_push"] / med["base_push"], 3),
        "ratio_pull_median": round(med["ours_pull"] / med["base_pull"], 3),
        "target": 0.9,
    }


def _zstd_row(label: str, data: bytes | memoryview, levels: list[int]) -> list[dict[str, Any]]:
    import zstandard

    rows = []
    n = len(data)
    t = time.perf_counter()
    hashlib.sha256(data).digest()
    sha_mbps = n / 1e6 / (time.perf_counter() - t)
    for level in levels:
        for threads in (0, -1):
            c = zstandard.ZstdCompressor(level=level, threads=threads)
            t = time.perf_counter()
            out = c.compress(data)
            ct = time.perf_counter() - t
            t = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(out)
            dt = time.perf_counter() - t
            rows.append({"data": label, "level": level, "threads": "all" if threads else 1,
                         "MB": round(n / 1e6, 1), "ratio": round(len(out) / n, 3),
                         "compress_MBps": round(n / 1e6 / ct), "decompress_MBps": round(n / 1e6 / dt),
                         "sha256_MBps": round(sha_mbps)})
    return rows


def bench_zstd(args: argparse.Namespace) -> dict[str, Any]:
    """zstd on real shards of a bf16, int8 and fp8 build, and on tensors made with torch directly."""
    import torch

    levels = [1, 3]
    work = Path(tempfile.mkdtemp(prefix="shardc-bench-zstd-"))
    rows: list[dict[str, Any]] = []
    try:
        for dtype in ("bf16", "int8", "fp8"):
            res = make_build(work, args, dtype, 2, 1)
            shard = res.out_dir / res.manifest["shards"][0]["file"]
            rows += _zstd_row(f"{dtype} shard ({shard.name})", shard.read_bytes(), levels)
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4096, 4096, generator=g) * 0.02
        q8 = torch.clamp(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)), -127, 127).to(torch.int8)
        f8 = torch.clamp(w / (w.abs().amax(1, keepdim=True) / 448), -448, 448).to(torch.float8_e4m3fn)
        for label, t in (("bf16 tensor 4096x4096", w.to(torch.bfloat16)), ("int8 tensor", q8),
                         ("fp8 e4m3 tensor", f8)):
            rows += _zstd_row(label, t.contiguous().view(torch.uint8).numpy().tobytes(), levels)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"zstd": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama3-70b-shapes", action="store_true", help="real Llama-3-70B tensor shapes")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--tp", type=int, help="TP degree (default 2, or 4 with --llama3-70b-shapes)")
    ap.add_argument("--pp", type=int, help="PP degree (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best of each side counts")
    ap.add_argument("--work", help="work directory (default: a temp dir, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--zstd", action="store_true", help="measure zstd instead of transfers")
    args = ap.parse_args()
    result = bench_zstd(args) if args.zstd else bench_transfer(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
