"""CUDA memory counted as PyTorch counts, read on a CPU: torch.cuda faked by the project's own emulator of the
caching allocator (engines/memory/caching.py), so that every tensor CudaMemory asks for is a block the emulator
places under the cap CudaMemory sets, and every torch.cuda figure it reads is the emulator's."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
from engines.memory.allocconf import AllocConf
from engines.memory.blocks import round_size
from engines.memory.caching import AllocatorOOM, CachingAllocator
from engines.memory.snapshot import snapshot

MiB = 2**20
TOTAL = 1000 * MiB


def format_size(nbytes: int) -> str:
    """c10's format_size, as torch's OutOfMemoryError prints a size."""
    for unit, scale in (("bytes", 1), ("KiB", 2**10), ("MiB", 2**20)):
        if nbytes <= scale * 1024:
            return f"{nbytes} bytes" if scale == 1 else f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**30:.2f} GiB"


class EmulatedDevice:
    """One CUDA device whose caching allocator is the emulator: torch.empty on it takes a block (freed when the
    tensor dies), the cap is the emulator's, and an allocation it refuses raises torch.OutOfMemoryError."""

    def __init__(self):
        self.allocator = CachingAllocator(TOTAL, device_bytes=TOTAL)
        self.fraction = 1.0

    def empty(self, nbytes: int) -> torch.Tensor:
        try:
            block = self.allocator.malloc(nbytes)
        except AllocatorOOM as e:  # torch names the segment it asked the device for, not the request
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {format_size(e.info.segment_bytes)}. "
                                         f"GPU 0 has a total capacity of {format_size(TOTAL)}") from None
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        weakref.finalize(tensor, self.allocator.free, block)
        return tensor

    def set_fraction(self, fraction: float, device=None) -> None:
        torch.cuda._utils._get_device_index(device, optional=False)  # an unindexed device: refused, as torch does
        self.fraction = fraction
        self.allocator.capacity_bytes = int(fraction * TOTAL)

    def stats(self, device=None) -> dict:
        return {"reserved_bytes.all.current": self.allocator.reserved,
                "allocated_bytes.all.current": self.allocator.allocated}


@pytest.fixture
def device(monkeypatch) -> EmulatedDevice:
    dev = EmulatedDevice()
    real_empty = torch.empty

    def empty(*size, device=None, **kw):
        if str(device).startswith("cuda"):
            return dev.empty(size[0])
        return real_empty(*size, device=device, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: dev.fraction)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", dev.set_fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: dev.allocator.reserved)
    monkeypatch.setattr(torch.cuda, "memory_stats", dev.stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (TOTAL - dev.allocator.reserved, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot(dev.allocator)["segments"])
    monkeypatch.setattr(torch.cuda, "empty_cache", dev.allocator.empty_cache)
    return dev


def test_the_kv_is_counted_as_pytorch_counts_it_so_allocated_never_passes_reserved(device):
    """Sixteen 3 MiB KV tensors: PyTorch rounds each to 512 B and packs six to a 20 MiB segment, 48 MiB allocated
    in 60 MiB reserved. Counted in the arena's 2 MiB granules they were 64 MiB: more than PyTorch reserved."""
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    for i in range(16):
        memory.allocate(3 * MiB, f"s{i}")
    stats = memory.stats()
    assert (stats.allocated_bytes, stats.reserved_bytes) == (48 * MiB, 60 * MiB)
    assert stats.allocated_bytes == device.allocator.allocated <= stats.reserved_bytes


@pytest.mark.parametrize("nbytes", [1, 511, 513, MiB - 1, MiB + 1, 3 * MiB + 4096, 11 * MiB + 7])
def test_every_kv_request_is_rounded_as_the_emulator_rounds_it(device, nbytes):
    """The request's rounding is PyTorch's; the block it gets may be larger (an 11 MiB request keeps its 12 MiB
    segment whole: a remainder of 1 MiB or less is not split off), never smaller."""
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    memory.allocate(nbytes, "kv")
    assert memory.rounded(nbytes) == memory.stats().allocated_bytes == round_size(nbytes, AllocConf())
    assert memory.stats().allocated_bytes <= device.allocator.allocated <= memory.stats().reserved_bytes


def test_the_rounding_follows_the_alloc_conf_cuda_started_with(device, environ):
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:4"
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    assert memory.rounded(1200 * 1024) == 1280 * 1024  # the next quarter between 1 MiB and 2 MiB


def test_a_kv_oom_with_the_slack_taken_by_activations_is_capacity_not_fragmentation(device):
    """The KV is far within its budget, but the activations hold all but 2 MiB under the cap: the device is
    truly full for a 3 MiB tensor. Judged by the KV's budget alone it was `fragmentation`."""
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    cap = device.allocator.capacity_bytes
    activations = device.empty(cap - 2 * MiB)  # noqa: F841 (held: the forward's tensors)
    with pytest.raises(cuda.OutOfMemory) as refused:
        memory.allocate(3 * MiB, "seq")
    event = refused.value.event
    assert (event.cause, event.layer, event.free_bytes) == ("capacity", "allocator", 2 * MiB)
    assert memory.first_oom_snapshot, "the allocator's segments at the OOM"


def test_a_kv_oom_with_the_bytes_free_in_holes_is_fragmentation(device):
    """Every other 3 MiB tensor freed: 36 MiB cached free in holes and tails, 16 MiB under the cap, and a 9 MiB
    request fits neither a hole nor the 20 MiB segment it asks for."""
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    activations = device.empty(device.allocator.capacity_bytes - 76 * MiB)  # noqa: F841 (held)
    held = [memory.allocate(3 * MiB, f"s{i}") for i in range(16)]
    for alloc in held[::2]:
        memory.free(alloc)
    with pytest.raises(cuda.OutOfMemory) as refused:
        memory.allocate(9 * MiB, "seq")
    event = refused.value.event
    assert (event.cause, event.cached_free_bytes, event.device_free_bytes) == ("fragmentation", 36 * MiB, 16 * MiB)


def test_an_oom_in_a_forward_is_judged_from_the_allocators_state(device):
    """The activations' own OOM (the engines call device_oom with the segment the error tried to allocate):
    capacity when nothing under the cap would hold it, fragmentation when the cache holds enough in pieces."""
    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    activations = device.empty(device.allocator.capacity_bytes - 2 * MiB)
    assert memory.device_oom(262 * MiB, "activations").cause == "capacity"
    del activations
    held = [device.empty(3 * MiB) for _ in range(30)]
    del held[::2]
    assert memory.device_oom(20 * MiB, "activations").cause == "fragmentation"
