"""Writing one pipeline stage: every TP rank's shard filled together, each by its own thread."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..formats.safetensors import ShardWriter, shard_metadata
from ..layout.ranks import Layout, RankLayout, TensorSpec
from .materialize import Materializer, stream_region


def write_stage(
    layout: Layout, ranks: list[RankLayout], out_dir: Path, mat: Materializer, bar: Any
) -> dict[str, ShardWriter]:
    """Write the listed TP ranks of one stage together: each source tensor is read once and every
    rank's slice goes to that rank's writer thread. Returns the filled, uncommitted writers."""
    writers = {
        rank_layout.file: ShardWriter(
            out_dir / rank_layout.file, [(t.name, t.dtype, t.shape) for t in rank_layout.tensors],
            shard_metadata(layout, rank_layout),
            chunk_digest=layout.plan.chunk_digest,
        )
        for rank_layout in ranks
    }
    pools = {rank_layout.file: ThreadPoolExecutor(1, thread_name_prefix=f"shardc-w{rank_layout.rank}")
             for rank_layout in ranks}
    pending: list[tuple[int, list[Future]]] = []  # (bytes, the ranks' writes) per tensor in flight
    try:
        # every name any rank of the stage holds, in name order (each rank's file is in name order
        # too); a routed expert placed by expert parallelism is held by one rank only
        held = [{t.name: t for t in rank_layout.tensors} for rank_layout in ranks]
        order = stage_order(ranks)
        # in flight: at most two of the stage's largest tensors' worth of bytes (and always the
        # next one), so memory stays bounded while runs of small tensors (a routed expert's, held
        # by one rank each) keep every writer busy
        budget = 2 * max((t.nbytes for t in order), default=0)
        # the last use of each quantized tensor (its weight, then its scale): once every rank has
        # written it, its buffer goes back to the quantizer (each rank writes in order)
        last = {(t.source, t.quant): i for i, t in enumerate(order) if t.quant}
        for i, first in enumerate(order):
            name = first.name
            futures = []
            for rank_layout, h in zip(ranks, held, strict=True):
                spec = h.get(name)
                if spec is None:
                    continue
                # slicing + cast run on the writer threads too: the main thread only hands out
                # source views and quantized tensors, so the per-rank work spreads over the cores
                futures.append(pools[rank_layout.file].submit(_write_piece, writers[rank_layout.file],
                                                              mat.full(spec), spec, bar))
            if first.quant and last[(first.source, first.quant)] == i:
                _when_all(futures, functools.partial(mat.release, first))
            pending.append((first.nbytes, futures))
            while len(pending) > 1 and sum(n for n, _ in pending) > budget:
                for f in pending.pop(0)[1]:
                    f.result()
        for _, fs in pending:
            for f in fs:
                f.result()
        return writers
    except BaseException:
        for p in pools.values():
            p.shutdown(wait=True, cancel_futures=True)
        for w in writers.values():
            w.abort()
        raise
    finally:
        for p in pools.values():
            p.shutdown(wait=True)


def stage_order(ranks: list[RankLayout]) -> list[TensorSpec]:
    """Every tensor the ranks of a stage hold, once each, in name order (each rank's file is in
    name order too): a routed expert placed by expert parallelism is held by one rank only."""
    first: dict[str, TensorSpec] = {}
    for rank_layout in ranks:
        for t in rank_layout.tensors:
            first.setdefault(t.name, t)
    return [first[n] for n in sorted(first)]


def _when_all(futures: list[Future], fn: Callable[[], None]) -> None:
    """Call ``fn`` once every future is done (on the thread that finishes the last one)."""
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for f in futures:
        f.add_done_callback(done)


def _write_piece(writer: ShardWriter, full, spec: TensorSpec, bar: Any) -> None:
    stream_region(writer, full, spec)
    if spec.pad_rows:
        row = spec.nbytes // spec.shape[0]
        writer.write(bytes(spec.pad_rows * row))
    if bar is not None:
        bar.update(spec.nbytes)
