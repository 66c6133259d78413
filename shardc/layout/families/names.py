"""The tensor names a family's runtime block reads, by the decoder's role (``Forward.names``).

Outside ``layout/families/`` no module spells a family's tensor name (``tests/test_family_names.py``
fails when one does): the runtime (``runtime/weights.py``), the Layout's stage placement and the
planner read them from here, through the model's ``Forward``. A family whose checkpoint names a
tensor differently declares its own ``Names``; today every family stores Llama's names, so the
defaults are Llama's and the shared rows in ``family.py`` are spelled from them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The projections, by the decoder's role (runtime/rankweights.py LayerWeights' fields): the module
# under model.layers.N., whose ``.weight`` (and ``.bias`` where the table has one) the block reads.
PROJECTIONS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
               ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
               ("down", "mlp.down_proj"))
# Norms some families add to the block, by role: per-head q/k norms (Qwen3, Gemma 3) and the norm
# after the MLP (Gemma's sandwich)
EXTRA_NORMS = (("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight"),
               ("post_ffw", "post_feedforward_layernorm.weight"))
# MLA's latent projections and their norms (Forward.mla), by role
LATENT = (("q_a", "self_attn.q_a_proj.weight"), ("q_a_norm", "self_attn.q_a_layernorm.weight"),
          ("kv_a", "self_attn.kv_a_proj_with_mqa.weight"),
          ("kv_a_norm", "self_attn.kv_a_layernorm.weight"), ("kv_b", "self_attn.kv_b_proj.weight"))


@dataclass(frozen=True)
class Names:
    """Where each role's tensor is in the checkpoint. Layer names are relative to
    ``model.layers.N.`` (``layer_prefix``); a role whose tensor the rank does not hold is absent
    from that family's model (the runtime asks the rank's tensor records, not this table)."""

    embed: str = "model.embed_tokens.weight"  # on the first pipeline stage
    final_norm: str = "model.norm.weight"  # on the last stage, with the lm_head
    lm_head: str = "lm_head.weight"  # absent when tied (pp = 1: the embedding serves)
    layer_prefix: str = "model.layers.{i}."
    ln1: str = "input_layernorm.weight"
    ln2: str = "post_attention_layernorm.weight"
    # Gemma's sandwich: when the layer holds this norm it precedes the MLP, and ``ln2`` follows
    # attention instead (the decoder's ``post_attn`` role)
    pre_mlp_norm: str = "pre_feedforward_layernorm.weight"
    projections: tuple[tuple[str, str], ...] = PROJECTIONS
    norms: tuple[tuple[str, str], ...] = EXTRA_NORMS
    latent: tuple[tuple[str, str], ...] = LATENT
    q_b: str = "self_attn.q_b_proj.weight"  # MLA with a q LoRA: q's up-projection is the q role
    linear: tuple[tuple[str, str], ...] = ()  # a linear-attention layer's tensors by role (hybrid.py LINEAR)
    sinks: str = "self_attn.sinks"  # per-head attention sinks (Forward.sinks)

    def layer(self, i: int) -> str:
        """The prefix of layer ``i``'s tensor names."""
        return self.layer_prefix.format(i=i)

    def projection(self, role: str) -> str:
        """The module of one projection role (``q``, ``k``, ... ``down``)."""
        return dict(self.projections)[role]


LLAMA = Names()
