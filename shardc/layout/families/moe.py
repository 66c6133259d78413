"""Rows and reading shared by the mixture-of-experts families (mixtral.py, qwen_moe.py).

A routed expert is a gated MLP of its own; its three tensors carry the expert id (``Row.expert``),
so a plan with ``expert_parallel`` places them whole on one rank (``Moe.owner``), and without it
they split like a dense MLP over TP (gate/up by rows, down by columns: vLLM's default MoE layout).
The router is replicated and stays 16-bit; the experts' projections are quantizable like any
linear (per output channel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import ModelError
from .family import COLUMN, EXPERT_MLPS, REPLICATED, ROW, Row, count, refuse

if TYPE_CHECKING:
    from .family import ModelShape


def expert_rows(m: ModelShape, p: str, templates: tuple[str, str, str], experts: int, inter: int) -> list[Row]:
    """Every routed expert's gate, up (column) and down (row) of one layer, prefix ``p``."""
    h = m.hidden_size
    gate, up, down = templates
    rows = []
    for e in range(experts):
        rows += [Row(p + gate.format(e=e), (inter, h), COLUMN, True, expert=e),
                 Row(p + up.format(e=e), (inter, h), COLUMN, True, expert=e),
                 Row(p + down.format(e=e), (h, inter), ROW, True, expert=e)]
    return rows


def router_row(m: ModelShape, p: str, name: str, experts: int) -> Row:
    return Row(p + name, (experts, m.hidden_size), REPLICATED)


def read_routing(cfg: dict[str, Any], experts_key: str, top_k: int = 2) -> tuple[int, int]:
    """(experts, top_k), top_k within 1..experts (``top_k``: transformers' default for the family).
    ``experts_key`` is the transformers 4 spelling; transformers 5 writes ``num_local_experts`` for
    every MoE family, and both must agree."""
    experts = count(cfg, experts_key)
    if experts_key != "num_local_experts" and "num_local_experts" in cfg:
        new = count(cfg, "num_local_experts")
        if experts is not None and new != experts:
            raise refuse(experts_key, experts, f"disagrees with num_local_experts={new}")
        experts_key, experts = "num_local_experts", new
    if experts is None:
        raise refuse(experts_key, None, "must give the number of routed experts")
    layers = count(cfg, "num_hidden_layers") or 1  # every layer may route: bound them all
    if experts * layers > EXPERT_MLPS:
        raise ModelError(f"config.json {experts_key}={experts} in each of num_hidden_layers={layers} is "
                         f"{experts * layers} routed experts, above the limit of {EXPERT_MLPS}",
                         key=experts_key, hint=f"at most {EXPERT_MLPS} routed experts in all layers, far "
                         "above any published model's; pass the checkpoint's own config.json")
    top_k = count(cfg, "num_experts_per_tok", top_k)
    if top_k > experts:
        raise refuse("num_experts_per_tok", top_k, f"is more than {experts_key}={experts}")
    return experts, top_k


def flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refuse(key, value, "must be true or false")
    return value
