"""The quantizers' per-element work, compiled with numba into vectorized loops.

As chains of numpy ufuncs the fp8 cast alone took a dozen passes over each chunk and int8 half
a dozen. Here each step is one loop that LLVM vectorizes, so both schemes cost a few times less
per weight than numpy's or torch's casts did (figures: docs/performance.md §2).

The quantizing loops hold no reduction and run without fast-math: every operation is the IEEE
one numpy would do, on any vector width, so the results are byte-identical to the formulas of
docs/architecture.md §5 (tests check them against torch). The maxima are taken over float bits as
integers, which is exact and vectorizes. Only ``error_stats`` may reorder its float64 sums
(``reassoc``), and its figures are rounded to 4 digits for the manifest.

Compiled code is cached on disk (``cache=True``): only the first quantized build after an
install pays for compiling; later ones import numba and load the machine code.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_U32 = np.uint32
_F32 = np.float32
_ABS = _U32(0x7FFFFFFF)  # the bits of |x|: non-negative floats order as their bits, NaN above inf


def _jit(fn=None, **flags):
    """numba.njit, caching the machine code on disk where numba finds a writable place (next
    to this file, else $NUMBA_CACHE_DIR or the user's cache); elsewhere (a read-only install
    and home) it compiles in memory each run instead of failing."""
    if fn is None:
        return lambda f: _jit(f, **flags)
    options = {"nogil": True, "error_model": "numpy", **flags}
    try:
        return nb.njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return nb.njit(cache=False, **options)(fn)


@_jit
def scales(w, s, qmax):
    """s[r] = max |w[r, :]| / qmax for fp32 rows (1 for an all-zero row, NaN or inf for a row
    that holds one)."""
    n, k = w.shape
    for r in range(n):
        m = _U32(0)
        for j in range(k):
            m = max(m, _U32(_F32(w[r, j]).view(_U32) & _ABS))
        s[r, 0] = _scale(m, qmax)


@_jit
def bf16_scales(bits, w, s, qmax):
    """``scales`` for bf16 rows given as their uint16 bits, also writing them to ``w`` as fp32
    (exact: bf16 is the top half of an fp32), in the same pass."""
    n, k = bits.shape
    for r in range(n):
        m = _U32(0)
        for j in range(k):
            u = _U32(_U32(bits[r, j]) << _U32(16))
            w[r, j] = u.view(_F32)
            m = max(m, _U32(u & _ABS))
        s[r, 0] = _scale(m, qmax)


@_jit
def _scale(absmax_bits, qmax):
    sc = _F32(_U32(absmax_bits).view(_F32) / _F32(qmax))
    return _F32(1.0) if sc == 0 else sc


@_jit
def int8_rows(w, s, q, err):
    """q = clamp(round_half_even(w / s), +-127) and err = w - fp32(q * s), for fp32 rows ``w``
    with per-row scales ``s`` ([rows, 1])."""
    n, k = w.shape
    for r in range(n):
        sc = s[r, 0]
        for j in range(k):
            x = w[r, j]
            y = _F32(min(max(np.rint(_F32(x / sc)), _F32(-127.0)), _F32(127.0)))
            q[r, j] = np.int8(y)
            err[r, j] = _F32(x - _F32(y * sc))


@_jit
def fp8_rows(w, s, q, err):
    """q = the e4m3fn bytes of clamp(w / s, +-448), rounded to nearest even as torch's cast
    does, and err = |w| - fp32(|q| * s) (q has the sign of w, so that is |w - q * s|).

    The rounding is the FPU's: with m = 2^(e+20) for |y| in [2^e, 2^(e+1)), the ulp of m is
    e4m3's spacing at e, so (|y| + m) - m is |y| rounded once, half to even, to e4m3
    precision. e4m3's subnormals share the spacing 2^-9 of its lowest binade: hence e >= -6.
    That value times 2^-120 (exact) holds e4m3's exponent and mantissa in fp32 bits 26..20,
    subnormals included."""
    n, k = w.shape
    for r in range(n):
        sc = s[r, 0]
        for j in range(k):
            x = w[r, j]
            y = _F32(min(max(_F32(x / sc), _F32(-448.0)), _F32(448.0)))
            u = y.view(_U32)
            e = _U32(max(_U32(u & _U32(0x7F800000)), _U32((127 - 6) << 23)) + _U32(20 << 23))
            m = e.view(_F32)
            mag = _F32(_F32(abs(y) + m) - m)
            code = _U32(_F32(mag * _F32(2.0**-120)).view(_U32) >> _U32(20))
            q[r, j] = np.uint8(((u >> _U32(24)) & _U32(0x80)) | code)
            err[r, j] = _F32(abs(x) - _F32(mag * sc))


@_jit(fastmath={"reassoc"})
def error_stats(err, w, out):
    """out = [max |err|, sum of err^2, sum of w^2], the sums in float64 (no overflow)."""
    n, k = w.shape
    m = _U32(0)
    sse = 0.0
    ssq = 0.0
    for r in range(n):
        for j in range(k):
            e = err[r, j]
            x = np.float64(w[r, j])
            m = max(m, _U32(_F32(e).view(_U32) & _ABS))
            sse += np.float64(e) * np.float64(e)
            ssq += x * x
    out[0] = _U32(m).view(_F32)
    out[1] = sse
    out[2] = ssq
