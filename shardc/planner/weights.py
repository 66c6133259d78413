"""Weights per GPU from the Layout, and the plan files the planner asks the Layout about.

Every family is sized the same way: the bytes each rank holds are the ``TensorSpec`` records the
Layout lists for a plan, the records ``shardc build`` writes, so the planner cannot disagree with
the shards about replicated norms, KV-head replicas, vocabulary padding, quantization scales, MLA's
replicated low-rank projections (DeepSeek-V3's ``q_a_proj`` / ``kv_a_proj_with_mqa``) or a router
kept in fp32. Asking for the full Layout of every candidate would list 61 x 800 tensors for
DeepSeek-V3; a probe model with one layer of each kind per stage answers the same question.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ..layout.model import ModelSpec
from ..layout.plan import (
    DEFAULT_IGNORE,
    DEFAULT_SHARD_PREFIX,
    DP_SHARD_PREFIX,
    QUANTIZED_DTYPES,
    Plan,
)
from ..layout.ranks import build_layout, check_degrees, stage_ranges
from ..layout.tensors import STACKED, layer_of, tensor_table


@dataclass(frozen=True)
class RankWeights:
    """One GPU's weights as the Layout lists them."""

    tp_rank: int
    pp_stage: int
    layers: tuple[int, int]
    nbytes: int  # stored bytes: quantized weights + float32 scales + 16-bit rest
    read_bytes: int  # streamed from HBM per decode step (all but the embedding-row lookup)
    linear_params: int  # matmul weight elements: 2 FLOPs each per token
    kv_heads: int  # KV heads this rank holds (one replicated head when tp > kv_heads)
    expert_bytes: int = 0  # routed MoE experts among nbytes: a decode step reads only those routed to


# The family options that list, per layer, something that decides the layer's tensors: routed
# experts or a dense MLP (DeepSeek-V3's first_k_dense_replace, Qwen2-MoE's decoder_sparse_step),
# whether the layer runs its own DSA indexer (GLM-5.x's indexer_types), and linear or full
# attention (Qwen3-Next's layer_types). A family adding such an option lists it here
# (tests/planner/test_planner.py test_probe_layout_equals_full_layout holds the bytes to the Layout's)
PER_LAYER = ("sparse", "indexed", "linear")


def layer_kinds(model: ModelSpec) -> tuple[Any, ...]:
    """Per layer, what decides its tensors: the values of the family's ``PER_LAYER`` options for that
    layer (one kind for every layer of a family without any)."""
    keys = [k for k in PER_LAYER if model.options and model.options.get(k) is not None]
    if not keys:
        return (None,) * model.num_layers
    return tuple(zip(*(model.options[k] for k in keys), strict=True))


# The probes of the last few models a search asked about: the candidates of one pipeline depth share
# their probe, so its tensor table (layout/tensors.py caches it per model object) is built once, not
# once per candidate (Kimi-K2's 384 experts: a few thousand rows, 60 candidates)
_PROBES: dict[tuple[int, tuple[Any, ...]], tuple[ModelSpec, ModelSpec]] = {}


def probe_model(model: ModelSpec, kinds: list[Any]) -> ModelSpec:
    """``model`` with one layer per entry of ``kinds``, each of that kind (the same object for the same
    model and kinds while cached)."""
    key = (id(model), tuple(kinds))
    hit = _PROBES.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    options = dict(model.options)
    keys = [k for k in PER_LAYER if options.get(k) is not None]
    for j, k in enumerate(keys):
        options[k] = tuple(kind[j] for kind in kinds)
    probe = dataclasses.replace(model, num_layers=len(kinds), options=options)
    if len(_PROBES) >= 16:
        _PROBES.pop(next(iter(_PROBES)))
    _PROBES[key] = (model, probe)
    return probe


def rank_weights(model: ModelSpec, plan: Plan) -> list[RankWeights]:
    """Every rank's weights, asked of the Layout of a probe model with one layer of each kind per stage.

    Decoder layers of one kind have identical tensors, so a stage's bytes are its non-layer tensors
    plus, per kind, (layers of that kind on the stage) x (its probe layer). The probe Layout lists a
    handful of layer tensors per rank instead of 80 x 9 (or DeepSeek-V3's 61 x 800), which keeps a
    search of dozens of candidates far below a second; tests check the result against the full Layout
    byte for byte.
    """
    check_degrees(model, plan)
    real = stage_ranges(model, plan)
    kinds = layer_kinds(model)
    probe_kinds: list[Any] = []
    per_stage: list[int] = []
    mult: list[int] = []  # probe layer -> layers it stands for
    for a, b in real:
        present = sorted(set(kinds[a:b]), key=repr)
        probe_kinds += present
        per_stage.append(len(present))
        mult += [kinds[a:b].count(k) for k in present]
    probe = probe_model(model, probe_kinds)
    layout = build_layout(probe, dataclasses.replace(plan, pp_layers=tuple(per_stage)))
    routed = ({n for n, r in tensor_table(probe).items() if r.expert is not None or r.split == STACKED}
              if model.forward.moe else set())
    names = model.forward.names
    k_weight = "." + names.projection("k") + ".weight"  # its rows: this rank's KV heads
    out = []
    for rank_layout in layout.ranks:
        totals = {"nbytes": 0, "read": 0, "linear": 0, "expert": 0}
        kv_heads = 0
        for t in rank_layout.tensors:
            layer = layer_of(t.name)
            n = mult[layer] if layer is not None else 1
            embed = t.name == names.embed
            streamed = not embed or (model.tie_word_embeddings and plan.pp == 1)  # tied: also lm_head
            totals["nbytes"] += n * t.nbytes
            totals["read"] += n * t.nbytes if streamed else 0
            totals["expert"] += n * t.nbytes if t.source in routed else 0
            # matrices (stacked experts: E of them); packed: values, not words
            if streamed and (len(t.shape) == 2 or t.split == STACKED and len(t.shape) == 3) and t.scale_of is None:
                totals["linear"] += n * math.prod(t.shape) * (t.pack or 1)
            if t.name.endswith(k_weight):
                kv_heads = t.shape[0] // model.head_dim
        kv_heads = kv_heads or max(1, model.num_kv_heads // plan.tp)  # k stored fused (Phi-3), or MLA
        out.append(
            RankWeights(rank_layout.tp_rank, rank_layout.pp_stage, real[rank_layout.pp_stage],
                        totals["nbytes"], totals["read"], totals["linear"], kv_heads, totals["expert"])
        )
    return out


# --- plans ------------------------------------------------------------------------------------


def plan_name(model_name: str, tp: int, pp: int, dtype: str, ep: int = 1) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-._")[:96] or "model"
    return f"{slug}-ep{ep}-{dtype}" if ep > 1 else f"{slug}-tp{tp}pp{pp}-{dtype}"


def plan_dict(
    name: str, source: str, tp: int, pp: int, dtype: str, *, kv_cache_cap_gib: float | None = None,
    max_concurrent_sequences: int | None = None, dp: int = 1,
) -> dict[str, Any]:
    """A plan file's content (the schema of layout/plan.py), ready for ``plan_from_dict``/YAML.

    ``dp`` > 1: an expert-parallel plan (``expert_parallel: true``, ``dp_degree: dp``; the EP group
    is the dp x tp ranks of a stage), with the shard names that carry ``{dp_rank}``."""
    rg: dict[str, Any] = {
        "name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype, "gpus_per_replica": tp * pp * dp,
        "nvlink_domain": "node-local",
    }
    if dp > 1:
        rg["dp_degree"] = dp
        rg["expert_parallel"] = True
    if kv_cache_cap_gib:
        rg["kv_cache_cap_gb"] = int(kv_cache_cap_gib) if kv_cache_cap_gib == int(kv_cache_cap_gib) else kv_cache_cap_gib
    if max_concurrent_sequences:
        rg["max_concurrent_sequences"] = max_concurrent_sequences
    rg["checkpoint"] = {"shard_prefix": DEFAULT_SHARD_PREFIX if dp == 1 else DP_SHARD_PREFIX}
    out: dict[str, Any] = {"replica_group": rg, "model": {"source": source}}
    if dtype in QUANTIZED_DTYPES:
        out["quantization"] = {"ignore": list(DEFAULT_IGNORE)}
    return out
