"""`--memory caching`: the KV held through the caching allocator emulator (caching.py) under a cap equal to
the KV budget, as `set_per_process_memory_fraction` caps PyTorch's: allocated and reserved differ where
PyTorch's would, and an OOM says which layer failed.

The bytes: one tensor stands for the device's virtual address space (three times the cap, plus room for a 20 MiB
segment), created empty so that the host commits only the pages an engine writes. Segments are placed in it by
best fit (a GPU maps a segment under fresh virtual addresses: the address space is large enough that placing a
segment never fails while the cap allows it), and every allocation is a view of its block's bytes, so engines
compute on them for real; contiguous policies index its rows as they index the arena's."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from engines.memory.allocconf import AllocConf, parse_alloc_conf
from engines.memory.arena import (
    Allocation,
    BestFitHeap,
    CachingAllocatorFigures,
    DeviceMemory,
    MemoryStats,
    OOMEvent,
    OutOfMemory,
    byte_backing,
)
from engines.memory.blocks import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    ROUND_LARGE_BYTES,
    SIZE_CLASSES,
    round_size,
    segment_size,
    size_class,
)
from engines.memory.caching import AllocatorOOM, CachingAllocator
from engines.memory.snapshot import snapshot

if TYPE_CHECKING:
    import torch

SPARE_ADDRESS_BYTES = 64 * 2**20  # beyond three caps: an expandable segment's 1 1/8 cap per pool, rounded to pages


class HeapAddresses:
    """Segments placed in one tensor's bytes, best fit, at 2 MiB granules."""

    def __init__(self, size: int):
        self.heap = BestFitHeap(size)

    def reserve(self, size: int) -> int | None:
        return self.heap.take(-(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES)

    def release(self, addr: int, size: int) -> None:
        self.heap.give(addr, -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES)


class CachingMemory(DeviceMemory):
    def __init__(self, capacity_bytes: int, conf: AllocConf | str | None = None,
                 backing_device: str | torch.device | None = "cpu"):
        self.capacity_bytes = capacity_bytes
        self.conf = conf if isinstance(conf, AllocConf) else parse_alloc_conf(conf)
        span = -(-(3 * capacity_bytes + SPARE_ADDRESS_BYTES) // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
        self.address_bytes = span  # where its blocks may lie, backed or not
        self.backing = byte_backing(span, backing_device, committed=False)
        self.device = self.backing.device if self.backing is not None else "cpu"
        self.allocator = CachingAllocator(capacity_bytes, self.conf, HeapAddresses(span))
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Allocation, object]] = {}  # offset -> (allocation, its block)
        self.size_classes = dict.fromkeys(SIZE_CLASSES, 0)  # requests by PyTorch's size class (size_class)
        self.first_oom_snapshot: list[dict] | None = None  # the segments at the first OOM, as _snapshot() has them

    @property
    def backed(self) -> bool:
        return self.backing is not None

    def rounded(self, nbytes: int) -> int:
        return round_size(nbytes, self.conf)

    def row_aligned(self, row_bytes: int) -> bool:
        """Segments start on 2 MiB granules and blocks are whole 512 B granules: whole rows where a row divides
        512 B (bookkeeping alone indexes no rows)."""
        return self.backing is None or MIN_BLOCK_BYTES % row_bytes == 0

    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        with self._lock:
            self.size_classes[size_class(round_size(nbytes, self.conf))] += 1
            try:
                block = self.allocator.malloc(nbytes)
            except AllocatorOOM as e:
                if self.first_oom_snapshot is None:  # the allocator's state as it failed: serve --oom-snapshot
                    self.first_oom_snapshot = snapshot(self.allocator)["segments"]
                raise OutOfMemory(self._oom_event(e, owner)) from None
            view = self.backing[block.addr: block.addr + block.size] if self.backing is not None else None
            alloc = Allocation(block.addr, block.size, nbytes, owner, view)
            self._live[block.addr] = (alloc, block)
        return alloc

    def _oom_event(self, e: AllocatorOOM, owner: str) -> OOMEvent:
        """The policy's OOM when the live KV and this request pass the cap; else the allocator's: cached and
        never-reserved bytes would hold it, but no block does and the segment it asks for does not fit."""
        i = e.info
        event = OOMEvent.judge(i.rounded_bytes, i.cached_free_bytes, i.device_free_bytes, self._largest(), owner,
                               "allocator")
        return replace(event, layer="policy") if event.cause == "capacity" else event

    def free(self, alloc: Allocation) -> None:
        with self._lock:
            found = self._live.pop(alloc.offset, None)
            if found is None or found[0] is not alloc:
                raise ValueError(f"double free or foreign allocation at offset {alloc.offset}")
            self.allocator.free(found[1])
            alloc.tensor = None

    def _largest(self) -> int:
        """The largest block a request could get now: a cached block, or a new segment under the cap."""
        a = self.allocator
        room = max(0, self.capacity_bytes - a.reserved)
        # a new segment is whole 2 MiB granules; an expandable one maps whole 20 MiB pages (a pool sized to the
        # 2 MiB granule would ask for a page past the cap)
        page = LARGE_BUFFER_BYTES if self.conf.expandable_segments else ROUND_LARGE_BYTES
        fresh = room // page * page
        if fresh == 0 or segment_size(fresh) > room:  # 1-10 MiB requests need a 20 MiB segment: small ones may fit
            fresh = 2**20 if room >= segment_size(2**20) else 0
        return max(a.largest_cached_bytes(), fresh)

    def stats(self) -> MemoryStats:
        with self._lock:
            s = self.allocator.stats()
            return MemoryStats(
                capacity_bytes=self.capacity_bytes,
                allocated_bytes=s.allocated_bytes,
                requested_bytes=s.requested_bytes,
                free_bytes=self.capacity_bytes - s.allocated_bytes,
                largest_free_bytes=self._largest(),
                num_allocations=len(self._live),
                reserved_bytes=s.reserved_bytes,
                allocator=CachingAllocatorFigures(s.allocated_bytes, s.reserved_bytes, s.active_bytes,
                                                  s.inactive_split_bytes, s.segments, s.alloc_retries,
                                                  *self.size_classes.values()),
            )

    def extents(self) -> list[tuple[int, int, str | None]]:
        """The allocator's blocks by address, mapped ones only: live with their owner, cached free as None."""
        with self._lock:
            out = []
            for head in self.allocator.segment_heads():
                b = head
                while b is not None:
                    if b.mapped:
                        owner = self._live[b.addr][0].owner if b.allocated else None
                        out.append((b.addr, b.size, owner))
                    b = b.next
            return out

    def view(self, alloc: Allocation) -> torch.Tensor:
        if alloc.tensor is None:
            raise RuntimeError("this caching memory keeps bookkeeping only (or the allocation was freed)")
        return alloc.tensor
