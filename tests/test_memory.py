import pytest
import torch

from engines.memory.arena import Arena, MiB, OutOfMemory, round_size


def test_rounding_follows_the_caching_allocator():
    assert round_size(1) == 512
    assert round_size(513) == 1024
    assert round_size(MiB) == MiB
    assert round_size(MiB + 1) == 2 * MiB
    assert round_size(5 * MiB) == 6 * MiB


def test_allocate_free_and_coalesce():
    a = Arena(16 * 1024)
    x, y, z = (a.allocate(4096, owner=o) for o in "xyz")
    assert (x.offset, y.offset, z.offset) == (0, 4096, 8192)
    assert a.stats().free_bytes == 4096
    a.free(x)
    a.free(z)  # z's extent joins the tail: 8 KiB; x's hole stays apart
    assert a.stats().largest_free_bytes == 8192
    a.free(y)  # the middle joins both neighbours
    s = a.stats()
    assert (s.allocated_bytes, s.free_bytes, s.largest_free_bytes) == (0, 16384, 16384)
    assert a.extents() == [(0, 16384, None)]


def test_best_fit_picks_the_smallest_hole():
    a = Arena(20 * 1024)
    blocks = [a.allocate(n) for n in (4096, 1024, 2048, 1024, 4096)]
    a.free(blocks[0])  # hole of 4 KiB at 0
    a.free(blocks[2])  # hole of 2 KiB at 5 KiB
    assert a.allocate(2048).offset == 5 * 1024


def test_oom_with_free_memory_is_fragmentation():
    a = Arena(8 * 1024)
    blocks = [a.allocate(2048) for _ in range(4)]
    a.free(blocks[0])
    a.free(blocks[2])  # 4 KiB free, in two 2 KiB holes
    with pytest.raises(OutOfMemory) as err:
        a.allocate(4096, owner="big")
    ev = err.value.event
    assert (ev.requested_bytes, ev.free_bytes, ev.largest_free_bytes, ev.cause) == (4096, 4096, 2048, "fragmentation")


def test_oom_without_enough_free_memory_is_capacity():
    a = Arena(4096)
    a.allocate(2048)
    with pytest.raises(OutOfMemory) as err:
        a.allocate(4096)
    assert err.value.event.cause == "capacity"


def test_allocations_are_real_tensor_views():
    a = Arena(8192)
    x = a.allocate(4096)
    a.view(x).view(torch.float32).fill_(1.5)
    assert a.backing[:4096].view(torch.float32).eq(1.5).all()
    assert a.backing[4096:].eq(0).all()


def test_double_free_is_refused():
    a = Arena(4096)
    x = a.allocate(512)
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)


def test_buddy_rounds_to_powers_of_two_and_merges_buddies():
    a = Arena(64 * 1024, placement="buddy", backing_device=None)
    x = a.allocate(5000)
    assert x.size == 8192
    y = a.allocate(8192)
    assert y.offset == 8192
    a.free(x)
    a.free(y)
    assert a.stats().largest_free_bytes == 64 * 1024


def test_buddy_cannot_merge_non_buddies():
    a = Arena(16 * 1024, placement="buddy", backing_device=None)
    blocks = [a.allocate(4096) for _ in range(4)]
    a.free(blocks[1])
    a.free(blocks[2])  # 8 KiB free but 1 and 2 are not buddies
    s = a.stats()
    assert (s.free_bytes, s.largest_free_bytes) == (8192, 4096)
    with pytest.raises(OutOfMemory) as err:
        a.allocate(8192)
    assert err.value.event.cause == "fragmentation"


def test_buddy_handles_capacity_that_is_not_a_power_of_two():
    a = Arena(12 * 1024, placement="buddy", backing_device=None)
    assert a.stats().largest_free_bytes == 8192
    blocks = [a.allocate(4096) for _ in range(3)]
    with pytest.raises(OutOfMemory):
        a.allocate(512)
    for b in blocks:
        a.free(b)
    assert a.stats().free_bytes == 12 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent")
def test_cuda_backend_reports_oom_events():
    from engines.memory.cuda import CudaMemory

    m = CudaMemory(64 * MiB)
    x = m.allocate(32 * MiB)
    with pytest.raises(OutOfMemory) as err:
        m.allocate(128 * MiB)
    assert err.value.event.cause == "capacity"
    m.free(x)
    assert m.stats().allocated_bytes <= 0
