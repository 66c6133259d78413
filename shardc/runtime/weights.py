"""Turn one rank's shard tensors into the runtime's weights.

The tensors come from ``shardc.loader.local.load_shard`` (sha256 + header checked against the
Layout before a byte is used), already on the rank's device: on CUDA they were copied from pinned
host buffers while the file was read and hashed. What each tensor is, and which vocabulary rows a
rank holds, is read from the Layout's TensorSpecs, never re-derived. int8 / fp8 weights are dequantized here with their
per-channel scales (weight-only quantization: activations stay in the 16-bit base dtype); int8
is unpacked first from compressed-tensors' pack-quantized ``X.weight_packed`` + ``X.weight_shape``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..compiler.quantize import dequantize
from ..errors import ManifestError
from ..formats.manifest import Manifest
from ..layout.dtypes import torch_name
from ..layout.quantization import PACKED_SUFFIX, SCALE_SUFFIX, SHAPE_SUFFIX
from ..layout.ranks import Layout, RankLayout
from ..layout.tensors import tensor_table
from .rankweights import Dims, ExpertWeights, LayerWeights, MoeWeights, StageWeights


def _held(specs: dict, name: str) -> bool:
    """Whether this rank holds a tensor (as itself or int8's packed form)."""
    return name in specs or name + PACKED_SUFFIX in specs


def compute_dtype(manifest: Manifest) -> torch.dtype:
    """The 16-bit dtype activations run in: the plan's base dtype (int8/fp8 dequantize to it)."""
    return getattr(torch, torch_name(manifest.layout.base_dtype))


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """pack-quantized int32 [out, in/4] -> int8 [out, in]: each int32 holds four values + 128,
    the first in its low byte; on a little-endian host that is the bytes in order, top bit
    flipped. (``shardc.compiler.quantize.pack_int8`` is the inverse.)"""
    if sys.byteorder != "little":
        raise ManifestError("pack-quantized int8 is read on little-endian hosts only")
    u = packed.contiguous().view(torch.uint8) ^ 0x80
    return u.view(torch.int8).reshape([int(n) for n in shape.tolist()])


def kept_source_quantized(layout: Layout) -> dict:
    """Weights a ``dtype: source`` build holds in its source's quantized format -> that format."""
    from ..layout.quant_formats import detect_source

    source_format = detect_source(layout.model.config) if layout.plan.dtype == "source" else None
    return dict.fromkeys(source_format.quantized(layout.model), source_format) if source_format is not None else {}


def source_dequantize(source_format, name: str, shape: tuple[int, ...], raw: dict[str, torch.Tensor],
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rank's slice of a source-quantized weight in the compute dtype: the format's reference
    dequantization (float32, on the host) then one cast, as transformers loads the source, so a
    ``dtype: source`` build runs the weights a 16-bit build of the same source holds."""
    from ..compiler.arrays import from_torch

    w = source_format.dequantize(name, tuple(shape), lambda n: from_torch(raw[n].cpu()))
    return torch.from_numpy(w).to(device=device, dtype=dtype)


def local_dims(layout: Layout) -> Dims:
    m, tp = layout.model, layout.plan.tp
    mla = m.forward.mla
    return Dims(
        hidden=m.hidden_size,
        heads=m.num_heads // tp,
        kv_heads=max(1, m.num_kv_heads // tp),
        head_dim=m.head_dim,
        vocab=m.vocab_size,
        eps=m.rms_norm_eps,
        latent=(mla.kv_lora_rank, mla.rope) if mla is not None else None,
        index_dim=mla.indexer.head_dim if mla is not None and mla.indexer is not None else None,
        linear=m.forward.hybrid.linear if m.forward.hybrid is not None else (),
    )


def _stacked_experts(get: Callable[[str], torch.Tensor], split: bool, p: str,
                     names: tuple[str, str, str, str], rank_layout: RankLayout,
                     experts: int) -> dict[int, ExpertWeights]:
    """Stacked experts (gpt-oss) as per-expert views: this rank's block of dim 0 (expert
    parallelism: ``rank_layout.experts``; otherwise every expert, its TP slice). ``split`` over TP, an
    expert's down bias is added by TP rank 0 only, so the all-reduced sum holds it once."""
    gate_up, gate_up_bias, down, down_bias = (get(p + n) for n in names)
    ids = rank_layout.experts or tuple(range(experts))
    return {e: (gate_up[j], gate_up_bias[j], down[j], None if split and rank_layout.tp_rank else down_bias[j])
            for j, e in enumerate(ids)}


def load_stage(
    manifest: Manifest, directory: Path, layout: Layout, tp_rank: int, pp_stage: int,
    device: torch.device, dp_rank: int = 0,
) -> StageWeights:
    """Load, check and arrange one rank's tensors (dequantizing int8/fp8)."""
    from ..loader.local import load_shard

    rank_layout = layout.rank(tp_rank, pp_stage, dp_rank)
    raw = load_shard(manifest, tp_rank, pp_stage, device=str(device), directory=directory, dp_rank=dp_rank)
    return arrange(raw, rank_layout, layout, compute_dtype(manifest), device)


def arrange(raw: dict[str, torch.Tensor], rank_layout: RankLayout, layout: Layout, dtype: torch.dtype,
            device: torch.device) -> StageWeights:
    """Rank tensors (as written by build) -> StageWeights in ``dtype`` on ``device``."""
    specs = {t.name: t for t in rank_layout.tensors}
    missing = sorted(set(specs) - set(raw))
    if missing:
        raise ManifestError(f"{rank_layout.file} lacks tensor {missing[0]}", hint="rebuild the shards")

    # The raw tensors are views of one buffer holding the whole file. When int8/fp8 weights are
    # dequantized into new tensors, the 16-bit ones are copied out so that buffer can be freed.
    kept = kept_source_quantized(layout)

    def layout_shape(name: str) -> tuple[int, ...]:
        """The rank's [out, in] of a kept weight: its values' spec, or X.weight_shape's contents."""
        stored = kept[name].stored(name)[0]
        spec = specs[stored.tensor(name)]
        if stored.weight_shape(spec.shape) is not None:  # MXFP4's blocks: [E, out, in/32, 16]; E2M1 nibbles
            return stored.weight_shape(spec.shape)
        if stored.suffix == "":
            return spec.shape
        value = next(specs[st.tensor(name)].value for st in kept[name].stored(name) if st.value)
        assert value is not None  # the Layout fixes the contents of a stored X.weight_shape
        return value
    copy_out = any(t.quant for t in rank_layout.tensors) or bool(kept)

    # w = q * scale per output channel, the scale rounded to the compute dtype first as the serving
    # clients hold it (compiler/quantize.py dequantize), so the gate scores what a server computes.
    def deq(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(q.to(device), scale.to(device), dtype)

    def get(name: str) -> torch.Tensor:
        if name in kept:  # a dtype: source build: the source format's own dequantization
            return source_dequantize(kept[name], name, layout_shape(name), raw, dtype, device)
        if name not in specs and name + PACKED_SUFFIX in specs:  # int8, pack-quantized
            q = unpack_int8(raw[name + PACKED_SUFFIX], raw[name + SHAPE_SUFFIX])
            return deq(q, raw[name + SCALE_SUFFIX]).contiguous()
        spec = specs[name]
        t = raw[name].to(device)
        if spec.quant:
            return deq(t, raw[name + SCALE_SUFFIX])
        # 16-bit tensors in the compute dtype; an fp32 one the family keeps so (Row.dtype) stays fp32
        t = t.to(dtype=torch.float32 if spec.dtype == "F32" else dtype).contiguous()
        return t.clone() if copy_out and t.data_ptr() == raw[name].data_ptr() else t

    moe = layout.model.forward.moe
    mla = layout.model.forward.mla
    hybrid = layout.model.forward.hybrid
    fused = layout.model.forward.fused
    table = tensor_table(layout.model) if fused else {}

    def split(name: str) -> tuple[torch.Tensor, ...]:
        """A fused tensor cut into its parts by the rank's part sizes: the Layout's pieces (tp > 1)
        or the family's part rows (whole)."""
        spec = specs.get(name) or specs[name + PACKED_SUFFIX]
        sizes = [b - a for a, b in spec.pieces] if spec.pieces else [n for n, _ in table[name].parts]
        return torch.split(get(name), sizes, dim=0)

    names = layout.model.forward.names
    layers = []
    for i in range(*rank_layout.layers):
        p = names.layer(i)
        # the projections by role (None: not on this layer), as LayerWeights' fields
        w: dict[str, torch.Tensor | None] = {}
        bias: dict[str, torch.Tensor] = {}
        for module, roles in fused:
            w |= dict(zip(roles, split(p + module + ".weight"), strict=True))
            if p + module + ".bias" in specs:
                bias |= dict(zip(roles, split(p + module + ".bias"), strict=True))
        sparse = moe is not None and moe.sparse[i]
        if sparse:  # the routed experts (and a shared expert) take the dense MLP's place
            w |= {"gate": None, "up": None, "down": None}
        linear = {}
        if hybrid is not None and hybrid.linear[i]:  # Gated DeltaNet: out_proj is the o role
            linear = {role: get(p + name) for role, name in names.linear if role != "o"}
            w |= {"q": None, "k": None, "v": None, "o": get(p + dict(names.linear)["o"])}
        latent = {}
        if mla is not None:  # q_b_proj (or q_proj) is q; the latent projections replace k and v
            latent = {role: get(p + name) for role, name in names.latent if _held(specs, p + name)}
            w |= {"k": None, "v": None}
            if mla.q_lora_rank is not None:
                w["q"] = get(p + names.q_b)
        w |= {key: get(p + proj + ".weight") for key, proj in names.projections if key not in w}
        bias |= {key: get(p + proj + ".bias") for key, proj in names.projections
                 if key not in bias and p + proj + ".bias" in specs}
        norms = {role: get(p + name) for role, name in names.norms if p + name in specs}
        if p + names.pre_mlp_norm in specs:  # Gemma: ln2 follows attention, this precedes the MLP
            norms["post_attn"] = get(p + names.ln2)
            ln2 = get(p + names.pre_mlp_norm)
        else:
            ln2 = get(p + names.ln2)
        sinks = get(p + names.sinks) if p + names.sinks in specs else None
        # ``w`` holds q, k, v, o, gate, up, down by now, keys built from the family's tables: mypy
        # cannot match a dict's keys to the fields they fill
        layers.append(LayerWeights(index=i, ln1=get(p + names.ln1), ln2=ln2,
                                   bias=bias, norms=norms, mla=latent, sinks=sinks, linear=linear,
                                   **w))  # type: ignore[arg-type]
        if sparse:
            assert moe is not None
            if moe.stacked:
                # not ``split``: that is the fused-tensor cutter above, which the next layer still calls
                tp_split = layout.plan.tp > 1 and not layout.plan.expert_parallel
                experts = _stacked_experts(get, tp_split, p, moe.stacked, rank_layout, moe.experts)
            else:
                experts = {e: tuple(get(p + t.format(e=e)) for t in moe.expert)
                           for e in range(moe.experts) if _held(specs, p + moe.expert[0].format(e=e))}
            layers[-1].moe = MoeWeights(
                router=get(p + moe.router),
                experts=experts,
                shared=tuple(get(p + t) for t in moe.shared) if moe.shared else None,  # type: ignore[arg-type]
                shared_gate=get(p + moe.shared_gate) if moe.shared_gate else None,
                score_bias=get(p + moe.score_bias) if moe.score_bias else None,
                router_bias=get(p + moe.router_bias) if moe.router_bias else None)
    embed = get(names.embed) if names.embed in specs else None
    last = rank_layout.pp_stage == layout.plan.pp - 1
    lm_head = None
    if last:
        # Tied embeddings with pp = 1: the Layout stores the embedding once and no lm_head tensor.
        lm_head = get(names.lm_head) if names.lm_head in specs else embed
    # The first vocabulary row of this rank's slice, as the Layout cut it (rows after it are padding).
    vocab_spec = specs.get(names.embed) or specs.get(names.lm_head)
    vocab_start = (vocab_spec.start or 0) if vocab_spec is not None else 0
    return StageWeights(
        layers=layers,
        embed=embed,
        vocab_start=vocab_start,
        norm=get(names.final_norm) if last else None,
        lm_head=lm_head,
    )
