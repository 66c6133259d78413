"""Greedy decode scored by teacher forcing: scripts/gpu_check.py's decode check (issue #41, item 10).

Why not token equality with transformers' own ``generate``: on random weights the top logits are
near-ties, so two correct bf16 implementations that round differently pick different tokens at
some step, and from there on they decode different texts (on an H200, transformers' CUDA SDPA path
left its own eager path, shardc's CUDA and CPU decode after 6 tokens; the 8B-shaped run agreed on 1
of 128). Equality then measures luck, not correctness.

Teacher forcing asks one question per generated position instead: given shardc's own prefix, is
shardc's token the reference's choice? The reference (transformers) runs ONE forward over the
prompt and shardc's tokens, and for every position, with ``top`` its largest logit there:

  exact     shardc's token is an argmax of the reference's logits (a tie at the top counts);
  near-tie  its logit is below ``top`` by at most the margin: NEAR_TIE_ULPS units in the last place
            of bfloat16 at the row's largest logit magnitude;
  mismatch  anything else, or a row that is not finite: a real difference, which fails the check.

The margin. bfloat16 keeps 8 significant bits, so one ulp at a magnitude m in [2^e, 2^(e+1)) is
2^(e-7), 1/128 to 1/256 of m. Two bf16 implementations of the same forward differ in the logits by
a few of those: each logit is rounded to bf16 on the way out of the lm_head (half an ulp each, so a
gap between two logits is uncertain by one ulp), the lm_head's fp32 accumulation order differs
between kernels (cuBLAS's split-K against shardc's matmul: about one more after rounding), and the
final normed hidden state entering it is itself a bf16 value each side rounds after its own
residual stream, which moves every logit by a relative 2^-9 or so of the row's scale (one to two
ulps more). NEAR_TIE_ULPS = 4 covers those and stays well below a real fault: a wrong weight, head
or rotary angle moves logits by a sizeable fraction of the row's scale (tens of these ulps and
more), and a shifted or stale KV position changes the argmax outright. The gap of every near-tie is reported in
ulps, so a run that needs all 4 is visible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NEAR_TIE_ULPS = 4
BF16_FRACTION_BITS = 7  # bfloat16: 1 implicit + 7 stored significand bits


def bf16_ulp(magnitude: float) -> float:
    """One unit in the last place of bfloat16 at ``magnitude`` (the spacing of bf16 values there)."""
    m = abs(float(magnitude))
    if not math.isfinite(m):
        raise ValueError(f"no bf16 ulp at {magnitude}")
    e = max(math.frexp(m)[1] - 1, -126) if m else -126  # 2^e <= m < 2^(e+1); subnormals as the smallest normal
    return 2.0 ** (e - BF16_FRACTION_BITS)


@dataclass(frozen=True)
class Mismatch:
    """A position where shardc's token is not the reference's choice, nor within the margin."""

    position: int  # index among the generated tokens
    ours: int
    theirs: int  # the reference's argmax
    gap: float  # reference logit of its argmax minus that of ours (nan: the row is not finite)
    margin: float

    def text(self) -> str:
        return (f"token {self.position}: shardc {self.ours}, transformers {self.theirs}, logit gap {self.gap:.4g} > "
                f"margin {self.margin:.4g}")


@dataclass(frozen=True)
class DecodeScore:
    """Every generated position, scored by the reference's teacher-forced logits."""

    tokens: int
    exact: int
    near_tie: int
    mismatches: tuple[Mismatch, ...]
    ulps: int  # the margin, in bf16 ulps at each row's largest logit magnitude
    worst_near_tie_ulps: float  # the largest near-tie gap, in those ulps (0.0 when there is none)
    margins: tuple[float, float]  # the smallest and largest margin of any row, in logits

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def line(self) -> str:
        """One line for the log: the counts and the margin."""
        return (f"{self.tokens} greedy tokens scored by teacher forcing: {self.exact} transformers' argmax, "
                f"{self.near_tie} near-ties within {self.ulps} bf16 ulps of the top logit (margin "
                f"{self.margins[0]:.4g}-{self.margins[1]:.4g} in logits; largest gap "
                f"{self.worst_near_tie_ulps:.2f} ulps), {len(self.mismatches)} real mismatch(es)")

    def failure(self) -> str:
        """Why the check failed: the first few mismatches."""
        shown = "; ".join(m.text() for m in self.mismatches[:5])
        more = f" (and {len(self.mismatches) - 5} more)" if len(self.mismatches) > 5 else ""
        return f"{len(self.mismatches)} of {self.tokens} tokens are not transformers' choice: {shown}{more}"

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "exact": self.exact, "near_tie": self.near_tie,
                "mismatch": len(self.mismatches), "margin_bf16_ulps": self.ulps,
                "worst_near_tie_ulps": self.worst_near_tie_ulps, "margins": list(self.margins),
                "mismatches": [m.__dict__ for m in self.mismatches[:20]]}


def score_tokens(tokens: Sequence[int], logits: Any, ulps: int = NEAR_TIE_ULPS) -> DecodeScore:
    """Score ``tokens`` (shardc's greedy output) against ``logits``: row i is the reference's logits
    at the position that chose ``tokens[i]``, computed on the prompt and ``tokens[:i]`` (teacher
    forcing), shape (len(tokens), vocab). Any float array (a CPU torch tensor or numpy)."""
    rows = np.asarray(logits, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] != len(tokens):
        raise ValueError(f"need one row of logits per token: {len(tokens)} tokens, logits of shape {rows.shape}")
    exact = near = 0
    worst = 0.0
    bad: list[Mismatch] = []
    margins: list[float] = []
    for i, tok in enumerate(tokens):
        row = rows[i]
        if not 0 <= tok < row.shape[0]:
            raise ValueError(f"token {i} is {tok}, outside the vocabulary of {row.shape[0]}")
        theirs = int(np.argmax(row))
        if not np.isfinite(row).all():
            bad.append(Mismatch(i, int(tok), theirs, math.nan, math.nan))
            continue
        ulp = bf16_ulp(float(np.abs(row).max()))
        margins.append(ulps * ulp)
        gap = float(row[theirs] - row[tok])
        if gap <= 0.0:
            exact += 1
        elif gap <= ulps * ulp:
            near += 1
            worst = max(worst, gap / ulp)
        else:
            bad.append(Mismatch(i, int(tok), theirs, gap, ulps * ulp))
    return DecodeScore(len(tokens), exact, near, tuple(bad), ulps, worst,
                       (min(margins), max(margins)) if margins else (0.0, 0.0))
