"""The decoder forward for one rank of a TP x PP replica: pure tensor math plus a ``Comm``.

One block serves every dense family; what differs between them is data, the family module's
``Forward`` (layout/families/family.py): the norm's form, q/k norms, sandwich norms, embedding,
residual and logit multipliers, soft-capping, sliding windows and local rope bases.

Numerics follow Hugging Face's modeling files (for Llama: RMSNorm in fp32 then weight * x in the
model dtype, rotary tables computed in fp32 and cast, SDPA attention, a gated MLP with the
config's activation; Gemma's norm scales by 1 + w in fp32 and its soft-capped attention is the
eager matmul-softmax-matmul transformers runs), so a tp1pp1 replica reproduces the reference. Tensor parallel is the Megatron pattern: column-parallel q/k/v/gate/up need no
communication, row-parallel o/down produce partial sums that are all-reduced (formed in fp32 and
rounded once, in rank order), the embedding is vocabulary-parallel (masked lookup + all-reduce) and the lm_head
produces a vocabulary slice of the logits that is gathered before any softmax.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..layout.families.family import Forward
from .deltanet import DeltaNetState, linear_attention
from .indexer import keep, select
from .moe import route, stacked_expert
from .qk import apply_rope, whole_qk_norm
from .qk import rotate_half as _rotate_half
from .rankweights import Dims, LayerWeights, MoeWeights, StageWeights
from .rope import rope_tables
from .support import activation_fn


class TPComm(Protocol):
    """What the forward needs from the tensor-parallel group (see comm.py)."""

    tp: int
    tp_rank: int
    dp_rank: int

    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor: ...

    def all_reduce_experts(self, x: torch.Tensor, what: str) -> torch.Tensor: ...

    def gather_vocab(self, x: torch.Tensor, what: str, everyone: bool) -> torch.Tensor | None: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_upcast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss's RMSNorm: the weight multiplies the fp32 normed x, then the cast."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dtype)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is an offset from 1, applied in fp32 before the cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


class KVCache:
    """Preallocated keys/values for one micro-batch: [batch, local kv heads, max_len, head_dim] per layer.

    With MLA (``dims.latent``) it holds what transformers' cache holds: ``k`` the normed latent
    [batch, 1, max_len, kv_lora_rank] and ``v`` the rotated shared key [batch, 1, max_len,
    qk_rope_head_dim], whole on every TP rank; each step expands them to this rank's heads. With DSA
    (``dims.index_dim``) ``index`` holds the indexer's keys [batch, max_len, index_head_dim] of the
    layers that run their own indexer."""

    def __init__(self, layers: list[int], batch: int, dims: Dims, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (batch, dims.kv_heads, max_len, dims.head_dim)
        kshape, vshape = ((batch, 1, max_len, dims.latent[0]), (batch, 1, max_len, dims.latent[1])) \
            if dims.latent else (shape, shape)
        # a linear-attention layer keeps a state (``linear``), no keys or values
        attn = [i for i in layers if not (dims.linear and dims.linear[i])]
        self.k = {i: torch.empty(kshape, dtype=dtype, device=device) for i in attn}
        self.v = {i: torch.empty(vshape, dtype=dtype, device=device) for i in attn}
        index = dims.index_dim
        self.index = {} if index is None else {
            i: torch.empty((batch, max_len, index), dtype=dtype, device=device) for i in layers}
        # a linear-attention layer's conv and recurrent state (runtime/deltanet.py), filled by the prefill
        self.linear = {i: DeltaNetState() for i in layers if dims.linear and dims.linear[i]}
        self.length = 0


class StageModel:
    """The forward of one rank's share of the model. Stateless apart from the weights."""

    def __init__(self, weights: StageWeights, dims: Dims, model: dict[str, Any], comm: TPComm,
                 dtype: torch.dtype, device: torch.device, fwd: Forward) -> None:
        self.w, self.d, self.model, self.comm, self.f = weights, dims, model, comm, fwd
        self.dtype, self.device = dtype, device
        # the rotary tables' width: MLA rotates qk_rope_head_dim dimensions per head, a partial rope rotary_dim
        rotary = fwd.mla.rope if fwd.mla is not None else fwd.rotary_dim
        self._rope_model = model if rotary is None else {**model, "head_dim": rotary}
        if device.type == "cuda":
            # Attention backend, chosen deliberately: PyTorch would pick cuDNN's SDPA for a GQA
            # decode, which plans anew for every KV length (14 ms of host time per call, measured on
            # an H200, for 0.004 ms of GPU work). Flash attention (GQA native, no per-shape set-up)
            # serves prefill and decode over the preallocated KV cache; the math kernel remains the
            # fallback for what flash cannot take (fp32, head_dim > 256). CPU keeps PyTorch's choice.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._chosen: torch.Tensor | None = None  # DSA: the top-k a "shared" indexer layer reuses
        fn, kwargs = activation_fn(fwd.activation)
        self._act = functools.partial(getattr(F, fn), **kwargs)
        self._norm = {"gemma": gemma_norm, "rms_upcast": rms_norm_upcast}.get(fwd.norm, rms_norm)

    def _rope(self, start: int, length: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions start..start+length; ``local``: the sliding layers' own base."""
        need = start + length
        cos, sin = self._tables.get(local, (torch.empty(0), torch.empty(0)))
        if need > cos.shape[0]:
            size = max(need, 2 * cos.shape[0], 256)
            model = self._rope_model if not local else {
                "head_dim": self.model["head_dim"], "rope_theta": self.f.rope_theta_local}
            cos, sin = rope_tables(model, size, self.dtype)
            self._tables[local] = cos.to(self.device), sin.to(self.device)
        cos, sin = self._tables[local]
        return cos[start:need], sin[start:need]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rows outside this rank's slice are zero, the all-reduce fills them."""
        table = self.w.embed
        assert table is not None
        if self.comm.tp == 1:
            h = F.embedding(ids, table)
        else:
            local = ids - self.w.vocab_start
            outside = (local < 0) | (local >= table.shape[0])
            h = F.embedding(local.clamp(0, table.shape[0] - 1), table)
            h = h.masked_fill(outside[..., None], 0)
            h = self.comm.all_reduce_sum(h, "embedding all-reduce")
        scale = self.f.embed_scale
        if scale is None:
            return h
        # Gemma rounds sqrt(hidden) to the model dtype first; Granite multiplies by the float
        return h * (torch.tensor(scale, dtype=h.dtype) if self.f.embed_scale_in_dtype else scale)

    def layers(self, h: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Every local layer. With a cache, h holds positions cache.length.. and the cache is extended."""
        start = cache.length if cache is not None else 0
        t = h.shape[1]
        self._chosen = None
        for lw in self.w.layers:
            local = self.f.window(lw.index) is not None and self.f.rope_theta_local is not None
            cos, sin = self._rope(start, t, local)
            h = self._layer(lw, h, cos, sin, cache, start)
        if cache is not None:
            cache.length = start + h.shape[1]
        return h

    def _layer(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: KVCache | None, start: int) -> torch.Tensor:
        d, b, f, norm = self.d, lw.bias, self.f, self._norm
        t = x.shape[1]
        h = norm(x, lw.ln1, d.eps)
        if t > 1 and start:
            raise AssertionError("prefill continuing a non-empty cache is not supported")
        if f.mla is not None:
            a = self._mla(lw, h, cos, sin, cache, start)
        elif lw.linear:  # Gated DeltaNet (runtime/deltanet.py); its state in the cache
            state = cache.linear[lw.index] if cache is not None else DeltaNetState()
            assert f.hybrid is not None
            a = linear_attention(f.hybrid, lw.linear, h, d.eps, state, self.comm.tp_rank)
        else:
            a = self._qkv_attention(lw, h, cos, sin, cache, start)
        o = self._row(a, lw.o, b.get("o"), f"layer {lw.index} attention all-reduce")
        if f.sandwich:
            o = norm(o, lw.norms["post_attn"], d.eps)
        x = x + (o if f.residual_scale == 1.0 else o * f.residual_scale)
        h = norm(x, lw.ln2, d.eps)
        if lw.moe is not None:
            m = self._moe(lw.moe, h, f"layer {lw.index} moe all-reduce")
        else:
            # a dense layer: they are None on a sparse one only
            assert lw.gate is not None and lw.up is not None and lw.down is not None
            g = self._act(_linear(h, lw.gate, b.get("gate"))) * _linear(h, lw.up, b.get("up"))
            m = self._row(g, lw.down, b.get("down"), f"layer {lw.index} mlp all-reduce")
        if f.sandwich:
            m = norm(m, lw.norms["post_ffw"], d.eps)
        return x + (m if f.residual_scale == 1.0 else m * f.residual_scale)

    def _qkv_attention(self, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: KVCache | None, start: int) -> torch.Tensor:
        """q/k/v projections, rope, attention: [batch, t, local heads x head_dim]."""
        d, b, f, norm = self.d, lw.bias, self.f, self._norm
        bsz, t, _ = h.shape
        assert lw.q is not None and lw.k is not None and lw.v is not None
        q, k = _linear(h, lw.q, b.get("q")), _linear(h, lw.k, b.get("k"))
        v = _linear(h, lw.v, b.get("v")).view(bsz, t, d.kv_heads, d.head_dim).transpose(1, 2)
        gate = None
        if f.hybrid is not None:  # gated attention, q_proj: [query, gate] per head (Qwen3-Next, Qwen3.5)
            q, gate = torch.chunk(q.view(bsz, t, d.heads, 2 * d.head_dim), 2, dim=-1)
            q, gate = q.reshape(bsz, t, -1), gate.reshape(bsz, t, -1)
        if f.qk_norm_whole:  # over every head's width, before rope (MiniMax-M2; runtime/qk.py)
            q, k = whole_qk_norm(q, k, lw.norms["q_norm"], lw.norms["k_norm"], d.eps, self.model["num_heads"],
                                 self.model["num_kv_heads"], d.head_dim, self.comm, f"layer {lw.index}")
        q, k = q.view(bsz, t, d.heads, d.head_dim), k.view(bsz, t, d.kv_heads, d.head_dim)
        if f.qk_norm:  # per head, before rope (Qwen3, Gemma 3)
            q, k = norm(q, lw.norms["q_norm"], d.eps), norm(k, lw.norms["k_norm"], d.eps)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            cache.k[lw.index][:, :, start : start + t] = k
            cache.v[lw.index][:, :, start : start + t] = v
            k = cache.k[lw.index][:, :, : start + t]
            v = cache.v[lw.index][:, :, : start + t]
        # Prefill always starts at position 0 (no chunked prefill), so is_causal's top-left mask is
        # right; a single decode query attends to everything cached (inside its window).
        a = self._attend(q, k, v, start, f.window(lw.index), lw.sinks)
        a = a.transpose(1, 2).reshape(bsz, t, d.heads * d.head_dim)
        return a if gate is None else a * torch.sigmoid(gate)

    def _mla(self, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: KVCache | None, start: int) -> torch.Tensor:
        """Multi-head latent attention (DeepSeek-V3) for this rank's whole heads: [batch, t, local
        heads x v_head_dim], computed as transformers' DeepseekV3Attention with eager attention,
        operation for operation (docs/architecture.md §4, "How the runtime computes MLA").

        The latent (kv_a_proj_with_mqa, normed) and the shared rotary key are the same on every
        rank (replicated projections); the cache keeps them, not per-head keys, and each step
        expands the whole cached sequence through this rank's rows of kv_b_proj, as transformers
        expands its cache."""
        a, w = self.f.mla, lw.mla
        assert a is not None
        bsz, t, _ = h.shape
        assert lw.q is not None
        if a.q_lora_rank is None:
            q = F.linear(h, lw.q)
        else:
            q_latent = rms_norm(F.linear(h, w["q_a"]), w["q_a_norm"], a.latent_eps)
            q = F.linear(q_latent, lw.q)
        q = q.view(bsz, t, -1, a.nope + a.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [a.nope, a.rope], dim=-1)
        kv_nope, k_rot = torch.split(F.linear(h, w["kv_a"]), [a.kv_lora_rank, a.rope], dim=-1)
        kv_nope = rms_norm(kv_nope, w["kv_a_norm"], a.latent_eps).view(bsz, 1, t, a.kv_lora_rank)
        k_rot = k_rot.view(bsz, 1, t, a.rope)
        if a.interleave:  # pairs (x0, x1), (x2, x3)...: transformers' apply_rotary_pos_emb_interleave
            c, s = cos[..., : a.rope // 2], sin[..., : a.rope // 2]
            q_rot, k_rot = (torch.cat([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 1::2] * c + x[..., 0::2] * s],
                                      dim=-1) for x in (q_rot, k_rot))
        else:
            q_rot, k_rot = (x * cos + _rotate_half(x) * sin for x in (q_rot, k_rot))
        if cache is not None:
            cache.k[lw.index][:, :, start : start + t] = kv_nope
            cache.v[lw.index][:, :, start : start + t] = k_rot
            kv_nope, k_rot = cache.k[lw.index][:, :, : start + t], cache.v[lw.index][:, :, : start + t]
        query = torch.cat((q_pass, q_rot), dim=-1)
        n = kv_nope.shape[2]
        kv = F.linear(kv_nope, w["kv_b"]).view(bsz, n, -1, a.nope + a.v).transpose(1, 2)
        k_nope, value = torch.split(kv, [a.nope, a.v], dim=-1)
        key = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        # eager attention (transformers' eager_attention_forward): scores in the model dtype times
        # the scale, the causal mask, softmax in fp32 rounded back, then the values
        scale = self.f.attn_scale
        assert scale is not None  # an MLA family gives its softmax scale (families/deepseek.py)
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        mask = torch.ones(t, n, dtype=torch.bool, device=h.device).tril(n - t) if t > 1 else None
        if a.indexer is not None:  # DSA: only the indexer's top-k tokens (runtime/indexer.py)
            if a.indexer.own[lw.index]:
                keys = cache.index[lw.index] if cache is not None else None
                self._chosen = select(a.indexer, w, h, q_latent, cos, sin, keys, start)
            assert self._chosen is not None  # a stage never starts on a shared layer (support.py)
            mask = keep(self._chosen, n) if mask is None else keep(self._chosen, n) & mask
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, value)
        return out.transpose(1, 2).reshape(bsz, t, -1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q (positions start..) over k/v (positions 0..), within ``window``
        keys of each query when given (transformers: kv > q - window)."""
        d, f = self.d, self.f
        t, n = q.shape[2], k.shape[2]
        scale = f.attn_scale if f.attn_scale is not None else d.head_dim**-0.5
        mask = None
        if (window is not None and n > window) or f.attn_softcap is not None or (sinks is not None and t > 1):
            qpos = torch.arange(start, start + t, device=q.device)[:, None]
            kpos = torch.arange(n, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
        if f.attn_softcap is None and sinks is None:
            causal = t > 1 and mask is None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=d.heads != d.kv_heads)
        # Soft-capped scores (Gemma 2) or sinks (gpt-oss): no fused kernel takes them;
        # transformers' eager path
        groups = d.heads // d.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if f.attn_softcap is not None:
            scores = soft_cap(scores, f.attn_softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if sinks is None:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(probs, v)
        # each head's sink logit joins the softmax (in the model dtype, after subtracting the row's
        # maximum, as transformers' gpt-oss eager attention) and is dropped after it
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, t, -1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)

    def _moe(self, mw: MoeWeights, h: torch.Tensor, what: str) -> torch.Tensor:
        """A mixture-of-experts MLP (docs/architecture.md §4, "How the runtime computes an MoE layer").

        Every rank routes every token (the router is replicated), then adds, for each routed expert
        it holds, in expert-id order, the expert's output times its routing weight: with the experts
        split over TP that output is a partial sum over this rank's slice of the intermediate
        dimension; with expert parallelism it is the whole expert's output, and only the rank that
        holds the expert adds it. Either way the sum over ranks is the layer's output, so one
        all-reduce finishes it. At tp = 1 this is transformers' experts loop, operation for
        operation (same order, same dtypes)."""
        moe = self.f.moe
        assert moe is not None
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        weights, chosen = route(moe, mw, x)
        # Experts split over TP give partial sums: those are added in fp32 and rounded once, after
        # the all-reduce (as the dense MLP's row-parallel sums are); whole experts (tp = 1, or
        # expert parallelism) are added in the model dtype, as transformers adds them.
        partial = self.comm.tp > 1 and len(mw.experts) == moe.experts
        out = torch.zeros(x.shape, dtype=torch.float32 if partial else x.dtype, device=x.device)
        for e, w in sorted(mw.experts.items()):
            slot, token = torch.where(chosen.T == e)  # by slot, then token: transformers' order
            if token.numel() == 0:
                continue
            y = stacked_expert(moe, x[token], *w) if moe.stacked else \
                F.linear(self._act(F.linear(x[token], w[0])) * F.linear(x[token], w[1]), w[2])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        out = self.comm.all_reduce_experts(out, what).to(x.dtype)
        if mw.shared is not None:  # Qwen2-MoE: added to the experts' sum, as transformers does
            gate, up, down = mw.shared
            shared = F.linear(self._act(F.linear(x, gate)) * F.linear(x, up), down)
            if self.comm.tp > 1:  # split over TP like a dense MLP (the same in every DP group)
                shared = self.comm.all_reduce_sum(shared, f"{what} (shared expert)")
            if mw.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, mw.shared_gate)) * shared
            out = out + shared
        return out.reshape(shape)

    def _row(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what: str) -> torch.Tensor:
        """Row-parallel projection: local partial sum, all-reduced; the (replicated) bias added once
        (at tp = 1 inside the one linear, as transformers' nn.Linear adds it)."""
        if self.comm.tp == 1:
            return F.linear(x, w, bias)
        y = F.linear(x, w)
        if self.comm.tp > 1:
            y = self.comm.all_reduce_sum(y, what)
        return y if bias is None else y + bias

    def logits(self, h: torch.Tensor, everyone: bool = True) -> torch.Tensor | None:
        """Final norm + vocabulary-parallel lm_head; fp32 logits over the true vocabulary.

        With ``everyone=False`` only TP rank 0 receives the gathered logits (others get None).
        """
        assert self.w.norm is not None and self.w.lm_head is not None
        h = self._norm(h, self.w.norm, self.d.eps)
        local = F.linear(h, self.w.lm_head)
        if self.f.logits_divisor != 1.0:  # Granite, in the model dtype as transformers divides
            local = local / self.f.logits_divisor
        if self.f.final_softcap is not None:  # Gemma 2, elementwise: the same on a vocabulary slice
            local = soft_cap(local, self.f.final_softcap)
        local = local.float()
        full = self.comm.gather_vocab(local, "lm_head logits gather", everyone) if self.comm.tp > 1 else local
        return None if full is None else full[..., : self.d.vocab]
