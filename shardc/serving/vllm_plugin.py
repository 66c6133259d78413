"""vLLM's ``--load-format shardc``: each worker loads exactly its own rank's shard of a shardc
build, every byte checked by shardc's loader as it arrives, into vLLM's own parameters.

Installed into vLLM's environment, shardc registers the format through the ``vllm.general_plugins``
entry point (pyproject.toml), which vLLM runs in every process it starts; shardc never imports
vLLM otherwise. Then ``vllm serve BUILD_DIR --load-format shardc --tensor-parallel-size N`` and
``LLM(model=BUILD_DIR, load_format="shardc", ...)`` serve the build: vLLM reads the build's
config.json and tokenizer, and this loader fills the weights.

Per worker, in this order (nothing is read from a shard before the checks that need no bytes):
1. the manifest is read, and the config.json vLLM built its model from must be the one the build
   wrote (its sha256 in the manifest), of the architecture the build holds;
2. the engine's degrees, its pipeline partition (vLLM's ``get_pp_indices``) and, under expert
   parallelism, its expert placement (the fused-MoE layers' expert maps) must be the build's;
3. fill.py maps each tensor the Layout gives the rank's shard to the parameter vLLM declares for it
   and refuses any parameter the default loader would fill that is not tiled exactly once;
4. the rank (vLLM's parallel state) loads its shard with ``shardc.load_shard`` (the header and
   every chunk checked against that same Layout: a flipped byte stops the start, naming the shard
   and the chunk). On CPU every tensor that fills a piece of a parameter as it is stored (its
   dtype, its shape, contiguous rows) is read straight into that piece (``into``: one pass from
   the page cache, no second copy of the rank in memory); the rest (casts, a vocabulary cut with
   padding, scalars) and, on a GPU, every tensor, are loaded onto the worker's device and copied.
Errors reach vLLM as one RuntimeError line, "shardc load format: ...": the start fails, nothing is
served.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ServeError, ShardcError

if TYPE_CHECKING:
    from ..layout.ranks import TensorSpec

LOAD_FORMAT = "shardc"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``--load-format shardc`` (idempotent)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    try:  # registering twice would log vLLM's "already registered" warning in every process
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as known
    except ImportError:
        known = {}
    if LOAD_FORMAT in known:
        return

    class ShardcModelLoader(BaseModelLoader):
        """vLLM's model loader for shardc builds (see the module docstring)."""

        def download_model(self, model_config: Any) -> None:
            _build_directory(model_config.model)  # a build is local: only its manifest is checked here

        def load_weights(self, model: Any, model_config: Any) -> None:
            try:
                load_into(model, model_config, self.load_config)
            except ShardcError as exc:
                raise RuntimeError(f"shardc load format: {exc.one_line()}") from None

    register_model_loader(LOAD_FORMAT)(ShardcModelLoader)


def _build_directory(model: str) -> Path:
    directory = Path(model)
    if not (directory / "manifest.json").is_file():
        raise ServeError(f"{model} is not a shardc build: it has no manifest.json", key="model",
                         hint="give the directory `shardc build` (or `shardc pull`) wrote, or drop "
                              "--load-format shardc to load a checkpoint")
    return directory


def load_into(model: Any, model_config: Any, load_config: Any) -> dict[str, Any]:
    """Fill ``model``'s parameters from this worker's shard; returns a summary (rank, tensors,
    bytes, seconds) that is also logged."""
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
    from vllm.distributed.utils import get_pp_indices

    import shardc

    from ..formats.manifest import load
    from ..layout.dtypes import torch_name
    from .fill import Engine, Tensor, check_engine, check_experts, fill_plan

    t0 = time.perf_counter()
    directory = _build_directory(model_config.model)
    manifest = load(directory / "manifest.json")
    layout = manifest.to_layout()
    plan, spec = layout.plan, layout.model
    _check_config(directory, manifest)
    arch = list(getattr(model_config.hf_config, "architectures", None) or [])
    if arch and spec.architecture not in arch:
        raise ServeError(f"the engine runs {arch[0]}, the build {plan.name} holds {spec.architecture}",
                         key="architectures", hint="serve the build directory's own config.json")
    if spec.forward.moe is not None and not spec.forward.moe.expert:
        raise ServeError(f"the build {plan.name} holds {spec.architecture}'s experts stacked, which vLLM's "
                         "model reorders as it loads (transposed, gate and up interleaved); the shardc load "
                         "format does not map them", key="architectures",
                         hint="serve the source checkpoint with vLLM's own loader; shardc verify checks the build")
    par = get_current_vllm_config().parallel_config
    ep = bool(par.enable_expert_parallel)
    layers = spec.num_layers
    engine = Engine(tp=par.tensor_parallel_size, pp=par.pipeline_parallel_size, dp=par.data_parallel_size,
                    expert_parallel=ep, stages=tuple(get_pp_indices(layers, r, par.pipeline_parallel_size)
                                                     for r in range(par.pipeline_parallel_size)))
    check_engine(plan.name, plan.tp, plan.pp, plan.dp, plan.expert_parallel, layout.stages, engine)
    want = str(model_config.dtype).removeprefix("torch.")
    base = torch_name(manifest.layout.base_dtype)
    if want != base:
        raise ServeError(f"the engine runs dtype {want}, the build {plan.name} is {base}", key="dtype",
                         hint=f"start vLLM with --dtype {base}")
    tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    dp_rank = int(par.data_parallel_rank) if ep and plan.dp > 1 else 0
    rank_layout = layout.rank(tp_rank, pp_rank, dp_rank)
    kept = frozenset(r.name for r in spec.spec.tensors(spec) if r.dtype == "F32")
    facts = dataclasses.replace(_facts(model, spec), fp32_kept=kept)
    if ep:
        placed = facts.local_experts.keys() if facts.local_experts is not None else ()
        check_experts(plan.name, rank_layout.experts, placed)
    params = dict(model.named_parameters())
    described = [_param(name, p, model) for name, p in params.items()]
    must = _must_fill(model, model_config, load_config)
    device = str(next(iter(params.values())).device) if params else "cpu"
    # the mapping is decided from the Layout's record of the shard, before a byte of it is read;
    # load_shard then checks the file's header and bytes against that same record
    shard = [Tensor(s.name, s.shape, torch_name(s.dtype), _vocab_rows(s)) for s in rank_layout.tensors]
    fills = fill_plan(shard, described, must, facts)
    into = _destinations(fills, params, shard) if device == "cpu" else {}
    t_read = time.perf_counter()
    # the Manifest already read (its Layout computed once: Manifest.to_layout), not the path again;
    # on CPU the tensors that land whole in a parameter are read straight into it (``into``)
    tensors = shardc.load_shard(manifest, tp_rank, pp_rank, device=device, directory=directory, dp_rank=dp_rank,
                                into=into or None)
    t_fill = time.perf_counter()
    vocab = {d.name for d in described if d.vocab is not None}
    # the rest are copied, never adopted (the shard's own memory as a parameter's storage): the
    # shard's tensors are views of one buffer, and vLLM repacks many weights after loading (oneDNN
    # on CPU, Marlin and the like on GPU) and drops the originals; one adopted view would keep the
    # whole buffer alive beside them
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with torch.no_grad():
        for pname, pieces in fills.items():
            data = params[pname].data
            for pc in pieces:
                if pc.tensor in into:
                    continue
                src = tensors[pc.tensor]
                dst = data if pc.expert is None else data[pc.expert]
                dst.narrow(0, pc.offset, pc.rows).copy_(src[:pc.rows] if src.dim() else src)
            if pname in vocab:  # the engine's own padding rows stay zero, as its loader leaves them
                data[pieces[0].rows:].zero_()
    summary = {"tp_rank": tp_rank, "pp_stage": pp_rank, "dp_rank": dp_rank, "file": rank_layout.file,
               "tensors": len(tensors), "parameters": len(fills), "bytes": nbytes, "read_into": len(into),
               "seconds": time.perf_counter() - t0, "read_seconds": t_fill - t_read,
               "fill_seconds": time.perf_counter() - t_fill}
    _log(f"shardc: rank tp={tp_rank} pp={pp_rank} loaded {rank_layout.file} ({len(tensors)} tensors into "
         f"{len(fills)} parameters, {len(into)} read straight into them, {nbytes / 2**20:.1f} MiB, every byte "
         f"checked) in {summary['seconds']:.2f}s "
         f"(checks {t_read - t0:.2f}s, read {t_fill - t_read:.2f}s, fill {summary['fill_seconds']:.2f}s)")
    return summary


def _vocab_rows(s: TensorSpec) -> tuple[int, int] | None:
    """The vocabulary rows [start, stop) a vocab-split tensor holds (None: another split)."""
    if str(s.split) != "vocab":
        return None
    assert s.start is not None and s.stop is not None  # the Layout's vocab cut sets both
    return s.start, s.stop


def _destinations(fills: dict[str, Any], params: dict[str, Any], shard: list[Any]) -> dict[str, Any]:
    """The shard tensors that fill a piece of a parameter exactly as stored (same dtype and shape,
    the piece contiguous: rows of the parameter, or of one local expert's slot in a fused-MoE
    stack): tensor name -> that piece, a view of the parameter, for load_shard's ``into``. The
    rest (a cast, a vocabulary cut with padding rows, a scalar) are copied after the load."""
    by_name = {t.name: t for t in shard}
    into: dict[str, Any] = {}
    for pname, pieces in fills.items():
        data = params[pname].data
        for pc in pieces:
            t = by_name[pc.tensor]
            dst = data if pc.expert is None else data[pc.expert]
            if not t.shape or dst.dim() == 0:
                continue
            view = dst.narrow(0, pc.offset, pc.rows)
            if tuple(view.shape) == tuple(t.shape) and str(view.dtype).removeprefix("torch.") == t.dtype \
                    and view.is_contiguous():
                into[pc.tensor] = view
    return into


def _check_config(directory: Path, manifest: Any) -> None:
    """vLLM builds its model from the build directory's config.json: it must be the file the build
    wrote (its sha256 in the manifest), or the model vLLM makes is not the one the shards are for."""
    from ..formats.files import sha256_file

    entry = manifest.file("config.json")
    if entry is None:
        return
    try:
        digest = sha256_file(directory / "config.json")
    except OSError as exc:
        raise ServeError(f"cannot read {directory / 'config.json'}: {exc.strerror}", key="config.json") from None
    if digest != entry.sha256:
        raise ServeError(f"{directory / 'config.json'} is not the file the build wrote (sha256 {digest[:12]}..., "
                         f"the manifest records {entry.sha256[:12]}...)", key="config.json",
                         hint="restore the build's config.json (shardc pull), or rebuild from the changed config")


def _param(name: str, p: Any, model: Any) -> Any:
    from .fill import Param

    module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    idx = getattr(module, "shard_indices", None)
    vocab = (idx.org_vocab_start_index, idx.org_vocab_end_index) if idx is not None and \
        name.endswith(".weight") else None
    return Param(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), vocab)


def _facts(model: Any, spec: Any) -> Any:
    """What fill.py reads of vLLM's model: its packed modules, its experts' local placement and
    its checkpoint-name mapper; the family's expert names from shardc's own table."""
    from .fill import ModelFacts

    packed = {k: tuple(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    moe = spec.forward.moe
    local: dict[int, int] | None = None
    for module in model.modules():
        emap = getattr(module, "expert_map", None) if hasattr(module, "w13_weight") else None
        if emap is not None:
            local = {g: int(i) for g, i in enumerate(emap.tolist()) if int(i) >= 0}
            break
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and getattr(mapper, "orig_to_new_stacked", None):
        # the packed modules are fill.py's to place (with their offsets): renames only
        mapper = dataclasses.replace(mapper, orig_to_new_stacked={})
    rename = mapper._map_name if mapper is not None else None
    return ModelFacts(packed=packed, expert_templates=tuple(moe.expert) if moe is not None else (),
                      local_experts=local, rename=rename)


def _must_fill(model: Any, model_config: Any, load_config: Any) -> set[str]:
    """The parameters vLLM's default loader requires from a checkpoint: all of the model's, less
    the ones its own weight tracking exempts (KV-cache scales, config-built parameters, ...).
    Its ``track_weights_loading`` adds the exempt names to the set it is given before it raises
    on the rest, so an empty set comes back holding exactly the exemptions."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    names = {n for n, p in model.named_parameters() if p.numel() > 0}
    exempt: set[str] = set()
    try:
        DefaultModelLoader(load_config).track_weights_loading(
            model, exempt, quantized=model_config.quantization is not None)
    except ValueError:
        pass
    return names - exempt


def _log(line: str) -> None:
    from vllm.logger import init_logger

    # under vLLM's "vllm" logger, whose handlers vLLM configures (a logger outside it prints nothing)
    init_logger("vllm.model_executor.model_loader.shardc").info(line)
