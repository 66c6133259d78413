"""Hybrid linear attention as data (``Forward.hybrid``): Qwen3-Next's Gated DeltaNet layers beside
its full-attention layers, what runtime/deltanet.py and runtime/decoder.py compute (``LINEAR``:
its tensors by role). Pure data: no torch.

A linear-attention layer keeps, per sequence, a fixed-size state instead of a KV cache: the last
``conv_kernel - 1`` inputs of its causal depthwise conv1d and one ``key_dim x value_dim`` matrix
per value head (the delta rule's memory). Its heads: ``key_heads`` heads of ``key_dim`` for q and
k, ``value_heads`` (a multiple) of ``value_dim`` for v and the output gate z; each key head owns
``value_heads / key_heads`` consecutive value heads, so TP gives a rank whole key heads and their
value heads, and every operation of the layer is per head or per channel: a rank's slice is
exact, with ``out_proj`` row-parallel like ``o_proj``.

The full-attention layers of these models are gated: ``q_proj`` emits each head's query and an
output gate side by side ([q_h, gate_h] per head), and the attention output is multiplied by
sigmoid(gate) before ``o_proj`` (every hybrid family shardc reads gates them).

Qwen3.5 stores the same layer's in-projections apart (``fused_qkvz=False``, ``LINEAR_SPLIT``):
``in_proj_qkv`` with rows [all q | all k | all v] (the conv's channel order, so TP cuts it in the
same three parts), ``in_proj_z`` (value heads), ``in_proj_b`` and ``in_proj_a`` (one row per value head).
"""

from __future__ import annotations

from dataclasses import dataclass

# a linear-attention layer's tensors under model.layers.N., by the decoder's role
LINEAR = (("qkvz", "linear_attn.in_proj_qkvz.weight"), ("ba", "linear_attn.in_proj_ba.weight"),
          ("conv", "linear_attn.conv1d.weight"), ("A_log", "linear_attn.A_log"),
          ("dt_bias", "linear_attn.dt_bias"), ("norm", "linear_attn.norm.weight"),
          ("o", "linear_attn.out_proj.weight"))
# Qwen3.5's: the in-projections apart (``Hybrid.fused_qkvz`` False)
LINEAR_SPLIT = (("qkv", "linear_attn.in_proj_qkv.weight"), ("z", "linear_attn.in_proj_z.weight"),
                ("b", "linear_attn.in_proj_b.weight"), ("a", "linear_attn.in_proj_a.weight"),
                *LINEAR[2:])


@dataclass(frozen=True)
class Hybrid:
    """Which layers are linear attention, and their sizes (linear_* config keys)."""

    linear: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention (False)
    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads
    key_dim: int  # linear_key_head_dim
    value_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    # in_proj_qkvz / in_proj_ba fused per key head (Qwen3-Next, LINEAR), or in_proj_qkv / _z / _b / _a
    # apart (Qwen3.5, LINEAR_SPLIT)
    fused_qkvz: bool = True
    state_fp32: bool = False  # mamba_ssm_dtype float32 (Qwen3.5): vLLM keeps the delta rule's state in fp32

    def state_bytes(self, layers: int, tp: int, dtype_bytes: int) -> int:
        """One sequence's state in ``layers`` linear layers on one GPU, as vLLM holds it
        (MambaStateShapeCalculator.gated_delta_net_state_shape): the conv's last kernel - 1 inputs of
        its channels / tp in the model dtype, and value_heads / tp matrices of key_dim x value_dim in
        the model dtype (fp32 with ``state_fp32``)."""
        conv = self.conv_channels // tp * (self.conv_kernel - 1) * dtype_bytes
        delta = self.value_heads // tp * self.key_dim * self.value_dim * (4 if self.state_fp32 else dtype_bytes)
        return layers * (conv + delta)

    @property
    def conv_channels(self) -> int:
        """The conv1d's channels: q and k of every key head, then v of every value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
