"""GPU profiles for the planner: compute peaks, memory, and the fabric between GPUs.

Datasheet figures (dense, no sparsity; bandwidths per direction per GPU). To be folded
into ``simplefsdp.hardware`` (the one device table) when that module exists.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One GPU kind and the fabric of a node built from it."""

    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    fp32_flops: float  # non-tensor-core fp32 peak (fp32 matmuls without TF32)
    memory_bytes: float  # usable HBM as the driver reports it
    hbm_Bps: float  # memory bandwidth, bytes/s
    nvlink_Bps: float  # intra-node, per GPU per direction
    nvlink_latency_s: float  # per collective start-up, intra-node
    ib_Bps: float  # inter-node, one NIC per GPU, per direction
    ib_latency_s: float  # per collective start-up, inter-node
    note: str = ""


DEVICES: dict[str, Device] = {
    # H100 SXM5 80 GB: 989 TFLOP/s bf16, 67 fp32, HBM3 3.35 TB/s; NVLink 4 900 GB/s
    # bidirectional; ConnectX-7 NDR 400 Gb/s per GPU (DGX H100).
    "h100-sxm": Device("h100-sxm", 989e12, 67e12, 79.6 * GiB, 3.35e12, 450e9, 15e-6,
                       50e9, 30e-6, "H100 SXM5 80 GB HBM3, 700 W"),
    # The H100 of the published torchtitan / SimpleFSDP runs (Meta's Grand Teton):
    # 96 GB HBM2e at 2.4 TB/s, 500 W power cap; same SMs and peak.
    "h100-96gb": Device("h100-96gb", 989e12, 67e12, 94.5 * GiB, 2.4e12, 450e9, 15e-6,
                        50e9, 30e-6, "H100 96 GB HBM2e, 500 W cap"),
    # H200: the H100 die with 141 GB HBM3e at 4.8 TB/s.
    "h200": Device("h200", 989e12, 67e12, 139.8 * GiB, 4.8e12, 450e9, 15e-6, 50e9, 30e-6,
                   "H200 SXM 141 GB HBM3e"),
    # A100 SXM4 80 GB: 312 TFLOP/s bf16, 19.5 fp32, 2.04 TB/s; NVLink 3 600 GB/s
    # bidirectional; HDR 200 Gb/s per GPU (DGX A100).
    "a100-80gb": Device("a100-80gb", 312e12, 19.5e12, 79.2 * GiB, 2.04e12, 300e9, 15e-6,
                        25e9, 30e-6, "A100 SXM4 80 GB"),
}


def device(name: str) -> Device:
    """The profile ``name``; a clear error lists the known ones."""
    if name not in DEVICES:
        raise ValueError(f"--gpu {name!r} is not a known device profile; choose one of "
                         f"{', '.join(DEVICES)}")
    return DEVICES[name]
