"""The GPU box read once more (issue 73): each defect reproduced on a CPU, with torch.cuda faked (or the project's
own sizing functions called), failing on e108c87 and passing since."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
import engines.memory.nvml
import scripts.gpu_items as items
from tests.test_gpu_paths import fake_cuda  # noqa: F401 (a CUDA device as torch.cuda describes it, a fixture)

MiB = 2**20


# -- 1: the nvml item read device_snapshot() as a dict
def test_1_the_nvml_item_reads_the_device_figures_record(fake_cuda, monkeypatch):  # noqa: F811
    lib = SimpleNamespace(nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
                          nvmlDeviceGetUUID=lambda h: "GPU-b",
                          nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=300 * MiB, total=1000 * MiB))
    monkeypatch.setattr(engines.memory.nvml, "nvml", lambda: lib)
    monkeypatch.setattr(cuda, "nvml", lambda: lib)
    stats = {"allocated_bytes.all.current": 90 * MiB, "reserved_bytes.all.current": 100 * MiB,
             **{key: 1 for key in cuda.ALLOCATOR_FIELDS.values()}}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: stats)
    line, figures = items.check_nvml(None)
    assert line == "device used 300 MiB, torch reserved 100 MiB"
    assert figures["device_used_bytes"] == 300 * MiB and figures["torch_segments"] == 1
    monkeypatch.setattr(cuda, "nvml", lambda: (_ for _ in ()).throw(OSError("no NVML")))
    with pytest.raises(AssertionError, match="empty: \\['device_used_bytes'\\]"):
        items.check_nvml(None)
