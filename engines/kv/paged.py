"""Fixed-size blocks from one pool: block tables, ref counts, prefix caching, copy-on-write, LRU reuse.

Invariants (checked by tests/test_kv_invariants.py and tests/test_kv_policies.py):
- a block with ref_count 0 is in the free queue, a block with ref_count > 0 is not;
- ref_count equals the number of block tables holding the block;
- a hashed block is reachable from `cached` under that hash, and only full blocks are hashed;
- a sequence's `rows` are its table's token rows, rebuilt when (and only when) a block is added or replaced;
- counted (`PagedKV.count_blocks`: memory not backed, no prefix caching) every table entry is the one placeholder
  `OWN`: the pool counts free blocks and names none, so a table's length is all it says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engines.kv.base import Breakdown, HeldTotals, KVOptions, KVPolicy, KVStats, SeqLike, seq_accounting
from engines.kv.pool import OWN, BlockPool, CountedPool, KVBlock, chain_hash
from engines.memory.arena import DeviceMemory, OOMEvent, OutOfMemory

if TYPE_CHECKING:
    import torch


@dataclass
class SeqBlocks:
    """Everything the pool knows of one sequence."""

    table: list[KVBlock]
    cached_tokens: int = 0  # leading tokens found in the prefix cache when it was admitted
    hashed_blocks: int = 0  # full blocks hashed so far, and the chain's last hash: each block is hashed once
    last_hash: int | None = None
    rows: torch.Tensor | None = field(default=None, repr=False)  # token rows of `table`; None: rebuild


class PagedKV(KVPolicy):
    name = "paged"

    @classmethod
    def build(cls, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, options: KVOptions,
              **params) -> PagedKV:
        return cls(memory, kv_bytes_per_token, max_seq_len, options.block_size, options.prefix_caching, **params)

    def __init__(
        self,
        memory: DeviceMemory,
        kv_bytes_per_token: int,
        max_seq_len: int,
        block_size: int = 16,
        prefix_caching: bool = True,
    ):
        self.memory = memory
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.block_bytes = block_size * kv_bytes_per_token
        num_blocks = memory.max_units(self.block_bytes)  # the allocator's rounding stays inside the budget
        if num_blocks < 1:
            raise ValueError(f"KV budget {memory.capacity_bytes} B holds no block of {self.block_bytes} B "
                             f"({memory.rounded(self.block_bytes)} B as the allocator rounds it)")
        # vLLM-style: one pool allocated up front; blocks are slices of it.
        self.pool_alloc = memory.allocate(num_blocks * self.block_bytes, owner="kv-block-pool")
        self.pool = BlockPool(num_blocks)
        self.counted = False  # True: the pool counts blocks instead of naming them (count_blocks)
        self.prefix_caching = prefix_caching
        self.seqs: dict[str, SeqBlocks] = {}
        self.totals = HeldTotals()  # over the tables, len(table) x block_size slots each
        self._block_rows: torch.Tensor | None = None  # built on the first rows(): the simulator never asks
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0

    def count_blocks(self) -> None:
        """Count blocks instead of naming them, before anything is held: for a simulator, whose memory holds no
        bytes (no row to index) and which hashes no prefix (no block to find again)."""
        assert not self.seqs and not self.memory.backed and not self.prefix_caching, \
            "only an empty pool on bookkeeping-only memory without prefix caching may stop naming its blocks"
        self.pool, self.counted = CountedPool(len(self.pool.blocks)), True

    # -- what the scheduler calls
    def holds(self, seq: SeqLike) -> bool:
        return seq.seq_id in self.seqs

    def table(self, seq: SeqLike) -> list[KVBlock]:
        return self.seqs[seq.seq_id].table

    def can_allocate(self, seq: SeqLike, num_tokens: int) -> bool:
        return self._blocks_needed(seq, num_tokens) <= self.pool.num_free

    def allocate(self, seq: SeqLike, num_tokens: int) -> None:
        need = self._blocks_needed(seq, num_tokens)
        if need > self.pool.num_free:
            free = self.pool.num_free * self.block_bytes
            raise OutOfMemory(OOMEvent.classify(need * self.block_bytes, free, free, seq.seq_id))
        rec = self.seqs.get(seq.seq_id)
        if rec is None:
            rec = self.seqs[seq.seq_id] = self._match_prefix(seq, num_tokens)
            self._account(seq, rec, 1)
        self._copy_on_write(rec, num_tokens)
        held = len(rec.table)
        if held * self.block_size < num_tokens:
            grown = -(-num_tokens // self.block_size)
            rec.table += self.pool.take(grown - held)
            rec.rows = None
            bs, final = self.block_size, seq.final_len
            self.totals.allocated_tokens += (grown - held) * bs
            self.totals.eventual_tokens += min(grown * bs, final) - min(held * bs, final)
        if self.prefix_caching:
            self._register_full_blocks(seq, rec, num_tokens)

    def free(self, seq: SeqLike) -> None:
        rec = self.seqs.pop(seq.seq_id, None)
        if rec is not None:
            self._account(seq, rec, -1)
            self.pool.release_table(rec.table)

    def discard(self, seq: SeqLike) -> None:
        """Blocks are hashed when they are allocated full, before the step writes them: after a failed
        forward, those past what was computed (and past the prefix-cache hits) are forgotten, then freed."""
        rec = self.seqs.get(seq.seq_id)
        if rec is not None:
            valid = max(rec.cached_tokens, seq.num_computed_tokens) // self.block_size
            for block in rec.table[valid:]:
                if block.ref_count == 1:
                    self.pool.unregister(block)
        self.free(seq)

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        rec = self.seqs[parent.seq_id]
        for block in rec.table:
            self.pool.touch(block)
        self.seqs[child.seq_id] = SeqBlocks(list(rec.table), parent.num_tokens, rec.hashed_blocks, rec.last_hash)
        self._account(child, self.seqs[child.seq_id], 1)

    def _account(self, seq: SeqLike, rec: SeqBlocks, sign: int) -> None:
        self.totals.add(len(rec.table) * self.block_size, seq.final_len, sign=sign)

    def longest_sequence_tokens(self) -> int:
        return len(self.pool.blocks) * self.block_size

    def slack_tokens(self, seq: SeqLike) -> int:
        rec = self.seqs.get(seq.seq_id)
        if rec is None:
            return -seq.num_tokens
        if rec.table and rec.table[-1].ref_count > 1:  # a shared tail is copied before the next write
            return min(0, len(rec.table) * self.block_size - seq.num_tokens)
        return len(rec.table) * self.block_size - seq.num_tokens

    def period_tokens(self, seq: SeqLike) -> int | None:
        """A held sequence whose tail block is its own takes exactly one block each time its tokens cross a
        block boundary, and nothing else: every block_size tokens. One sharing its tail (a fork's, until it is
        copied) has no period."""
        rec = self.seqs.get(seq.seq_id)
        if rec is None or (rec.table and rec.table[-1].ref_count > 1):
            return None
        return self.block_size

    def can_allocate_periodic(self, num_seqs: int, crossings: int) -> bool:
        return num_seqs * crossings <= self.pool.num_free

    def allocate_periodic(self, seqs: list[SeqLike], crossings: int, lag: int) -> None:
        """Named blocks: each sequence's allocate, in order (block ids, copy-on-write and hashing as ever). Counted:
        each table gains `crossings` blocks, with none of allocate's look-ups (the tail is its own, nothing hashes)."""
        if not self.counted:
            return super().allocate_periodic(seqs, crossings, lag)
        assert self.can_allocate_periodic(len(seqs), crossings), \
            f"{len(seqs)} sequences x {crossings} blocks taken from {self.pool.num_free} free: the caller checks"
        self.pool.free_blocks -= len(seqs) * crossings
        bs, records, grown_slots = self.block_size, self.seqs, crossings * self.block_size
        if seqs:  # a call's sequences share their phase: the first one's tokens speak for all (checked once, not n)
            tokens, held_slots = seqs[0].num_tokens - lag, len(records[seqs[0].seq_id].table) * bs
            assert held_slots < tokens <= held_slots + grown_slots, \
                f"{seqs[0].seq_id}: {tokens} tokens are not {crossings} blocks past its {held_slots // bs}"
        grown, eventual = [OWN] * crossings, 0
        for seq in seqs:
            table = records[seq.seq_id].table
            room = seq.final_len - len(table) * bs  # > 0: it crosses into a block it will fill, at least in part
            table += grown
            eventual += grown_slots if grown_slots <= room else room
        totals = self.totals
        totals.eventual_tokens += eventual
        totals.allocated_tokens += len(seqs) * grown_slots

    def decode_headroom(self, num_seqs: int, own_steps: int) -> int:
        """Any free block serves any sequence: in k steps each crosses at most ceil(k / block_size) block
        boundaries (plus one copy-on-write), so block_size x (free blocks // sequences - 1) steps cannot run out."""
        pool_steps = self.block_size * (self.pool.num_free // max(1, num_seqs) - 1)
        return max(super().decode_headroom(num_seqs, own_steps), pool_steps)

    def num_cached_tokens(self, seq: SeqLike) -> int:
        rec = self.seqs.get(seq.seq_id)
        return rec.cached_tokens if rec else 0

    def rows(self, seq: SeqLike, n: int) -> torch.Tensor:
        assert not self.counted, "a counted pool names no block: it has no rows"
        rec = self.seqs[seq.seq_id]
        if rec.rows is None:  # a block was added or replaced since the last look: once per block, not per step
            # torch loads here, not with the module: the simulator runs this policy without it
            import torch

            from engines.host_copy import to_device

            if self._block_rows is None:
                self._block_rows = torch.arange(self.block_size, device=self.memory.device)
            ids = to_device([b.block_id for b in rec.table], self._block_rows.device)
            rec.rows = (ids[:, None] * self.block_size + self._block_rows[None, :]).flatten()
        return rec.rows[:n]

    def row_of(self, seq: SeqLike, position: int) -> int:
        assert not self.counted, "a counted pool names no block: it has no rows"
        block = self.seqs[seq.seq_id].table[position // self.block_size]
        return block.block_id * self.block_size + position % self.block_size

    def block_table(self, seq: SeqLike) -> list[int]:
        return [b.block_id for b in self.seqs[seq.seq_id].table]

    def store(self) -> torch.Tensor:
        return self.memory.view(self.pool_alloc)

    # -- accounting
    def breakdown(self, seqs: list[SeqLike]) -> Breakdown:
        bs, kvb = self.block_size, self.kv_bytes_per_token
        used_blocks = len(self.pool.blocks) - self.pool.num_free
        tokens, reservation, internal = used_blocks * bs, 0, 0
        seen: set[int] = set()
        for seq in seqs:
            rec = self.seqs.get(seq.seq_id)
            table = rec.table if rec else None
            if not table or table[-1].block_id in seen:
                continue
            if table[-1].ref_count > 1:  # a tail two tables share is counted once (an own one cannot repeat)
                seen.add(table[-1].block_id)
            start = (len(table) - 1) * bs
            live = seq.num_tokens - start
            t, r, i = seq_accounting(bs, live, seq.final_len - start)
            tokens += t - bs  # the last block was counted as full above
            reservation, internal = reservation + r, internal + i
        return Breakdown(
            token_states_bytes=tokens * kvb,
            reservation_bytes=reservation * kvb,
            internal_fragmentation_bytes=internal * kvb,
            external_fragmentation_bytes=0,  # any free block serves any request
            free_bytes=self.pool.num_free * self.block_bytes,
        )

    def breakdown_of(self, live_tokens: int) -> Breakdown:
        """Used blocks hold token states but for the tails' unused slots (sum of slots - live tokens), which
        are reservation up to each final length and internal fragmentation beyond."""
        kvb, held = self.kv_bytes_per_token, self.totals
        used_slots = (len(self.pool.blocks) - self.pool.num_free) * self.block_size
        return Breakdown(
            token_states_bytes=(used_slots - held.allocated_tokens + live_tokens) * kvb,
            reservation_bytes=(held.eventual_tokens - live_tokens) * kvb,
            internal_fragmentation_bytes=(held.allocated_tokens - held.eventual_tokens) * kvb,
            external_fragmentation_bytes=0,
            free_bytes=self.pool.num_free * self.block_bytes,
        )

    def stats(self) -> KVStats:
        free = self.pool.num_free * self.block_bytes
        capacity = len(self.pool.blocks) * self.block_bytes
        return KVStats(
            kv_capacity_bytes=capacity,
            allocated_bytes=capacity - free,
            free_bytes=free,
            largest_free_bytes=free,
            num_seqs=len(self.seqs),
        )

    def memory_map(self) -> list[dict]:
        """The pool as runs of consecutive blocks alike (the same owners, ref count and caching): a real
        model's pool holds tens of thousands of blocks, its sequences' runs far fewer. Counted: the held blocks
        as one run, then the free ones (no block has a place)."""
        if self.counted:
            held = len(self.pool.blocks) - self.pool.num_free
            return [{"block": 0, "blocks": held, "owners": sorted(self.seqs), "ref_count": 1, "cached": False},
                    {"block": held, "blocks": self.pool.num_free, "owners": [], "ref_count": 0, "cached": False}]
        owners: dict[int, list[str]] = {}
        for seq_id, rec in self.seqs.items():
            for block in rec.table:
                owners.setdefault(block.block_id, []).append(seq_id)
        runs: list[dict] = []
        for b in self.pool.blocks:
            who, cached = owners.get(b.block_id, []), b.block_hash is not None
            last = runs[-1] if runs else None
            if last and last["owners"] == who and last["ref_count"] == b.ref_count and last["cached"] == cached:
                last["blocks"] += 1
            else:
                runs.append({"block": b.block_id, "blocks": 1, "owners": who, "ref_count": b.ref_count,
                             "cached": cached})
        return runs

    # -- internals
    def _blocks_needed(self, seq: SeqLike, num_tokens: int) -> int:
        rec = self.seqs.get(seq.seq_id)
        table = rec.table if rec else None
        if table is not None and num_tokens <= len(table) * self.block_size:  # decode within its last block
            return 1 if table[(num_tokens - 1) // self.block_size].ref_count > 1 else 0
        total = -(-num_tokens // self.block_size)
        if table is None:
            hits = self._lookup_prefix(seq, num_tokens)
            # a hit on a free cached block takes it from the free queue too
            return total - len(hits) + sum(1 for b in hits if b.ref_count == 0)
        return max(0, total - len(table)) + (1 if self._shared_tail(table, num_tokens) else 0)

    def _lookup_prefix(self, seq: SeqLike, num_tokens: int) -> list[KVBlock]:
        params = getattr(seq, "params", None)
        if not self.prefix_caching or getattr(params, "prompt_logprobs", None) is not None:
            return []  # prompt logprobs need every prompt position's logits: nothing is served from the cache
        bs, hits, parent = self.block_size, [], None
        # never the block holding the last known token: its logits must be computed
        for i in range((min(num_tokens, len(seq.token_ids)) - 1) // bs):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.cached.get(parent)
            if block_id is None:
                break
            hits.append(self.pool.blocks[block_id])
        return hits

    def _match_prefix(self, seq: SeqLike, num_tokens: int) -> SeqBlocks:
        hits = self._lookup_prefix(seq, num_tokens)
        for block in hits:
            self.pool.touch(block)
        self.prefix_hits_tokens += len(hits) * self.block_size
        self.prefix_queries_tokens += num_tokens
        return SeqBlocks(hits, cached_tokens=len(hits) * self.block_size)

    def _shared_tail(self, table: list[KVBlock], num_tokens: int) -> bool:
        """Whether the next write (position num_tokens - 1) lands in a block another sequence reads."""
        idx = (num_tokens - 1) // self.block_size
        return idx < len(table) and table[idx].ref_count > 1

    def _copy_on_write(self, rec: SeqBlocks, num_tokens: int) -> None:
        if not self._shared_tail(rec.table, num_tokens):
            return
        idx = (num_tokens - 1) // self.block_size
        old, new = rec.table[idx], self.pool.take()[0]
        self.copy_rows(old.block_id * self.block_size, new.block_id * self.block_size, self.block_size)
        self.pool.release([old])
        rec.table[idx] = new
        rec.rows = None

    def _register_full_blocks(self, seq: SeqLike, rec: SeqBlocks, num_tokens: int) -> None:
        """Hash blocks as they fill, continuing the sequence's chain: each block is hashed once."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(rec.hashed_blocks, min(num_tokens, len(seq.token_ids)) // bs):
            rec.last_hash = chain_hash(rec.last_hash, seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.register(rec.table[i], rec.last_hash)
            rec.hashed_blocks = i + 1
