"""Which device a rank uses, and whether this node has the GPUs a plan needs.

One rule everywhere (verify --distributed, run, gate, load_shard): ``cuda`` means this process's
own GPU, ``cuda:LOCAL_RANK`` (torchrun and shardc's launcher set LOCAL_RANK; 0 without it), so the
ranks of one node spread over its GPUs instead of piling onto GPU 0. ``cuda:N`` still means GPU N.
The GPU count is ``torch.cuda.device_count()``, which honours CUDA_VISIBLE_DEVICES. Importing this
module does not import torch.
"""

from __future__ import annotations

import os

from ..errors import DeviceError


def local_rank() -> int:
    """LOCAL_RANK from the environment (0 when unset or malformed: a single process)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def resolve_device(device: str | None, rank: int | None = None) -> str | None:
    """'cuda' -> 'cuda:<LOCAL_RANK>' (or ``rank`` when given); 'cuda:N' and 'cpu' unchanged."""
    if device is None:
        return None
    dev = device.strip().lower()
    if dev == "cuda":
        return f"cuda:{local_rank() if rank is None else rank}"
    if dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit()):
        return dev
    raise DeviceError(f"{device!r} is not cpu, cuda or cuda:N", key="device")


def visible_gpus() -> int:
    """GPUs this process can see (CUDA_VISIBLE_DEVICES respected); 0 without CUDA."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    import torch

    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver counts as no GPU
        return 0


def node_ranks(world: int) -> int:
    """How many of a job's ranks run on this node: LOCAL_WORLD_SIZE under torchrun, else all."""
    try:
        return min(world, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return world


def check_gpus(plan: str, device: str | None, need: int) -> None:
    """Before anything loads: raise DeviceError (one line, exit 2) when ``device`` is CUDA and this
    node shows fewer than ``need`` GPUs (or lacks the explicit ``cuda:N``)."""
    if device is None or not device.strip().lower().startswith("cuda"):
        return
    dev = resolve_device(device)
    assert dev is not None
    if device.strip().lower() != "cuda":  # an explicit cuda:N: that GPU must exist
        need = max(need, int(dev[5:]) + 1)
    have = visible_gpus()
    if have < need:
        raise DeviceError(
            f"plan {plan} needs {need} GPU{'s' if need != 1 else ''} on this node; "
            f"{have} {'is' if have == 1 else 'are'} visible",
            hint="run on a node with more GPUs, widen CUDA_VISIBLE_DEVICES, or use `device` cpu",
        )
