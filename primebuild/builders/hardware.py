"""Accelerator facts the planner sizes against.

FLOP/s are dense (no 2:4 sparsity) tensor-core peaks; NVIDIA's headline numbers are "with sparsity",
i.e. twice these. Memory is the total CUDA reports (`torch.cuda.mem_get_info()[1]`, what vLLM's
gpu_memory_utilization multiplies), not the marketing GB: measured on an H200 it is 150,109,880,320
bytes, 613 MiB less than nvidia-smi's 143771 MiB. H100 and B200 use nvidia-smi's figure (not measured
here), which may be as much higher.

Sources (public spec sheets):
- H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ — 80 GB HBM3, 3.35 TB/s, BF16 1,979 and
  FP8 3,958 TFLOP/s with sparsity, NVLink 900 GB/s. nvidia-smi: 81559 MiB.
- H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ — 141 GB HBM3e, 4.8 TB/s, same tensor
  cores as H100, NVLink 900 GB/s. nvidia-smi: 143771 MiB; CUDA: 150,109,880,320 bytes.
- B200 (HGX/DGX B200): https://www.nvidia.com/en-us/data-center/dgx-b200/ — 1,440 GB and 64 TB/s of
  HBM3e for 8 GPUs (180 GB, 8 TB/s each), 72 PFLOP/s FP8 training for 8 GPUs with sparsity (4.5
  dense per GPU), BF16 half of that, NVLink 5 at 1.8 TB/s. nvidia-smi: 183359 MiB.
- Network: DGX H100/H200/B200 give each GPU one 400 Gb/s ConnectX-7 NIC, i.e. 50 GB/s per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from primebuild.errors import UserError

MIB = 1024**2
GIB = 1024**3
TERA = 10**12


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense peak FLOP/s
    fp8_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, one direction, inside a node
    network_bytes_per_s: float  # per GPU, between nodes
    gpus_per_node: int = 8

    def flops(self, precision: str) -> float:
        """Dense peak for the matmul precision ("bf16" or "fp8")."""
        if precision == "fp8":
            return self.fp8_flops
        if precision in ("bf16", "fp16", "fp32"):  # fp32 training still runs its matmuls in bf16/tf32
            return self.bf16_flops
        raise UserError(f"unknown precision '{precision}'", hint="use 'bf16' or 'fp8'")


_GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="h100", memory_bytes=81559 * MIB, bf16_flops=989.5 * TERA, fp8_flops=1979 * TERA,
        hbm_bytes_per_s=3.35 * TERA, nvlink_bytes_per_s=450e9, network_bytes_per_s=50e9,
    ),
    "h200": GpuSpec(
        name="h200", memory_bytes=150_109_880_320, bf16_flops=989.5 * TERA, fp8_flops=1979 * TERA,
        hbm_bytes_per_s=4.8 * TERA, nvlink_bytes_per_s=450e9, network_bytes_per_s=50e9,
    ),
    "b200": GpuSpec(
        name="b200", memory_bytes=183359 * MIB, bf16_flops=2250 * TERA, fp8_flops=4500 * TERA,
        hbm_bytes_per_s=8.0 * TERA, nvlink_bytes_per_s=900e9, network_bytes_per_s=50e9,
    ),
}

# A laptop or CI runner: memory is the host memory the manifest states; compute is a rough fp32 figure
# for a few cores (only the tiny embedded models run here, so precision of these hardly matters).
_CPU_FLOPS = 1e11
_CPU_MEMORY_BYTES_PER_S = 2e10


def known_gpus() -> list[str]:
    return sorted([*_GPUS, "cpu"])


def gpu_spec(name: str, *, host_memory_bytes: int | None = None) -> GpuSpec:
    """Spec of an accelerator type by its manifest name (case-insensitive).

    "cpu" needs `host_memory_bytes` (from the manifest), because no table can know it.
    """
    key = name.strip().lower()
    if key in _GPUS:
        return _GPUS[key]
    if key == "cpu":
        if not host_memory_bytes or host_memory_bytes <= 0:
            raise UserError("device 'cpu' needs the host memory size",
                            hint="state the host memory in the manifest (e.g. hardware.host_memory: 16GiB)")
        return GpuSpec(
            name="cpu", memory_bytes=int(host_memory_bytes), bf16_flops=_CPU_FLOPS, fp8_flops=_CPU_FLOPS,
            hbm_bytes_per_s=_CPU_MEMORY_BYTES_PER_S, nvlink_bytes_per_s=_CPU_MEMORY_BYTES_PER_S,
            network_bytes_per_s=1.25e9, gpus_per_node=1,
        )
    raise UserError(f"unknown GPU type '{name}'", hint=f"known types: {', '.join(known_gpus())}")
