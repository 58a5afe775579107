"""Hardware facts, one table for all: device peaks, memory bandwidths, fabric defaults.

Used by the training metrics (MFU), the cost model's roofline fallback and its
communication defaults. Datasheet figures, dense (no sparsity); where a measurement is
possible (calibration, a timed matmul) it comes first and these are the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GB", "GPU_PROFILES", "KNOWN_FABRICS", "KNOWN_GPUS", "Efficiency", "Fabric",
           "GpuProfile", "GpuSpec", "detect_profile", "gpu_peak_flops", "gpu_profile",
           "gpu_spec", "profile_with_memory"]


@dataclass(frozen=True)
class GpuSpec:
    """Dense peak FLOP/s (bf16/fp16 tensor cores; fp32 without TF32; float8 tensor cores,
    None where the GPU has none) and HBM bandwidth."""

    name: str
    bf16_flops: float
    fp32_flops: float
    mem_bandwidth_Bps: float
    fp8_flops: float | None = None


# Matched by substrings of ``torch.cuda.get_device_name``, first match wins: the more
# specific entries come first ("H200" before "H20", "H100 PCIe" before "H100").
KNOWN_GPUS: tuple[tuple[tuple[str, ...], GpuSpec], ...] = (
    # Float8 peaks: NVIDIA's datasheets give FP8 tensor-core figures "with sparsity";
    # dense is half (H100 SXM / H200: 3,958 -> 1,979 TFLOP/s; H100 PCIe: 3,026 -> 1,513;
    # H20: 296 dense). Ampere (A100) has no float8 tensor cores.
    # H200 SXM: H100's compute, HBM3e 4.8 TB/s.
    (("H200",), GpuSpec("H200", 989e12, 67e12, 4.8e12, 1979e12)),
    # H20 (export part): 148 TFLOP/s bf16 dense, 44 TFLOP/s fp32, HBM3 4.0 TB/s.
    (("H20",), GpuSpec("H20", 148e12, 44e12, 4.0e12, 296e12)),
    # H100 PCIe: 756 TFLOP/s bf16 dense, 51 TFLOP/s fp32, HBM2e 2.0 TB/s.
    (("H100", "PCIe"), GpuSpec("H100 PCIe", 756e12, 51e12, 2.0e12, 1513e12)),
    # H100 SXM: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, HBM3 3.35 TB/s.
    (("H100",), GpuSpec("H100 SXM", 989e12, 67e12, 3.35e12, 1979e12)),
    # A100 SXM: 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, 2.0 TB/s (80 GB).
    (("A100",), GpuSpec("A100", 312e12, 19.5e12, 2.0e12)),
)


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The spec of a GPU from its device name, or None if it is not in the table."""
    for keys, spec in KNOWN_GPUS:
        if all(k in device_name for k in keys):
            return spec
    return None


def model_flops_utilization(flops_per_token: float, tokens_per_s: float,
                            peak_flops: float) -> float:
    """MFU: the model's FLOP/s over the devices' peak (``peak_flops``: all the devices
    the tokens ran on, summed); one definition for the trainer and the planner."""
    return flops_per_token * tokens_per_s / peak_flops


def gpu_peak_flops(device_name: str) -> float | None:
    """Peak bf16 dense FLOP/s of a GPU from its name, or None if not in the table."""
    spec = gpu_spec(device_name)
    return None if spec is None else spec.bf16_flops


@dataclass(frozen=True)
class Fabric:
    """A link type: per-collective start-up latency, achievable ring bus bandwidth, the
    fraction of concurrent compute that hides communication
    (``CommModel.hidden_fraction``), and the device's copy bandwidth (bytes copied per
    second: a bucket's copy-in/out)."""

    alpha_s: float
    bus_bandwidth_Bps: float
    note: str
    hidden_fraction: float = 1.0
    copy_Bps: float = 1e12
    max_bytes: float | None = None  # largest collective the figures hold for
    ring_step_s: float = 0.0  # latency per step of a ring (the planner's collectives)


# Defaults used when calibration is off. A ring all-gather / reduce-scatter over n ranks
# moves (n-1)/n of the full tensor through every rank's link, a ring all-reduce twice
# that (reduce-scatter + all-gather), so beta = factor / bus_bandwidth and the bus
# bandwidth is the figure nccl-tests reports as "busbw".
KNOWN_FABRICS: dict[str, Fabric] = {
    # H100 SXM, NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA
    # H100 datasheet: "900 GB/s" bidirectional). nccl-tests on 8x H100 reach ~80% of that
    # for large all-gathers, hence 360 GB/s; small-message latency is ~10-20 us.
    # Copy: HBM3 3.35 TB/s moves a byte in and out, ~1.3e12 copied bytes/s achieved.
    # Per ring step ~1 us on NVLink, ~4 us across InfiniBand (the planner's collectives).
    "nvlink_h100": Fabric(15e-6, 360e9, "NVLink 4 intra-node (H100 SXM)", copy_Bps=1.3e12,
                          ring_step_s=1e-6),
    # Inter-node InfiniBand NDR: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s per direction
    # (DGX H100 reference design); ~80% achievable -> 40 GB/s busbw. Inter-node latency
    # (switch hops, proxy thread) is a few times NVLink's: ~50 us.
    "infiniband_ndr": Fabric(50e-6, 40e9, "InfiniBand NDR 400 Gb/s per GPU, inter-node",
                             copy_Bps=1.3e12, ring_step_s=4e-6),
    # A100 SXM, NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction; ~80% -> 240 GB/s.
    "nvlink_a100": Fabric(15e-6, 240e9, "NVLink 3 intra-node (A100 SXM)", ring_step_s=1e-6),
    # InfiniBand HDR: one 200 Gb/s NIC per GPU (DGX A100) = 25 GB/s; ~80% -> 20 GB/s.
    "infiniband_hdr": Fabric(50e-6, 20e9, "InfiniBand HDR 200 Gb/s per GPU, inter-node",
                             ring_step_s=4e-6),
    # Gloo over TCP loopback between CPU processes on one host: order of magnitude only
    # (CPU hosts and their load vary a lot; calibrate instead), from calibrations on a
    # 2-core host (README, cost model defaults). Hidden fraction 0: gloo's threads compete
    # with the compute for the same cores. Copy: a loaded core's torch.cat bandwidth.
    # Max bytes: the calibrated range; the fit says nothing about larger collectives.
    "gloo_cpu_loopback": Fabric(600e-6, 0.5e9, "gloo over TCP loopback, CPU processes",
                                hidden_fraction=0.0, copy_Bps=10e9, max_bytes=16 * 2 ** 20),
}


GiB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a device's datasheet peaks that real kernels reach, for the planner's
    roofline (``compiler.cost.compute.roofline_seconds``). The defaults are H100 figures
    (cuBLAS, FlashAttention-2 and memory-bound kernel benchmarks), global, not tuned per
    case; one table per device profile."""

    matmul: float = 0.60  # large bf16 GEMMs
    # Flash attention (FlashAttention-2, SDPA's flash kernel), head size 128, from the
    # FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608, Figs. 5-7: FA2 on H100
    # SXM5 at 8k-16k tokens) over the 989 TFLOP/s peak: forward 335 TFLOP/s causal (half
    # the scores counted), 370 without a mask; backward 320 TFLOP/s counting its FLOPs as
    # 2.5x the forward's (as ``models.llama.ATTENTION_BACKWARD_FLOPS`` does).
    attention: float = 335 / 989  # forward, causal
    attention_unmasked: float = 370 / 989  # forward, no mask (a ring's block of others' keys)
    attention_backward: float = 320 / 989
    # Query/key and value heads of different sizes (MLA's 192 / 128), which flash refuses,
    # measured on an H200 (torch 2.11, bf16, 4 x 4096 tokens, 16 heads, causal; backward
    # FLOPs counted 2.5x the forward's; README "Mixture of experts"): SDPA's
    # memory-efficient kernel 140 TFLOP/s forward, 38 backward; cuDNN's fused kernel (what
    # our MLA calls) 489-521 forward, 382-399 backward (two runs; their means here). The
    # H200's compute (132 SMs at 1,980 MHz) is the H100 SXM's; so are its flash rates
    # (measured 336-344 forward, 301-318 backward at head size 128, 16k tokens).
    efficient_attention: float = 140 / 989
    efficient_attention_backward: float = 38 / 989
    cudnn_attention: float = 505 / 989
    cudnn_attention_backward: float = 390 / 989
    memory: float = 0.70  # memory-bound kernels: fraction of HBM bandwidth
    # An MoE's token permutations (gathers by token, index_add, their backwards: the
    # passes plan/moe.py counts), measured on an H200 (torch 2.11, DeepSeek-V3 16B at EP 8,
    # profiled steps, README "Measured on a GPU"): eager 171 ms, compiled (Inductor, its
    # index_put backward slower than eager's) 256 ms, where the 31 passes at 70% of HBM
    # bandwidth give 96.6 ms. Inductor does not fuse them away.
    permute_memory: float = 0.40
    permute_memory_compiled: float = 0.26
    kernel_floor_s: float = 6e-6  # per kernel launched eagerly
    compiled_kernel_floor_s: float = 3e-6  # per kernel of a compiled graph
    fused_memory: float = 0.4  # compiled: memory-bound traffic left after Inductor's fusion

    def floor_s(self, compiled: bool) -> float:
        """The per-kernel floor, eager or compiled."""
        return self.compiled_kernel_floor_s if compiled else self.kernel_floor_s


@dataclass(frozen=True)
class GpuProfile:
    """A device profile for the planner (``--gpu``): the GPU, its usable memory as the
    driver reports it, and the fabrics of a node built from it (KNOWN_FABRICS keys)."""

    spec: GpuSpec
    memory_bytes: float
    intra_node: str
    inter_node: str
    note: str
    efficiency: Efficiency = Efficiency()
    # CPU offload (data_parallel's offload_policy, the planner's --cpu-offload):
    # host<->device copy bandwidth per direction from pinned memory, and the rate at which
    # the host's optimizer step gets through its state (bytes of parameters, gradients
    # and moments read and written per second, per rank). PCIe Gen5 x16 (H100/H200):
    # 64 GB/s per direction on the datasheet ("128 GB/s" bidirectional); pinned copies
    # reach ~80% of a link, hence 50 GB/s. Host step: a DGX H100's host (2 sockets x 8
    # DDR5-4800 channels, ~614 GB/s) shared by 8 GPUs is ~77 GB/s a rank; torch's CPU
    # AdamW makes several passes over each tensor, so an order of magnitude less (calibrate).
    pcie_Bps: float = 50e9
    host_optimizer_Bps: float = 10e9
    # Eager MoE steps wait for the host: each routed block reads its split sizes on the
    # host, so the device drains there and then waits for the next launches. Host seconds
    # per routed block and pass (a forward run or a backward; ``plan.moe.host_seconds``),
    # with the expert-parallel exchange's own work on top, and selective AC's dispatch
    # mode per forward run. Fitted to our eager DeepSeek-V3 16B steps on an H200 (torch
    # 2.11, docs/performance.md "Measured on an H200"): the host's CPU and torch decide
    # them, so they are the order of magnitude for another host.
    moe_block_host_s: float = 11.1e-3
    moe_exchange_host_s: float = 7.6e-3
    moe_selective_host_s: float = 9.3e-3


GPU_PROFILES: dict[str, GpuProfile] = {
    "h100-sxm": GpuProfile(gpu_spec("H100"), 79.6 * GiB, "nvlink_h100", "infiniband_ndr",
                           "H100 SXM5 80 GB HBM3, 700 W"),
    # The H100 of the published torchtitan / SimpleFSDP runs (Meta's Grand Teton):
    # 96 GB HBM2e at 2.4 TB/s, 500 W power cap; same SMs and datasheet peak.
    "h100-96gb": GpuProfile(GpuSpec("H100 96GB", 989e12, 67e12, 2.4e12,
                                                   1979e12), 94.5 * GiB,
                            "nvlink_h100", "infiniband_ndr", "H100 96 GB HBM2e, 500 W cap"),
    "h200": GpuProfile(gpu_spec("H200"), 139.8 * GiB, "nvlink_h100", "infiniband_ndr",
                       "H200 SXM 141 GB HBM3e"),
    # A100: PCIe Gen4 x16, 32 GB/s per direction on the datasheet; ~80% -> 25 GB/s.
    "a100-80gb": GpuProfile(gpu_spec("A100"), 79.2 * GiB, "nvlink_a100", "infiniband_hdr",
                            "A100 SXM4 80 GB", pcie_Bps=25e9),
    # One gloo rank on a CPU host, for planning CPU runs (``parallel.layout = "auto"``
    # with ``job.device = "cpu"``): the cost model's uncalibrated CPU figures per core
    # (``compiler.cost.compute.default_compute_spec``: 40 GFLOP/s fp32, 10 GB/s) and its
    # gloo loopback fabric between every pair of ranks. Memory is a placeholder: the
    # trainer plans CPU runs with the host's memory over its ranks (``name@GB``).
    "cpu": GpuProfile(GpuSpec("CPU core", 20e9, 40e9, 10e9), 16 * GiB, "gloo_cpu_loopback",
                      "gloo_cpu_loopback", "one CPU core per gloo rank, TCP loopback"),
}

GB = 1e9  # a memory limit's unit ("name@70GB", parallel.memory_limit_gb): decimal, as
# compile.memory_limit_gb


def gpu_profile(name: str) -> GpuProfile:
    """The profile ``name``: a key of ``GPU_PROFILES``, or ``KEY@<N>GB`` for that profile
    with ``N`` decimal GB of usable memory (a memory limit below the device's, e.g.
    ``h100-sxm@60GB``; a string, so it travels to the search's worker processes as the
    plain names do). A clear error lists the known ones."""
    key, at, limit = name.partition("@")
    if key not in GPU_PROFILES:
        raise ValueError(f"--gpu {name!r} is not a known device profile; choose one of "
                         f"{', '.join(GPU_PROFILES)} (optionally with @<N>GB: its memory)")
    if not at:
        return GPU_PROFILES[key]
    try:
        gb = float(limit.removesuffix("GB"))
    except ValueError:
        gb = -1.0
    if not limit.endswith("GB") or not gb > 0:
        raise ValueError(f"--gpu {name!r}: write the memory as {key}@<N>GB, N > 0 "
                         f"(decimal gigabytes), e.g. {key}@40GB")
    return replace(GPU_PROFILES[key], memory_bytes=gb * GB,
                   note=f"{GPU_PROFILES[key].note}; {gb:g} GB usable")


def profile_with_memory(name: str, memory_gb: float | None) -> str:
    """``name`` with its usable memory set to ``memory_gb`` decimal GB (``NAME@<N>GB``;
    ``name`` unchanged when None)."""
    return name if memory_gb is None else f"{name.partition('@')[0]}@{memory_gb!r}GB"


def detect_profile(device_type: str) -> str:
    """The profile of this process's device: a CUDA device's by its name (``KNOWN_GPUS``
    mapped to ``GPU_PROFILES``; an H100 counts as the 80 GB SXM part), else ``cpu``.
    A ValueError names a GPU with no profile (pass one explicitly)."""
    if device_type != "cuda":
        return "cpu"
    import torch

    device_name = torch.cuda.get_device_name()
    spec = gpu_spec(device_name)
    for key, profile in GPU_PROFILES.items():
        if spec is not None and profile.spec == spec:
            return key
    raise ValueError(f"no device profile for {device_name!r}: set parallel.hardware to "
                     f"one of {', '.join(GPU_PROFILES)}")
