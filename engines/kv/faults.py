"""Fault injection for the KV-integrity check (`serve --inject-kv-fault`): a cache manager's bugs that
throughput never shows. Only tests and a user testing a checker should ever turn one on.

- `early-free` (paged): a sequence's block goes back to the free queue (at its head: the next block taken)
  once the block after it is taken, while its table still reads it; the next sequence that takes it writes
  its own K/V over that context.
- `leak-block` (paged): a finished sequence's tail block is never handed back; each finished request keeps one
  block of the pool for good (counted as internal fragmentation: held, holding no live token). A leak the
  memory gate (`fragbench memory-gate`) must catch: the blocks still held once the trace has drained grow by
  one per finished request until the pool runs dry."""

from __future__ import annotations

from engines.kv.base import KVPolicy, SeqLike
from engines.kv.paged import PagedKV
from engines.kv.pool import KVBlock

FAULTS = ("early-free", "leak-block")


class EarlyFreeKV(PagedKV):
    """PagedKV with a use-after-free: each sequence's next-to-last block is released early, once."""

    freed_early: dict[str, KVBlock]  # seq_id -> the block its table still holds but the pool has back (inject)

    def allocate(self, seq: SeqLike, num_tokens: int) -> None:
        super().allocate(seq, num_tokens)
        table = self.seqs[seq.seq_id].table
        if seq.seq_id not in self.freed_early and len(table) >= 2 and table[-2].ref_count == 1:
            self.freed_early[seq.seq_id] = table[-2]
            self.pool.release([table[-2]])
            self.pool.free_queue.move_to_end(table[-2].block_id, last=False)  # the next block taken

    def free(self, seq: SeqLike) -> None:
        early = self.freed_early.pop(seq.seq_id, None)
        rec = self.seqs.pop(seq.seq_id, None)
        if rec is not None:
            self._account(seq, rec, -1)
            # released already: another sequence may hold it now, and its count is that one's
            self.pool.release([b for b in reversed(rec.table) if b is not early])


class LeakBlockKV(PagedKV):
    """PagedKV with a leak: each freed sequence's tail block stays taken, its slots still counted as held."""

    leaked_blocks: int  # blocks kept by sequences that are gone (inject)

    def free(self, seq: SeqLike) -> None:
        rec = self.seqs.pop(seq.seq_id, None)
        if rec is None:
            return
        self._account(seq, rec, -1)
        if not rec.table:
            return
        kept = rec.table[-1]
        self.pool.release_table(rec.table[:-1])
        if not self.counted:
            # the block's hash would let a later prefix hit share it: forget it, as an owner-less block would be
            self.pool.unregister(kept)
        self.leaked_blocks += 1
        self.totals.add(self.block_size, 0)  # held, never filled: internal fragmentation in Figure 2


FAULT_CLASSES: dict[str, type[PagedKV]] = {"early-free": EarlyFreeKV, "leak-block": LeakBlockKV}


def inject(kv: KVPolicy, fault: str) -> KVPolicy:
    """The same policy with the fault: its class swapped for the faulty subclass (the state is the same)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown KV fault {fault!r}; faults: {', '.join(FAULTS)}")
    assert isinstance(kv, PagedKV), f"{fault} is a paged pool's bug: the factory offers it on the paged engine alone"
    kv.__class__ = FAULT_CLASSES[fault]
    if isinstance(kv, EarlyFreeKV):
        kv.freed_early = {}
    else:
        kv.leaked_blocks = 0
    return kv
