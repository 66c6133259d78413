"""Quantize ahead of the writers, within a memory budget, reusing the output buffers.

A quantized build is CPU-bound while it quantizes and disk-bound while it streams the big 16-bit
tensors (embeddings, lm_head). A background thread quantizes the weights in file order, as far
ahead of the writers as ``budget`` bytes of quantized output allow, so that work overlaps the
16-bit streaming instead of following it. (How far ahead matters little within that budget:
docs/performance.md §2.)

Output buffers go back to a pool when the writers are done with a tensor, and the next tensor
of that size reuses them: zeroing a fresh buffer's pages costs about as much CPU as quantizing
into it (docs/performance.md §2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from .quantize import quantize_array, stored

Key = tuple[str, str]  # (source tensor name, scheme)


class QuantQueue:
    """Quantizes ``keys`` in order on one background thread; ``get`` waits for a result and
    ``release`` hands its memory back. At most ``budget`` bytes of results are held at a time
    (a single result larger than the budget is still produced, alone)."""

    def __init__(
        self,
        keys: list[Key],
        view: Callable[[str], np.ndarray],
        stats: dict[str, dict],
        budget: int,
        workers: int = 1,
    ) -> None:
        self._keys, self._view, self._stats, self._budget = list(dict.fromkeys(keys)), view, stats, budget
        self._workers = workers
        self._results: dict[Key, Future] = {k: Future() for k in self._keys}
        self._cond = threading.Condition()
        self._held = 0  # bytes of results handed out or waiting to be
        self._pool: dict[int, list[np.ndarray]] = {}  # spare output buffers (uint8) by size
        self._buffers: dict[Key, np.ndarray] = {}
        self._closed = False
        self.peak_held = 0  # the most result bytes held at once (for tests and benchmarks)
        self.allocations = 0  # output buffers allocated fresh rather than reused
        self._thread = threading.Thread(target=self._run, name="shardc-quant", daemon=True)
        self._thread.start()

    def get(self, key: Key) -> tuple[np.ndarray, np.ndarray]:
        """Quantized values and scales of ``key`` (raises what quantizing it raised)."""
        return self._results[key].result()

    def release(self, key: Key) -> None:
        """The writers are done with ``key``: its buffer may be reused."""
        with self._cond:
            buf = self._buffers.pop(key, None)
            if buf is None:
                return
            self._held -= buf.size
            self._pool.setdefault(buf.size, []).append(buf)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop quantizing (after the current tensor) and drop the pooled buffers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._pool.clear()

    def _run(self) -> None:
        try:
            for key in self._keys:
                name, scheme = key
                w = self._view(name)
                buf = self._reserve(key, w.size)  # one byte per quantized weight
                if buf is None:  # closed
                    break
                try:
                    q, scale, self._stats[name] = quantize_array(name, w, scheme, self._workers, out=buf)
                    q = stored(q, scheme)  # int8: packed in place, as the files hold it
                finally:
                    del w  # unmap the source tensor now: RSS stays bounded
                self._results[key].set_result((q, scale))
        except BaseException as exc:  # noqa: BLE001 - NaN in the source: whoever waits raises it
            for fut in self._results.values():
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            for fut in self._results.values():
                fut.cancel()  # closed early: nobody waits for these

    def _reserve(self, key: Key, nbytes: int) -> np.ndarray | None:
        """An output buffer of ``nbytes`` for ``key`` once the budget allows (None if closed)."""
        with self._cond:
            while not self._closed and self._held and self._held + nbytes > self._budget:
                self._cond.wait()
            if self._closed:
                return None
            spares = self._pool.get(nbytes)
            buf = spares.pop() if spares else None
            # spare buffers of other sizes count against the budget too: drop some if need be
            sizes = [size for size, bs in self._pool.items() for _ in bs]
            while sizes and self._held + nbytes + sum(sizes) > self._budget:
                size = sizes.pop()
                self._pool[size].pop()
            self._pool = {size: bs for size, bs in self._pool.items() if bs}
            self._held += nbytes
            self.peak_held = max(self.peak_held, self._held)
            if buf is None:
                self.allocations += 1
                buf = np.empty(nbytes, np.uint8)
            self._buffers[key] = buf
        return buf
