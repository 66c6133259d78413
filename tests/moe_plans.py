"""The plan the mixture-of-experts tests build (test_family_moe, _deepseek, _gpt_oss, and the
MXFP4 sources): tp, expert parallelism, attention data parallelism and pp over one source, named
after what it asks for."""

from __future__ import annotations

from pathlib import Path

from shardc.layout.plan import Plan, plan_from_dict


def moe_plan(src: Path, tp: int, ep: bool = False, dtype: str = "bf16", name: str | None = None,
             dp: int = 1, pp: int = 1) -> Plan:
    rg = {"name": name or f"{src.name}-tp{tp}{f'-dp{dp}' if dp > 1 else ''}{f'-pp{pp}' if pp > 1 else ''}"
                          f"{'-ep' if ep else ''}-{dtype}",
          "tp_degree": tp, "pp_degree": pp, "dtype": dtype, "gpus_per_replica": tp * dp * pp}
    if ep:
        rg["expert_parallel"] = True
    if dp > 1:
        rg["dp_degree"] = dp
    return plan_from_dict({"replica_group": rg, "model": {"source": str(src)}})
