"""The gate's independent reference: the baseline scored by transformers itself.

``shardc gate --reference transformers`` takes the baseline's logits from Hugging Face
transformers (``AutoModelForCausalLM.from_pretrained`` on the baseline build's directory: a tp = 1
build is a Hugging Face checkpoint, config.json and model.safetensors.index.json included, unless
stacked experts are split over its DP ranks: ``compiler/outputs.py`` ``hf_checkpoint_problem``) instead
of from shardc's sharded runtime, so a bug in shardc's forward (a misread config key, a wrong
rope or activation) cannot pass both sides of the gate. The candidate is still scored by shardc's
runtime and compared by the same code (``worker._against``).

What stays the same as shardc's own baseline pass: the windows, one window per forward, the
build's compute dtype (the plan's base dtype), the logits written losslessly in that dtype to the
same kind of scratch file, one CPU thread on the CPU. Attention is transformers' default for the
model (SDPA where the model supports it, eager where it does not, as for Gemma 2's soft-capping):
what a user of transformers gets, and on the CPU shardc's tp = 1 forward equals it bit for bit for
the Llama family, so an identical candidate scores a delta of exactly 0. What it adds: the whole build checked
by verify's checks (``verify_build``: every shard's sha256 against the manifest, config.json and
the index against the Layout) before transformers opens a file. transformers and torch are
imported inside the functions that need them.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from ..errors import ShardcError, VerifyMismatch
from .api_results import ReferencePass

REFERENCES = ("shardc", "transformers")
DEFAULT_REFERENCE = "shardc"
ATTENTION: str | None = None  # transformers' default for the model (recorded as "default")
INDEX = "model.safetensors.index.json"  # what makes a build directory a transformers checkpoint


class ReferenceUnfit(ShardcError):
    """``--reference transformers`` cannot score this baseline here (tp > 1, stacked experts over
    DP ranks, no HF index, a package missing, under torchrun): bad input, exit 2."""


def check_reference(base: Any, reference: str, *, torchrun: bool = False) -> None:
    """Refuse, before anything is scored, a reference that cannot score ``base`` (a BuildRef)."""
    if reference == DEFAULT_REFERENCE:
        return
    if reference not in REFERENCES:
        raise ReferenceUnfit(f"unknown reference {reference!r}", key="reference",
                             hint=f"use one of {', '.join(REFERENCES)}")
    lay = base.manifest.layout
    hint_tp1 = (f"reshard the baseline ({base.manifest_path}) to a plan with tp_degree: 1 first and gate against "
                "that build, or use `reference` shardc")
    if lay.tp_degree != 1:
        raise ReferenceUnfit(
            f"transformers cannot load the baseline {base.name}: it is split tp={lay.tp_degree}, and "
            f"transformers reads only a tp=1 build (any pp) as a checkpoint", key="reference", hint=hint_tp1)
    from ..compiler.outputs import hf_checkpoint_problem

    try:
        problem = hf_checkpoint_problem(base.manifest.to_layout())
    except ShardcError as exc:  # the baseline's plan or config does not lay out: nothing to load
        problem = f"its layout cannot be recomputed ({exc.message})"
    if problem is not None:  # stacked experts over DP ranks: each file holds a block under one name
        raise ReferenceUnfit(
            f"transformers cannot load the baseline {base.name} as a checkpoint: {problem}", key="reference",
            hint=f"reshard the baseline ({base.manifest_path}) to a plan with tp_degree: 1 and no dp_degree and "
                 "gate against that build, or use `reference` shardc")
    if not (base.directory / INDEX).is_file():
        raise ReferenceUnfit(
            f"the baseline {base.name} has no {INDEX} in {base.directory}, so transformers cannot load it",
            key="reference", hint="rebuild it with this shardc (every tp=1 build writes one), or use `reference` shardc")
    if torchrun:
        raise ReferenceUnfit("transformers scores the baseline in one process; it does not run under torchrun",
                             key="reference", hint="run shardc gate without torchrun (its own launcher starts the ranks)")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if lay.dtype in ("int8", "fp8") and importlib.util.find_spec("compressed_tensors") is None:
        missing.append("compressed-tensors")
    if missing:
        raise ReferenceUnfit(f"transformers cannot score the baseline: {' and '.join(missing)} not installed",
                             key="reference", hint=f"pip install {' '.join(missing)}, or use `reference` shardc")


def reference_record(reference: str) -> dict[str, Any] | None:
    """What scored the baseline, for the cache key and the report: None for shardc's own runtime
    (whose records stay as they were), else the library and versions that computed the logits."""
    if reference == DEFAULT_REFERENCE:
        return None
    from importlib.metadata import version

    return {"name": reference, "transformers": version("transformers"), "torch": version("torch"),
            "attn_implementation": ATTENTION or "default"}


def save_baseline_transformers(base: Any, windows: list[list[int]], path: str | Path, key: dict[str, Any], *,
                               device: str = "cpu", threads: int | None = None) -> ReferencePass:
    """The gate's baseline pass with transformers: check the build, load it with transformers in
    the build's compute dtype and transformers' default attention, score ``windows`` one at a time and write the
    logits [windows, T - 1, vocab] to ``path`` as ``save_baseline`` does (same tensor, dtype and
    metadata). Returns the pass's times. ``threads``: CPU threads for the pass."""
    import torch

    from ..formats.safetensors import ShardWriter
    from ..layout.dtypes import from_torch_name
    from ..loader.devices import resolve_device
    from ..verify.checks import verify_build
    from .weights import compute_dtype

    t_load = time.perf_counter()
    report = verify_build(base.manifest, base.directory)
    if not report.ok:
        raise VerifyMismatch(f"baseline {base.name}: {report.problems[0]}",
                             hint="run shardc verify for the full report; re-pull or rebuild the baseline")
    dtype = compute_dtype(base.manifest)
    dev = torch.device(resolve_device(device) or "cpu")
    saved_threads = torch.get_num_threads()
    model = writer = None
    try:
        if threads:
            torch.set_num_threads(int(threads))
        model = _load(base.directory, dtype, dev)
        load_s = time.perf_counter() - t_load
        rows = torch.tensor(windows, dtype=torch.int64)
        n, t = rows.shape
        vocab = int(base.manifest.model["vocab_size"])
        name = from_torch_name(str(dtype))
        assert name is not None  # the compute dtype, a 16-bit safetensors dtype (weights.compute_dtype)
        meta = {"shardc.baseline_cache": json.dumps(key, sort_keys=True)}  # as worker._LogitSaver writes
        writer = ShardWriter(Path(path), [("logits", name, (n, t - 1, vocab))], meta)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(n):
                logits = model(rows[i : i + 1].to(dev)).logits[:, :-1]
                if logits.shape[-1] != vocab:
                    raise ShardcError(f"transformers gives {logits.shape[-1]} logits per position, the "
                                      f"manifest's vocabulary is {vocab}")
                part = logits.to(dtype)
                if not torch.equal(part.float(), logits.float()):  # as the runtime's own saver checks
                    raise ShardcError(f"transformers' logits are not exact in {name}")
                writer.write(part.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        writer.commit()
        writer = None
        return ReferencePass(time.perf_counter() - t0, load_s)
    finally:
        if writer is not None:
            writer.abort()
        torch.set_num_threads(saved_threads)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the candidate's ranks need the GPU next


def _load(directory: Path, dtype: Any, dev: Any) -> Any:
    """transformers' model of a checked build directory: local files only, no remote code, every
    tensor of the model read from the build (a missing, unexpected or mis-shaped tensor is refused,
    never left at a random initialization). The loaders' progress bars (transformers',
    compressed-tensors') go to a buffer: the gate's stderr carries its own lines."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    with contextlib.redirect_stderr(io.StringIO()):
        # output_loading_info=True returns (model, info); transformers' types know the model alone
        loaded: tuple[Any, dict[str, list[Any]]] = AutoModelForCausalLM.from_pretrained(  # type: ignore[assignment]
            str(directory.resolve()), dtype=dtype, attn_implementation=ATTENTION,
            local_files_only=True, trust_remote_code=False, output_loading_info=True)
        model, info = loaded
    bad = {k: sorted(map(str, v))[:3] for k, v in info.items() if v}
    if bad:
        raise ReferenceUnfit(f"transformers does not read the build at {directory} as its model: {bad}",
                             key="reference", hint="use `reference` shardc")
    return model.to(dev).eval()
