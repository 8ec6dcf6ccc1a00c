"""Device memory: one interface, one stats record, one OOM event for the arena and the CUDA allocator.

The arena is a fixed-capacity byte heap backed by one tensor. Placement is best-fit with coalescing
(sizes rounded as PyTorch's caching allocator rounds them) or power-of-two buddy (as the vLLM paper's
Orca baselines). An allocation fails when no single free extent fits, exactly as on a GPU, and the
failure says whether free memory would have sufficed (`fragmentation`) or not (`capacity`).
"""

from __future__ import annotations

import bisect
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # a memory of bookkeeping alone (the simulator's) makes no tensor: torch is imported where one is
    import torch

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
    allocator: CachingAllocatorFigures | None = None  # the caching allocator's own figures, where one holds the KV


@dataclass(frozen=True)
class CachingAllocatorFigures:
    """What torch.cuda.memory_stats() says of the caching allocator (or its emulator): /stats' `allocator`."""

    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    segments: int
    alloc_retries: int
    # requests by PyTorch's size class (as rounded): small <= 1 MiB (2 MiB segments), large under 10 MiB (a 20 MiB
    # segment each), huge from 10 MiB (a segment of their own size); counted since the memory was made
    small_requests: int = 0
    large_requests: int = 0
    huge_requests: int = 0


Layer = Literal["policy", "allocator"]


@dataclass(frozen=True)
class OOMEvent:
    requested_bytes: int
    free_bytes: int
    largest_free_bytes: int
    cause: Cause
    owner: str = ""
    # where a caching allocator holds the KV: free bytes inside its segments, and under the cap outside them
    cached_free_bytes: int = 0
    device_free_bytes: int = 0
    # which layer failed: the policy's (the live KV did not fit under the cap) or the allocator's (cached and
    # never-reserved bytes together would hold it, but no block does and the segment it asks for does not fit)
    layer: Layer = "policy"

    @staticmethod
    def classify(requested_bytes: int, free_bytes: int, largest_free_bytes: int, owner: str = "") -> OOMEvent:
        cause: Cause = "capacity" if free_bytes < requested_bytes else "fragmentation"
        return OOMEvent(requested_bytes, free_bytes, largest_free_bytes, cause, owner)

    @staticmethod
    def judge(rounded_bytes: int, cached_free_bytes: int, device_free_bytes: int, largest_free_bytes: int,
              owner: str, layer: Layer) -> OOMEvent:
        """A caching allocator's refusal (the emulator's or PyTorch's own): `fragmentation` where its cached free
        bytes and the room left under its cap would together hold the request (the bytes exist, in no block or
        segment that fits), `capacity` where they would not (the memory is truly full)."""
        free = cached_free_bytes + device_free_bytes
        cause: Cause = "capacity" if free < rounded_bytes else "fragmentation"
        return OOMEvent(rounded_bytes, free, largest_free_bytes, cause, owner, cached_free_bytes, device_free_bytes,
                        layer)


class OutOfMemory(RuntimeError):
    def __init__(self, event: OOMEvent):
        layer = (f"; the allocator's: {event.cached_free_bytes} B cached free in its segments, "
                 f"{event.device_free_bytes} B free under the cap" if event.layer == "allocator" else "")
        super().__init__(
            f"out of memory ({event.cause}): requested {event.requested_bytes} B, "
            f"free {event.free_bytes} B, largest free extent {event.largest_free_bytes} B{layer}"
        )
        self.event = event


@dataclass
class Allocation:
    offset: int  # into the arena; 0 for a CUDA tensor of its own
    size: int  # rounded
    requested: int
    owner: str
    tensor: torch.Tensor | None = field(default=None, repr=False)


def byte_backing(nbytes: int, device: str | torch.device | None, committed: bool) -> torch.Tensor | None:
    """nbytes of uint8 on device (zeroed where `committed`, else empty: the host commits only the pages written), or
    None where device is None: bookkeeping alone, as the simulator keeps it, without importing torch (1.4 s)."""
    if device is None:
        return None
    import torch

    return (torch.zeros if committed else torch.empty)(nbytes, dtype=torch.uint8, device=device)


class DeviceMemory(ABC):
    capacity_bytes: int
    device: torch.device | str  # where the bytes (and the row indices into them) live; "cpu" for bookkeeping alone

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

    def close(self) -> None:  # noqa: B027 (most memories change nothing beyond their bytes)
        """Give back what the memory changed beyond its own bytes (the CUDA allocator's process-wide cap)."""

    def device_oom(self, segment_bytes: int, owner: str) -> OOMEvent:
        """A torch.cuda.OutOfMemoryError outside this memory's own bytes (a forward's activations), given the segment
        it says it tried to allocate (engines/oom.segment_asked): `capacity`, nothing under the device was left
        for it. CUDA memory overrides it with the allocator's own judgement."""
        return OOMEvent(segment_bytes, 0, 0, "capacity", owner)

    @abstractmethod
    def rounded(self, nbytes: int) -> int:
        """What an allocation of nbytes takes, as this allocator rounds it."""

    def row_aligned(self, row_bytes: int) -> bool:
        """Whether every allocation of whole rows starts on a whole row (True where nothing is indexed by
        rows of one store: a CUDA tensor of its own)."""
        return True

    def free_bytes_below(self, nbytes: int) -> int:
        """Free bytes in extents that cannot hold an allocation of `nbytes` (rounded as this allocator rounds
        it): external fragmentation against that allocation."""
        need = self.rounded(nbytes)
        return sum(size for _, size, owner in self.extents() if owner is None and size < need)

    def max_units(self, unit_bytes: int, extra_bytes: int = 0) -> int:
        """The most whole units of unit_bytes one allocation (of `extra_bytes` more) can take now, rounding
        included: a pool sized so never asks for more than the budget. Rounding is monotonic, so a binary
        search finds it."""
        limit = self.stats().largest_free_bytes
        lo, hi = 0, limit // unit_bytes
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.rounded(mid * unit_bytes + extra_bytes) <= limit else (lo, mid - 1)
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
        self.backing = byte_backing(capacity_bytes, backing_device, committed=True)
        self.device = self.backing.device if self.backing is not None else "cpu"
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

    def row_aligned(self, row_bytes: int) -> bool:
        """Offsets are sums of rounded sizes: whole rows when every granule (512 B, 2 MiB pages; a buddy's
        powers of two) is a multiple or a divisor of the row. Bookkeeping alone (the simulator) indexes no
        rows: nothing to align."""
        if self.backing is None:
            return True
        power_of_two = row_bytes & (row_bytes - 1) == 0
        return power_of_two if self.placement == "buddy" else power_of_two and LARGE_PAGE_BYTES % row_bytes == 0

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

    def free_bytes_below(self, nbytes: int) -> int:
        with self._lock:
            return self._heap.free_below(self._heap.round(nbytes))

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

    def free_below(self, size: int) -> int:
        """Bytes in free extents smaller than `size` (the sizes are sorted: the ones before it)."""
        return sum(s for s, _ in self._by_size[: bisect.bisect_left(self._by_size, (size, -1))])

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

    def free_below(self, size: int) -> int:
        return sum(s * len(offs) for s, offs in self._free.items() if s < size)

    def free_extents(self) -> list[tuple[int, int]]:
        return [(o, s) for s, offs in self._free.items() for o in offs]

    def _region_size(self, offset: int) -> int:
        for region_offset, size in self._regions:
            if region_offset <= offset < region_offset + size:
                return size
        raise ValueError(f"offset {offset} lies outside the buddy regions")


# What `auto` means when set: the test suite pins it to cpu (tests/conftest.py), so that on a GPU box its servers and
# benches run where the suite's figures were made; FRAGBENCH_DEVICE=cuda (or auto) runs them on the GPU instead
DEVICE_ENV = "FRAGBENCH_DEVICE"


def cuda_available() -> bool:
    import torch  # here, not at the top: a run on the CPU that names its device needs no torch to decide it

    return torch.cuda.is_available()


def resolve_device(requested: str = "auto") -> str:
    """`auto` is FRAGBENCH_DEVICE where set, else the GPU where CUDA is available, else the CPU; asking for CUDA
    without it is an error."""
    if requested == "auto":
        requested = os.environ.get(DEVICE_ENV) or "auto"
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    if requested.startswith("cuda") and not cuda_available():
        raise ValueError(f"--device {requested}: this machine has no CUDA device (use --device cpu or auto)")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], not {requested!r}")
    return requested
