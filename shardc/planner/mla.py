"""MLA (DeepSeek-style) models for the planner: advisory figures for models `shardc build` cannot compile.

Multi-head latent attention caches one compressed latent per token and layer (``kv_lora_rank``
values plus a shared ``qk_rope_head_dim`` rotary key) instead of K and V per head, and every TP
rank keeps the whole latent: bytes per token per GPU = layers x (kv_lora_rank + qk_rope_head_dim) x
KV bytes, not divided by TP (vLLM's MLA backends; DeepSeek-V3 bf16: 61 x 576 x 2 = 70,272 B).

The Layout knows Llama-family tensor names only, so the weights here come from the config's shapes,
matrix by matrix, split the way vLLM splits them (column / row parallel by TP; the low-rank
``q_a_proj`` and ``kv_a_proj_with_mqa``, norms and the MoE router replicated; routed experts split
by TP like the dense MLP). The result is an estimate: plans for these models are advisory and
``shardc plan --out`` refuses to write them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelError
from .formulas import RankWeights

MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim")


def _deepseek(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


# Advisory presets (config.json values of the published checkpoints), beside spec.model.PRESETS.
MLA_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _deepseek(),
    "deepseek-v2-lite": _deepseek(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, vocab_size=102400, max_position_embeddings=163840),
}


@dataclass(frozen=True)
class MlaModel:
    """The shape of an MLA model, with the attribute names the planner reads from a ModelSpec."""

    architecture: str
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)
    qkv_bias = o_bias = mlp_bias = False

    @property
    def num_kv_heads(self) -> int:
        return 1  # one latent shared by every head

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def moe_layers(self, start: int, stop: int) -> int:
        """MoE layers among [start, stop): from first_k_dense_replace on, every moe_layer_freq-th.
        Counted, not iterated, so a config with absurd layer counts costs nothing."""
        if not self.n_routed_experts:
            return 0
        a, f = max(start, self.first_k_dense_replace), self.moe_layer_freq
        return max(0, -(-stop // f) - -(-a // f)) if stop > a else 0

    def summary(self) -> dict[str, Any]:
        keys = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "torch_dtype", "moe_intermediate_size",
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace")
        return {k: getattr(self, k) for k in keys}


def is_mla_config(cfg: Any) -> bool:
    return isinstance(cfg, dict) and all(k in cfg for k in MLA_KEYS)


def mla_from_config(cfg: dict[str, Any]) -> MlaModel:
    """Validate the numbers an MLA estimate needs (ModelError naming the key otherwise)."""

    def num(key: str, default: int | None = None, *, zero: bool = False) -> int:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
            raise ModelError(f"config.json {key} must be a {'non-negative' if zero else 'positive'} integer, "
                             f"found {value!r}", key=key, hint="pass a DeepSeek-style (MLA) config.json")
        return value

    archs = cfg.get("architectures") or ["MLA model"]
    q_lora = cfg.get("q_lora_rank")
    return MlaModel(
        architecture=str(archs[0]) if isinstance(archs, list) and archs else "MLA model",
        hidden_size=num("hidden_size"), intermediate_size=num("intermediate_size"),
        num_layers=num("num_hidden_layers"), num_heads=num("num_attention_heads"),
        kv_lora_rank=num("kv_lora_rank"), qk_rope_head_dim=num("qk_rope_head_dim"),
        qk_nope_head_dim=num("qk_nope_head_dim", 128), v_head_dim=num("v_head_dim", 128),
        q_lora_rank=num("q_lora_rank") if q_lora is not None else None, vocab_size=num("vocab_size"),
        max_position_embeddings=num("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or "bfloat16"),
        moe_intermediate_size=num("moe_intermediate_size", 0, zero=True),
        n_routed_experts=num("n_routed_experts", 0, zero=True) if cfg.get("n_routed_experts") else 0,
        n_shared_experts=num("n_shared_experts", 0, zero=True) if cfg.get("n_shared_experts") else 0,
        num_experts_per_tok=num("num_experts_per_tok", 0, zero=True) if cfg.get("num_experts_per_tok") else 0,
        first_k_dense_replace=num("first_k_dense_replace", 0, zero=True),
        moe_layer_freq=num("moe_layer_freq", 1), config=copy.deepcopy(cfg),
    )


def mla_tp_problems(model: MlaModel, tp: int) -> list[str]:
    """What stops vLLM from splitting this model tp ways (heads and MLP widths must divide)."""
    out = []
    for name, value in (("num_attention_heads", model.num_heads), ("intermediate_size", model.intermediate_size),
                        ("moe_intermediate_size", model.moe_intermediate_size)):
        if value and value % tp:
            out.append(f"{name}={value} is not divisible by tp={tp}")
    return out


# (rows, cols, split): split is col (rows / tp), row (cols / tp) or rep (whole on every rank)
Matrix = tuple[int, int, str]


def _attention(m: MlaModel) -> tuple[list[Matrix], int]:
    """The attention projections of one layer, and its 16-bit replicated norm elements."""
    h, heads = m.hidden_size, m.num_heads
    mats: list[Matrix] = []
    if m.q_lora_rank:
        mats += [(m.q_lora_rank, h, "rep"), (heads * m.head_dim, m.q_lora_rank, "col")]
    else:
        mats.append((heads * m.head_dim, h, "col"))
    mats += [(m.latent_dim, h, "rep"), (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "col"),
             (h, heads * m.v_head_dim, "row")]
    norms = 2 * h + m.kv_lora_rank + (m.q_lora_rank or 0)
    return mats, norms


def _mlp(h: int, inter: int, copies: int = 1) -> list[Matrix]:
    return [(inter, h, "col"), (inter, h, "col"), (h, inter, "row")] * copies


def _bytes(mats: list[Matrix], tp: int, quantized: bool) -> tuple[int, int]:
    """(stored bytes, matmul elements) on one rank: 16-bit, or 1 B + a float32 scale per output row."""
    nbytes = elems = 0
    for rows, cols, split in mats:
        r = rows // tp if split == "col" else rows
        c = cols // tp if split == "row" else cols
        nbytes += r * c + 4 * r if quantized else 2 * r * c
        elems += r * c
    return nbytes, elems


def mla_rank_weights(model: MlaModel, tp: int, pp: int, dtype: str, ranges: list[tuple[int, int]]) -> list[RankWeights]:
    """One RankWeights per (tp rank, stage); every TP rank of a stage holds the same amount."""
    q = dtype in ("int8", "fp8")
    h = model.hidden_size
    attn, norms = _attention(model)
    a_bytes, a_elems = _bytes(attn, tp, q)
    dense_b, dense_e = _bytes(_mlp(h, model.intermediate_size), tp, q)
    shared_b, shared_e = _bytes(_mlp(h, model.moe_intermediate_size, model.n_shared_experts), tp, q)
    expert_b, expert_e = _bytes(_mlp(h, model.moe_intermediate_size), tp, q)
    router = model.n_routed_experts * h  # 16-bit, replicated
    vocab = -(-model.vocab_size // tp) * h  # rows per rank, padded like the Layout pads
    active = model.num_experts_per_tok
    out = []
    for st, (a, b) in enumerate(ranges):
        moe = model.moe_layers(a, b)
        dense = b - a - moe
        experts = moe * model.n_routed_experts * expert_b
        nbytes = (b - a) * (a_bytes + 2 * norms) + dense * dense_b + moe * (shared_b + 2 * router) + experts
        linear = (b - a) * a_elems + dense * dense_e + moe * (shared_e + active * expert_e + router)
        read = nbytes
        if st == 0:
            nbytes += 2 * vocab  # the embedding lookup reads a few rows, not the table
        if st == pp - 1:  # final norm and lm_head (a tied one is the embedding, stored once at pp=1)
            nbytes += 2 * h + (0 if model.tie_word_embeddings and pp == 1 else 2 * vocab)
            read += 2 * h + 2 * vocab
            linear += vocab
        out += [RankWeights(r, st, (a, b), nbytes, read, linear, 1, experts) for r in range(tp)]
    return out


def routed_expert_elems(model: MlaModel) -> int:
    """Matmul elements of one routed expert (gate, up, down of moe_intermediate_size), one layer."""
    return _bytes(_mlp(model.hidden_size, model.moe_intermediate_size), 1, False)[1]


def mla_param_count(model: MlaModel) -> int:
    """Parameters of the checkpoint (no multi-token-prediction head), from the same matrices."""
    attn, norms = _attention(model)
    per = sum(r * c for r, c, _ in attn) + norms
    moe = model.moe_layers(0, model.num_layers)
    experts = sum(r * c for r, c, _ in _mlp(model.hidden_size, model.moe_intermediate_size,
                                            model.n_routed_experts + model.n_shared_experts))
    dense = sum(r * c for r, c, _ in _mlp(model.hidden_size, model.intermediate_size))
    total = model.num_layers * per + moe * (experts + model.n_routed_experts * model.hidden_size)
    total += (model.num_layers - moe) * dense
    embed = model.vocab_size * model.hidden_size
    return total + embed * (1 if model.tie_word_embeddings else 2) + model.hidden_size


def experts_touched(batch: float, active: int, routed: int) -> float:
    """Expected share of routed experts a decode step reads: 1 - (1 - k/n)^batch (uniform routing)."""
    if not routed:
        return 1.0
    return 1.0 - math.pow(1.0 - active / routed, max(batch, 1.0))
