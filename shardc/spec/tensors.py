"""What a Llama-family checkpoint holds and how each tensor splits under tensor parallelism.

The split rules are data (``SPLIT_RULES``); ``source_tensors`` lists every tensor a checkpoint of a
model must contain; ``valid_tp_degrees`` says which TP degrees the model's shapes allow. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import LayoutError
from .model import ModelSpec

# HF name pattern -> split kind. First match wins.
#   column:    dim 0 split evenly (output rows); biases the same way
#   kv_column: like column, but when tp > kv_heads each rank holds one whole (replicated) KV head
#   row:       dim 1 split evenly (input columns)
#   vocab:     dim 0 split by vocabulary rows, padded with zero rows to a multiple of tp
#   replicated: whole tensor on every TP rank of the owning stage
SPLIT_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "vocab"),
    (r"lm_head\.weight", "vocab"),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)", "kv_column"),
    (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.(self_attn\.o|mlp\.down)_proj\.weight", "row"),
    (r"model\.layers\.\d+\.(self_attn\.o|mlp\.down)_proj\.bias", "replicated"),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", "replicated"),
    (r"model\.norm\.weight", "replicated"),
)
_COMPILED = tuple((re.compile(p), kind) for p, kind in SPLIT_RULES)
MAX_TP_HINT = 64


def split_kind(name: str) -> str:
    """The split rule for an HF tensor name (LayoutError for names outside the Llama family)."""
    for pattern, kind in _COMPILED:
        if pattern.fullmatch(name):
            return kind
    raise LayoutError(f"no split rule for tensor {name!r}", hint="only Llama-family names are known")


def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class SourceTensor:
    """A tensor the checkpoint must contain, with the shape the config implies."""

    name: str
    shape: tuple[int, ...]


def source_tensors(model: ModelSpec) -> list[SourceTensor]:
    """Every tensor a checkpoint of this model must hold, in HF naming, with its shape."""
    h, hd = model.hidden_size, model.head_dim
    q_out, kv_out, inter = model.num_heads * hd, model.num_kv_heads * hd, model.intermediate_size
    out = [SourceTensor("model.embed_tokens.weight", (model.vocab_size, h))]
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        out += [
            SourceTensor(p + "input_layernorm.weight", (h,)),
            SourceTensor(p + "post_attention_layernorm.weight", (h,)),
            SourceTensor(p + "self_attn.q_proj.weight", (q_out, h)),
            SourceTensor(p + "self_attn.k_proj.weight", (kv_out, h)),
            SourceTensor(p + "self_attn.v_proj.weight", (kv_out, h)),
            SourceTensor(p + "self_attn.o_proj.weight", (h, q_out)),
            SourceTensor(p + "mlp.gate_proj.weight", (inter, h)),
            SourceTensor(p + "mlp.up_proj.weight", (inter, h)),
            SourceTensor(p + "mlp.down_proj.weight", (h, inter)),
        ]
        if model.qkv_bias:
            out += [
                SourceTensor(p + "self_attn.q_proj.bias", (q_out,)),
                SourceTensor(p + "self_attn.k_proj.bias", (kv_out,)),
                SourceTensor(p + "self_attn.v_proj.bias", (kv_out,)),
            ]
        if model.o_bias:
            out.append(SourceTensor(p + "self_attn.o_proj.bias", (h,)))
        if model.mlp_bias:
            out += [
                SourceTensor(p + "mlp.gate_proj.bias", (inter,)),
                SourceTensor(p + "mlp.up_proj.bias", (inter,)),
                SourceTensor(p + "mlp.down_proj.bias", (h,)),
            ]
    out.append(SourceTensor("model.norm.weight", (h,)))
    if not model.tie_word_embeddings:
        out.append(SourceTensor("lm_head.weight", (model.vocab_size, h)))
    return sorted(out, key=lambda t: t.name)


def valid_tp_degrees(model: ModelSpec, limit: int = MAX_TP_HINT) -> list[int]:
    return [t for t in range(1, limit + 1) if not _tp_problems(model, t)]


def _tp_problems(model: ModelSpec, tp: int) -> list[str]:
    problems = []
    if model.num_heads % tp:
        problems.append(f"num_attention_heads={model.num_heads} is not divisible by tp={tp}")
    kv = model.num_kv_heads
    if kv >= tp and kv % tp:
        problems.append(f"num_key_value_heads={kv} is not divisible by tp={tp}")
    if kv < tp and tp % kv:
        problems.append(f"tp={tp} is not a multiple of num_key_value_heads={kv}")
    if model.intermediate_size % tp:
        problems.append(f"intermediate_size={model.intermediate_size} is not divisible by tp={tp}")
    if model.hidden_size % tp:
        problems.append(f"hidden_size={model.hidden_size} is not divisible by tp={tp}")
    return problems
