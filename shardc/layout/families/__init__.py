"""The model families shardc compiles and runs: one module each, listed in ``FAMILIES``.

Adding a family is one new module here (its config reader, tensor table and forward, see
family.py) plus its tests; docs/architecture.md §8 lists what else one touches today.
"""

from __future__ import annotations

from . import (
    deepseek,
    deepseek_v32,
    gemma,
    glm4_moe,
    gpt_oss,
    granite,
    llama,
    minimax_m2,
    mixtral,
    phi3,
    qwen3,
    qwen3_5,
    qwen3_next,
    qwen_moe,
)
from .family import Family, Forward, Row

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, granite.FAMILY, phi3.FAMILY,
                                gemma.GEMMA2_FAMILY, gemma.GEMMA3_FAMILY, mixtral.FAMILY, qwen_moe.QWEN2_MOE,
                                qwen_moe.QWEN3_MOE, deepseek.FAMILY, gpt_oss.FAMILY,
                                minimax_m2.FAMILY, deepseek_v32.FAMILY, qwen3_next.FAMILY, glm4_moe.FAMILY,
                                qwen3_5.QWEN3_5, qwen3_5.QWEN3_5_MOE)

BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


__all__ = ["BY_ARCHITECTURE", "BY_NAME", "FAMILIES", "Family", "Forward", "Row"]
