"""GPU presets: memory as CUDA reports it, HBM bandwidth and dense bf16 peak (vendor data sheets).

The memory is cudaGetDeviceProperties' totalGlobalMem (torch.cuda.get_device_properties().total_memory, the
"total capacity" of torch's OutOfMemoryError), not nvidia-smi's "Total", which is larger by what the driver keeps
(an H100 80GB HBM3: 81,559 MiB in nvidia-smi, about 81,090 MiB to CUDA): the engine's cap is a fraction of
CUDA's figure, and a plan sized on nvidia-smi's promised about 0.46 GiB the engine never has."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        # torch's device properties as printed on each (total_memory=...MB); they vary by a few MiB by driver
        GPU("a100-40gb", 40536 * MiB, 1.555e12, 312e12),  # A100-SXM4-40GB: 40536 (nvidia-smi 40960)
        GPU("a100-80gb", 81050 * MiB, 2.039e12, 312e12),  # A100-SXM4-80GB: 79.15 GiB (nvidia-smi 81920)
        GPU("h100-80gb", 81090 * MiB, 3.35e12, 989e12),  # H100 80GB HBM3: 81082-81090 (nvidia-smi 81559)
        GPU("h200-141gb", 143156 * MiB, 4.8e12, 989e12),  # H200: 143156 (nvidia-smi 143771)
    )
}


# The device names (torch.cuda.get_device_name, NVML's) each preset's figures are those of, exactly: an A100 80GB
# PCIe (1.94 TB/s), an H100 PCIe or NVL, a GH200 or an H200 NVL has figures of its own, and no preset stands for it
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",  # the same 40 GB of HBM2 at 1.555 TB/s
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA H100 80GB HBM3": "h100-80gb",  # the SXM5 board
    "NVIDIA H200": "h200-141gb",  # the SXM board
}


def gpu_of_device_name(name: str | None) -> GPU | None:
    """The preset whose figures are the named device's (DEVICE_NAMES, by the whole name), or None."""
    key = {k.lower(): v for k, v in DEVICE_NAMES.items()}.get((name or "").strip().lower())
    return GPUS[key] if key else None


# What a GPU-hour of each preset costs, in USD: indicative on-demand cloud list prices (they vary by provider,
# region and commitment, and drift), for `simulate --grid`'s requests per dollar; a grid file's
# `price_per_gpu_hour` overrides them with the user's own.
USD_PER_GPU_HOUR: dict[str, float] = {"a100-40gb": 1.50, "a100-80gb": 1.80, "h100-80gb": 2.50, "h200-141gb": 3.50}


def gpu_preset(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
    return GPUS[name]


def resolve_gpu(name: str | None, memory_bytes: int | None, hbm_bytes_per_s: float = 0.0,
                peak_flops: float = 0.0) -> GPU | None:
    """A preset by name, else a GPU of the given memory (and speed, where a step model needs one), else None."""
    if name:
        return gpu_preset(name)
    return GPU(f"{memory_bytes} B", memory_bytes, hbm_bytes_per_s, peak_flops) if memory_bytes else None
