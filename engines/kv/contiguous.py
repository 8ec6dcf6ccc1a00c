"""What static and growth share: one contiguous arena allocation per sequence."""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING

from engines.kv.base import Breakdown, HeldTotals, KVPolicy, KVStats, SeqLike, seq_accounting
from engines.memory.arena import Allocation, DeviceMemory

if TYPE_CHECKING:
    import torch

RECENT_ALLOCATIONS = 256  # allocations whose median stands for the next one when no request waits


class ContiguousKV(KVPolicy):
    """Rows of one store: a sequence's buffer starts at a whole row. Where the allocator's granules are not
    whole rows (a 57,344 B row against 2 MiB pages), an offset can land inside a row: each buffer then asks
    for one row less a byte more (`pad_bytes`), and its rows start at the first whole row inside it (the pad
    is allocator rounding: internal fragmentation)."""

    def __init__(self, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int):
        self.memory = memory
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_seq_len = max_seq_len
        self.pad_bytes = 0 if memory.row_aligned(kv_bytes_per_token) else kv_bytes_per_token - 1
        # what the next allocation needs (the scheduler's queue head, `allocation_bytes`), else the median of the
        # recent ones: free extents too small for it are external fragmentation
        self.next_need_bytes: int | None = None
        self.recent_bytes: deque[int] = deque(maxlen=RECENT_ALLOCATIONS)
        self.allocs: dict[str, Allocation] = {}
        self.totals = HeldTotals()
        self._all_rows: torch.Tensor | None = None  # built on the first rows(): the simulator never asks

    def holds(self, seq: SeqLike) -> bool:
        return seq.seq_id in self.allocs

    def capacity_tokens(self, seq: SeqLike) -> int:
        alloc = self.allocs.get(seq.seq_id)
        return alloc.requested // self.kv_bytes_per_token if alloc else 0

    def longest_sequence_tokens(self) -> int:
        return self.memory.max_units(self.kv_bytes_per_token, self.pad_bytes)

    def slack_tokens(self, seq: SeqLike) -> int:
        return self.capacity_tokens(seq) - seq.num_tokens

    def free(self, seq: SeqLike) -> None:
        alloc = self.allocs.pop(seq.seq_id, None)
        if alloc is not None:
            self._account(seq, alloc, -1)
            self.memory.free(alloc)

    def _account(self, seq: SeqLike, alloc: Allocation, sign: int) -> None:
        kvb = self.kv_bytes_per_token
        self.totals.add(alloc.size // kvb, seq.final_len, alloc.size % kvb, sign)

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """Contiguous buffers cannot share: the child gets its own copy of the parent's tokens."""
        self.allocate(child, parent.num_tokens)
        if self.memory.backed:
            self.copy_rows(self._base_row(parent), self._base_row(child), parent.num_tokens)

    def _base_row(self, seq: SeqLike) -> int:
        return self._first_row(self.allocs[seq.seq_id])

    def _first_row(self, alloc: Allocation) -> int:
        """The first whole row inside an allocation (its start, where the granules are whole rows)."""
        row = -(-alloc.offset // self.kv_bytes_per_token)
        assert (row + alloc.requested // self.kv_bytes_per_token) * self.kv_bytes_per_token \
            <= alloc.offset + alloc.size, "a buffer's rows run past its allocation"
        return row

    def rows(self, seq: SeqLike, n: int) -> torch.Tensor:
        """A view of every row index of the store: nothing is built per step."""
        if self._all_rows is None:  # every row an allocation may start at: the arena's, or caching's addresses
            import torch

            span = getattr(self.memory, "address_bytes", self.memory.capacity_bytes)
            self._all_rows = torch.arange(span // self.kv_bytes_per_token, device=self.memory.device)
        base = self._base_row(seq)
        return self._all_rows[base : base + n]

    def row_of(self, seq: SeqLike, position: int) -> int:
        return self._base_row(seq) + position

    def store(self) -> torch.Tensor:
        backing = getattr(self.memory, "backing", None)  # one tensor of bytes: the arena's, or caching's address space
        if backing is None:
            raise RuntimeError("contiguous KV on real tensors needs a backed arena (or caching memory)")
        return backing

    def breakdown(self, seqs: list[SeqLike]) -> Breakdown:
        kvb = self.kv_bytes_per_token
        tokens = reservation = internal = 0
        for seq in seqs:
            alloc = self.allocs.get(seq.seq_id)
            if alloc is None:
                continue
            t, r, i = seq_accounting(alloc.size // kvb, seq.num_tokens, seq.final_len)
            tokens, reservation = tokens + t * kvb, reservation + r * kvb
            # rounding below a whole token row is allocated and never used
            internal += i * kvb + alloc.size % kvb
        return self._breakdown(tokens, reservation, internal)

    def breakdown_of(self, live_tokens: int) -> Breakdown:
        kvb, held = self.kv_bytes_per_token, self.totals
        return self._breakdown(live_tokens * kvb, (held.eventual_tokens - live_tokens) * kvb,
                               (held.allocated_tokens - held.eventual_tokens) * kvb + held.remainder_bytes)

    def need_bytes(self) -> int | None:
        """The allocation external fragmentation is judged against: the queue head's, else the recent median."""
        if self.next_need_bytes is not None:
            return self.next_need_bytes
        return int(statistics.median(self.recent_bytes)) if self.recent_bytes else None

    def _breakdown(self, tokens: int, reservation: int, internal: int) -> Breakdown:
        """Free bytes in extents too small for the next allocation are external fragmentation (they hold no
        request that comes); the rest of the free bytes are free, however many holes they lie in."""
        mem = self.memory.stats()
        need = self.need_bytes()
        external = self.memory.free_bytes_below(need) if need else 0
        return Breakdown(
            token_states_bytes=tokens,
            reservation_bytes=reservation,
            internal_fragmentation_bytes=internal,
            external_fragmentation_bytes=external,
            free_bytes=mem.free_bytes - external,
        )

    def stats(self) -> KVStats:
        mem = self.memory.stats()
        return KVStats(
            kv_capacity_bytes=mem.capacity_bytes,
            allocated_bytes=mem.allocated_bytes,
            free_bytes=mem.free_bytes,
            largest_free_bytes=mem.largest_free_bytes,
            num_seqs=len(self.allocs),
        )

    def memory_map(self) -> list[dict]:
        return self.memory.memory_map()

    def _replace(self, seq: SeqLike, tokens: int) -> None:
        """Allocate the new buffer before freeing the old, as torch.cat does: both live at the peak."""
        new = self.memory.allocate(tokens * self.kv_bytes_per_token + self.pad_bytes, owner=seq.seq_id)
        self.recent_bytes.append(new.size)
        old = self.allocs.get(seq.seq_id)
        self.allocs[seq.seq_id] = new
        self._account(seq, new, 1)
        if old is not None:
            kvb = self.kv_bytes_per_token
            if self.memory.backed:  # bookkeeping alone (the simulator) has no rows to copy
                self.copy_rows(self._first_row(old), self._first_row(new), old.requested // kvb)
            self._account(seq, old, -1)
            self.memory.free(old)
