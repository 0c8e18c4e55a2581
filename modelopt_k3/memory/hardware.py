"""Hardware constants for the wall-time model (``wall_time.py``): named presets and their overrides.

Every figure is a rate one *rank* (one GPU and the process driving it) or one *host* (the machine whose disks
its ranks share) reaches. Peak figures are the vendors' datasheet numbers (cited beside each); what a run
reaches is peak x a nominal efficiency, stated once here (``EFFICIENCY``) rather than hidden in the peaks, so a
measured constant (``benchmarks/bench_wall_time.py`` measures this machine's) replaces a preset field
one-for-one with ``dataclasses.replace`` or the CLI's ``--disk_gbps``/``--net_gbps``.

Storage is the least known input: no GPU datasheet states it, and it decides the load and export of a
single-GPU run. The presets assume node-local NVMe (``HOST_DISK_*``) and a per-process rate of one Python
reader or writer (``PROCESS_IO_*``); both are assumptions, overridable, and named in the plan's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9  # datasheets count decimal gigabytes
TFLOPS = 1e12

# What a run reaches of a datasheet peak (nominal, not measured): large BF16 GEMMs ~60%, streaming HBM ~80%,
# NVLink/InfiniBand all-to-all of ~MB messages ~70%, PCIe/C2C host copies from pinned memory ~80%.
EFFICIENCY = {"gemm": 0.6, "hbm": 0.8, "link": 0.7, "host_link": 0.8}

# Storage assumptions shared by the GPU presets (no datasheet figure): a host's NVMe array reads ~20 GB/s and
# writes ~10 GB/s in aggregate; one process's safetensors read (page cache copy, checks, device copy) reaches
# ~2 GB/s and its shard writes (NVFP4 packing, fsync) ~1.5 GB/s.
HOST_DISK_READ, HOST_DISK_WRITE = 20 * GB, 10 * GB
PROCESS_IO_READ, PROCESS_IO_WRITE = 2 * GB, 1.5 * GB
# Fixed costs of a GPU run: process start (torch, transformers, NCCL init, tokenizer, preflight) and per
# decoder layer per forward (kernel launches and Python dispatch of ~30 modules; eager, no CUDA graphs).
GPU_STARTUP_S = 60.0
GPU_LAYER_FORWARD_S = 2e-3
# Fixed costs per tensor and per routed-expert call (nominal, not measured on a GPU host; this CPU host measures
# its own, 0.1-0.5 ms each: benchmarks/bench_wall_time.py). The loader handles each source tensor in Python (slice,
# checks, decode and copy launches), the export each written tensor (quantize launches, device->host copy, header,
# digest) and the served check reads each one back; an eager fused-experts forward launches ~15 kernels per expert
# that received tokens (gather, two GEMMs, activation, scatter, the observers' reductions) at ~10 us each.
GPU_TENSOR_LOAD_S, GPU_TENSOR_EXPORT_S, GPU_TENSOR_CHECK_S = 1e-4, 1e-4, 5e-5
GPU_EXPERT_CALL_S = 1.5e-4


@dataclass(frozen=True)
class Hardware:
    """Rates per rank (``*_per_s``: bytes or FLOP per second, already x efficiency) and per host.

    ``gpus_per_host``: ranks sharing one host's disks; ``nvlink_domain``: ranks an all-to-all reaches over
    NVLink (beyond it, ``inter_node_bytes_per_s``). ``decode_bytes_per_s``: decoded bytes one rank produces
    per second from an MXFP4/FP8 source (on a GPU: HBM-bound, three passes: read source, write decoded,
    the copy into the module). ``startup_s`` and ``layer_forward_s``: the fixed costs. The per-unit costs
    (``tensor_load_s``: per source tensor a rank loads; ``expert_call_s``: per routed expert that receives tokens,
    per batch and MoE layer; ``tensor_export_s``: per tensor written; ``tensor_check_s``: per tensor the served
    check reads back) grow with the expert count, not the bytes; 0 leaves a cost out."""

    name: str
    memory_bytes: int  # per GPU (the memory planner's budget)
    gpus_per_host: int
    nvlink_domain: int
    gemm_flop_per_s: float
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # host <-> device (PCIe Gen5 x16, NVLink-C2C); CPU runs: no copy (inf)
    intra_node_bytes_per_s: float  # one direction, per rank
    inter_node_bytes_per_s: float  # one direction, per rank
    host_disk_read_bytes_per_s: float
    host_disk_write_bytes_per_s: float
    process_read_bytes_per_s: float
    process_write_bytes_per_s: float
    decode_bytes_per_s: float
    search_bytes_per_s: float  # fp32 bytes a weight search streams per second (candidates x weights x 4 bytes)
    factor_flop_per_s: float  # GPTQ's Cholesky/inverse (fp32 linalg: far below GEMM peak)
    startup_s: float
    layer_forward_s: float
    source: str = ""  # where the numbers come from, printed with the plan
    tensor_load_s: float = 0.0
    expert_call_s: float = 0.0
    tensor_export_s: float = 0.0
    tensor_check_s: float = 0.0

    def with_overrides(self, *, disk_gbps: float | None = None, disk_write_gbps: float | None = None,
                       net_gbps: float | None = None) -> Hardware:
        """The flags of ``modelopt-k3-plan``: ``disk_gbps`` sets the host's read rate and caps one process's;
        ``disk_write_gbps`` the same for writes (default: unchanged); ``net_gbps`` the inter-node rate per rank
        (GB/s, already effective: no efficiency applied)."""
        changes: dict[str, float | str] = {}
        if disk_gbps is not None:
            changes.update(host_disk_read_bytes_per_s=disk_gbps * GB,
                           process_read_bytes_per_s=min(self.process_read_bytes_per_s, disk_gbps * GB))
        if disk_write_gbps is not None:
            changes.update(host_disk_write_bytes_per_s=disk_write_gbps * GB,
                           process_write_bytes_per_s=min(self.process_write_bytes_per_s, disk_write_gbps * GB))
        if net_gbps is not None:
            changes["inter_node_bytes_per_s"] = net_gbps * GB
        if changes:
            flags = ", ".join(f"{k}={v}" for k, v in (("disk_gbps", disk_gbps), ("disk_write_gbps", disk_write_gbps),
                                                     ("net_gbps", net_gbps)) if v is not None)
            changes["name"] = f"{self.name} ({flags})"
        return dataclasses.replace(self, **changes)


def gpu_preset(name: str, *, memory_gb: float, gpus_per_host: int, nvlink_domain: int, bf16_tflops: float, hbm_tbps: float,
               host_link_gbps: float, nvlink_gbps: float, network_gbps: float, source: str) -> Hardware:
    """A GPU preset from datasheet figures (memory GB, dense BF16 TFLOPS, HBM TB/s, one-direction link GB/s), the
    rates x ``EFFICIENCY``."""
    hbm = hbm_tbps * 1e12 * EFFICIENCY["hbm"]
    return Hardware(
        name=name, memory_bytes=int(memory_gb * GB), gpus_per_host=gpus_per_host, nvlink_domain=nvlink_domain,
        gemm_flop_per_s=bf16_tflops * TFLOPS * EFFICIENCY["gemm"], hbm_bytes_per_s=hbm,
        host_link_bytes_per_s=host_link_gbps * GB * EFFICIENCY["host_link"],
        intra_node_bytes_per_s=nvlink_gbps * GB * EFFICIENCY["link"],
        inter_node_bytes_per_s=network_gbps * GB * EFFICIENCY["link"],
        host_disk_read_bytes_per_s=HOST_DISK_READ, host_disk_write_bytes_per_s=HOST_DISK_WRITE,
        process_read_bytes_per_s=PROCESS_IO_READ, process_write_bytes_per_s=PROCESS_IO_WRITE,
        decode_bytes_per_s=hbm / 3, search_bytes_per_s=hbm, factor_flop_per_s=bf16_tflops * TFLOPS * 0.02,
        startup_s=GPU_STARTUP_S, layer_forward_s=GPU_LAYER_FORWARD_S, source=source,
        tensor_load_s=GPU_TENSOR_LOAD_S, expert_call_s=GPU_EXPERT_CALL_S, tensor_export_s=GPU_TENSOR_EXPORT_S,
        tensor_check_s=GPU_TENSOR_CHECK_S)


PRESETS: dict[str, Hardware] = {
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, BF16 1,979 TFLOPS with sparsity (989 dense), HBM3e 4.8 TB/s, NVLink 900 GB/s
    # (both directions: 450 each), PCIe Gen5 x16 128 GB/s (64 each way); DGX H200: 8 GPUs, 8 x ConnectX-7
    # 400 Gb/s (50 GB/s per GPU).
    "h200-node": gpu_preset("h200-node", memory_gb=141, gpus_per_host=8, nvlink_domain=8, bf16_tflops=989, hbm_tbps=4.8,
                            host_link_gbps=64, nvlink_gbps=450, network_gbps=50,
                            source="H200 SXM datasheet; DGX H200 (8 GPUs, ConnectX-7 400 Gb/s per GPU)"),
    # NVIDIA HGX/DGX B200 datasheet: 1,440 GB HBM3e per 8 GPUs (180 each), BF16 36 PFLOPS per 8 GPUs with sparsity (2,250 dense per GPU), HBM3e 8 TB/s,
    # NVLink 5 1.8 TB/s (900 GB/s each way), PCIe Gen5, 8 x ConnectX-7 400 Gb/s.
    "b200-node": gpu_preset("b200-node", memory_gb=180, gpus_per_host=8, nvlink_domain=8, bf16_tflops=2250, hbm_tbps=8.0,
                            host_link_gbps=64, nvlink_gbps=900, network_gbps=50,
                            source="HGX B200 datasheet (8 GPUs, ConnectX-7 400 Gb/s per GPU)"),
    # NVIDIA GB200 NVL72 datasheet: 13.4 TB HBM3e per 72 GPUs (186 each), BF16 360 PFLOPS per 72 GPUs with sparsity (2,500 dense per GPU), HBM3e 8 TB/s
    # per GPU, NVLink 5 1.8 TB/s per GPU across the 72-GPU domain, NVLink-C2C 900 GB/s per Grace shared by its two
    # GPUs (225 GB/s each way per GPU); a compute tray (one host, its disks) holds 4 GPUs.
    "gb200": gpu_preset("gb200", memory_gb=186, gpus_per_host=4, nvlink_domain=72, bf16_tflops=2500, hbm_tbps=8.0,
                        host_link_gbps=225, nvlink_gbps=900, network_gbps=50,
                        source="GB200 NVL72 datasheet (4 GPUs per compute tray, 72 per NVLink domain)"),
}


def get_hardware(name: str) -> Hardware:
    """The preset ``name``; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


__all__ = ["EFFICIENCY", "GB", "PRESETS", "Hardware", "get_hardware", "gpu_preset"]
