"""Device memory: one interface, one stats record, one OOM event for the arena and the CUDA allocator.

The arena is a fixed-capacity byte heap backed by one tensor. Placement is best-fit with coalescing
(sizes rounded as PyTorch's caching allocator rounds them) or power-of-two buddy (as the vLLM paper's
Orca baselines). An allocation fails when no single free extent fits, exactly as on a GPU, and the
failure says whether free memory would have sufficed (`fragmentation`) or not (`capacity`).
"""

from __future__ import annotations

import bisect
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

from engines.nvml import memory_info, nvml

KiB, MiB, GiB = 2**10, 2**20, 2**30
ROUND_BYTES = 512  # PyTorch's kMinBlockSize
LARGE_BYTES = 1 * MiB  # above this PyTorch serves from the large pool...
LARGE_PAGE_BYTES = 2 * MiB  # ...in 2 MiB granules

Cause = Literal["capacity", "fragmentation"]
Placement = Literal["best-fit", "buddy"]


@dataclass(frozen=True)
class MemoryStats:
    capacity_bytes: int
    allocated_bytes: int  # as the allocator hands them out, rounding included
    requested_bytes: int  # as the callers asked
    free_bytes: int
    largest_free_bytes: int
    num_allocations: int
    reserved_bytes: int  # held from the device (CUDA caching allocator); the capacity for the arena


@dataclass(frozen=True)
class OOMEvent:
    requested_bytes: int
    free_bytes: int
    largest_free_bytes: int
    cause: Cause
    owner: str = ""

    @staticmethod
    def classify(requested_bytes: int, free_bytes: int, largest_free_bytes: int, owner: str = "") -> OOMEvent:
        cause: Cause = "capacity" if free_bytes < requested_bytes else "fragmentation"
        return OOMEvent(requested_bytes, free_bytes, largest_free_bytes, cause, owner)


class OutOfMemory(RuntimeError):
    def __init__(self, event: OOMEvent):
        super().__init__(
            f"out of memory ({event.cause}): requested {event.requested_bytes} B, "
            f"free {event.free_bytes} B, largest free extent {event.largest_free_bytes} B"
        )
        self.event = event


@dataclass
class Allocation:
    offset: int  # into the arena; 0 for a CUDA tensor of its own
    size: int  # rounded
    requested: int
    owner: str
    tensor: torch.Tensor | None = field(default=None, repr=False)


class DeviceMemory(ABC):
    capacity_bytes: int
    device: torch.device  # where the bytes (and the row indices into them) live

    @abstractmethod
    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        """Raises OutOfMemory carrying the OOMEvent."""

    @abstractmethod
    def free(self, alloc: Allocation) -> None: ...

    @abstractmethod
    def stats(self) -> MemoryStats: ...

    @abstractmethod
    def extents(self) -> list[tuple[int, int, str | None]]:
        """(offset, size, owner or None when free), in address order: the memory map."""

    def memory_map(self) -> list[dict]:
        """The extents as the report draws them."""
        return [{"offset": o, "size": s, "owner": owner} for o, s, owner in self.extents()]

    @property
    @abstractmethod
    def backed(self) -> bool:
        """Whether allocations hold real bytes (False: bookkeeping only, as in the simulator)."""

    @abstractmethod
    def view(self, alloc: Allocation) -> torch.Tensor:
        """The allocation's bytes as a uint8 tensor."""

    @abstractmethod
    def rounded(self, nbytes: int) -> int:
        """What an allocation of nbytes takes, as this allocator rounds it."""

    def max_units(self, unit_bytes: int) -> int:
        """The most whole units of unit_bytes one allocation can take now, rounding included: a pool sized
        so never asks for more than the budget. Rounding is monotonic, so a binary search finds it."""
        limit = self.stats().largest_free_bytes
        lo, hi = 0, limit // unit_bytes
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.rounded(mid * unit_bytes) <= limit else (lo, mid - 1)
        return lo


def round_size(nbytes: int) -> int:
    """PyTorch's caching-allocator rounding: 512 B granules, 2 MiB granules above 1 MiB."""
    granule = LARGE_PAGE_BYTES if nbytes > LARGE_BYTES else ROUND_BYTES
    return max(granule, -(-nbytes // granule) * granule)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Arena(DeviceMemory):
    """A fixed-capacity heap; `backing_device=None` keeps bookkeeping only (the simulator)."""

    def __init__(
        self,
        capacity_bytes: int,
        placement: Placement = "best-fit",
        backing_device: str | torch.device | None = "cpu",
    ):
        if capacity_bytes < ROUND_BYTES:
            raise ValueError(f"arena capacity must be at least {ROUND_BYTES} B, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.placement = placement
        self.backing = (
            torch.zeros(capacity_bytes, dtype=torch.uint8, device=backing_device)
            if backing_device is not None
            else None
        )
        self.device = self.backing.device if self.backing is not None else torch.device("cpu")
        self._lock = threading.Lock()
        self._live: dict[int, Allocation] = {}
        self._allocated = 0
        self._requested = 0
        self._heap = BuddyHeap(capacity_bytes) if placement == "buddy" else BestFitHeap(capacity_bytes)

    @property
    def backed(self) -> bool:
        return self.backing is not None

    def rounded(self, nbytes: int) -> int:
        return self._heap.round(nbytes)

    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        size = self._heap.round(nbytes)
        with self._lock:
            offset = self._heap.take(size)
            if offset is None:
                free = self.capacity_bytes - self._allocated
                raise OutOfMemory(OOMEvent.classify(size, free, self._heap.largest(), owner))
            alloc = Allocation(offset, size, nbytes, owner)
            self._live[offset] = alloc
            self._allocated += size
            self._requested += nbytes
        return alloc

    def free(self, alloc: Allocation) -> None:
        with self._lock:
            if self._live.pop(alloc.offset, None) is not alloc:
                raise ValueError(f"double free or foreign allocation at offset {alloc.offset}")
            self._heap.give(alloc.offset, alloc.size)
            self._allocated -= alloc.size
            self._requested -= alloc.requested

    def stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(
                capacity_bytes=self.capacity_bytes,
                allocated_bytes=self._allocated,
                requested_bytes=self._requested,
                free_bytes=self.capacity_bytes - self._allocated,
                largest_free_bytes=self._heap.largest(),
                num_allocations=len(self._live),
                reserved_bytes=self.capacity_bytes,
            )

    def extents(self) -> list[tuple[int, int, str | None]]:
        with self._lock:
            used = [(a.offset, a.size, a.owner) for a in self._live.values()]
            free = [(o, s, None) for o, s in self._heap.free_extents()]
        return sorted(used + free)

    def view(self, alloc: Allocation) -> torch.Tensor:
        if self.backing is None:
            raise RuntimeError("this arena keeps bookkeeping only: it has no bytes to view")
        return self.backing[alloc.offset : alloc.offset + alloc.size]


class BestFitHeap:
    """Free extents by offset and by size; freed extents coalesce with both neighbours at once."""

    def __init__(self, capacity: int):
        self._by_start: dict[int, int] = {0: capacity}
        self._by_end: dict[int, int] = {capacity: 0}
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]  # sorted (size, offset)

    @staticmethod
    def round(nbytes: int) -> int:
        return round_size(nbytes)

    def take(self, size: int) -> int | None:
        i = bisect.bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        extent_size, offset = self._by_size[i]
        self._remove(offset, extent_size)
        if extent_size > size:
            self._add(offset + size, extent_size - size)
        return offset

    def give(self, offset: int, size: int) -> None:
        end = offset + size
        if end in self._by_start:  # the extent after
            after = self._by_start[end]
            self._remove(end, after)
            size += after
        if offset in self._by_end:  # the extent before
            before = self._by_end[offset]
            self._remove(before, offset - before)
            size += offset - before
            offset = before
        self._add(offset, size)

    def largest(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        return list(self._by_start.items())

    def _add(self, offset: int, size: int) -> None:
        self._by_start[offset] = size
        self._by_end[offset + size] = offset
        bisect.insort(self._by_size, (size, offset))

    def _remove(self, offset: int, size: int) -> None:
        del self._by_start[offset]
        del self._by_end[offset + size]
        del self._by_size[bisect.bisect_left(self._by_size, (size, offset))]


class BuddyHeap:
    """Power-of-two buddy allocation over the capacity split into aligned power-of-two regions."""

    def __init__(self, capacity: int):
        self._regions: list[tuple[int, int]] = []  # (offset, size), largest first so each is aligned
        offset, rest = 0, capacity - capacity % ROUND_BYTES
        while rest >= ROUND_BYTES:
            size = 1 << (rest.bit_length() - 1)
            self._regions.append((offset, size))
            offset, rest = offset + size, rest - size
        self._free: dict[int, set[int]] = {}  # block size -> offsets
        for region_offset, size in self._regions:
            self._free.setdefault(size, set()).add(region_offset)

    @staticmethod
    def round(nbytes: int) -> int:
        return max(ROUND_BYTES, next_pow2(nbytes))

    def take(self, size: int) -> int | None:
        fits = [s for s, offs in self._free.items() if s >= size and offs]
        if not fits:
            return None
        block = min(fits)
        offset = min(self._free[block])  # lowest address first keeps placement deterministic
        self._free[block].discard(offset)
        while block > size:  # split, keeping the low half
            block //= 2
            self._free.setdefault(block, set()).add(offset + block)
        return offset

    def give(self, offset: int, size: int) -> None:
        region_size = self._region_size(offset)
        while size < region_size:
            buddy = offset ^ size
            if buddy not in self._free.get(size, ()):
                break
            self._free[size].discard(buddy)
            offset, size = min(offset, buddy), size * 2
        self._free.setdefault(size, set()).add(offset)

    def largest(self) -> int:
        return max((s for s, offs in self._free.items() if offs), default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        return [(o, s) for s, offs in self._free.items() for o in offs]

    def _region_size(self, offset: int) -> int:
        for region_offset, size in self._regions:
            if region_offset <= offset < region_offset + size:
                return size
        raise ValueError(f"offset {offset} lies outside the buddy regions")


class CudaMemory(DeviceMemory):
    """The real PyTorch CUDA caching allocator, capped at the KV budget above what is already in use."""

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda memory backend needs a CUDA device; this machine has none")
        self.device = torch.device(device)
        self.capacity_bytes = capacity_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        in_use = torch.cuda.memory_reserved(self.device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (in_use + capacity_bytes) / total), self.device)
        self._baseline = torch.cuda.memory_allocated(self.device)
        self._live: dict[int, Allocation] = {}
        self._requested = 0
        self.first_oom_snapshot: list[dict] | None = None  # the allocator's segments at the first OOM

    @property
    def backed(self) -> bool:
        return True

    def rounded(self, nbytes: int) -> int:
        return round_size(nbytes)

    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            if self.first_oom_snapshot is None:
                self.first_oom_snapshot = cuda_segments(self.device)
            s = self.stats()
            raise OutOfMemory(
                OOMEvent.classify(round_size(nbytes), s.free_bytes, s.largest_free_bytes, owner)
            ) from None
        alloc = Allocation(0, round_size(nbytes), nbytes, owner, tensor)
        self._live[id(alloc)] = alloc
        self._requested += nbytes
        return alloc

    def free(self, alloc: Allocation) -> None:
        if self._live.pop(id(alloc), None) is None:
            raise ValueError("double free or foreign allocation")
        self._requested -= alloc.requested
        alloc.tensor = None

    def stats(self) -> MemoryStats:
        s = torch.cuda.memory_stats(self.device)
        allocated = s.get("allocated_bytes.all.current", 0) - self._baseline
        reserved = s.get("reserved_bytes.all.current", 0)
        free = max(0, self.capacity_bytes - allocated)
        return MemoryStats(
            capacity_bytes=self.capacity_bytes,
            allocated_bytes=allocated,
            requested_bytes=self._requested,
            free_bytes=free,
            largest_free_bytes=min(free, self._largest_free_block(reserved)),
            num_allocations=len(self._live),
            reserved_bytes=reserved,
        )

    def _largest_free_block(self, reserved: int) -> int:
        """The largest inactive block in the cache, or the never-reserved rest of the cap if larger."""
        inactive = [
            b["size"]
            for seg in torch.cuda.memory_snapshot()
            for b in seg["blocks"]
            if b["state"] == "inactive"
        ]
        unreserved = max(0, self._baseline + self.capacity_bytes - reserved)
        return max([unreserved, *inactive])

    def extents(self) -> list[tuple[int, int, str | None]]:
        out: list[tuple[int, int, str | None]] = []
        for seg in torch.cuda.memory_snapshot():
            addr = seg["address"]
            for b in seg["blocks"]:
                out.append((addr, b["size"], "allocated" if b["state"] == "active_allocated" else None))
                addr += b["size"]
        return sorted(out)

    def view(self, alloc: Allocation) -> torch.Tensor:
        assert alloc.tensor is not None
        return alloc.tensor


def cuda_segments(device: torch.device | None = None) -> list[dict]:
    """torch.cuda.memory_snapshot() cut to what the report draws: each segment's blocks, in address order."""
    index = None if device is None else torch.device(device).index
    return [{"address": seg["address"], "total_size": seg["total_size"], "device": seg.get("device"),
             "blocks": [{"size": b["size"], "state": b["state"]} for b in seg["blocks"]]}
            for seg in torch.cuda.memory_snapshot() if index is None or seg.get("device") in (None, index)]


# torch.cuda.memory_stats fields sampled beside the allocator totals: the gap between reserved and allocated
# that the caching allocator keeps, how much of it is split blocks no request fits, and its retries and OOMs
ALLOCATOR_FIELDS = {
    "torch_active_bytes": "active_bytes.all.current",
    "torch_inactive_split_bytes": "inactive_split_bytes.all.current",
    "torch_segments": "segment.all.current",
    "torch_alloc_retries": "num_alloc_retries",
    "torch_ooms": "num_ooms",
}


def make_memory(kind: str, capacity_bytes: int, device: str = "cpu", placement: Placement = "best-fit"):
    if kind == "arena":
        return Arena(capacity_bytes, placement, backing_device=device)
    if kind == "cuda":
        return CudaMemory(capacity_bytes, device if device != "cpu" else "cuda")
    raise ValueError(f"memory backend must be arena or cuda, not {kind!r}")


def resolve_device(requested: str = "auto") -> str:
    """`auto` is the GPU where CUDA is available, else the CPU; asking for CUDA without it is an error."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: this machine has no CUDA device (use --device cpu or auto)")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], not {requested!r}")
    return requested


def device_info(device: str) -> dict:
    """What run.json records of the device a run used."""
    info = {"device": device, "name": None, "driver": None, "cuda": None}
    if device.startswith("cuda"):
        info.update(name=torch.cuda.get_device_name(torch.device(device)), cuda=torch.version.cuda)
        try:
            info["driver"] = nvml().nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing or refusing: the rest still stands
            pass
    return info


def device_snapshot() -> dict:
    """What the device itself says: the PyTorch CUDA allocator and NVML, or None where there is no GPU."""
    out: dict = {"torch_allocated_bytes": None, "torch_reserved_bytes": None, "device_used_bytes": None,
                 **dict.fromkeys(ALLOCATOR_FIELDS)}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        out["torch_allocated_bytes"] = stats.get("allocated_bytes.all.current", 0)
        out["torch_reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
        out.update({column: stats.get(key, 0) for column, key in ALLOCATOR_FIELDS.items()})
        try:
            out["device_used_bytes"] = memory_info(torch.cuda.current_device()).used
        except Exception:  # NVML missing or refusing: the allocator's numbers still stand
            pass
    return out


def device_note() -> str:
    """One clear line on what device memory the run can see."""
    if not torch.cuda.is_available():
        return "no CUDA device: KV memory is the arena's; PyTorch allocator and NVML figures are absent"
    try:
        import pynvml

        pynvml.nvmlInit()
        return f"CUDA device {torch.cuda.get_device_name()}; NVML driver {pynvml.nvmlSystemGetDriverVersion()}"
    except Exception as e:
        return f"CUDA device {torch.cuda.get_device_name()}; NVML unavailable ({type(e).__name__})"
