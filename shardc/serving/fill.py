"""Which tensors of one rank's shard fill which parameters of an engine's model, checked so that a
build never loads wrong. Pure: no torch, no vLLM (their facts come in as plain data, read by
vllm_plugin.py), so every rule here is tested without an engine.

A shard holds the source's tensors under their checkpoint names, each already cut for its rank by
the Layout (Megatron column / row cuts, the vocabulary padded to a multiple of tp). An engine fuses
some of them; vLLM declares how, as data, and that is all this module reads of it:

* ``packed_modules_mapping`` of the model class (``qkv_proj`` = [q_proj; k_proj; v_proj],
  ``gate_up_proj`` = [gate_proj; up_proj], DeepSeek's ``fused_qkv_a_proj``): a packed parameter is
  its members' rank cuts end to end along dim 0, in the mapping's order;
* fused-MoE expert stacks: ``experts.w13_<leaf>`` is [gate; up] per local expert and
  ``experts.w2_<leaf>`` is down, dim 0 the local expert index from the engine's expert map; which
  checkpoint tensor is gate, up or down is the family's (``Forward.moe.expert``);
* vocabulary-parallel parameters hold the vocabulary rows [start, stop) the engine gives the rank
  (its own padding), zero beyond: the shard's cut must be those very rows;
* the model's checkpoint-name mapper (vLLM's ``hf_to_vllm_mapper``), when it has one.

Everything else is the checkpoint's name. Fail closed: every parameter the engine's own loader
would fill gets exactly its shape from pieces that tile it once, in a dtype it holds exactly, and
every tensor of the shard lands somewhere; anything else is one ServeError naming the parameter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ServeError

# dtype widenings that keep every value (vLLM keeps some routers and norms in fp32 and its own
# loader copies a 16-bit checkpoint tensor into them); anything else must match exactly
EXACT_CASTS = {("bfloat16", "float32"), ("float16", "float32")}
# and one rounding, for the tensors a family keeps in fp32 whatever the plan (Row.dtype "F32", e.g.
# DeepSeek-V3's router): where the engine declares them 16-bit, its own loader rounds the source's
# fp32 the same way (copy_), so the build loads to the very bytes the source does
ROUNDED = {("float32", "bfloat16"), ("float32", "float16")}
_EXPERT = re.compile(r"^(?P<pre>.*\.)?experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<leaf>[^.]+)$")
# a fused-MoE stack: ``<pre>experts.[holder.]w13_<leaf>`` (vLLM 0.32 holds it in ``routed_experts``)
_STACK = re.compile(r"^(?P<pre>.*\.)?experts\.(?:[^.]+\.)*(?P<w>w13|w2)_(?P<leaf>[^.]+)$")


@dataclass(frozen=True)
class Param:
    """One parameter of the engine's model on this worker. ``vocab``: for a vocabulary-parallel
    parameter, the vocabulary rows [start, stop) it holds (the rest of its rows are padding)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.": bfloat16, float32, int32 ...
    vocab: tuple[int, int] | None = None


@dataclass(frozen=True)
class Tensor:
    """One tensor of the rank's shard. ``rows``: a vocabulary cut's source rows [start, stop)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Piece:
    """Where a shard tensor goes: dim 0 rows [offset, offset + rows) of the parameter, inside
    local expert ``expert`` (dim 0 of a fused-MoE stack) when not None. For a vocabulary cut,
    ``rows`` counts its source rows only (its padding stays out)."""

    tensor: str
    expert: int | None
    offset: int
    rows: int


@dataclass(frozen=True)
class ModelFacts:
    """What the engine's model class declares about its parameters' names."""

    packed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    expert_templates: tuple[str, ...] = ()  # the family's gate, up, down checkpoint names ({e})
    local_experts: dict[int, int] | None = None  # global expert id -> local index; None: identity
    rename: Callable[[str], str | None] | None = None  # checkpoint name -> parameter name
    fp32_kept: frozenset[str] = frozenset()  # tensors the family stores fp32 (may round: ROUNDED)


def _roles(templates: tuple[str, ...]) -> dict[str, str]:
    """Expert projection name -> "gate" | "up" | "down", from the family's templates."""
    out = {}
    for role, template in zip(("gate", "up", "down"), templates, strict=False):
        m = _EXPERT.match(template.replace("{e}", "0"))
        if m is not None:
            out[m["proj"]] = role
    return out


def _destination(t: Tensor, facts: ModelFacts, params: dict[str, Param], roles: dict[str, str],
                 shard: dict[str, Tensor], stacks: dict[tuple[str, str, str], str]) -> tuple[str, Piece] | None:
    """(parameter, piece) for one shard tensor, or None when no parameter is named for it."""
    name = facts.rename(t.name) if facts.rename is not None else t.name
    if name is None:
        return None
    m = _EXPERT.match(name)
    if m is not None and m["proj"] in roles:
        role, e, leaf = roles[m["proj"]], int(m["e"]), m["leaf"]
        local = e if facts.local_experts is None else facts.local_experts.get(e)
        if local is None:
            raise ServeError(f"the shard holds expert {e}, which the engine places on another rank",
                             key=t.name, hint="start the engine with the build's expert placement")
        pre = m["pre"] or ""
        w = "w2" if role == "down" else "w13"
        target = stacks.get((pre, w, leaf), f"{pre}experts.{w}_{leaf}")
        offset = 0
        if role == "up":  # [gate; up]: after this expert's gate rows
            gate = next(p for p, r in roles.items() if r == "gate")
            offset = shard[f"{pre}experts.{e}.{gate}.{leaf}"].shape[0] if \
                f"{pre}experts.{e}.{gate}.{leaf}" in shard else 0
        return target, Piece(t.name, local, offset, t.shape[0] if t.shape else 1)
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    for fused, members in facts.packed.items():
        if last in members and last != fused:
            target = f"{parent + '.' if parent else ''}{fused}.{leaf}"
            if target not in params:
                continue  # the engine keeps this member on its own (e.g. no q_lora_rank)
            offset = 0
            for member in members[:members.index(last)]:
                before = shard.get(f"{parent + '.' if parent else ''}{member}.{leaf}")
                offset += 0 if before is None else before.shape[0] if before.shape else 1  # a scalar: one slot
            return target, Piece(t.name, None, offset, t.shape[0] if t.shape else 1)
    return name, Piece(t.name, None, 0, (t.rows[1] - t.rows[0]) if t.rows else (t.shape[0] if t.shape else 1))


def fill_plan(shard: Iterable[Tensor], params: Iterable[Param], must_fill: Iterable[str],
              facts: ModelFacts) -> dict[str, list[Piece]]:
    """Parameter name -> the pieces that fill it, each shard tensor used once; raises ServeError
    (naming the parameter or tensor) unless every parameter in ``must_fill`` is tiled exactly,
    with shapes and dtypes it holds exactly, and every shard tensor has a parameter."""
    tensors = {t.name: t for t in shard}
    by_name = {p.name: p for p in params}
    roles = _roles(facts.expert_templates)
    stacks = {(m["pre"] or "", m["w"], m["leaf"]): name for name in by_name if (m := _STACK.match(name))}
    plan: dict[str, list[Piece]] = {}
    for t in sorted(tensors.values(), key=lambda t: t.name):
        dest = _destination(t, facts, by_name, roles, tensors, stacks)
        if dest is None or dest[0] not in by_name:
            raise ServeError(f"the shard's tensor fills no parameter of the engine's model "
                             f"(looked for {dest[0] if dest else 'a mapped name'})", key=t.name,
                             hint="serve the build with the architecture it was built from; a shardc "
                                  "build of another model or family cannot load here")
        plan.setdefault(dest[0], []).append(dest[1])
    for name in sorted(must_fill):
        if name not in plan:
            raise ServeError("no tensor of the rank's shard fills this parameter", key=name,
                             hint="the engine's model has a parameter the build does not: serve the "
                                  "build with the model config it was built from")
    for name, pieces in plan.items():
        _check(by_name[name], pieces, tensors, facts.fp32_kept)
    return plan


def _check(p: Param, pieces: list[Piece], tensors: dict[str, Tensor], fp32_kept: frozenset[str]) -> None:
    """The pieces tile ``p`` once, each with ``p``'s trailing shape and a dtype it holds exactly."""
    def refuse(what: str) -> ServeError:
        return ServeError(what, key=p.name, hint="the build and the engine disagree on this parameter; "
                                                 "rebuild from the checkpoint the engine's config describes")

    expert_dim = any(pc.expert is not None for pc in pieces)
    inner = p.shape[2:] if expert_dim else p.shape[1:]
    rows = p.shape[1] if expert_dim else (p.shape[0] if p.shape else 1)
    groups: dict[int | None, list[Piece]] = {}
    for pc in pieces:
        t = tensors[pc.tensor]
        if t.dtype != p.dtype and (t.dtype, p.dtype) not in EXACT_CASTS and not (
                t.name in fp32_kept and (t.dtype, p.dtype) in ROUNDED):
            raise refuse(f"the shard's {pc.tensor} is {t.dtype}, the parameter {p.dtype}")
        slot = len(t.shape) == 0 and len(p.shape) == 1  # a per-tensor scalar into its part's slot (ModelOpt)
        if not slot and (tuple(t.shape[1:]) != tuple(inner) or (len(t.shape) == 0) != (len(p.shape) == 0)):
            raise refuse(f"shape {list(p.shape)} cannot hold the shard's {pc.tensor} {list(t.shape)}")
        groups.setdefault(pc.expert, []).append(pc)
    if p.vocab is not None:
        t = tensors[pieces[0].tensor]
        if len(pieces) != 1 or t.rows != p.vocab:
            raise ServeError(f"the engine gives this rank vocabulary rows {list(p.vocab)}, the build's "
                             f"shard holds {list(t.rows) if t.rows else 'its own cut'}", key=p.name,
                             hint="the engine pads the vocabulary its own way: build with a tp whose "
                                  "vocabulary cut matches it (a vocabulary size that is a multiple of 64 x tp)")
        return
    if expert_dim:
        if set(groups) != set(range(p.shape[0])):
            raise refuse(f"holds {p.shape[0]} local experts, the shard fills "
                         f"{sorted(e for e in groups if e is not None)}")
    for group in groups.values():
        at = 0
        for pc in sorted(group, key=lambda pc: pc.offset):
            if pc.offset != at:
                raise refuse(f"rows {at}..{pc.offset} are not filled (or filled twice)")
            at += pc.rows
        if at != rows:
            raise refuse(f"the shard fills {at} of its {rows} rows")


@dataclass(frozen=True)
class Engine:
    """The engine's parallel shape: its degrees and its pipeline layer partition (one [start,
    stop) per stage, from the engine's own partition function)."""

    tp: int
    pp: int
    dp: int
    expert_parallel: bool
    stages: tuple[tuple[int, int], ...]


def check_engine(name: str, tp: int, pp: int, dp: int, expert_parallel: bool,
                 stages: tuple[tuple[int, int], ...], engine: Engine) -> None:
    """The engine runs the build's degrees and splits its layers as the build's stages do; else
    one ServeError naming both, raised before any byte of a shard is read. ``dp`` counts only for
    expert-parallel builds: without expert parallelism each of the engine's data-parallel
    replicas is a whole copy and loads the same shards."""
    def flag(field: str, have: object, want: object, how: str) -> ServeError:
        return ServeError(f"the engine runs {field}={have}, the build {name} was made for {want}",
                          key=field, hint=how)

    if engine.tp != tp:
        raise flag("tensor_parallel_size", engine.tp, tp, f"start vLLM with --tensor-parallel-size {tp}, "
                                                          f"or build a plan with tp: {engine.tp}")
    if engine.pp != pp:
        raise flag("pipeline_parallel_size", engine.pp, pp, f"start vLLM with --pipeline-parallel-size {pp}, "
                                                            f"or build a plan with pp: {engine.pp}")
    if engine.expert_parallel != expert_parallel:
        raise flag("enable_expert_parallel", engine.expert_parallel, expert_parallel,
                   ("add" if expert_parallel else "drop") + " --enable-expert-parallel")
    if expert_parallel and engine.dp != dp:
        raise flag("data_parallel_size", engine.dp, dp, f"start vLLM with --data-parallel-size {dp}")
    if tuple(engine.stages) != tuple(stages):
        raise ServeError(f"the engine's pipeline stages hold layers {_ranges(engine.stages)}, the build's "
                         f"{_ranges(stages)}", key="pipeline_parallel_size",
                         hint="set VLLM_PP_LAYER_PARTITION=" + ",".join(str(b - a) for a, b in stages))


def check_experts(name: str, held: tuple[int, ...], placed: Iterable[int]) -> None:
    """The routed experts the rank's shard holds are the ones the engine places on this rank."""
    want = tuple(sorted(placed))
    if tuple(sorted(held)) != want:
        raise ServeError(f"the engine places experts {_ids(want)} on this rank, the build {name} put "
                         f"{_ids(held)} in its shard", key="expert_placement_strategy",
                         hint="start vLLM with the build's placement (--expert-placement-strategy linear)")


def _ranges(stages: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{a}-{b - 1}" for a, b in stages)


def _ids(ids: tuple[int, ...]) -> str:
    return "none" if not ids else _ranges(_runs(ids))


def _runs(ids: tuple[int, ...]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
