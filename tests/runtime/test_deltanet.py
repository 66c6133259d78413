"""shardc/runtime/deltanet.py against transformers' own Gated DeltaNet (Qwen3-Next, Qwen3.5), bit
for bit (torch.equal): the gated norm, the conv with its cache semantics, both delta rules, whole
layers through a transformers cache (prefill, decode steps, a multi-token continuation), and a
rank's subset of heads against the slice of the full result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardc.runtime import deltanet as dn

tq = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import DynamicCache, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as t35  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
HK, HV, DK, DV, KERNEL = 4, 8, 16, 8, 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _rule_inputs(t: int, dtype: torch.dtype, seed: int, b: int = 2):
    q = _rand(b, t, HK, DK, dtype=dtype, seed=seed)
    k = _rand(b, t, HK, DK, dtype=dtype, seed=seed + 1)
    v = _rand(b, t, HV, DV, dtype=dtype, seed=seed + 2)
    beta = _rand(b, t, HV, dtype=dtype, seed=seed + 3).sigmoid()
    g = -F.softplus(_rand(b, t, HV, seed=seed + 4))  # fp32, as the layer computes it
    return q, k, v, g, beta


def _kw() -> dict[str, bool]:
    return {"output_final_state": True, "use_qk_l2norm_in_kernel": True}


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype: torch.dtype) -> None:
    norm = tq.Qwen3NextRMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_rand(DV, seed=5))
    x, z = _rand(30, DV, dtype=dtype, seed=6), _rand(30, DV, dtype=dtype, seed=7)
    with torch.no_grad():
        assert torch.equal(dn.gated_rms_norm(x, z, norm.weight, 1e-6), norm(x, z))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 4, 9])
def test_conv_prefill_then_steps(dtype: torch.dtype, t: int) -> None:
    cfg = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"])
    ch = 24
    conv = torch.nn.Conv1d(ch, ch, KERNEL, groups=ch, bias=False, padding=KERNEL - 1).to(dtype)
    cache = DynamicCache(config=cfg)
    x = _rand(2, ch, t, dtype=dtype, seed=8)
    with torch.no_grad():
        ref = tq.causal_conv1d_forward(conv, x, cache, 0, activation="silu")
        y, state = dn.conv_prefill(x, conv.weight, "silu")
        assert torch.equal(y, ref)
        assert torch.equal(state, cache.layers[0].conv_states[0])
        assert state.shape == (2, ch, KERNEL) and state.dtype == dtype
        for step in range(3):
            xs = _rand(2, ch, 1, dtype=dtype, seed=20 + step)
            ref = tq.causal_conv1d_forward(conv, xs, cache, 0, activation="silu")
            assert torch.equal(dn.conv_step(xs, state, conv.weight, "silu"), ref)
            assert torch.equal(state, cache.layers[0].conv_states[0])
        # several tokens after earlier ones: the conv runs over cat(state, x)
        xs = _rand(2, ch, 5, dtype=dtype, seed=30)
        ref = tq.causal_conv1d_forward(conv, xs, cache, 0, activation="silu")
        y, state = dn.conv_prefill(xs, conv.weight, "silu", prev_state=state)
        assert torch.equal(y, ref)
        assert torch.equal(state, cache.layers[0].conv_states[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_rule(dtype: torch.dtype, t: int, with_state: bool) -> None:
    q, k, v, g, beta = _rule_inputs(t, dtype, seed=t)
    s0 = _rand(2, HV, DK, DV, seed=99) * 0.1 if with_state else None
    ref_out, ref_s = tq.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0,
                                                     **_kw())
    out, s = dn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert out.dtype == dtype and s.dtype == torch.float32
    assert torch.equal(out, ref_out) and torch.equal(s, ref_s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_decode_after_chunked_prefill(dtype: torch.dtype) -> None:
    q, k, v, g, beta = _rule_inputs(70, dtype, seed=3)
    _, s = dn.chunk_gated_delta_rule(q, k, v, g, beta)
    ref_s = s
    for step in range(3):
        qs, ks, vs, gs, bs = _rule_inputs(1, dtype, seed=40 + 5 * step)
        ref_out, ref_s = tq.torch_recurrent_gated_delta_rule(qs, ks, vs, g=gs, beta=bs,
                                                             initial_state=ref_s, **_kw())
        s_before = s.clone()
        out, s = dn.recurrent_gated_delta_rule(qs, ks, vs, gs, bs, s)
        assert torch.equal(out, ref_out) and torch.equal(s, ref_s)
        assert not torch.equal(s, s_before)
    # several tokens at once, from no state, also match
    q, k, v, g, beta = _rule_inputs(5, dtype, seed=60)
    ref_out, ref_s = tq.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **_kw())
    out, s = dn.recurrent_gated_delta_rule(q, k, v, g, beta, None)
    assert torch.equal(out, ref_out) and torch.equal(s, ref_s)


def _next_layer(dtype: torch.dtype):
    cfg = Qwen3NextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                          linear_num_key_heads=HK, linear_num_value_heads=HV,
                          linear_key_head_dim=DK, linear_value_head_dim=DV,
                          linear_conv_kernel_dim=KERNEL)
    torch.manual_seed(0)
    layer = tq.Qwen3NextGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        layer.dt_bias.copy_(torch.rand(HV) * 2 - 1)
        layer.norm.weight.copy_(torch.rand(DV) + 0.5)
    return cfg, layer.to(dtype).eval()


def _next_projections(layer, h: torch.Tensor):
    """Qwen3-Next's fused projections, split per key head: [q | k | v(r heads) | z(r heads)]."""
    bsz, t, _ = h.shape
    r = HV // HK
    qkvz = F.linear(h, layer.in_proj_qkvz.weight).view(bsz, t, HK, 2 * DK + 2 * r * DV)
    q, k, v, z = torch.split(qkvz, [DK, DK, r * DV, r * DV], dim=3)
    ba = F.linear(h, layer.in_proj_ba.weight).view(bsz, t, HK, 2 * r)
    b, a = torch.split(ba, [r, r], dim=3)
    return (q, k, v.reshape(bsz, t, HV, DV), z.reshape(bsz, t, HV, DV),
            b.reshape(bsz, t, HV), a.reshape(bsz, t, HV))


def _qwen35_layer(dtype: torch.dtype):
    cfg = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                            linear_num_key_heads=HK, linear_num_value_heads=HV,
                            linear_key_head_dim=DK, linear_value_head_dim=DV,
                            linear_conv_kernel_dim=KERNEL)
    torch.manual_seed(1)
    layer = t35.Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        layer.dt_bias.copy_(torch.rand(HV) * 2 - 1)
        layer.norm.weight.copy_(torch.rand(DV) + 0.5)
    return cfg, layer.to(dtype).eval()


def _qwen35_projections(layer, h: torch.Tensor):
    bsz, t, _ = h.shape
    q, k, v = torch.split(F.linear(h, layer.in_proj_qkv.weight), [HK * DK, HK * DK, HV * DV], -1)
    return (q.reshape(bsz, t, HK, DK), k.reshape(bsz, t, HK, DK), v.reshape(bsz, t, HV, DV),
            F.linear(h, layer.in_proj_z.weight).reshape(bsz, t, HV, DV),
            F.linear(h, layer.in_proj_b.weight), F.linear(h, layer.in_proj_a.weight))


def _ours(layer, proj, h: torch.Tensor, state: dn.DeltaNetState) -> torch.Tensor:
    q, k, v, z, b, a = proj(layer, h)
    core = dn.gated_deltanet(q, k, v, z, b, a, layer.A_log, layer.dt_bias, layer.conv1d.weight,
                             layer.norm.weight, layer.norm.variance_epsilon, state)
    return F.linear(core.reshape(h.shape[0], h.shape[1], -1), layer.out_proj.weight)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize(("t", "dtype"), [(70, torch.bfloat16), (3, torch.bfloat16),
                                          (70, torch.float32)])
def test_whole_layer_prefill_then_decode(family: str, t: int, dtype: torch.dtype) -> None:
    """The layer forward of transformers (its cache) == our functions composed the same way: a
    prefill (t > 64 and not a multiple of it, or t < kernel), 3 decode steps, a 5-token continuation."""
    cfg, layer = _next_layer(dtype) if family == "qwen3_next" else _qwen35_layer(dtype)
    proj = _next_projections if family == "qwen3_next" else _qwen35_projections
    cache, state = DynamicCache(config=cfg), dn.DeltaNetState()
    with torch.no_grad():
        for i, n in enumerate([t, 1, 1, 1, 5]):
            h = _rand(2, n, 32, dtype=dtype, seed=100 + i)
            ref = layer(h, cache=cache)
            assert torch.equal(_ours(layer, proj, h, state), ref), f"call {i} (t={n})"
            assert state.conv is not None and state.recurrent is not None
            assert torch.equal(state.conv, cache.layers[0].conv_states[0])
            assert torch.equal(state.recurrent, cache.layers[0].recurrent_states[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_subset_of_heads_is_the_slice(dtype: torch.dtype, tp: int) -> None:
    """Each rank's key heads, their value heads, conv channels, A_log and dt_bias alone give
    exactly that slice of the full result, state included: prefill, decode steps, a continuation.
    32 value heads of dim 32, so that (on AVX512) the full layer's [1, 1, 32] beta/g run through
    SIMD and a rank's 16 through the scalar tail: beta_and_decay's full-width trick is exercised."""
    hk, hv, dk, dv, r = 16, 32, 32, 32, 2
    conv_w = _rand(2 * hk * dk + hv * dv, 1, KERNEL, dtype=dtype, seed=300) * 0.5
    A_log, dt_bias = _rand(hv, dtype=dtype, seed=301), _rand(hv, dtype=dtype, seed=302)
    norm_w = (_rand(dv, seed=303) * 0.1 + 1).to(dtype)
    full_state, states = dn.DeltaNetState(), [dn.DeltaNetState() for _ in range(tp)]
    for i, n in enumerate([70, 1, 1, 1, 5]):
        q, k = (_rand(1, n, hk, dk, dtype=dtype, seed=310 + 10 * i + j) for j in (0, 1))
        v, z = (_rand(1, n, hv, dv, dtype=dtype, seed=312 + 10 * i + j) for j in (0, 1))
        b, a = (_rand(1, n, hv, dtype=dtype, seed=314 + 10 * i + j) for j in (0, 1))
        full = dn.gated_deltanet(q, k, v, z, b, a, A_log, dt_bias, conv_w, norm_w, 1e-6, full_state)
        assert full_state.conv is not None and full_state.recurrent is not None
        for rank, state in enumerate(states):
            ks = range(rank * hk // tp, (rank + 1) * hk // tp)
            vs = slice(ks.start * r, ks.stop * r)
            chans = dn.local_conv_channels(ks, hk, dk, hv, dv)
            kh = slice(ks.start, ks.stop)
            part = dn.gated_deltanet(
                *(x.contiguous() for x in (q[:, :, kh], k[:, :, kh], v[:, :, vs], z[:, :, vs],
                                           b[..., vs], a[..., vs], A_log[vs], dt_bias[vs])),
                conv_w[chans], norm_w, 1e-6, state, v_head_offset=vs.start, num_v_heads=hv)
            assert part.shape == (1, n, hv // tp, dv)
            assert torch.equal(part, full[:, :, vs]), f"call {i} (t={n}), rank {rank}"
            assert torch.equal(state.conv, full_state.conv[:, chans])
            assert torch.equal(state.recurrent, full_state.recurrent[:, vs])


def test_local_conv_channels() -> None:
    """[all q | all k | all v] channels of key heads 1..2 of 4 (dk 2), value heads 2..5 (dv 1)."""
    got = dn.local_conv_channels(range(1, 3), 4, 2, 8, 1).tolist()
    assert got == [2, 3, 4, 5, 10, 11, 12, 13, 18, 19, 20, 21]
