"""The quantizer that runs ahead of the writers: order, memory budget, buffer reuse, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardc.compiler.quantize import quantize, unpack_int8
from shardc.compiler.quantqueue import QuantQueue
from shardc.errors import QuantizationError

SHAPES = {"a": (64, 32), "b": (64, 32), "c": (16, 32), "d": (64, 32)}


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in SHAPES.items()}


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_results_equal_direct_quantization_and_buffers_are_reused(scheme):
    src = tensors()
    stats: dict[str, dict] = {}
    budget = 2 * 64 * 32  # two of the big tensors at a time
    queue = QuantQueue([(n, scheme) for n in src], src.__getitem__, stats, budget)
    try:
        for name, w in src.items():
            q, s = queue.get((name, scheme))
            q_ref, s_ref, st_ref = quantize(name, torch.from_numpy(w), scheme)
            if scheme == "int8":  # the queue hands out what the files hold: pack-quantized int32
                assert q.dtype == np.dtype("<i4") and q.shape == (w.shape[0], w.shape[1] // 4)
                q = unpack_int8(q)
            assert np.array_equal(q.view(np.uint8), q_ref.view(torch.uint8).numpy()), name
            assert np.array_equal(s, s_ref.numpy()), name
            assert stats[name] == st_ref
            queue.release((name, scheme))
        assert queue.peak_held <= budget
        # a and b need two buffers; c its own size; d reuses a's
        assert queue.allocations == 3
    finally:
        queue.close()


def test_budget_holds_the_quantizer_back_until_release(monkeypatch):
    """The quantizer parks on its condition for b (a holds the whole budget): observed, not
    slept for. A queue that ignored the budget would never park, and the wait below fails."""
    import threading
    import types

    from shardc.compiler import quantqueue

    parked = threading.Event()

    class SeenParking(threading.Condition):
        def wait(self, timeout=None):
            parked.set()
            return super().wait(timeout)

    monkeypatch.setattr(quantqueue, "threading",
                        types.SimpleNamespace(Condition=SeenParking, Thread=threading.Thread))
    src = tensors()
    done: list[str] = []

    def view(name: str) -> np.ndarray:
        done.append(name)
        return src[name]

    queue = QuantQueue([(n, "int8") for n in src], view, {}, budget=64 * 32)
    try:
        queue.get(("a", "int8"))
        assert parked.wait(30), "the quantizer never waited for room"
        with queue._cond:  # parked on it: nothing moves until a release
            assert done == ["a", "b"]  # b is mapped, but waits for room before it is quantized
            assert not queue._results[("b", "int8")].done()
            assert queue.peak_held == 64 * 32
        queue.release(("a", "int8"))
        for name in ("b", "c"):
            queue.get((name, "int8"))
            queue.release((name, "int8"))
        queue.get(("d", "int8"))
    finally:
        queue.close()


def test_a_tensor_larger_than_the_budget_is_still_produced_alone():
    src = tensors()
    queue = QuantQueue([("a", "fp8")], src.__getitem__, {}, budget=10)
    try:
        q, _ = queue.get(("a", "fp8"))
        assert q.shape == SHAPES["a"]
    finally:
        queue.close()


def test_nan_is_raised_to_the_consumer_for_that_tensor_and_the_rest():
    src = tensors()
    src["b"][3, 4] = np.nan
    queue = QuantQueue([(n, "int8") for n in src], src.__getitem__, {}, budget=1 << 20)
    try:
        queue.get(("a", "int8"))
        for name in ("b", "c"):
            with pytest.raises(QuantizationError, match="'b' holds NaN or Inf"):
                queue.get((name, "int8"))
    finally:
        queue.close()


def test_close_stops_a_queue_that_waits_for_room():
    src = tensors()
    queue = QuantQueue([(n, "int8") for n in src], src.__getitem__, {}, budget=64 * 32)
    queue.get(("a", "int8"))
    queue.close()  # b waits for room that never comes: close must not hang
    assert queue.peak_held == 64 * 32
