"""What must hold of the caching allocator emulator (caching.py) between any two calls, whatever the trace, the
settings and the cap: the randomized differential test (tests/test_allocator_fuzz.py) and its 100,000-event run
(benchmarks/allocator_fuzz.py) check it after every event. `audit` returns the broken invariants, worded; none
when the state is sound."""

from __future__ import annotations

from engines.memory.allocstats import AllocatorOOM
from engines.memory.blocks import LARGE_BUFFER_BYTES, MIN_BLOCK_BYTES, Block
from engines.memory.caching import CachingAllocator


def audit(alloc: CachingAllocator) -> list[str]:
    """The invariants the state breaks: the counters against the blocks, every segment's blocks against its
    size, the pools against the free blocks, the limits against reserved."""
    wrong: list[str] = []
    heads = alloc.segment_heads()
    mapped = allocated = segments = 0
    seen: set[int] = set()
    for head in heads:
        size, b, prev = 0, head, None
        while b is not None:
            if id(b) in seen:
                wrong.append(f"block at {b.addr:#x} in two segments' chains")
                break
            seen.add(id(b))
            wrong.extend(_block(alloc, b, prev))
            size += b.size
            mapped += b.size if b.mapped else 0
            allocated += b.size if b.allocated else 0
            prev, b = b, b.next
        if head.segment is None:
            segments += 1
        elif head.addr != head.segment.base or size != head.segment.size:
            wrong.append(f"expandable segment at {head.segment.base:#x}: its blocks cover {size} B from "
                         f"{head.addr:#x}, its range {head.segment.size} B")
    live = {id(b) for b in alloc.live.values()}
    if live - seen:
        wrong.append(f"{len(live - seen)} live blocks in no segment")
    s = alloc.stats()
    figures = {"reserved": (s.reserved_bytes, mapped), "allocated": (s.allocated_bytes, allocated),
               "active": (s.active_bytes, allocated), "segments": (s.segments, segments),
               "allocations": (s.allocations, len(alloc.live))}
    wrong.extend(f"{name}: counted {counted}, the blocks say {actual}" for name, (counted, actual) in figures.items()
                 if counted != actual)
    wrong.extend(_pools(alloc, seen))
    wrong.extend(_limits(alloc))
    if s.inactive_split < 0 or s.inactive_split_bytes < 0:
        wrong.append(f"inactive_split {s.inactive_split} ({s.inactive_split_bytes} B) below zero")
    return wrong


def _block(alloc: CachingAllocator, b: Block, prev: Block | None) -> list[str]:
    wrong = []
    if b.prev is not prev:
        wrong.append(f"block at {b.addr:#x}: its prev is not the block before it")
    if prev is not None and prev.addr + prev.size != b.addr:
        wrong.append(f"blocks at {prev.addr:#x} (+{prev.size}) and {b.addr:#x} are not contiguous")
    if b.size <= 0 or b.size % MIN_BLOCK_BYTES:
        wrong.append(f"block at {b.addr:#x}: size {b.size} is not a positive number of 512 B granules")
    if b.allocated and (not b.mapped or alloc.live.get(b.addr) is not b):
        wrong.append(f"allocated block at {b.addr:#x} is unmapped or not among the live blocks")
    if not b.mapped and b.segment is None:
        wrong.append(f"unmapped block at {b.addr:#x} outside an expandable segment")
    if prev is not None and not prev.allocated and not b.allocated and prev.mapped == b.mapped:
        wrong.append(f"free blocks at {prev.addr:#x} and {b.addr:#x} left unmerged")
    return wrong


def _pools(alloc: CachingAllocator, seen: set[int]) -> list[str]:
    """Every free mapped block is in its pool once, under its key; every unmapped range in `unmapped`."""
    wrong = []
    for pool in (alloc.small, alloc.large):
        keys = pool.keys
        if keys != sorted(keys) or len(keys) != len(set(keys)) or len(keys) != len(pool.free):
            wrong.append(f"{'small' if pool.small else 'large'} pool's keys unsorted, repeated or unmatched")
        for stream, size, addr in keys:
            b = pool.free.get(addr)
            if b is None or b.size != size or b.stream != stream or b.allocated or not b.mapped or id(b) not in seen:
                wrong.append(f"pool key ({stream}, {size}, {addr:#x}) names no free mapped block of a segment")
            elif b.small != pool.small:
                wrong.append(f"block at {addr:#x} cached in the other pool")
        for (stream, addr), b in pool.unmapped.items():
            if b.addr != addr or b.stream != stream or b.mapped or id(b) not in seen:
                wrong.append(f"unmapped range ({stream}, {addr:#x}) names no unmapped block of a segment")
    free = sum(len(p.free) + len(p.unmapped) for p in (alloc.small, alloc.large))
    if free + len(alloc.live) != len(seen):
        wrong.append(f"{len(seen)} blocks in segments, {free} cached or unmapped and {len(alloc.live)} live")
    return wrong


def _limits(alloc: CachingAllocator) -> list[str]:
    """allocated <= reserved <= the device; reserved <= the cap, past which only expandable segments may map: the
    cap is checked against the request's segment size before its pages map, and the pages a request maps come
    to less than its size plus one page (20 MiB)."""
    s = alloc.stats()
    wrong = []
    if s.allocated_bytes > s.reserved_bytes:
        wrong.append(f"allocated {s.allocated_bytes} B > reserved {s.reserved_bytes} B")
    if s.reserved_bytes > alloc.device_bytes:
        wrong.append(f"reserved {s.reserved_bytes} B > the device's {alloc.device_bytes} B")
    past = LARGE_BUFFER_BYTES if alloc.conf.expandable_segments else 0
    if s.reserved_bytes > alloc.capacity_bytes + past:
        wrong.append(f"reserved {s.reserved_bytes} B past the {alloc.capacity_bytes} B cap by more than {past} B")
    if s.peak_reserved_bytes < s.reserved_bytes or s.peak_allocated_bytes < s.allocated_bytes:
        wrong.append("a peak below its current value")
    return wrong


def exercise(alloc: CachingAllocator, ops: list[tuple], check: bool = True) -> list[str]:
    """Run `ops` on the allocator, auditing after each: ("alloc", n, bytes, stream) allocates block n (an OOM is
    an answer, not a failure), ("free", n) frees it where it lives and, freed again, must be refused,
    ("empty_cache",) empties the cache. The first broken invariant, named with the op before it; else none."""
    live: dict[int, Block] = {}
    gone: list[Block] = []
    for i, op in enumerate(ops):
        if op[0] == "alloc":
            try:
                live[op[1]] = alloc.malloc(op[2], op[3])
            except AllocatorOOM:
                pass
        elif op[0] == "free" and op[1] in live:
            block = live.pop(op[1])
            alloc.free(block)
            gone.append(block)
        elif op[0] == "free" and gone and not gone[-1].allocated:  # freed twice (not handed out again since):
            try:  # refused, and nothing changes
                alloc.free(gone[-1])
            except ValueError:
                pass
            else:
                return [f"op {i}: a second free of the block at {gone[-1].addr:#x} was accepted"]
        elif op[0] == "empty_cache":
            alloc.empty_cache()
        wrong = audit(alloc) if check else []
        if wrong:
            return [f"op {i} {op}: {w}" for w in wrong]
    return []
