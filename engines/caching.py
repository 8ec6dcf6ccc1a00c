"""PyTorch's CUDA caching allocator, rule for rule, on any machine: the state machine alone (blocks, pools,
segments, stats), with no bytes behind it. `engines/caching_memory.py` backs it with tensors for the engines;
`harness/replay.py` drives it from a real trace.

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

The cap is `set_per_process_memory_fraction`'s: reserved bytes plus the new segment must stay within it (a GPU maps
a segment's pages under fresh virtual addresses, so the device itself never fragments)."""

from __future__ import annotations

from bisect import bisect_left, insort

from engines.allocconf import AllocConf, AllocConfError, parse_alloc_conf
from engines.allocstats import AllocatorOOM, AllocatorOOMInfo, AllocatorStats

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 2**20  # kSmallSize: the largest request the small pool serves
SMALL_BUFFER_BYTES = 2 * 2**20  # kSmallBuffer: a small pool's segment (and an expandable small page)
MIN_LARGE_ALLOC_BYTES = 10 * 2**20  # kMinLargeAlloc: below it a large request carves a 20 MiB segment
ROUND_LARGE_BYTES = 2 * 2**20  # kRoundLarge
LARGE_BUFFER_BYTES = 20 * 2**20  # kLargeBuffer: that segment (and an expandable large page)
FIRST_ADDRESS = 0x7F0000000000  # where the default address space starts: as a GPU's virtual addresses look


class Block:
    __slots__ = ("addr", "size", "requested", "stream", "small", "allocated", "prev", "next", "segment", "mapped",
                 "gc_base")

    def __init__(self, addr: int, size: int, stream: int, small: bool, segment: Expandable | None = None):
        self.addr, self.size, self.stream, self.small, self.segment = addr, size, stream, small, segment
        self.requested, self.allocated, self.mapped, self.gc_base = 0, False, True, 0
        self.prev: Block | None = None
        self.next: Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Expandable:
    """One expandable segment's virtual range: pages map and unmap inside it."""

    __slots__ = ("base", "size", "page")

    def __init__(self, base: int, size: int, page: int):
        self.base, self.size, self.page = base, size, page


class Pool:
    """Free blocks of one pool, sorted by (stream, size, address); unmapped expandable ranges by address."""

    __slots__ = ("small", "keys", "free", "unmapped", "gc_calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.free: dict[int, Block] = {}
        self.unmapped: dict[tuple[int, int], Block] = {}  # (stream, address) -> block: few, scanned in order
        self.gc_calls = 0  # get_free_block calls: a cached block's age for garbage collection

    def insert(self, block: Block) -> None:
        block.gc_base = self.gc_calls
        insort(self.keys, (block.stream, block.size, block.addr))
        self.free[block.addr] = block

    def remove(self, block: Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (block.stream, block.size, block.addr))]
        del self.free[block.addr]

    def cached_bytes(self) -> int:
        return sum(k[1] for k in self.keys)


class BumpAddresses:
    """A GPU's virtual address space as the allocator sees it: every segment at a fresh address."""

    def __init__(self, start: int = FIRST_ADDRESS):
        self.next = start

    def reserve(self, size: int) -> int:
        addr = self.next
        self.next += -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
        return addr

    def release(self, addr: int, size: int) -> None:
        pass


def round_size(size: int, conf: AllocConf) -> int:
    """The block size a request takes: 512 B granules, or the next power-of-two division where configured."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = conf.divisions(size)
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return power2_division(size, divisions)
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def power2_division(size: int, divisions: int) -> int:
    """The next of `divisions` equal steps between the powers of two around size (1200 by 4: 1280)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def segment_size(size: int) -> int:
    """What a new segment for a block of `size` takes from the device (get_allocation_size)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class CachingAllocator:
    """The allocator of one device under a cap of `capacity_bytes` reserved. `addresses` places segments
    (reserve/release); `events`, when a list, receives (action, address, size, stream) for every segment_alloc,
    segment_free, segment_map and segment_unmap, as PyTorch's trace names them."""

    def __init__(self, capacity_bytes: int, conf: AllocConf | str | None = None, addresses=None,
                 events: list | None = None):
        self.conf = conf if isinstance(conf, AllocConf) else parse_alloc_conf(conf)
        if self.conf.backend != "native":
            raise AllocConfError(f"alloc conf: backend:{self.conf.backend} is CUDA's own allocator, not the "
                                 "caching allocator: there are no rules to emulate")
        self.capacity_bytes = capacity_bytes
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
                if block.segment is None or _expandable_size(nxt) >= _expandable_size(block):
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
            merged = self._try_merge(block, other, pool)
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

    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        """Merge free neighbour src into dst (one segment: prev/next never cross one); its size, or 0."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[(src.stream, src.addr)]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- segments from the device ------------------------------------------------------------------------------

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        if retry:
            self.retries += 1
        if self.reserved + alloc_size > self.capacity_bytes:
            return None
        if self.conf.expandable_segments:
            from engines.expandable import allocate_expandable

            return allocate_expandable(self, pool, size, stream)
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
        """A whole cached segment back to the device (cudaFree)."""
        self._event("segment_free", block.addr, block.size, block.stream)
        self.addresses.release(block.addr, block.size)
        self.reserved -= block.size
        self.segments -= 1
        pool.remove(block)

    def _release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        """Free one oversize cached block that covers the request (or the largest few that together do)."""
        if self.max_split >= 2**63 - 1:
            return False
        want = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, (stream, want, 0))
        if i < len(keys) and keys[i][0] == stream:
            self._release_block(pool.free[keys[i][2]], pool)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < want and keys[i][0] == stream and keys[i][1] >= self.max_split:
            block = pool.free[keys[i][2]]
            released += block.size
            self._release_block(block, pool)
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
                from engines.expandable import release_expandable

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
        return AllocatorOOMInfo(orig_size, size, alloc_size, self.reserved, self.allocated,
                                self.reserved - self.allocated, max(0, self.capacity_bytes - self.reserved),
                                self.largest_cached_bytes())


def _expandable_size(block: Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
