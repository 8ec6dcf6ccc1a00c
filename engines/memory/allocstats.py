"""The caching allocator's figures: its stats and OOM records (engines/memory/caching.py), and /stats' `allocator`,
read from the engine's KV memory (the emulator's under --memory caching; none for the arena). Where no GPU
answers for torch_allocated_bytes and torch_reserved_bytes (the debugging pass reads them), the emulator's
figures stand in for PyTorch's."""

from __future__ import annotations

from dataclasses import asdict, dataclass


def kv_memory(engine):
    """The DeviceMemory holding an engine's KV: its policy's, or its own (hf); None for an engine without one."""
    kv = getattr(engine, "kv", None)
    return getattr(kv, "memory", None) or getattr(engine, "memory", None)


@dataclass(frozen=True)
class DeviceFigures:
    """What the device the engine runs on says (cuda.device_snapshot), as /stats names it and in its order:
    PyTorch's CUDA allocator totals, NVML's used bytes, then cuda.ALLOCATOR_FIELDS; all None off a GPU. Kept
    here, torch-free, since allocator_stats reads it to stand in where the device measured nothing."""

    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    torch_active_bytes: int | None = None
    torch_inactive_split_bytes: int | None = None
    torch_segments: int | None = None
    torch_alloc_retries: int | None = None
    torch_ooms: int | None = None


def allocator_stats(engine, device: DeviceFigures) -> dict:
    """{"allocator": {...} or None}, and torch_allocated_bytes/torch_reserved_bytes where the device left them
    None and the emulator has them."""
    memory = kv_memory(engine)
    figures = getattr(memory.stats(), "allocator", None) if memory is not None else None
    if figures is None:
        return {"allocator": None}
    out: dict = {"allocator": asdict(figures)}
    if device.torch_allocated_bytes is None:
        out.update(torch_allocated_bytes=figures.allocated_bytes, torch_reserved_bytes=figures.reserved_bytes)
    return out


@dataclass(frozen=True)
class AllocatorStats:
    """torch.cuda.memory_stats()'s aggregate figures, by their names (current values; peaks where named)."""

    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    inactive_split: int
    segments: int
    requested_bytes: int
    allocations: int
    alloc_retries: int
    ooms: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_segments: int

    def memory_stats(self) -> dict[str, int]:
        """The same, keyed as torch.cuda.memory_stats() keys them."""
        return {"allocated_bytes.all.current": self.allocated_bytes, "reserved_bytes.all.current":
                self.reserved_bytes, "active_bytes.all.current": self.active_bytes,
                "inactive_split_bytes.all.current": self.inactive_split_bytes,
                "inactive_split.all.current": self.inactive_split, "segment.all.current": self.segments,
                "requested_bytes.all.current": self.requested_bytes, "allocation.all.current": self.allocations,
                "num_alloc_retries": self.alloc_retries, "num_ooms": self.ooms,
                "allocated_bytes.all.peak": self.peak_allocated_bytes,
                "reserved_bytes.all.peak": self.peak_reserved_bytes, "segment.all.peak": self.peak_segments}


@dataclass(frozen=True)
class AllocatorOOMInfo:
    """The allocator's state when a request failed: which layer failed follows from these."""

    requested_bytes: int  # as asked
    rounded_bytes: int  # as the allocator rounds it: the block it looked for
    segment_bytes: int  # the segment it asked the device for
    reserved_bytes: int
    allocated_bytes: int
    cached_free_bytes: int  # inside the allocator's segments, free
    device_free_bytes: int  # under the cap, outside every segment
    largest_cached_bytes: int


class AllocatorOOM(RuntimeError):
    def __init__(self, info: AllocatorOOMInfo):
        super().__init__(f"caching allocator out of memory: tried to allocate {info.segment_bytes} B for a "
                         f"{info.requested_bytes} B request; {info.reserved_bytes} B reserved, "
                         f"{info.allocated_bytes} B allocated, {info.cached_free_bytes} B cached free, "
                         f"{info.device_free_bytes} B free under the cap")
        self.info = info
