"""The GPU box read a fourth time (issue 80): each defect reproduced on a CPU, with torch.cuda faked or the
project's caching-allocator emulator standing in for PyTorch's, failing on be5c217 and passing since."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
from engines.memory.caching import CachingAllocator
from engines.memory.snapshot import snapshot
from engines.shapes import load_shape

MiB, GiB = 2**20, 2**30


# -- 2: fusing the weights left their originals in PyTorch's cache, and the cuda cap counted them as in use
class EmulatedH100:
    """torch.cuda answered by the allocator emulator on an H100's 80 GiB: what CudaMemory reads and sets."""

    def __init__(self, monkeypatch, total: int = 80 * GiB):
        self.total, self.fraction = total, 1.0
        self.allocator = CachingAllocator(total, device_bytes=total)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: self.allocator.reserved)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot(self.allocator)["segments"])
        monkeypatch.setattr(torch.cuda, "empty_cache", self.allocator.empty_cache)

    def set_fraction(self, fraction: float, device=None) -> None:
        self.fraction = fraction
        self.allocator.capacity_bytes = int(fraction * self.total)


def load_and_fuse(allocator: CachingAllocator, model: str = "llama-3-8b", dtype_bytes: int = 2) -> None:
    """The allocator's calls of `model.to("cuda")` (a block per parameter) and then of fused_weights
    (engines/scheduled/model.laid_out: each group's fused matrix allocated, then each original freed as its weight
    becomes a view of it), in their order."""
    s = load_shape(model)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    h, i, v = s.hidden_size, s.intermediate_size, s.vocab_size
    groups = [[q * h, kv * h, kv * h], [h * q], [i * h, i * h], [h * i]]
    blocks = [allocator.malloc(v * h * dtype_bytes)]  # the embeddings
    layers = []
    for _ in range(s.num_layers):
        layers.append([[allocator.malloc(n * dtype_bytes) for n in g] for g in groups])
        blocks += [allocator.malloc(h * dtype_bytes) for _ in range(2)]  # the two norms
    blocks.append(allocator.malloc(h * dtype_bytes))
    head = None if s.tied_embeddings else allocator.malloc(v * h * dtype_bytes)
    for layer in layers:
        for group in layer:
            blocks.append(allocator.malloc(sum(b.size for b in group)))
            for original in group:
                allocator.free(original)
    if head is not None:
        blocks.append(allocator.malloc(head.size))
        allocator.free(head)


def test_2_the_cuda_cap_counts_the_fused_weights_in_use_not_their_originals_cached(monkeypatch, capsys):
    """Llama-3-8B bf16 on an H100, replayed through the emulator: after fusing, about 8 GiB of the originals is
    cached free beside 15 GiB in use. CudaMemory's cap is what is in use + the budget + a segment's slack + the
    headroom and cuBLAS's workspace; what is in use is what stays reserved once the cache is emptied."""
    dev = EmulatedH100(monkeypatch)
    load_and_fuse(dev.allocator)
    allocated, reserved = dev.allocator.allocated, dev.allocator.reserved
    assert reserved - allocated > 7 * GiB, "the originals fused away stay cached"
    budget, headroom = 2 * GiB, 3 * GiB
    memory = cuda.CudaMemory(budget, "cuda:0", headroom_bytes=headroom)
    assert reserved - dev.allocator.reserved > 7 * GiB, "the cache gave its free segments back"
    beside = budget + cuda.SEGMENT_SLACK_BYTES + headroom + cuda.CUBLAS_WORKSPACE_BYTES
    assert memory._cap_bytes() == pytest.approx(dev.allocator.reserved + beside, abs=4096)
    with capsys.disabled():
        print(f"\nLlama-3-8B bf16 fused: {allocated / GiB:.2f} GiB allocated, {reserved / GiB:.2f} GiB reserved "
              f"before empty_cache, {dev.allocator.reserved / GiB:.2f} after; cap {memory._cap_bytes() / GiB:.2f} "
              f"GiB")


def test_2_the_factory_gives_the_fused_originals_back_before_it_builds_the_memory(tiny_model, monkeypatch):
    """The reserved figures every sample, the debug pass and NVML carry are without the cached originals whatever
    the memory: the cache is emptied after fusing, before the memory (and its cap) is made."""
    from engines.factory import EngineSpec, make_engine
    from engines.memory.arena import Arena
    from engines.scheduled import model

    events, real_laid_out, real_load = [], model.laid_out, model.load_hf_model

    def laid_out(linears):
        events.append("laid_out")
        return real_laid_out(linears)

    def memory(kind, capacity, on, placement="best-fit", headroom_bytes=0, alloc_conf=None):
        events.append("memory")
        return Arena(capacity, backing_device="cpu")

    monkeypatch.setattr(model, "laid_out", laid_out)
    monkeypatch.setattr(model, "load_hf_model", lambda d, device="cpu": real_load(d, "cpu"))  # no GPU here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr("engines.factory.make_memory", memory)
    make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="arena", device="cuda:0"))
    last_layout = max(i for i, e in enumerate(events) if e == "laid_out")
    assert "empty_cache" in events[last_layout:events.index("memory")], events
