"""PyTorch's CUDA caching allocator, rule for rule, on any machine: the state machine alone (blocks, pools,
segments, stats), with no bytes behind it. `engines/memory/caching_memory.py` backs it with tensors for the engines;
`engines/memory/snapshot_replay.py` drives it from a real trace.

Reimplemented from the rules of c10/cuda/CUDACachingAllocator.cpp (torch 2.13), one stream per block pool key:
- a request is rounded to 512 B (or to a power-of-two division, `roundup_power2_divisions`);
- requests <= 1 MiB come from the small pool, packed in 2 MiB segments; larger ones from the large pool, where
  a request under 10 MiB carves a 20 MiB segment and a larger one a segment of its size rounded to 2 MiB;
- the free block chosen is the smallest that fits, then the lowest address (best fit by (size, address));
- a small-pool block is split when 512 B or more would remain, a large-pool one when more than 1 MiB would remain
  and the request is under max_split_size; a block of max_split_size or more serves only a request of
  max_split_size or more, within max_non_split_rounding (20 MiB) of its size;
- a freed block merges with its free neighbours in its own segment, never across segments;
- when a new segment would pass the cap: garbage collection first (garbage_collection_threshold), then one
  oversize cached block (or several) is freed and the segment retried, then every unsplit cached segment is
  freed and the segment retried once more (`num_alloc_retries`), then OOM (`num_ooms`);
- expandable_segments:True: one segment per pool and stream that maps 2 MiB (small) or 20 MiB (large) pages at
  its lowest free address, and unmaps its empty pages before the last retry.

The cap is `set_per_process_memory_fraction`'s, checked where `alloc_block` checks it: reserved bytes plus the
segment a request asks for (`alloc_size`) must stay within it, before any segment is made. Past that check a
segment fails only when the device runs out (`device_bytes`): cudaMalloc for a whole segment; for expandable
segments each page's cuMemCreate, which maps whole pages, so an expandable segment may grow past the cap by up to
a page less 2 MiB (a GPU maps a segment's pages under fresh virtual addresses, so the device never fragments)."""

from __future__ import annotations

from bisect import bisect_left

from engines.memory.allocconf import AllocConf, AllocConfError, parse_alloc_conf
from engines.memory.allocstats import AllocatorOOM, AllocatorOOMInfo, AllocatorStats
from engines.memory.blocks import (
    MIN_BLOCK_BYTES,
    SMALL_SIZE_BYTES,
    Block,
    BumpAddresses,
    Expandable,
    Pool,
    expandable_size,
    merge,
    round_size,
    segment_size,
)
from engines.memory.expandable import allocate_expandable, release_expandable


class CachingAllocator:
    """The allocator of one device of `device_bytes` (default: the cap; the device's total memory, which sizes an
    expandable segment's virtual range and refuses what it cannot hold) under a cap of `capacity_bytes` reserved.
    `addresses` places segments (reserve/release); `events`, when a list, receives (action, address, size,
    stream) for every segment_alloc, segment_free, segment_map and segment_unmap, as PyTorch's trace names them."""

    def __init__(self, capacity_bytes: int, conf: AllocConf | str | None = None, addresses=None,
                 events: list | None = None, device_bytes: int | None = None):
        self.conf = conf if isinstance(conf, AllocConf) else parse_alloc_conf(conf)
        if self.conf.backend != "native":
            raise AllocConfError(f"alloc conf: backend:{self.conf.backend} is CUDA's own allocator, not the "
                                 "caching allocator: there are no rules to emulate")
        self.capacity_bytes = capacity_bytes
        self.device_bytes = capacity_bytes if device_bytes is None else device_bytes
        self.addresses = addresses or BumpAddresses()
        self.events = events
        self.small, self.large = Pool(True), Pool(False)
        self.expandables: list[Expandable] = []
        self.live: dict[int, Block] = {}  # allocated blocks by address: the snapshot and the invariants walk them
        self.max_split = self.conf.max_split_size_bytes
        self.gc = self.conf.garbage_collection_threshold > 0.0
        self.allocated = self.reserved = self.active = self.inactive_split_bytes = self.inactive_split = 0
        self.segments = self.requested = self.allocations = self.retries = self.ooms = 0
        self.peak_allocated = self.peak_reserved = self.peak_segments = 0

    # ---- the public calls -------------------------------------------------------------------------------------

    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """A block for `orig_size` bytes, or AllocatorOOM carrying the state at the failure."""
        size = round_size(orig_size, self.conf)
        pool = self.small if size <= SMALL_SIZE_BYTES else self.large
        alloc_size = segment_size(size)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, stream, True)
            if block is None:
                self.ooms += 1
                raise AllocatorOOM(self._oom_info(orig_size, size, alloc_size))
        return self._alloc_found_block(pool, block, size, orig_size)

    def free(self, block: Block) -> None:
        if not block.allocated:
            raise ValueError(f"double free of the block at {block.addr:#x}")
        block.allocated = False
        del self.live[block.addr]
        self.allocations -= 1
        self.allocated -= block.size
        self._free_block(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every unsplit cached segment back to the device."""
        self._release_cached_blocks()

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.allocated, self.reserved, self.active, self.inactive_split_bytes,
                              self.inactive_split, self.segments, self.requested, self.allocations, self.retries,
                              self.ooms, self.peak_allocated, self.peak_reserved, self.peak_segments)

    def segment_heads(self) -> list[Block]:
        """The first block of every segment (of every expandable segment's range), by address."""
        every = [*self.live.values(), *self.small.free.values(), *self.large.free.values(),
                 *self.small.unmapped.values(), *self.large.unmapped.values()]
        return sorted((b for b in every if b.prev is None), key=lambda b: b.addr)

    def largest_cached_bytes(self) -> int:
        return max((k[1] for p in (self.small, self.large) for k in p.keys), default=0)

    # ---- finding and carving a block ---------------------------------------------------------------------------

    def _get_free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        if self.gc:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, 0))
        if i == len(keys) or keys[i][0] != stream:
            return None
        block = pool.free[keys[i][2]]
        if block.segment is not None:  # expandable: a block is as large as the unmapped range after it
            while i + 1 < len(keys) and keys[i + 1][0] == stream:
                nxt = pool.free[keys[i + 1][2]]
                if block.segment is None or expandable_size(nxt) >= expandable_size(block):
                    break
                i, block = i + 1, nxt
        if size < self.max_split <= block.size:
            return None  # an oversize block never serves a request under max_split_size
        if size >= self.max_split and block.size >= size + self.conf.max_non_split_rounding_bytes:
            return None  # ...and an oversize request only within the rounding tolerance
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.max_split and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, pool: Pool, block: Block, size: int, orig_size: int) -> Block:
        already_split = block.is_split()
        if self._should_split(block, size):
            rest = block
            block = Block(rest.addr, size, rest.stream, rest.small, rest.segment)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
            if rest.segment is None:
                if already_split:  # an inactive split block shrinks by the new block
                    self.inactive_split_bytes -= size
                else:  # a new inactive split block: the rest of an unsplit one
                    self.inactive_split_bytes += rest.size
                    self.inactive_split += 1
        elif already_split and block.segment is None:
            self.inactive_split_bytes -= block.size
            self.inactive_split -= 1
        block.allocated = True
        block.requested = orig_size
        self.live[block.addr] = block
        self.allocations += 1
        self.allocated += block.size
        self.active += block.size
        self.requested += orig_size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def _free_block(self, block: Block) -> None:
        pool = self.small if block.small else self.large
        size, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        for other in (block.prev, block.next):
            merged = merge(block, other, pool)
            if merged:
                net_blocks -= 1
                net_bytes -= merged
        pool.insert(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        if block.segment is None:  # PyTorch leaves expandable segments out of inactive_split
            self.inactive_split += net_blocks
            self.inactive_split_bytes += net_bytes
        self.active -= size
        self.requested -= requested

    # ---- segments from the device ------------------------------------------------------------------------------

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        if retry:
            self.retries += 1
        if self.reserved + alloc_size > self.capacity_bytes:  # alloc_block: the fraction's one check
            return None
        if self.conf.expandable_segments:  # pages map until the device runs out (ExpandableSegment::map)
            return allocate_expandable(self, pool, size, stream)
        if self.reserved + alloc_size > self.device_bytes:  # cudaMalloc: the device is out
            return None
        addr = self.addresses.reserve(alloc_size)
        if addr is None:
            return None
        block = Block(addr, alloc_size, stream, pool.small)
        self.segments += 1
        self._reserve(alloc_size)
        self.peak_segments = max(self.peak_segments, self.segments)
        self._event("segment_alloc", addr, alloc_size, stream)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _event(self, action: str, addr: int, size: int, stream: int) -> None:
        if self.events is not None:
            self.events.append((action, addr, size, stream))

    def _release_block(self, block: Block, pool: Pool) -> None:
        """A whole cached segment back to the device (cudaFree); never an expandable segment's block (PyTorch
        asserts `!block->expandable_segment_`: those are unmapped page by page, release_expandable)."""
        assert block.segment is None, "release_block of an expandable segment's block"
        self._event("segment_free", block.addr, block.size, block.stream)
        self.addresses.release(block.addr, block.size)
        self.reserved -= block.size
        self.segments -= 1
        pool.remove(block)

    def _release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        """Free one oversize cached block that covers the request (or the largest few that together do).
        Expandable segments' blocks are never freed here: the search skips one found first (to the largest few)
        and the loop passes over them (CUDACachingAllocator.cpp: `(*it)->expandable_segment_` in the search,
        `if (!(*cur)->expandable_segment_)` in the loop); only their empty pages go, at the last retry."""
        if self.max_split >= 2**63 - 1:
            return False
        want = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, (stream, want, 0))
        if i < len(keys) and keys[i][0] == stream and pool.free[keys[i][2]].segment is None:
            self._release_block(pool.free[keys[i][2]], pool)
            return True
        if i == 0:
            return False
        released = 0
        i -= 1  # the largest block below the key: every stream's blocks lie in one order, this stream's last
        while released < want and keys[i][1] >= self.max_split and keys[i][0] == stream:
            block = pool.free[keys[i][2]]
            if block.segment is None:
                released += block.size
                self._release_block(block, pool)
            if i == 0:
                break
            i -= 1
        return released >= want

    def _release_cached_blocks(self) -> None:
        for pool in (self.large, self.small):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.free[key[2]]
                if block.segment is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block, pool)
            if to_unmap:
                release_expandable(self, pool, to_unmap)

    def _garbage_collect(self) -> None:
        """Free unsplit cached large segments older than the average age until reserved falls under
        garbage_collection_threshold x cap (a segment's age: get_free_block calls since it was cached)."""
        threshold = int(self.conf.garbage_collection_threshold * self.capacity_bytes)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = {a: pool.gc_calls - b.gc_base for a, b in pool.free.items() if not b.is_split()}
        total_age, count = sum(ages.values()), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            average, freed = total_age / count, False
            for key in list(pool.keys):
                block = pool.free[key[2]]
                age = pool.gc_calls - block.gc_base
                if not block.is_split() and block.segment is None and age >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)

    def _oom_info(self, orig_size: int, size: int, alloc_size: int) -> AllocatorOOMInfo:
        limit = min(self.capacity_bytes, self.device_bytes)
        return AllocatorOOMInfo(orig_size, size, alloc_size, self.reserved, self.allocated,
                                self.reserved - self.allocated, max(0, limit - self.reserved),
                                self.largest_cached_bytes())

