"""The paged policy's block pool: blocks by name, their LRU free queue and the prefix cache (BlockPool), or, where
no block's name matters, a count of free ones (CountedPool). Invariants are paged.py's."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    """One block of the paged KV (engines/memory/blocks.Block is the caching allocator's, PyTorch's name)."""

    block_id: int
    ref_count: int = 0
    # chained hash of every token up to the end of this block; None until the block is full
    block_hash: int | None = None


class BlockPool:
    """The blocks, the LRU free queue and the prefix cache. A block held by one table is the common case and
    costs nothing to count; blocks held by more (shared prefixes, forks) are counted by ref count in
    `shared_refs`, so /stats reads sharing in O(1)."""

    def __init__(self, num_blocks: int):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # LRU order: the head is evicted first. Cached blocks stay here, reusable, until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.shared_refs: dict[int, int] = {}  # ref count (2 or more) -> blocks holding it

    @property
    def shared(self) -> int:
        """Blocks more than one table holds."""
        return sum(self.shared_refs.values())

    @property
    def max_refs(self) -> int:
        return max(self.shared_refs, default=1 if self.num_free < len(self.blocks) else 0)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def _share(self, refs: int, delta: int) -> None:
        if refs >= 2:
            left = self.shared_refs[refs] = self.shared_refs.get(refs, 0) + delta
            if not left:
                del self.shared_refs[refs]

    def take(self, n: int = 1) -> list[KVBlock]:
        """n blocks from the head of the free queue (the least recently freed), each with one owner."""
        pop, blocks, cached = self.free_queue.popitem, self.blocks, self.cached
        out = [blocks[pop(last=False)[0]] for _ in range(n)]
        for block in out:
            if block.block_hash is not None:  # evict its cached content
                del cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
        return out

    def touch(self, block: KVBlock) -> None:
        """A prefix-cache hit: one more owner, and out of the free queue if it was there."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        self._share(block.ref_count, -1)
        block.ref_count += 1
        self._share(block.ref_count, 1)

    def release(self, blocks) -> None:
        """One owner fewer for each, in order: the ones nobody holds join the free queue's tail."""
        queue = self.free_queue
        for block in blocks:
            refs = block.ref_count
            assert refs > 0, f"block {block.block_id} released more often than held"
            block.ref_count = refs - 1
            if refs == 1:
                queue[block.block_id] = None
            else:
                self._share(refs, -1)
                self._share(refs - 1, 1)

    def release_table(self, table: list[KVBlock]) -> None:
        """A freed sequence's blocks, tail first: its tail blocks are the least likely to be shared, so they are
        evicted first."""
        self.release(reversed(table))

    def unregister(self, block: KVBlock) -> None:
        """A block whose hash promised K/V that was never written: out of the prefix cache."""
        if block.block_hash is not None and self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        block.block_hash = None

    def register(self, block: KVBlock, block_hash: int) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block.block_id


# A counted pool's block: held by one table (ref_count 1), never hashed, never shared, never named.
OWN = KVBlock(-1, ref_count=1)


class CountedPool(BlockPool):
    """The pool as a count of free blocks: the simulator's, where memory is not backed and nothing is hashed, so no
    block's name matters. Taking or releasing n blocks costs O(1) in Python, not n pops and n pushes."""

    def __init__(self, num_blocks: int):
        self.blocks = range(num_blocks)  # len() is the pool's size; no block has a name to look up
        self.free_blocks = num_blocks
        self.cached, self.shared_refs = {}, {}  # nothing is hashed or shared: empty for good

    @property
    def num_free(self) -> int:
        return self.free_blocks

    def take(self, n: int = 1) -> list[KVBlock]:
        assert n <= self.free_blocks, f"{n} blocks taken from {self.free_blocks} free"
        self.free_blocks -= n
        return [OWN] * n

    def release_table(self, table: list[KVBlock]) -> None:
        self.free_blocks += len(table)

    def release(self, blocks) -> None:
        raise AssertionError("a counted pool's blocks are only released a whole table at a time")

    def touch(self, block: KVBlock) -> None:
        raise AssertionError("a counted pool shares no block: no prefix cache, no fork")


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))
