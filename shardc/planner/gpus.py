"""GPU and interconnect presets for the planner: the spec-sheet numbers, as data.

Memory is what CUDA reports (``cudaGetDeviceProperties().totalGlobalMem``, the number vLLM and
PyTorch print as "total capacity"), not the marketing size: an "80 GB" A100 gives 79.15 GiB, and every
KV-budget figure downstream is a difference of such numbers, so the marketing size would overstate
the KV cache by gigabytes. Bandwidths are per GPU and per direction. Every figure can be overridden
from the command line (``--gpu-memory``, ``--hbm-bandwidth``, ``--nvlink-bandwidth``,
``--interconnect``, ``--fabric``).

The fabric (the link inside a node) also bounds tensor parallelism: an NVLink domain serves TP up
to its size, PCIe up to 4 cards, an NVLink bridge a pair. Figures on fabrics other than NVLink are
labelled "reduced calibration": the efficiency defaults were set on NVLink systems.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError

GIB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class Interconnect:
    """A link as the ring all-reduce sees it: bandwidth per GPU per direction, latency per hop."""

    name: str
    bandwidth: float  # bytes/s, per GPU, one direction
    latency: float  # seconds per ring hop (NCCL LL protocol, order of magnitude)
    description: str
    tp_limit: int | None = None  # widest TP group the link serves well; None: the whole domain
    calibrated: bool = True  # the speed defaults were set on this fabric (NVLink); else "reduced"


INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect("nvlink3", 300 * GB, 2e-6, "NVLink 3 (A100 SXM): 12 links x 25 GB/s per direction"),
        Interconnect("nvlink4", 450 * GB, 2e-6, "NVLink 4 (H100/H200 SXM): 18 links x 25 GB/s per direction"),
        # PCIe: all-reduce traffic crosses the root complex, so a TP group wider than one switch's
        # four cards loses to TP4 x PP2; the speed model was not calibrated on it.
        Interconnect("pcie4", 32 * GB, 5e-6, "PCIe 4.0 x16: 32 GB/s per direction, through the host",
                     tp_limit=4, calibrated=False),
        Interconnect("pcie5", 64 * GB, 5e-6, "PCIe 5.0 x16: 64 GB/s per direction, through the host",
                     tp_limit=4, calibrated=False),
        Interconnect("nvlink-bridge", 300 * GB, 3e-6, "NVLink bridge (A100 PCIe pairs): 600 GB/s both "
                     "directions between two cards", tp_limit=2, calibrated=False),
        Interconnect("xgmi", 448 * GB, 3e-6, "AMD Infinity Fabric (xGMI), 8-GPU hive: 7 links x 64 GB/s per "
                     "direction", calibrated=False),
        Interconnect("ib-hdr", 25 * GB, 6e-6, "InfiniBand HDR: one 200 Gb/s NIC per GPU"),
        Interconnect("ib-ndr", 50 * GB, 6e-6, "InfiniBand NDR: one 400 Gb/s NIC per GPU"),
    )
}
INTERCONNECT_ALIASES = {"pcie": "pcie4", "infiniband": "ib-ndr", "ib": "ib-ndr", "ndr": "ib-ndr",
                        "hdr": "ib-hdr"}
DEFAULT_INTER_NODE = "ib-ndr"


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory as CUDA reports it, HBM bandwidth, dense 16-bit tensor FLOP/s."""

    name: str
    memory: int  # bytes, as cudaGetDeviceProperties reports them
    hbm_bandwidth: float  # bytes/s
    flops: float  # dense BF16/FP16 tensor-core FLOP/s (activations stay 16-bit: weight-only quant)
    link: Interconnect  # inside the node (the NVLink domain; PCIe cards have only PCIe)
    description: str

    @property
    def nvlink(self) -> bool:
        return self.link.name.startswith("nvlink")


def _gpu(name: str, memory: int, hbm_gbs: float, tflops: float, link: str, desc: str) -> GPU:
    return GPU(name, memory, hbm_gbs * GB, tflops * 1e12, INTERCONNECTS[link], desc)


# Memory values: deviceQuery "Total amount of global memory" in bytes where published; H200 from
# PyTorch's "total capacity of 139.80 GiB". HBM/FLOP/s: NVIDIA data sheets (dense, no sparsity).
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        _gpu("a100-40gb", 42_298_834_944, 1555, 312, "nvlink3", "A100-SXM4-40GB (HBM2)"),
        _gpu("a100-80gb", 84_987_740_160, 2039, 312, "nvlink3", "A100-SXM4-80GB (HBM2e)"),
        _gpu("a100-40gb-pcie", 42_297_786_368, 1555, 312, "pcie4", "A100-PCIE-40GB"),
        _gpu("a100-80gb-pcie", 84_974_239_744, 1935, 312, "pcie4", "A100 80GB PCIe"),
        _gpu("h100-sxm", 85_028_896_768, 3350, 989, "nvlink4", "H100 80GB HBM3 (SXM5)"),
        _gpu("h200", round(139.80 * GIB), 4800, 989, "nvlink4", "H200 141GB HBM3e (SXM)"),
        _gpu("l40s", 47_576_711_168, 864, 362, "pcie4", "L40S 48GB GDDR6 (PCIe, no NVLink)"),
    )
}
# FP8 tensor cores (Hopper, Ada): vLLM runs an fp8 checkpoint's GEMMs in fp8 (W8A8, dynamic
# per-token activation scales), at twice the 16-bit rate (data sheets, dense). Others: 16-bit.
FP8_TFLOPS = {"h100-sxm": 1979, "h200": 1979, "l40s": 733}


def gemm_flops(gpu: GPU, dtype: str) -> float:
    """Dense tensor-core FLOP/s a unit's GEMMs run at: fp8 weights on an fp8-capable GPU compute in
    fp8; int8 (weight-only) and 16-bit weights compute in 16-bit."""
    if dtype == "fp8" and gpu.name in FP8_TFLOPS:
        return FP8_TFLOPS[gpu.name] * 1e12
    return gpu.flops


def rates(gpu: GPU, dtype: str, sp: Any) -> tuple[float, float, float]:
    """(weight-read bytes/s, KV-read bytes/s, GEMM FLOP/s) a unit of ``dtype`` reaches, with the
    efficiencies of ``sp`` (formulas.SpeedParams): 8-bit weights stream at w8_hbm_efficiency, fp8
    GEMMs on fp8 tensor cores run at fp8_compute_efficiency of the fp8 peak."""
    weights = gpu.hbm_bandwidth * (sp.w8_hbm_efficiency if dtype in ("int8", "fp8") else sp.hbm_efficiency)
    fp8 = dtype == "fp8" and gpu.name in FP8_TFLOPS
    flops = gemm_flops(gpu, dtype) * (sp.fp8_compute_efficiency if fp8 else sp.compute_efficiency)
    return weights, gpu.hbm_bandwidth * sp.kv_hbm_efficiency, flops


GPU_ALIASES = {
    "a100": "a100-80gb", "a100-sxm": "a100-80gb", "a100-80gb-sxm": "a100-80gb",
    "a100-40gb-sxm": "a100-40gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h200-sxm": "h200",
}


def _preset(table: dict[str, Any], aliases: dict[str, str], name: str, key: str, what: str,
            hint: str) -> Any:
    """A preset by name (case-insensitive, aliases resolved); PlanError names the field and lists them."""
    k = aliases.get(name.lower(), name.lower())
    if k not in table:
        raise PlanError(f"unknown {what} preset {name!r}", key=key, hint=f"presets: {', '.join(table)}{hint}")
    return table[k]


def get_gpu(name: str) -> GPU:
    """A GPU preset by name (a few aliases: a100, h100, ...)."""
    return _preset(GPUS, GPU_ALIASES, name, "gpu", "GPU", " (override figures with `gpu_memory`, `hbm_bandwidth`)")


def get_interconnect(name: str) -> Interconnect:
    """An interconnect preset by name or alias (nvlink3, pcie, ib-ndr, ...)."""
    return _preset(INTERCONNECTS, INTERCONNECT_ALIASES, name, "interconnect", "interconnect", "")


def override_gpu(
    gpu: GPU,
    *,
    memory: int | None = None,
    hbm_bandwidth: float | None = None,
    link_bandwidth: float | None = None,
    fabric: str | None = None,
) -> GPU:
    """The preset with spec-sheet figures replaced (a custom SKU, a measured bandwidth, the fabric
    inside the node: e.g. PCIe cards paired by NVLink bridges)."""
    out = gpu
    if fabric is not None:
        try:
            out = dataclasses.replace(out, link=get_interconnect(fabric))
        except PlanError as exc:
            raise PlanError(exc.message, key="fabric", hint=exc.hint) from None
    if memory is not None:
        out = dataclasses.replace(out, memory=memory)
    if hbm_bandwidth is not None:
        out = dataclasses.replace(out, hbm_bandwidth=hbm_bandwidth)
    if link_bandwidth is not None:
        link = dataclasses.replace(out.link, bandwidth=link_bandwidth)
        out = dataclasses.replace(out, link=link)
    return out


@dataclass(frozen=True)
class Cluster:
    """Where replicas run: GPUs per node form the NVLink domain; nodes talk over ``inter_node``."""

    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    inter_node: Interconnect = INTERCONNECTS[DEFAULT_INTER_NODE]

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def node_of(self, gpu_index: int) -> int:
        return gpu_index // self.gpus_per_node

    @property
    def tp_limit(self) -> int:
        """Widest TP group: inside one node, and no wider than the fabric serves."""
        return min(self.gpus_per_node, self.gpu.link.tp_limit or self.gpus_per_node)

    @property
    def calibrated(self) -> bool:
        return self.gpu.link.calibrated

    def fabric(self) -> str:
        """The fabric in words, as the header and --json say it."""
        link = self.gpu.link
        domain = "NVLink domain" if self.gpu.nvlink and link.calibrated else f"{link.name} fabric"
        out = f"{domain}: TP up to {self.tp_limit}"
        return out if link.calibrated else out + " (reduced calibration: speed defaults set on NVLink)"
