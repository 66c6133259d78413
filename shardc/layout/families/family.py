"""What a model family declares: its configs, the config keys that change the math, one table of
its tensors, and the forward its runtime computes. Pure data and arithmetic: no I/O, no torch.

Every other part of shardc derives from a family's table (docs/architecture.md §8, "A family"):
the checkpoint check and the synthetic source (``source_tensors``), the split rules and the
Layout (``Row.split``), the quantization targets (``Row.quantizable``), the planner's memory and
the export. The forward is data too (``Forward``), read by ``runtime/decoder.py``: what that
decoder cannot yet express is declared there, never a special case elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, overload

from ...errors import ModelError
from .hybrid import Hybrid
from .indexer import Indexer
from .names import LLAMA, Names


class ModelShape(Protocol):
    """What a family's table and forward read of the model: the numbers every decoder has and the
    family's own ``options``. ``layout/model.py``'s ``ModelSpec`` is the one implementation; the
    families name this instead of it because ModelSpec is built from the families' answers (so
    the families importing it, even for typing only, would close an import loop)."""

    @property
    def architecture(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def options(self) -> dict[str, Any]: ...

RopeReader = Callable[[dict[str, Any]], tuple[float, dict[str, Any] | None]]

class Split(str, Enum):
    """How a tensor is cut over tensor parallelism (layout/cuts.py interprets it). A ``str``: a
    manifest's tensor records carry the value, the same bytes the bare strings were."""

    COLUMN = "column"  # dim 0 (output rows) split evenly; biases the same way
    KV_COLUMN = "kv_column"  # like column; when tp > kv_heads each rank holds one whole KV head
    ROW = "row"  # dim 1 (input columns) split evenly
    VOCAB = "vocab"  # dim 0 by vocabulary rows, padded with zero rows to a multiple of tp
    REPLICATED = "replicated"  # whole on every TP rank of the owning stage
    FUSED = "fused"  # dim 0 holds several column tensors end to end (Phi-3's qkv_proj, gate_up_proj):
    #                  each part is cut by its own kind and the rank's pieces are concatenated
    EXPERT = "expert"  # a routed expert's tensor placed whole on one rank (plan expert_parallel);
    #                    without expert parallelism the row's own kind (column / row) splits it
    STACKED = "stacked"  # every routed expert of a layer in one tensor, dim 0 the expert id (gpt-oss):
    #                      expert parallelism gives each rank its experts' block of dim 0; without it
    #                      TP cuts ``Row.tp_dim`` (None: whole on every TP rank)

    def __str__(self) -> str:  # the value in messages and f-strings on every Python version
        return self.value


# The members by their short names, as the families' tables spell them.
COLUMN, KV_COLUMN, ROW, VOCAB = Split.COLUMN, Split.KV_COLUMN, Split.ROW, Split.VOCAB
REPLICATED, FUSED, EXPERT, STACKED = Split.REPLICATED, Split.FUSED, Split.EXPERT, Split.STACKED


@dataclass(frozen=True)
class Row:
    """One tensor: name, the shape the config implies, TP split, quantizable, a fused tensor's parts."""

    name: str
    shape: tuple[int, ...]
    split: Split
    quantizable: bool = False
    parts: tuple[tuple[int, Split], ...] = ()  # FUSED: (rows, COLUMN | KV_COLUMN) in order
    expert: int | None = None  # a routed expert's id: placed whole by expert parallelism
    dtype: str | None = None  # stored in this safetensors dtype whatever the plan's (e.g. "F32": a
    #                           router transformers keeps in fp32, _keep_in_fp32_modules_strict)
    tp_dim: int | None = None  # STACKED: the dimension TP cuts (None: whole on every TP rank)


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts MLP as the runtime computes it (runtime/decoder.py ``_moe``), with the
    tensor names it reads under ``model.layers.N.`` (``{e}``: the expert id).

    Routing is transformers' TopKRouter: router logits in the model dtype, softmax in fp32, top-k,
    renormalized when ``norm_topk``; the weights stay fp32 (Mixtral) or are cast to the model dtype
    first (Qwen). Each routed token's expert output times its weight is added in the model dtype,
    experts in id order, as transformers' experts loop does."""

    experts: int  # routed experts per sparse layer
    top_k: int
    norm_topk: bool
    weights_fp32: bool  # the routing weights multiply the expert output in fp32 (Mixtral)
    sparse: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP (False)
    router: str  # e.g. "mlp.gate.weight"
    expert: tuple[str, ...]  # gate, up, down templates, e.g. "mlp.experts.{e}.gate_proj.weight"; ()
    #                          when the experts are ``stacked``
    shared: tuple[str, str, str] | None = None  # a shared expert's gate, up, down (Qwen2-MoE)
    shared_gate: str | None = None  # its sigmoid gate [1, hidden]
    # DeepSeek-V3's router (transformers' DeepseekV3TopkRouter), when scoring is "sigmoid": logits
    # in fp32 from the fp32 router, sigmoid scores, ``score_bias`` (e_score_correction_bias) added
    # for the choice only, the best ``topk_groups`` of ``groups`` groups by the sum of their two
    # best biased scores, top-k among those; the weights are the unbiased scores, renormalized
    # (+1e-20) when ``norm_topk``, times ``scaling``
    scoring: str = "softmax"
    score_bias: str | None = None
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    # gpt-oss (transformers' GptOssTopKRouter and GptOssExperts), scoring "topk_softmax": logits
    # with ``router_bias``, the top k logits softmaxed in the model dtype; the experts ``stacked``
    # (gate_up [E, hidden, 2·inter] with gate and up interleaved, its bias [E, 2·inter], down
    # [E, inter, hidden], its bias [E, hidden]; x @ W + b) with the clamped SwiGLU ``swiglu``
    # (alpha, limit): gate ≤ limit, |up| ≤ limit, (up + 1) · gate · sigmoid(alpha · gate)
    router_bias: str | None = None
    # MiniMax-M2 (transformers' MiniMaxM2TopKRouter), scoring "sigmoid_bias": logits in the router's dtype, then
    # sigmoid in fp32, ``score_bias`` added for the choice only, top-k, the unbiased scores renormalized
    stacked: tuple[str, str, str, str] | None = None
    swiglu: tuple[float, float] | None = None

    def owner(self, e: int, ranks: int) -> int:
        """The rank of ``ranks`` that holds expert ``e`` under expert parallelism: vLLM's linear
        placement, rank r holding [r·E/N, (r+1)·E/N) with the remainder to the first ranks."""
        base, extra = divmod(self.experts, ranks)
        cut = extra * (base + 1)
        return e // (base + 1) if e < cut else extra + (e - cut) // base


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V3), as runtime/decoder.py ``_mla`` computes it (its
    tensors: names.py ``LATENT``), and DeepSeek-V3.2's sparse attention when ``indexer`` is set."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim: the rotary part of q and k (k's shared by every head)
    v: int  # v_head_dim
    interleave: bool  # rope_interleave: rotary dimensions in (even, odd) pairs
    latent_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' RMSNorm default eps
    indexer: Indexer | None = None  # DSA's top-k token selection (indexer.py)


@dataclass(frozen=True)
class Forward:
    """What the runtime's one decoder computes for a family (runtime/decoder.py reads it).

    Defaults are Llama's; each field names the config key it comes from in the family module."""

    norm: str = "rms"  # rms: w * norm(x).to(dtype) (Llama); gemma: (norm(x.float()) * (1 + w)).to(dtype);
    #                    rms_upcast: (w * norm(x.float())).to(dtype), the product in fp32 (gpt-oss)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # q's, k's RMSNorm over all heads (MiniMax-M2): TP all-reduces the sum of squares
    rotary_dim: int | None = None  # rope turns the first rotary_dim dims of a head, the rest pass (MiniMax-M2)
    sandwich: bool = False  # norms after attention and around the MLP (Gemma 2 and 3)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden); Granite)
    embed_scale_in_dtype: bool = False  # the factor rounded to the compute dtype first (Gemma)
    residual_scale: float = 1.0  # branch outputs times this before the residual add (Granite)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2)
    logits_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = full
    rope_theta_local: float | None = None  # rope base of sliding-window layers (Gemma 3)
    activation: str = "silu"  # config.json hidden_act / hidden_activation (runtime/support.py)
    # tensors stored fused (Phi-3): (module under model.layers.N, its parts' decoder roles in order), e.g.
    # ("self_attn.qkv_proj", ("q", "k", "v")); runtime/weights.py cuts the rank's tensor into those roles
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    moe: Moe | None = None  # mixture-of-experts MLP on the layers ``moe.sparse`` marks
    mla: Mla | None = None  # multi-head latent attention instead of q/k/v projections (DeepSeek-V3)
    yarn: bool = False  # the family's rope may be YaRN (transformers' _compute_yarn_parameters)
    sinks: bool = False  # per-head attention sinks (gpt-oss): a logit per head joins each query's softmax, then dropped
    hybrid: Hybrid | None = None  # linear-attention layers and gated attention (Qwen3-Next; hybrid.py)
    names: Names = LLAMA  # the tensor names the runtime's block reads, by role (names.py)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


@dataclass(frozen=True)
class Preset:
    """A published model's config.json, so plans validate and plan offline; ``repos``: the hub
    repositories whose config it is (the first is where ``shardc build`` fetches the weights);
    ``quantization``: its ``quantization_config``, verbatim, when published quantized (layout/model.py
    PRESETS adds it: the planner sizes that stored form, ``dtype: source``, first)."""

    config: dict[str, Any]
    repos: tuple[str, ...] = ()
    quantization: dict[str, Any] | None = None


@dataclass(frozen=True)
class Family:
    """A model family: one module under layout/families/ defines one of these (``FAMILY``).

    ``read`` turns a config into the family's options (every key that changes the math, both
    the transformers 4 and 5 spellings, refusing values it cannot honour with one line; the
    options ``qkv_bias`` / ``o_bias`` say which projections carry a bias whatever
    ``attention_bias`` says, ``tie_word_embeddings`` the family's default when the key is absent);
    ``tensors`` lists the checkpoint's tensors; ``forward`` says what the runtime computes."""

    name: str
    architectures: tuple[str, ...]
    read: Callable[[dict[str, Any]], dict[str, Any]]
    tensors: Callable[[ModelShape], list[Row]]
    forward: Callable[[ModelShape], Forward]
    # each architecture's model_type (its transformers configuration class's): transformers builds
    # by config.json's model_type, vLLM by architectures, so another one's is refused (model.py)
    model_types: dict[str, str]
    presets: dict[str, Preset] = field(default_factory=dict)  # name -> real-size config
    # The global rope (theta, scaling in rope_scaling's form) when the family spells it its own
    # way (Gemma 3's per-layer-type rope_parameters), given layout/model.py's reader of one rope
    # object (both spellings) to apply to its parts; None: that reader on the whole config.
    rope: Callable[[dict[str, Any], RopeReader], tuple[float, dict[str, Any] | None]] | None = None
    # Checkpoint tensors outside the table that the forward never reads and a build leaves out, as
    # transformers' loader skips them (DeepSeek-V3's multi-token-prediction layers); None: none.
    unused: Callable[[ModelShape, str], bool] | None = None


# ---- config readers every family shares --------------------------------------------------------

HINT = "pass the config.json of a supported Hugging Face checkpoint"


def number(cfg: dict[str, Any], key: str, default: float | None, *, positive: bool = True,
           below: float | None = None) -> float | None:
    """A finite number (positive unless told; below ``below`` when given), or None when absent and no default."""
    value = cfg.get(key, default)
    if value is None:
        value = default
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (positive and value <= 0) or (below is not None and value >= below)):
        what = "a finite positive number" if positive else "a finite number"
        bound = f" below {below}" if below is not None else ""
        raise ModelError(f"config.json {key} must be {what}{bound}, found {value!r}", hint=HINT, key=key)
    return float(value)


# ---- bounds: every count and size a config gives ----------------------------------------------

# (lowest, highest) accepted for every whole number a config gives, checked before anything is sized
# by it: a 1 KB config.json with ``num_local_experts: 10**8`` kept ``plan`` and ``build --dry-run``
# building tensor tables for minutes. Each bound is far above every published model (their config.json
# values, transformers' defaults). The first row is layout/model.py's ``LIMITS`` (the manifest's too).
LAYERS = 4096  # Llama 3.1 405B: 126; DeepSeek-V3: 61
EXPERTS = 4096  # routed experts: Qwen3-Next 512 (the most published), Kimi-K2 384, DeepSeek-V3 256
HIDDEN, INTER, HEAD, POSITIONS = 1 << 18, 1 << 20, 1 << 14, 1 << 28  # 405B: 16384, 53248; head_dim 256
BOUNDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, HIDDEN), "intermediate_size": (1, INTER), "num_hidden_layers": (1, LAYERS),
    "num_attention_heads": (1, 4096), "num_key_value_heads": (1, 4096), "head_dim": (1, HEAD),
    "vocab_size": (1, 1 << 24), "max_position_embeddings": (1, POSITIONS),
    # routing (DeepSeek-V3: top 8 of 256 in 8 groups, the best 4, one shared expert); top-k, n_group
    # and topk_group are then checked against the experts (moe.py, deepseek.py)
    "num_local_experts": (1, EXPERTS), "num_experts": (1, EXPERTS), "n_routed_experts": (1, EXPERTS),
    "num_experts_per_tok": (1, EXPERTS), "n_group": (1, EXPERTS), "topk_group": (1, EXPERTS), "n_shared_experts": (1, EXPERTS),
    # an expert's MLP, under intermediate_size's bound (DeepSeek-V3 2048, Qwen1.5-MoE's shared 5632)
    "moe_intermediate_size": (1, INTER), "shared_expert_intermediate_size": (1, INTER),
    # counts of layers, steps and patterns (DeepSeek-V3 first_k_dense_replace 3, one MTP layer;
    # Qwen2 max_window_layers 28 to 80; Gemma 3 pattern 6)
    "first_k_dense_replace": (0, LAYERS), "decoder_sparse_step": (1, LAYERS),
    "max_window_layers": (0, LAYERS), "sliding_window_pattern": (1, LAYERS),
    "num_nextn_predict_layers": (0, LAYERS), "num_mtp_layers": (0, LAYERS), "num_mtp_modules": (0, LAYERS),
    # MLA: ranks under hidden_size's bound (1536, 512), head dims under head_dim's (128, 64, 128); DSA's indexer (64 heads of 128, the best 2048 tokens; GLM-5.3 runs its own every 4 layers)
    "q_lora_rank": (1, HIDDEN), "kv_lora_rank": (1, HIDDEN), "qk_nope_head_dim": (1, HEAD),
    "qk_rope_head_dim": (1, HEAD), "v_head_dim": (1, HEAD), "index_n_heads": (1, 4096), "index_head_dim": (1, HEAD),
    "index_topk": (1, POSITIONS), "index_topk_freq": (1, LAYERS), "index_skip_topk_offset": (0, LAYERS), "full_attention_interval": (1, LAYERS),
    # Gated DeltaNet (Qwen3-Next: 16 key heads of 128, 32 value heads of 128, a conv of 4)
    "linear_num_key_heads": (1, 4096), "linear_num_value_heads": (1, 4096), "linear_key_head_dim": (1, HEAD), "linear_value_head_dim": (1, HEAD), "linear_conv_kernel_dim": (1, 64),
    "sliding_window": (1, POSITIONS),  # positions (Qwen1.5-MoE 32768, gpt-oss 128)
}
EXPERT_MLPS = 1 << 17  # routed expert MLPs in all layers: Kimi-K2 61 x 384 = 23,424 (the two bounds: 4096 x 4096)


def above(key: str, value: int, high: int) -> ModelError:
    """The one line for a number above its bound: the key, the value and what would work."""
    return ModelError(f"config.json {key} is {value}, above the limit of {high}", key=key,
                      hint=f"{key} at most {high}, far above any published model's; pass the "
                           "checkpoint's own config.json")


@overload
def count(cfg: dict[str, Any], key: str, default: int) -> int: ...
@overload
def count(cfg: dict[str, Any], key: str, default: None = None) -> int | None: ...
def count(cfg: dict[str, Any], key: str, default: int | None = None) -> int | None:
    """A whole number within ``BOUNDS[key]`` (every key read has a row there), or the default
    when absent or null (an int whenever the default is)."""
    low, high = BOUNDS[key]
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelError(f"config.json {key} must be a whole number >= {low}, found {value!r}",
                         hint=HINT, key=key)
    if value > high:
        raise above(key, value, high)
    return value


def refuse(key: str, value: Any, why: str, hint: str = "") -> ModelError:
    return ModelError(f"config.json {key}={short(value)} {why}", key=key,
                      hint=hint or "shardc builds and runs only what it computes exactly")


def short(value: Any) -> str:
    """At most 80 characters of a value's repr, a long list or object cut to 32 entries first (a
    16 MiB list in a config costs a second to repr whole)."""
    if isinstance(value, (list, dict)) and len(value) > 32:
        value = value[:32] if isinstance(value, list) else dict(list(value.items())[:32])
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def layer_types(cfg: dict[str, Any], layers: int, default: Callable[[int], str]) -> tuple[str, ...]:
    """config.json ``layer_types`` (transformers 5: full_attention / sliding_attention per layer), or the default."""
    given = cfg.get("layer_types")
    if given is None:
        return tuple(default(i) for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(
            t not in ("full_attention", "sliding_attention") for t in given):
        raise refuse("layer_types", given, f"must list full_attention or sliding_attention for each "
                     f"of the {layers} layers")
    return tuple(given)


def windows_for(types: tuple[str, ...], window: int | None) -> tuple[int | None, ...]:
    """Per-layer sliding windows: ``window`` on sliding_attention layers, None elsewhere."""
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


# ---- the rows most families share --------------------------------------------------------------

def attention_rows(m: ModelShape, p: str, *, qkv_bias: bool, o_bias: bool) -> list[Row]:
    """q/k/v (column, KV heads kv_column) and o (row) of one layer, prefix ``p``."""
    h, hd = m.hidden_size, m.head_dim
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    name = {role: p + LLAMA.projection(role) for role in "qkvo"}
    rows = [Row(name["q"] + ".weight", (q, h), COLUMN, True),
            Row(name["k"] + ".weight", (kv, h), KV_COLUMN, True),
            Row(name["v"] + ".weight", (kv, h), KV_COLUMN, True),
            Row(name["o"] + ".weight", (h, q), ROW, True)]
    if qkv_bias:
        rows += [Row(name["q"] + ".bias", (q,), COLUMN), Row(name["k"] + ".bias", (kv,), KV_COLUMN),
                 Row(name["v"] + ".bias", (kv,), KV_COLUMN)]
    if o_bias:
        rows.append(Row(name["o"] + ".bias", (h,), REPLICATED))
    return rows


def mlp_rows(m: ModelShape, p: str, *, bias: bool) -> list[Row]:
    """The gated MLP of one layer: gate/up column, down row."""
    h, inter = m.hidden_size, m.intermediate_size
    gate, up, down = (p + LLAMA.projection(role) for role in ("gate", "up", "down"))
    rows = [Row(gate + ".weight", (inter, h), COLUMN, True), Row(up + ".weight", (inter, h), COLUMN, True),
            Row(down + ".weight", (h, inter), ROW, True)]
    if bias:
        rows += [Row(gate + ".bias", (inter,), COLUMN), Row(up + ".bias", (inter,), COLUMN),
                 Row(down + ".bias", (h,), REPLICATED)]
    return rows


def norm_rows(m: ModelShape, p: str, names: tuple[str, ...], size: int | None = None) -> list[Row]:
    return [Row(p + n + ".weight", (size or m.hidden_size,), REPLICATED) for n in names]


def outer_rows(m: ModelShape) -> list[Row]:
    """Embedding, final norm and (untied) lm_head."""
    v, h = m.vocab_size, m.hidden_size
    rows = [Row(LLAMA.embed, (v, h), VOCAB), Row(LLAMA.final_norm, (h,), REPLICATED)]
    if not m.tie_word_embeddings:
        rows.append(Row(LLAMA.lm_head, (v, h), VOCAB))
    return rows
