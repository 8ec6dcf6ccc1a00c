"""Each policy's Figure-2 accounting on hand-computed cases."""

import pytest
import torch

from engines.kv import GrowthKV, PagedKV, StaticKV
from engines.memory.arena import Arena, OutOfMemory
from tests.helpers import seq

KVB = 512  # bytes per token: below every rounding granule, so the arithmetic stays visible


def shares_tokens(bd, kvb=KVB):
    return (
        bd.token_states_bytes // kvb,
        bd.reservation_bytes // kvb,
        bd.internal_fragmentation_bytes // kvb,
        bd.external_fragmentation_bytes // kvb,
        bd.free_bytes // kvb,
    )


@pytest.mark.parametrize(
    "reserve, expected",
    [("max", (4, 6, 22, 0, 96)), ("pow2", (4, 6, 6, 0, 112)), ("oracle", (4, 6, 0, 0, 118))],
)
def test_static_reservations(reserve, expected):
    kv = StaticKV(Arena(128 * KVB), KVB, max_seq_len=32, reserve=reserve)
    s = seq("a", prompt_len=4, max_tokens=6)  # final length 10
    kv.allocate(s, 4)
    bd = kv.breakdown([s])
    assert shares_tokens(bd) == expected
    assert bd.capacity_bytes == 128 * KVB


def test_static_oracle_holes_too_small_for_the_next_allocation_are_external_fragmentation():
    kv = StaticKV(Arena(64 * KVB), KVB, max_seq_len=32, reserve="oracle")
    a, b = seq("a", 4, 6), seq("b", 4, 6)
    kv.allocate(a, 4)
    kv.allocate(b, 4)
    kv.free(a)  # a 10-token hole before b, 44 tokens free after it
    # no request waits: the next allocation is taken to be the recent median (10 tokens), which the hole holds
    assert shares_tokens(kv.breakdown([b])) == (4, 6, 0, 0, 54)
    kv.next_need_bytes = kv.allocation_bytes(seq("c", 12, 8))  # the queue's head needs 20: the hole cannot
    assert shares_tokens(kv.breakdown([b])) == (4, 6, 0, 10, 44)
    assert shares_tokens(kv.breakdown_of(4)) == (4, 6, 0, 10, 44)


def test_a_buddy_heap_of_max_length_reservations_strands_nothing_they_fit():
    """static-max on buddy placement: every free block of a reservation's size holds the next one; a free
    block too small for it is external fragmentation, however it came about."""
    kv = StaticKV(Arena(128 * KVB, placement="buddy"), KVB, max_seq_len=32, reserve="max")
    seqs = [seq(x, 4, 6) for x in "abcd"]
    for s in seqs:
        kv.allocate(s, 4)
    kv.free(seqs[1])  # a 32-token buddy block free between two held ones
    bd = kv.breakdown([seqs[0], seqs[2], seqs[3]])
    assert bd.external_fragmentation_bytes == 0 and bd.free_bytes == 32 * KVB


def test_static_admission_sees_free_bytes_not_extents():
    kv = StaticKV(Arena(30 * KVB), KVB, max_seq_len=32, reserve="oracle")
    a, b, c = seq("a", 5, 5), seq("b", 5, 5), seq("c", 5, 5)
    for s in (a, b, c):
        kv.allocate(s, 5)
    kv.free(a)
    kv.free(c)
    big = seq("big", 10, 10)  # 20 tokens: 20 free, in two holes of 10
    assert kv.can_allocate(big, 10)
    with pytest.raises(OutOfMemory) as err:
        kv.allocate(big, 10)
    assert err.value.event.cause == "fragmentation"


def test_growth_reallocates_and_leaves_holes():
    kv = GrowthKV(Arena(128 * KVB), KVB, max_seq_len=64)
    s = seq("a", 4, 6)
    kv.allocate(s, 4)
    assert shares_tokens(kv.breakdown([s])) == (4, 0, 0, 0, 124)
    s.token_ids.append(1)
    kv.allocate(s, 5)  # new 5-token buffer after the old one; the old 4 become a hole
    assert shares_tokens(kv.breakdown([s])) == (5, 0, 0, 4, 119)


def test_growth_copies_the_tokens_it_holds():
    arena = Arena(128 * KVB)
    kv = GrowthKV(arena, KVB, max_seq_len=64)
    s = seq("a", 4, 6)
    kv.allocate(s, 4)
    rows = kv.store().view(-1, KVB)
    rows[kv.slots(s, 0, 4)] = torch.arange(4, dtype=torch.uint8).unsqueeze(1).expand(4, KVB)
    kv.allocate(s, 5)
    assert rows[kv.slots(s, 0, 4)][:, 0].tolist() == [0, 1, 2, 3]


def test_paged_accounting_counts_only_the_last_block():
    kv = PagedKV(Arena(64 * KVB), KVB, max_seq_len=64, block_size=4, prefix_caching=False)
    s = seq("a", prompt_len=6, max_tokens=4)  # final 10: blocks of 4, 4, 2
    kv.allocate(s, 6)
    assert shares_tokens(kv.breakdown([s])) == (6, 2, 0, 0, 56)
    s.token_ids.extend([1, 2, 3, 4])
    kv.allocate(s, 10)
    assert shares_tokens(kv.breakdown([s])) == (10, 0, 2, 0, 52)
    kv.free(s)
    assert kv.stats().allocated_bytes == 0


def test_paged_prefix_cache_shares_full_blocks_and_survives_free():
    kv = PagedKV(Arena(64 * KVB), KVB, max_seq_len=64, block_size=4)
    a = seq("a", 10, 4)
    kv.allocate(a, 10)  # 3 blocks; blocks 0 and 1 are full and hashed
    b = seq("b", 10, 4)  # the same 10 tokens
    kv.allocate(b, 10)
    assert kv.num_cached_tokens(b) == 8
    assert kv.block_table(a)[:2] == kv.block_table(b)[:2]
    assert kv.pool.num_free == 16 - 4
    kv.free(a)
    kv.free(b)
    assert kv.stats().allocated_bytes == 0
    c = seq("c", 10, 4)
    kv.allocate(c, 10)  # the cached blocks come back from the free queue
    assert kv.num_cached_tokens(c) == 8


def test_paged_fork_shares_then_copies_on_write():
    kv = PagedKV(Arena(64 * KVB), KVB, max_seq_len=64, block_size=4)
    parent = seq("p", 6, 4)
    kv.allocate(parent, 6)
    rows = kv.store().view(-1, KVB)
    rows[kv.slots(parent, 0, 6)] = 7
    child = seq("c", 6, 4)
    kv.fork(parent, child)
    assert kv.pool.num_free == 16 - 2  # shared, not copied
    child.token_ids.append(99)
    kv.allocate(child, 7)  # writes position 6, in the shared partial block: copy it
    assert kv.pool.num_free == 16 - 3
    assert kv.block_table(child)[0] == kv.block_table(parent)[0]
    assert kv.block_table(child)[1] != kv.block_table(parent)[1]
    assert rows[kv.slots(child, 0, 6)].eq(7).all()


def test_paged_oom_is_capacity_and_can_allocate_says_so_first():
    kv = PagedKV(Arena(8 * KVB), KVB, max_seq_len=64, block_size=4)
    a = seq("a", 8, 4)
    kv.allocate(a, 8)
    b = seq("b", 4, 4, first_token=500)
    assert not kv.can_allocate(b, 4)
    with pytest.raises(OutOfMemory) as err:
        kv.allocate(b, 4)
    assert err.value.event.cause == "capacity"
