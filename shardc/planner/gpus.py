"""GPU and interconnect presets for the planner: the spec-sheet numbers, as data.

Memory is what CUDA reports (``cudaGetDeviceProperties().totalGlobalMem``, the number vLLM and
PyTorch print as "total capacity"), not the marketing size: an "80 GB" A100 gives 79.15 GiB, and every
KV-budget figure downstream is a difference of such numbers, so the marketing size would overstate
the KV cache by gigabytes. Bandwidths are per GPU and per direction. Every figure can be overridden
from the command line (``--gpu-memory``, ``--hbm-bandwidth``, ``--nvlink-bandwidth``,
``--interconnect``, ``--fabric``).

The fabric (the link inside a node) also bounds tensor parallelism: an NVLink domain serves TP up
to its size, PCIe up to 4 cards, an NVLink bridge a pair. The speed model is calibrated per card
against aiconfigurator 0.12's measured vLLM tables (``GPU.peer``, scripts/bench_plan.py --peer); a
card without such data, or a preset given another fabric (``--fabric``), is labelled "uncalibrated".
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from .allreduce_tables import MEASURED

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


INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect("nvlink3", 300 * GB, 2e-6, "NVLink 3 (A100 SXM): 12 links x 25 GB/s per direction"),
        Interconnect("nvlink4", 450 * GB, 2e-6, "NVLink 4 (H100/H200 SXM): 18 links x 25 GB/s per direction"),
        # aiconfigurator 0.12's b200_sxm / gb200 intra_node_bw: 900 GB/s per GPU, one direction
        Interconnect("nvlink5", 900 * GB, 2e-6, "NVLink 5 (B200/B300 SXM, GB200/GB300 NVL72): 18 links x 50 GB/s "
                     "per direction"),
        # PCIe: all-reduce traffic crosses the root complex, so a TP group wider than one switch's
        # four cards loses to TP4 x PP2.
        Interconnect("pcie4", 32 * GB, 5e-6, "PCIe 4.0 x16: 32 GB/s per direction, through the host",
                     tp_limit=4),
        Interconnect("pcie5", 64 * GB, 5e-6, "PCIe 5.0 x16: 64 GB/s per direction, through the host",
                     tp_limit=4),
        Interconnect("nvlink-bridge", 300 * GB, 3e-6, "NVLink bridge (A100 PCIe pairs): 600 GB/s both "
                     "directions between two cards", tp_limit=2),
        Interconnect("xgmi", 448 * GB, 3e-6, "AMD Infinity Fabric (xGMI), 8-GPU hive: 7 links x 64 GB/s per "
                     "direction"),
        Interconnect("ib-hdr", 25 * GB, 6e-6, "InfiniBand HDR: one 200 Gb/s NIC per GPU"),
        Interconnect("ib-ndr", 50 * GB, 6e-6, "InfiniBand NDR: one 400 Gb/s NIC per GPU"),
    )
}
INTERCONNECT_ALIASES = {"pcie": "pcie4", "infiniband": "ib-ndr", "ib": "ib-ndr", "ndr": "ib-ndr",
                        "hdr": "ib-hdr"}
DEFAULT_INTER_NODE = "ib-ndr"


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory (as CUDA reports it where known), HBM bandwidth, dense 16-bit tensor FLOP/s."""

    name: str
    memory: int  # bytes, as cudaGetDeviceProperties reports them
    hbm_bandwidth: float  # bytes/s
    flops: float  # dense BF16/FP16 tensor-core FLOP/s (activations stay 16-bit: weight-only quant)
    link: Interconnect  # inside the node (the NVLink domain; PCIe cards have only PCIe)
    description: str
    domain: int = 8  # GPUs per node (the NVLink domain) when the command line gives none: NVL72 racks are 72
    memory_from: str = "as CUDA reports it"  # where ``memory`` comes from, as the header and --explain say it
    # the aiconfigurator 0.12 system whose measured vLLM tables the speed model was calibrated on
    # (scripts/bench_plan.py --peer); None: no measured data for this card, its figures are uncalibrated
    peer: str | None = None
    # vLLM's TP all-reduce as measured on this system, where the link's formula does not follow it
    # (allreduce_tables.MEASURED): GPUs -> ((message bytes, seconds), ...); empty: the formula
    allreduce: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()

    def measures_allreduce(self, n: int) -> bool:
        """Whether an all-reduce over ``n`` of these GPUs was measured (``allreduce_s`` answers)."""
        return any(k == n for k, _ in self.allreduce)

    def allreduce_s(self, n: int, nbytes: float) -> float | None:
        """Seconds of one measured all-reduce of ``nbytes`` over ``n`` of these GPUs, interpolated linearly
        between the measured sizes (the smallest's time below them, proportional beyond the largest);
        None where nothing was measured for ``n``."""
        pts = next((t for k, t in self.allreduce if k == n), None)
        if pts is None:
            return None
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        return pts[-1][1] * nbytes / pts[-1][0]

    @property
    def nvlink(self) -> bool:
        return self.link.name.startswith("nvlink")


def _gpu(name: str, memory: int, hbm_gbs: float, tflops: float, link: str, desc: str, *, domain: int = 8,
         peer: str | None = None, memory_from: str = "as CUDA reports it") -> GPU:
    table = tuple(sorted(MEASURED.get(peer or "", {}).items()))
    return GPU(name, memory, hbm_gbs * GB, tflops * 1e12, INTERCONNECTS[link], desc, domain=domain, peer=peer,
               memory_from=memory_from, allreduce=table)


SMI = "as nvidia-smi reports it"  # Blackwell cards: aiconfigurator's figure, a little above CUDA's


# Memory values: deviceQuery "Total amount of global memory" in bytes where published; H200 from
# PyTorch's "total capacity of 139.80 GiB". HBM/FLOP/s: NVIDIA data sheets (dense, no sparsity).
# Blackwell cards: every figure from aiconfigurator 0.12's system files (systems/<peer>.yaml:
# mem_capacity, mem_bw, bfloat16_tc_flops, fp8_tc_flops, intra_node_bw, num_gpus_per_rack), whose
# memory is nvidia-smi's total (GB200 189,471 MiB, B300 275,040 MiB, GB300 284,208 MiB, RTX PRO 6000
# 97,887 MiB; B200 "180 GiB"), a few hundred MiB above what CUDA reports on the cards measured both ways.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        _gpu("a100-40gb", 42_298_834_944, 1555, 312, "nvlink3", "A100-SXM4-40GB (HBM2)"),
        _gpu("a100-80gb", 84_987_740_160, 2039, 312, "nvlink3", "A100-SXM4-80GB (HBM2e)", peer="a100_sxm"),
        _gpu("a100-40gb-pcie", 42_297_786_368, 1555, 312, "pcie4", "A100-PCIE-40GB"),
        _gpu("a100-80gb-pcie", 84_974_239_744, 1935, 312, "pcie4", "A100 80GB PCIe"),
        _gpu("h100-sxm", 85_028_896_768, 3350, 989, "nvlink4", "H100 80GB HBM3 (SXM5)", peer="h100_sxm"),
        _gpu("h200", round(139.80 * GIB), 4800, 989, "nvlink4", "H200 141GB HBM3e (SXM)", peer="h200_sxm"),
        # measured all-reduce (allreduce_tables.py): L40S servers pair the cards under PCIe switches; a
        # wider group reduces through the host's root complex, shared by the whole group: 4 MiB takes
        # 0.23 ms on 2 GPUs and 1.65 ms on 4 (7.2x, where a ring's bandwidth term grows 1.5x)
        _gpu("l40s", 47_576_711_168, 864, 362, "pcie4", "L40S 48GB GDDR6 (PCIe, no NVLink)", peer="l40s"),
        _gpu("b200", 193_273_528_320, 7700, 2250, "nvlink5", "B200 180GB HBM3e (SXM, HGX 8-GPU)", peer="b200_sxm",
             memory_from="as aiconfigurator sizes it"),
        _gpu("b300", 288_400_343_040, 7750, 2250, "nvlink5", "B300 288GB HBM3e (SXM, HGX 8-GPU)", peer="b300_sxm",
             memory_from=SMI),
        _gpu("gb200", 198_674_743_296, 8000, 2500, "nvlink5", "GB200 NVL72: 72 B200 GPUs in one NVLink domain",
             domain=72, peer="gb200", memory_from=SMI),
        _gpu("gb300", 298_013_687_808, 8000, 2500, "nvlink5", "GB300 NVL72: 72 B300 GPUs in one NVLink domain",
             domain=72, peer="gb300", memory_from=SMI),
        _gpu("rtx-pro-6000", 102_641_958_912, 1792, 467.8, "pcie5",
             "RTX PRO 6000 Blackwell Server Edition 96GB GDDR7 (PCIe 5.0, no NVLink)", peer="rtx_pro_6000_server",
             memory_from=SMI),
    )
}
# FP8 tensor cores (Hopper, Ada, Blackwell): vLLM runs an fp8 checkpoint's GEMMs in fp8 (W8A8, dynamic
# per-token activation scales), at twice the 16-bit rate (data sheets, dense). Others: 16-bit.
FP8_TFLOPS = {"h100-sxm": 1979, "h200": 1979, "l40s": 733, "b200": 4500, "b300": 4500, "gb200": 5000,
              "gb300": 5000, "rtx-pro-6000": 935.6}


# The speed model's efficiencies fitted per card (scripts/bench_plan.py --peer --fit, each card's grid on its
# own; docs/performance.md "Speed model calibration"), keyed by the aiconfigurator system (GPU.peer), as
# formulas.SpeedParams field values. Hopper's fit (h100_sxm and h200_sxm together) is SpeedParams' defaults;
# a card without an entry computes with them.
CALIBRATED: dict[str, dict[str, float]] = {
    "b200_sxm": {"hbm_efficiency": 0.91, "w8_hbm_efficiency": 0.54, "kv_hbm_efficiency": 0.73, "compute_efficiency": 0.8,
                 "fp8_compute_efficiency": 0.5, "link_efficiency": 0.62, "layer_overhead_us": 22.1,
                 "step_overhead_ms": 0, "allreduce_overhead_us": 19.5, "two_stage_us": 5.7, "fp8_single_token_us": 43.9},
    "gb200": {"hbm_efficiency": 0.95, "w8_hbm_efficiency": 0.61, "kv_hbm_efficiency": 0.66, "compute_efficiency": 0.63,
              "fp8_compute_efficiency": 0.43, "link_efficiency": 0.28, "layer_overhead_us": 32.4, "step_overhead_ms": 0,
              "allreduce_overhead_us": 5.9, "two_stage_us": 0, "fp8_single_token_us": 65.4},
    "b300_sxm": {"hbm_efficiency": 0.95, "w8_hbm_efficiency": 0.67, "kv_hbm_efficiency": 0.65, "compute_efficiency": 0.73,
                 "fp8_compute_efficiency": 0.47, "link_efficiency": 0.41, "layer_overhead_us": 35.4,
                 "step_overhead_ms": 0, "allreduce_overhead_us": 6.0, "two_stage_us": 11.4, "fp8_single_token_us": 56.9},
    "gb300": {"hbm_efficiency": 0.94, "w8_hbm_efficiency": 0.79, "kv_hbm_efficiency": 0.72, "compute_efficiency": 0.77,
              "fp8_compute_efficiency": 0.52, "link_efficiency": 0.26, "layer_overhead_us": 40.4, "step_overhead_ms": 0,
              "allreduce_overhead_us": 1.6, "two_stage_us": 1.4, "fp8_single_token_us": 74.1, "fp8_layer_us": 12.7},
    # PCIe cards: no custom two-stage all-reduce, so two_stage_us is 0
    "rtx_pro_6000_server": {"hbm_efficiency": 0.83, "w8_hbm_efficiency": 0.75, "kv_hbm_efficiency": 0.74,
                            "compute_efficiency": 0.78, "fp8_compute_efficiency": 0.95, "link_efficiency": 0.35,
                            "layer_overhead_us": 0, "step_overhead_ms": 0.15, "allreduce_overhead_us": 0,
                            "two_stage_us": 0, "fp8_single_token_us": 2.2},
    # L40S: its all-reduce is measured (GPU.allreduce), so link_efficiency and allreduce_overhead_us stay
    # Hopper's, unused by its TP; compute held at aiconfigurator's own L40S GEMM rates (bench_plan.PINNED)
    "l40s": {"hbm_efficiency": 0.77, "w8_hbm_efficiency": 0.69, "kv_hbm_efficiency": 0.7, "compute_efficiency": 0.6,
             "fp8_compute_efficiency": 0.45, "layer_overhead_us": 0, "step_overhead_ms": 0, "fp8_single_token_us": 2.9},
    # A100 has no fp8 tensor cores: its grid has bf16 cells only, so the 8-bit knobs stay Hopper's
    "a100_sxm": {"hbm_efficiency": 0.75, "kv_hbm_efficiency": 0.56, "compute_efficiency": 0.86, "link_efficiency": 0.26,
                 "layer_overhead_us": 42.6, "step_overhead_ms": 0, "allreduce_overhead_us": 7.0, "two_stage_us": 0},
}
# The worst cell after that fit: max |shardc / aiconfigurator - 1| over the card's grid, TPOT and tokens/s per
# GPU. Within CALIBRATION_TOLERANCE the card is calibrated; beyond it its figures are labelled approximate.
WORST_CELL: dict[str, float] = {"a100_sxm": 0.07, "h100_sxm": 0.10, "h200_sxm": 0.10, "rtx_pro_6000_server": 0.12,
                                "l40s": 0.06, "b200_sxm": 0.22, "b300_sxm": 0.12, "gb200": 0.14, "gb300": 0.14}
CALIBRATION_TOLERANCE = 0.15


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


def fp8_fixed_us(gpu: GPU, dtype: str, sp: Any, tokens: float) -> float:
    """Microseconds per layer a step with fp8 weights costs beyond the roofline: the activations'
    quantization before its GEMMs (sp.fp8_layer_us, every step), and where the step has one token, the
    slower kernel fp8 GEMMs of one row take (sp.fp8_single_token_us: aiconfigurator 0.12 measures vLLM
    0.24's on Blackwell at ~65 us per layer whatever the model's size and tp, B200 8B fp8 tp1: TPOT
    4.87 ms at concurrency 1, 3.18 ms at 2); 0 for 16-bit weights and cards without fp8 tensor cores."""
    if dtype != "fp8" or gpu.name not in FP8_TFLOPS:
        return 0.0
    return sp.fp8_layer_us + (sp.fp8_single_token_us if tokens <= 1 else 0.0)


GPU_ALIASES = {
    "a100": "a100-80gb", "a100-sxm": "a100-80gb", "a100-80gb-sxm": "a100-80gb",
    "a100-40gb-sxm": "a100-40gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h200-sxm": "h200",
    "b200-sxm": "b200", "b300-sxm": "b300", "gb200-nvl72": "gb200", "gb300-nvl72": "gb300",
    "rtx-pro-6000-server": "rtx-pro-6000", "rtx-pro-6000-blackwell": "rtx-pro-6000",
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
            link = get_interconnect(fabric)
        except PlanError as exc:
            raise PlanError(exc.message, key="fabric", hint=exc.hint) from None
        # the card's fitted kernel efficiencies still hold; its calibration label does not
        # (Cluster.worst_cell: the measured system had the preset's own fabric)
        out = dataclasses.replace(out, link=link, allreduce=())  # measured on the preset's own fabric
    if memory is not None:
        out = dataclasses.replace(out, memory=memory, memory_from="as given")
    if hbm_bandwidth is not None:
        out = dataclasses.replace(out, hbm_bandwidth=hbm_bandwidth)
    if link_bandwidth is not None:
        link = dataclasses.replace(out.link, bandwidth=link_bandwidth)
        out = dataclasses.replace(out, link=link, allreduce=())
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
    def worst_cell(self) -> float | None:
        """The speed model's worst cell against measured data of this card on this fabric (GPU.peer);
        None: no such data, or the preset given another fabric than the one measured."""
        preset = GPUS.get(self.gpu.name)
        if not self.gpu.peer or preset is None or preset.link.name != self.gpu.link.name:
            return None
        return WORST_CELL.get(self.gpu.peer)

    @property
    def calibrated(self) -> bool:
        """Whether the speed model is within CALIBRATION_TOLERANCE of this card's measured data."""
        worst = self.worst_cell
        return worst is not None and worst <= CALIBRATION_TOLERANCE

    @property
    def calibration(self) -> str:
        """calibrated | approximate (measured, the fit's worst cell beyond the tolerance) | uncalibrated."""
        return "calibrated" if self.calibrated else "uncalibrated" if self.worst_cell is None else "approximate"

    def fabric(self) -> str:
        """The fabric in words, as the header and --json say it."""
        link = self.gpu.link
        domain = "NVLink domain" if self.gpu.nvlink and link.tp_limit is None else f"{link.name} fabric"
        out = f"{domain}: TP up to {self.tp_limit}"
        if self.calibration == "uncalibrated":
            return out + " (uncalibrated: no measured data for this card and fabric)"
        if self.calibration == "approximate":
            return out + (f" (approximate: speed up to {self.worst_cell:.0%} from aiconfigurator 0.12's measured "
                          "vLLM data for this card)")
        return out
