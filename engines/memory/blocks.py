"""The caching allocator's parts (c10/cuda/CUDACachingAllocator.cpp): its sizes, a block, a pool of free blocks,
an expandable segment's virtual range, the address space, and the rounding of a request. Apart from the allocator
(caching.py) so that expandable segments (expandable.py) build on them without importing the allocator, which
imports them."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Protocol

from engines.memory.allocconf import AllocConf

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


def smallest_request_for_segment(segment_bytes: int) -> int:
    """The smallest block whose new segment is `segment_bytes` (segment_size's inverse, at its low end): what a
    torch.cuda.OutOfMemoryError's "Tried to allocate" (the segment, not the request) says of the request. A 2 MiB
    segment is any small request; a 20 MiB one a request from just over 1 MiB (also one just over 18 MiB: the
    low end is taken); a larger one a request within the last 2 MiB below it, and never under 10 MiB."""
    if segment_bytes <= SMALL_BUFFER_BYTES:
        return MIN_BLOCK_BYTES
    if segment_bytes == LARGE_BUFFER_BYTES:
        return SMALL_SIZE_BYTES + MIN_BLOCK_BYTES
    return max(MIN_LARGE_ALLOC_BYTES, segment_bytes - ROUND_LARGE_BYTES + MIN_BLOCK_BYTES)


def merge(dst: Block, src: Block | None, pool: Pool) -> int:
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


def expandable_size(block: Block) -> int:
    """A free expandable block's size with the unmapped range right after it (get_free_block's expandable_size)."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class SegmentHost(Protocol):
    """What expandable segments read and change of the allocator that holds them (caching.CachingAllocator)."""

    device_bytes: int
    reserved: int
    addresses: BumpAddresses
    expandables: list[Expandable]

    def _reserve(self, nbytes: int) -> None: ...

    def _event(self, action: str, addr: int, size: int, stream: int) -> None: ...


SIZE_CLASSES = ("small", "large", "huge")  # PyTorch's classes of a request, by its rounded size


def size_class(rounded_bytes: int) -> str:
    """PyTorch's class of a request: small (<= 1 MiB, the small pool's 2 MiB segments), large (under 10 MiB: a 20
    MiB segment), huge (a segment of its own size)."""
    if rounded_bytes <= SMALL_SIZE_BYTES:
        return "small"
    return "large" if rounded_bytes < MIN_LARGE_ALLOC_BYTES else "huge"
