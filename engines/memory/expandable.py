"""expandable_segments:True for the caching allocator emulator (caching.py): one segment per pool and stream
reserves a virtual range of 1 1/8 the device's memory (`numSegments(prop.totalGlobalMem + prop.totalGlobalMem / 8)`
pages, whatever the cap) and maps pages into it, 2 MiB for the small pool and 20 MiB for the large, at the lowest
address where free and unmapped space together hold the request; before the last retry every empty page is
unmapped, and a segment left with nothing mapped is released. The cap is checked once, before (caching.py's
`_alloc_block`, as `alloc_block` checks it); a page then maps unless the device itself is out
(`ExpandableSegment::map` fails only when cuMemCreate does), so the segment may pass the cap by part of a page."""

from __future__ import annotations

from engines.memory.blocks import LARGE_BUFFER_BYTES, SMALL_BUFFER_BYTES, Block, Expandable, Pool, SegmentHost, merge


def allocate_expandable(alloc: SegmentHost, pool: Pool, size: int, stream: int) -> Block | None:
    """A free mapped block of at least `size` at the lowest address that can hold it (mapping pages), or None."""
    candidate = _find(alloc, pool, size, stream)
    if candidate is None:
        return None
    if not candidate.mapped and not _map(alloc, pool, candidate, min(candidate.size, size)):
        return None
    while candidate.size < size:  # free, then unmapped: map what is missing, merging into one block
        following = candidate.next
        assert following is not None and not following.mapped
        if not _map(alloc, pool, following, min(size - candidate.size, following.size)):
            return None
        candidate = following
    pool.remove(candidate)
    return candidate


def release_expandable(alloc: SegmentHost, pool: Pool, blocks: list[Block]) -> None:
    """Unmap the empty pages of these free blocks; a segment with nothing mapped goes back whole."""
    for block in blocks:
        _unmap(alloc, pool, block)
        if block.prev is None and block.next is None and not block.mapped:
            del pool.unmapped[(block.stream, block.addr)]
            alloc.addresses.release(block.addr, block.size)
            alloc.expandables.remove(block.segment)


def _free(block: Block | None) -> bool:
    return block is not None and not block.allocated


def _room(block: Block, size: int) -> bool:
    total = 0
    b: Block | None = block
    while total < size and _free(b):
        total += b.size
        b = b.next
    return total >= size


def _find(alloc: SegmentHost, pool: Pool, size: int, stream: int) -> Block | None:
    for key in sorted(k for k in pool.unmapped if k[0] == stream):
        candidate = pool.unmapped[key]
        if _free(candidate.prev):  # a free block just before the unmapped range starts lower
            candidate = candidate.prev
        if _room(candidate, size):
            return candidate
    page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
    span = -(-(alloc.device_bytes + alloc.device_bytes // 8) // page) * page  # the device's, not the cap's
    base = alloc.addresses.reserve(span)
    if base is None:
        return None
    segment = Expandable(base, span, page)
    alloc.expandables.append(segment)
    block = Block(base, span, stream, pool.small, segment)
    block.mapped = False
    pool.unmapped[(stream, base)] = block
    return block


def _splice(block: Block, before: Block | None, after: Block | None) -> None:
    block.prev, block.next = before, after
    if before is not None:
        before.next = block
    if after is not None:
        after.prev = block


def _map(alloc: SegmentHost, pool: Pool, block: Block, size: int) -> bool:
    segment = block.segment
    page = segment.page
    first = (block.addr - segment.base) // page
    end = -(-(block.addr + size - segment.base) // page)
    mapped = (end - first) * page
    if mapped == 0 or alloc.reserved + mapped > alloc.device_bytes:  # cuMemCreate: the device is out
        return False
    del pool.unmapped[(block.stream, block.addr)]
    block.mapped = True
    if mapped < block.size:
        rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, segment)
        rest.mapped = False
        _splice(rest, block, block.next)
        pool.unmapped[(rest.stream, rest.addr)] = rest
        block.size = mapped
    merge(block, block.prev, pool)
    merge(block, block.next, pool)
    pool.insert(block)
    alloc._reserve(mapped)
    alloc._event("segment_map", block.addr, mapped, block.stream)
    return True


def _unmap(alloc: SegmentHost, pool: Pool, block: Block) -> None:
    segment = block.segment
    page = segment.page
    offset = block.addr - segment.base
    first, end = -(-offset // page), (offset + block.size) // page
    if first >= end:
        return
    pool.remove(block)
    start, size = segment.base + first * page, (end - first) * page
    before, after = start - block.addr, block.size - (start - block.addr) - size
    if before > 0:
        head = Block(block.addr, before, block.stream, block.small, segment)
        _splice(head, block.prev, block)
        pool.insert(head)
    if after > 0:
        tail = Block(start + size, after, block.stream, block.small, segment)
        _splice(tail, block, block.next)
        pool.insert(tail)
    block.addr, block.size, block.mapped = start, size, False
    merge(block, block.prev, pool)
    merge(block, block.next, pool)
    pool.unmapped[(block.stream, block.addr)] = block
    alloc.reserved -= size
    alloc._event("segment_unmap", start, size, block.stream)
