"""compiler/quantize.py behaviours that mutation testing found unchecked, each against values derived
by hand here: the 16-bit dequantization rule (scale rounded to the dtype first), unpacking
pack-quantized int8 (the reshard of an int8 build reads it), the hint of the NaN error, tensors
of several row chunks on one thread or a pool, and the compressed-tensors config block."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

from shardc.compiler.quantize import (
    dequantize,
    pack_int8,
    quantization_config,
    quantize,
    quantize_array,
    unpack_int8,
)
from shardc.errors import QuantizationError

# q = [100, -5], scale 1 + 3 * 2^-9 = 1.005859375 (exact in fp32)
Q = torch.tensor([[100, -5]], dtype=torch.int8)
S = torch.tensor([[1.005859375]], dtype=torch.float32)


def test_dequantize_in_float32_is_the_exact_product():
    got = dequantize(Q, S)
    assert got.dtype == torch.float32
    assert got.tolist() == [[100.5859375, -5.029296875]]  # 100 * s, -5 * s: exact in fp32


@pytest.mark.parametrize(("dtype", "q", "scale", "want"), [
    # bf16 (7 fraction bits): s = 1.005859375 is 128.75 steps of 2^-7 -> 1.0078125.
    # 100 * 1.0078125 = 100.78125 -> nearest bf16 (step 0.5 in [64, 128)) is 101.0;
    # the unrounded scale would give 100.5859375 -> 100.5.
    # -5 * 1.0078125 = -5.0390625 -> step 2^-5 in [4, 8): 161.25 steps -> -5.03125.
    (torch.bfloat16, [[100, -5]], 1.005859375, [[101.0, -5.03125]]),
    # fp16 (10 fraction bits): s = 1 + 3 * 2^-12 is 0.75 of a step 2^-10 above 1 -> 1 + 2^-10.
    # 127 * (1 + 2^-10) = 127.1240234375 -> step 2^-4 in [64, 128): 2033.98 steps -> 127.125;
    # the unrounded scale would give 127.093017578125 -> 127.0625.
    (torch.float16, [[127, -1]], 1 + 3 * 2**-12, [[127.125, -(1 + 2**-10)]]),
])
def test_dequantize_to_16_bit_rounds_the_scale_first(dtype, q, scale, want):
    got = dequantize(torch.tensor(q, dtype=torch.int8), torch.tensor([[scale]], dtype=torch.float32), dtype)
    assert got.dtype == dtype
    assert got.float().tolist() == want


def _word(values: list[int]) -> int:
    """compressed-tensors' pack_to_int32 for 8 bits, by hand: value + 128 in byte i of the word."""
    w = sum((v + 128) << (8 * i) for i, v in enumerate(values))
    return w - (1 << 32) if w >= 1 << 31 else w  # as a signed int32


ROWS = [[-127, 0, 1, 127, -1, 5, 64, -64], [3, -3, 100, -100, 0, 0, 127, -127]]
WORDS = [[_word(r[:4]), _word(r[4:])] for r in ROWS]


def test_pack_int8_gives_the_hand_packed_words():
    got = pack_int8(np.array(ROWS, np.int8))
    assert got.dtype == np.dtype("<i4") and got.tolist() == WORDS


@pytest.mark.parametrize("order", ["<i4", ">i4"])
def test_unpack_int8_inverts_the_hand_packed_words(order):
    """Any int32 byte order in memory: the values are what counts."""
    got = unpack_int8(np.array(WORDS, order))
    assert got.dtype == np.int8
    assert got.tolist() == ROWS


def test_nonfinite_error_carries_its_hint():
    w = torch.ones(4, 8)
    w[2, 3] = float("nan")
    with pytest.raises(QuantizationError) as info:
        quantize("w.x", w, "int8", workers=1)
    assert info.value.one_line() == ("tensor 'w.x' holds NaN or Inf (first at index [2, 3]) "
                                     "(hint: the source checkpoint is damaged; re-download or re-export it)")


@pytest.mark.parametrize(("q", "got"), [
    (np.zeros((2, 8), np.uint8), "uint8[2, 8]"),  # not int8
    (np.zeros((2, 4), np.int16), "int16[2, 4]"),
    (np.zeros(8, np.int8), "int8[8]"),  # not 2-D
    (np.zeros((2, 4, 4), np.int8), "int8[2, 4, 4]"),
    (np.zeros((2, 6), np.int8), "int8[2, 6]"),  # in % 4 != 0
    (np.zeros((2, 16), np.int8)[:, :8], "int8[2, 8]"),  # rows not contiguous
])
def test_pack_int8_refuses_what_it_cannot_pack_and_leaves_it_alone(q, got):
    before = q.copy()
    with pytest.raises(ValueError, match=r"^pack_int8 needs a C-contiguous int8 \[out, in\] with "
                                         rf"in % 4 == 0, got {re.escape(got)}$"):
        pack_int8(q)
    assert np.array_equal(q, before)  # packing works in place: a refusal must not have started


def test_a_one_element_weight_on_a_fresh_thread():
    """The per-thread buffers start empty: the first request, however small, allocates them."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(quantize_array("w", np.float32([[0.5]]), "int8", 1)))
    t.start()
    t.join()
    q, s, _ = out[0]
    assert q.tolist() == [[127]] and s.tolist() == [[np.float32(0.5) / np.float32(127)]]


def _ref_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """docs/architecture.md §5 in numpy: scale = absmax/127 in fp32 (1 for a zero row), q =
    clamp(round half to even(w / scale), ±127)."""
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    scale[scale == 0] = 1
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tensor_of_several_row_chunks(workers):
    """600 x 1000 fp32 is 2.3 chunks of 2^18 elements (262 rows each): every row quantized once,
    the statistics over the whole tensor, on one thread or a pool."""
    w = np.random.default_rng(3).standard_normal((600, 1000)).astype(np.float32)
    w[599] *= 50  # the last, partial chunk holds the largest error
    q, s, stats = quantize_array("w", w, "int8", workers)
    q_ref, s_ref = _ref_int8(w)
    assert np.array_equal(q, q_ref) and np.array_equal(s, s_ref)
    err = w.astype(np.float64) - (q_ref.astype(np.float32) * s_ref).astype(np.float64)
    assert stats["max_abs_err"] == pytest.approx(np.abs(err).max(), rel=1e-3)
    assert stats["rel_rms_err"] == pytest.approx(np.sqrt((err ** 2).sum() / (w.astype(np.float64) ** 2).sum()),
                                                 rel=1e-3)


def test_an_all_zero_weight_has_zero_error():
    q, s, stats = quantize_array("w", np.zeros((3, 8), np.float32), "fp8", 1)
    assert not q.view(np.uint8).any() and s.tolist() == [[1.0]] * 3
    assert stats == {"max_abs_err": 0.0, "rel_rms_err": 0.0}


def test_unknown_scheme_is_one_line_with_its_hint():
    with pytest.raises(QuantizationError) as info:
        quantize_array("w", np.ones((2, 4), np.float32), "int4")
    assert info.value.one_line() == "unknown scheme 'int4' (hint: int8 or fp8)"


@pytest.mark.parametrize(("scheme", "kind", "fmt"), [("int8", "int", "pack-quantized"),
                                                      ("fp8", "float", "float-quantized")])
def test_quantization_config_block_written_out(scheme, kind, fmt):
    """compressed-tensors' weight-only, per-channel, symmetric 8-bit scheme, key by key."""
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None}
    assert quantization_config(scheme, ["lm_head", "a.b"]) == {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["a.b", "lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
