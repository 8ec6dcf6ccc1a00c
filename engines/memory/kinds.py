"""A device memory by its `--memory` name. Apart from engines/memory/arena.py so that the interface does not import
what implements it (engines/memory/cuda.py imports the interface; the interface importing cuda.py was a circle)."""

from __future__ import annotations

from engines.memory.arena import Arena, DeviceMemory, Placement
from engines.memory.caching_memory import CachingMemory

MEMORY_KINDS = ("arena", "cuda", "caching")


def make_memory(kind: str, capacity_bytes: int, device: str = "cpu", placement: Placement = "best-fit",
                headroom_bytes: int = 0, alloc_conf: str | None = None) -> DeviceMemory:
    """`device` is where the model runs: the KV lives on the same one (cuda memory on a CPU model would put
    every K/V row on another device than the activations that write it). `alloc_conf` (PYTORCH_CUDA_ALLOC_CONF's
    syntax) configures the caching emulator; under `cuda` the server's environment carries it."""
    if kind == "arena":
        return Arena(capacity_bytes, placement, backing_device=device)
    if kind == "cuda":
        from engines.memory.cuda import CudaMemory  # torch.cuda's side, apart

        return CudaMemory(capacity_bytes, device, headroom_bytes)
    if kind == "caching":
        return CachingMemory(capacity_bytes, alloc_conf, backing_device=device)
    raise ValueError(f"memory backend must be one of {', '.join(MEMORY_KINDS)}, not {kind!r}")
