"""The caching allocator emulator (engines/memory/caching.py), one test per rule at the sizes that tell it apart, the
PYTORCH_CUDA_ALLOC_CONF parser, and a property test that its stats always add up."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.memory.allocconf import AllocConfError, parse_alloc_conf
from engines.memory.blocks import round_size
from engines.memory.caching import AllocatorOOM, CachingAllocator

MiB = 2**20
BIG = 10**12  # a cap that never binds


def test_rounding_is_512_bytes_and_power2_divisions():
    default = parse_alloc_conf("")
    assert [round_size(n, default) for n in (1, 512, 513, 5000)] == [512, 512, 1024, 5120]
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(5000, four) == 5120  # 4096..8192 in steps of 1024
    assert round_size(int(1.1 * MiB), four) == int(1.25 * MiB)
    assert round_size(1200, four) == 1536  # under 512 x 4: plain 512 B granules
    per_interval = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert per_interval.divisions(3 * MiB) == 1 and per_interval.divisions(2**31) == 4
    assert per_interval.divisions(600 * MiB) == 4  # as PyTorch parses it, `>` fills from the last named interval on
    assert parse_alloc_conf("roundup_power2_divisions:[256:1,512:2]").divisions(600 * MiB) == 2


def test_a_small_request_shares_a_2_mib_segment():
    a = CachingAllocator(BIG)
    a.malloc(MiB)
    a.malloc(MiB)  # the rest of the same segment: a small block splits while 512 B remain
    assert (a.reserved, a.segments) == (2 * MiB, 1)


def test_a_1_5_mib_request_reserves_20_mib():
    a = CachingAllocator(BIG)
    block = a.malloc(int(1.5 * MiB))
    assert (a.reserved, block.size, a.segments) == (20 * MiB, int(1.5 * MiB), 1)
    assert a.inactive_split_bytes == int(18.5 * MiB)  # the rest of the segment, cached


def test_a_12_mib_request_reserves_12_mib_and_is_not_split_under_1_mib_spare():
    a = CachingAllocator(BIG)
    assert (a.malloc(12 * MiB).size, a.reserved) == (12 * MiB, 12 * MiB)
    b = CachingAllocator(BIG)
    block = b.malloc(11 * MiB + 1)  # a 12 MiB segment; 1 MiB would remain, not more: the whole block
    assert (block.size, b.allocated, b.reserved) == (12 * MiB, 12 * MiB, 12 * MiB)


def test_best_fit_by_size_then_address():
    a = CachingAllocator(BIG)
    blocks = [a.malloc(12 * MiB), a.malloc(14 * MiB), a.malloc(12 * MiB)]
    for b in blocks:
        a.free(b)
    chosen = a.malloc(11 * MiB)  # 12 MiB blocks fit best; the lower address of the two wins
    assert chosen.addr == blocks[0].addr and a.segments == 3


def test_small_blocks_never_serve_a_large_request():
    a = CachingAllocator(BIG)
    small = [a.malloc(MiB) for _ in range(4)]
    for b in small:
        a.free(b)
    a.malloc(2 * MiB)  # 4 MiB of small pool cached, but a large request takes a 20 MiB segment
    assert a.reserved == 4 * MiB + 20 * MiB


def test_a_free_block_never_merges_across_segments():
    a = CachingAllocator(40 * MiB)
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)  # two segments, adjacent addresses
    assert y.addr == x.addr + 12 * MiB
    a.free(x)
    a.free(y)
    assert sorted(k[1] for k in a.large.keys) == [12 * MiB, 12 * MiB]  # not one 24 MiB block
    a.malloc(24 * MiB)  # 24 + 24 > 40: both unsplit segments go back, then the retry fits
    assert (a.reserved, a.segments, a.retries) == (24 * MiB, 1, 1)


def test_the_issue_30_mib_cap_case():
    """8 + 8 MiB share one 20 MiB segment; after freeing the first, 12 MiB are cached free (8 + 4, never one
    block) and 10 MiB are free under the cap: a 9 MiB request needs a new 20 MiB segment and fails."""
    a = CachingAllocator(30 * MiB)
    first = a.malloc(8 * MiB)
    a.malloc(8 * MiB)
    a.free(first)
    with pytest.raises(AllocatorOOM) as oom:
        a.malloc(9 * MiB)
    info = oom.value.info
    assert (info.cached_free_bytes, info.device_free_bytes, info.segment_bytes) == (12 * MiB, 10 * MiB, 20 * MiB)
    assert info.largest_cached_bytes == 8 * MiB
    assert (a.retries, a.ooms) == (1, 1)


def test_max_split_size_keeps_oversize_blocks_whole_within_tolerance():
    a = CachingAllocator(BIG, "max_split_size_mb:32")
    a.free(a.malloc(40 * MiB))
    a.malloc(9 * MiB)  # under max_split: the cached 40 MiB block is not split for it (a 20 MiB segment)
    assert a.reserved == 60 * MiB
    reused = a.malloc(36 * MiB)  # oversize request: the 40 MiB block serves it whole (within 20 MiB)
    assert (reused.size, a.reserved) == (40 * MiB, 60 * MiB)
    b = CachingAllocator(BIG, "max_split_size_mb:32")
    b.free(b.malloc(60 * MiB))
    b.malloc(36 * MiB)  # 60 >= 36 + 20: out of tolerance, a segment of its own
    assert b.reserved == 96 * MiB


def test_an_oversize_cached_block_is_freed_before_the_retry():
    a = CachingAllocator(64 * MiB, "max_split_size_mb:32")
    a.free(a.malloc(40 * MiB))
    a.malloc(30 * MiB)  # 40 + 30 > 64: the oversize block goes back, and no retry is counted
    assert (a.reserved, a.retries) == (30 * MiB, 0)


def test_garbage_collection_frees_old_segments_before_any_retry():
    def run(conf):
        a = CachingAllocator(100 * MiB, conf)
        blocks = [a.malloc(24 * MiB) for _ in range(3)]
        a.free(blocks[0])
        a.free(blocks[1])
        a.malloc(30 * MiB)
        return a.reserved, a.retries

    assert run("garbage_collection_threshold:0.5") == (54 * MiB, 0)
    assert run("") == (54 * MiB, 1)  # without it the segments go back only at the last retry


def test_expandable_segments_tile_one_segment():
    a = CachingAllocator(60 * MiB, "expandable_segments:True")
    blocks = [a.malloc(12 * MiB) for _ in range(3)]
    assert a.reserved == 40 * MiB and [b.addr - blocks[0].addr for b in blocks] == [0, 12 * MiB, 24 * MiB]
    for b in blocks:
        a.free(b)
    a.malloc(30 * MiB)  # the freed blocks merged into one mapped range: no new page, no retry
    assert (a.reserved, a.retries) == (40 * MiB, 0)
    plain = CachingAllocator(60 * MiB)
    for b in [plain.malloc(12 * MiB) for _ in range(3)]:
        plain.free(b)
    plain.malloc(30 * MiB)
    assert (plain.reserved, plain.retries) == (30 * MiB, 1)


def test_expandable_segments_unmap_empty_pages_on_oom():
    a = CachingAllocator(40 * MiB, "expandable_segments:True")
    a.free(a.malloc(30 * MiB))  # two 20 MiB pages mapped, then empty
    a.malloc(MiB)  # a small page does not fit under the cap until the large pages are unmapped
    assert (a.reserved, a.retries) == (2 * MiB, 1)


def test_alloc_conf_errors_name_the_key():
    for bad, word in [("max_split_size_mb:10", "max_split_size_mb"), ("foo:1", "foo"),
                      ("expandable_segments:yes", "expandable_segments"),
                      ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
                      ("roundup_power2_divisions:3", "roundup_power2_divisions"),
                      ("expandable_segments", "expandable_segments")]:
        with pytest.raises(AllocConfError, match=word):
            parse_alloc_conf(bad)
    conf = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert conf.expandable_segments and conf.max_split_size_bytes == 128 * MiB
    assert conf.garbage_collection_threshold == 0.6


def check_invariants(a: CachingAllocator) -> None:
    heads = a.segment_heads()
    mapped_blocks = []
    for head in heads:
        b = head
        while b is not None:
            assert b.next is None or b.next.prev is b and b.next.addr == b.addr + b.size
            if b.mapped:
                mapped_blocks.append(b)
            b = b.next
    live = [b for b in mapped_blocks if b.allocated]
    cached = [b for b in mapped_blocks if not b.allocated]
    assert a.allocated == sum(b.size for b in live) == a.active
    assert a.reserved == sum(b.size for b in mapped_blocks) == a.allocated + sum(k[1] for p in (a.small, a.large)
                                                                                 for k in p.keys)
    assert a.reserved <= a.capacity_bytes
    split_free = [b for b in cached if b.is_split() and b.segment is None]
    assert a.inactive_split_bytes == sum(b.size for b in split_free)
    assert a.inactive_split == len(split_free)
    assert a.segments == len([h for h in heads if h.segment is None])
    assert a.requested == sum(b.requested for b in live)
    for b in cached:  # free neighbours in one segment have merged
        assert b.next is None or b.next.allocated or b.next.mapped != b.mapped


SIZES = st.sampled_from([1, 700, 4096, 300_000, MiB, MiB + 1, int(1.5 * MiB), 3 * MiB, 8 * MiB, 9 * MiB,
                         12 * MiB, 25 * MiB, 33 * MiB, 48 * MiB])
CONFS = st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:24", "garbage_collection_threshold:0.5",
                         "roundup_power2_divisions:4", "max_split_size_mb:40,garbage_collection_threshold:0.7"])


@settings(max_examples=60, deadline=None)
@given(conf=CONFS, cap_mib=st.integers(24, 160),
       ops=st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 10**6)), min_size=1, max_size=60))
def test_stats_always_add_up(conf, cap_mib, ops):
    a = CachingAllocator(cap_mib * MiB, conf)
    live = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            try:
                live.append(a.malloc(size))
            except AllocatorOOM as oom:
                assert oom.info.cached_free_bytes + oom.info.device_free_bytes + a.allocated == max(
                    a.reserved, a.capacity_bytes)
        else:
            a.free(live.pop(pick % len(live)))
        check_invariants(a)
    for b in live:
        a.free(b)
    check_invariants(a)
    a.empty_cache()
    assert a.reserved == 0 and a.segments == 0


# ---- --memory caching: the emulator behind the engines' DeviceMemory ------------------------------------------

def test_caching_memory_views_hold_bytes_and_stats_carry_the_allocator():
    from engines.memory.caching_memory import CachingMemory

    mem = CachingMemory(64 * MiB, "")
    a, b = mem.allocate(3 * MiB, "a"), mem.allocate(700, "b")
    mem.view(a)[:5] = torch.arange(5, dtype=torch.uint8)
    assert mem.view(a)[:5].tolist() == [0, 1, 2, 3, 4] and mem.view(b).numel() == 1024
    s = mem.stats()
    assert (s.allocated_bytes, s.reserved_bytes) == (3 * MiB + 1024, 22 * MiB)
    assert s.allocator.segments == 2 and s.allocator.inactive_split_bytes == 17 * MiB + 2 * MiB - 1024
    mem.free(a)
    assert mem.stats().allocated_bytes == 1024 and mem.stats().reserved_bytes == 22 * MiB  # the cache keeps it
    owners = [o for _, _, o in mem.extents()]
    assert owners.count("b") == 1 and None in owners


def test_caching_memory_oom_says_which_layer_failed():
    from engines.memory.arena import OutOfMemory
    from engines.memory.caching_memory import CachingMemory

    mem = CachingMemory(30 * MiB, "")
    first = mem.allocate(8 * MiB)
    mem.allocate(8 * MiB)
    mem.free(first)
    with pytest.raises(OutOfMemory) as allocator:
        mem.allocate(9 * MiB)
    ev = allocator.value.event
    assert (ev.layer, ev.cause, ev.cached_free_bytes, ev.device_free_bytes) == ("allocator", "fragmentation",
                                                                                12 * MiB, 10 * MiB)
    with pytest.raises(OutOfMemory) as policy:
        mem.allocate(25 * MiB)  # 8 MiB live + 25 MiB > 30 MiB: no allocator could hold it
    assert (policy.value.event.layer, policy.value.event.cause) == ("policy", "capacity")


@pytest.mark.parametrize("name", ["static", "paged", "hf", "growth"])
def test_engines_compute_on_caching_memory_as_on_the_arena(tiny_model, name):
    from engines.factory import EngineSpec, make_engine
    from engines.offline import generate
    from engines.sequence import SamplingParams

    prompts = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40)]
    outs = {}
    for memory in ("arena", "caching"):
        engine = make_engine(EngineSpec(name, str(tiny_model), 64 * MiB, max_seq_len=256, memory=memory,
                                        alloc_conf="expandable_segments:True" if name == "growth" else None))
        outs[memory] = [o[0].token_ids for o in generate(engine, prompts, SamplingParams(12))]
    assert outs["caching"] == outs["arena"]


def test_stats_carry_the_allocator_and_fill_torch_figures_on_the_cpu():
    from types import SimpleNamespace

    from engines.memory.allocstats import DeviceFigures, allocator_stats
    from engines.memory.arena import Arena
    from engines.memory.caching_memory import CachingMemory

    mem = CachingMemory(64 * MiB, "")
    mem.allocate(3 * MiB)
    out = allocator_stats(SimpleNamespace(kv=SimpleNamespace(memory=mem)), DeviceFigures())
    assert out["allocator"] == {"allocated_bytes": 3 * MiB, "reserved_bytes": 20 * MiB, "active_bytes": 3 * MiB,
                                "inactive_split_bytes": 17 * MiB, "segments": 1, "alloc_retries": 0,
                                "small_requests": 0, "large_requests": 1, "huge_requests": 0}
    assert (out["torch_allocated_bytes"], out["torch_reserved_bytes"]) == (3 * MiB, 20 * MiB)
    arena = SimpleNamespace(memory=Arena(MiB), kv=None)
    assert allocator_stats(arena, DeviceFigures()) == {"allocator": None}
