"""`fragbench simulate --memory caching`: the engines' KV policies at real model shapes on PyTorch's caching allocator
(engines/memory/caching.py) instead of the arena, its bookkeeping alone (no tensor behind it: a 60 GiB budget costs
nothing). The allocator's classes are absolute (512 B, 1 MiB, 10 MiB, 20 MiB), so only at a real model's sizes do
its segments, splits and cached blocks fall as they would on the GPU. `AllocatorTrack` follows the allocator over
simulated time for the result's `allocator` block: what torch.cuda.memory_stats() would say after the run, its
peaks, and the share of the budget reserved but allocated to nothing (time-weighted)."""

from __future__ import annotations

from engines.memory.arena import Arena, DeviceMemory
from engines.memory.caching_memory import CachingMemory

SIM_MEMORIES = ("arena", "caching")


def sim_memory(kind: str, budget_bytes: int, placement: str, alloc_conf: str | None = None) -> DeviceMemory:
    """The simulator's KV memory, bookkeeping only: the arena placed as `placement`, or the caching allocator under
    a cap of the budget configured by `alloc_conf` (PYTORCH_CUDA_ALLOC_CONF's syntax)."""
    if kind == "caching":
        return CachingMemory(budget_bytes, alloc_conf, backing_device=None)
    if kind == "arena":
        return Arena(budget_bytes, placement=placement, backing_device=None)
    raise ValueError(f"the simulator's memory is one of {', '.join(SIM_MEMORIES)}, not {kind!r}")


def placement_of(memory: DeviceMemory) -> str:
    """What a result calls where its KV lived: the arena's placement, or the caching allocator."""
    return getattr(memory, "placement", None) or "caching"


class AllocatorTrack:
    """The caching allocator under a simulated policy, integrated over simulated time; inert for the arena."""

    def __init__(self, memory: DeviceMemory):
        self.allocator = getattr(memory, "allocator", None)
        self.size_classes = getattr(memory, "size_classes", None)  # requests by PyTorch's size class
        self.conf = getattr(memory, "conf", None)
        self.gap_bytes_s = 0.0  # (reserved - allocated) x seconds
        self.seconds = 0.0

    def add(self, dt_s: float) -> None:
        """dt_s simulated seconds pass with the allocator as it is now."""
        if self.allocator is not None and dt_s > 0:
            self.gap_bytes_s += dt_s * (self.allocator.reserved - self.allocator.allocated)
            self.seconds += dt_s

    def block(self, oom_layers: list[str]) -> dict | None:
        """The result's `allocator`: the state after the run (every sequence done: what the allocator keeps), its
        exact peaks, the time-weighted reserved-unallocated share of the cap, and the OOMs by layer."""
        a = self.allocator
        if a is None:
            return None
        s = a.stats()
        return {"alloc_conf": self.conf.label, "allocated_bytes": s.allocated_bytes,
                "reserved_bytes": s.reserved_bytes, "active_bytes": s.active_bytes,
                "inactive_split_bytes": s.inactive_split_bytes, "segments": s.segments,
                "alloc_retries": s.alloc_retries, "peak_allocated_bytes": s.peak_allocated_bytes,
                "peak_reserved_bytes": s.peak_reserved_bytes, "peak_segments": s.peak_segments,
                "reserved_unallocated_share": (self.gap_bytes_s / self.seconds / a.capacity_bytes
                                               if self.seconds and a.capacity_bytes else None),
                "oom_policy": oom_layers.count("policy"), "oom_allocator": oom_layers.count("allocator"),
                "size_classes": dict(self.size_classes) if self.size_classes is not None else None}
