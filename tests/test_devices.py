"""Device selection: the GPU where CUDA is available, the CPU elsewhere, one flag to override."""

import json
import os
from dataclasses import asdict

import pytest
import torch

from engines.memory.arena import resolve_device
from engines.memory.cuda import device_info
from tests.conftest import run_cli


def test_without_cuda_auto_is_the_cpu_and_asking_for_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    assert device_info("cpu") == {"device": "cpu", "name": None, "driver": None, "cuda": None}


def test_with_cuda_auto_is_the_gpu_and_cpu_still_overrides(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no real device is touched
    monkeypatch.delenv("FRAGBENCH_DEVICE")  # a user's shell: nothing pins auto
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


def test_the_suite_runs_on_the_cpu_on_a_gpu_box_unless_told_otherwise(monkeypatch):
    """tests/conftest.py pins `auto` to the CPU for this process and every server and bench it starts: on a GPU
    box `make test` ran them on CUDA, against figures and tolerances made on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert os.environ["FRAGBENCH_DEVICE"] == "cpu" and resolve_device("auto") == "cpu"
    assert resolve_device("cuda") == "cuda"  # a test that asks for the GPU still gets it
    monkeypatch.setenv("FRAGBENCH_DEVICE", "cuda")
    assert resolve_device("auto") == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_bench_on_cuda_without_cuda_exits_2_with_one_line(tiny_model, tmp_path):
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--device", "cuda", "--out", str(tmp_path))
    assert r.returncode == 2 and "no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_allocator_columns_are_sampled_and_empty_without_cuda(monkeypatch):
    from engines.memory.cuda import ALLOCATOR_FIELDS, device_snapshot
    from harness.results import SAMPLE_COLUMNS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    snap = asdict(device_snapshot())
    assert set(ALLOCATOR_FIELDS) <= set(snap) <= set(SAMPLE_COLUMNS) and set(snap.values()) == {None}


def test_allocator_columns_come_from_torch_memory_stats(monkeypatch):
    from engines.memory.cuda import device_snapshot

    stats = {"allocated_bytes.all.current": 3, "reserved_bytes.all.current": 8, "inactive_split_bytes.all.current": 5,
             "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no real device is touched
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: stats)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    snap = device_snapshot()
    assert (snap.torch_allocated_bytes, snap.torch_reserved_bytes, snap.torch_inactive_split_bytes,
            snap.torch_ooms, snap.torch_alloc_retries) == (3, 8, 5, 1, 0)


def test_the_report_draws_the_allocators_segments_at_the_first_oom(tmp_path):
    from harness.views.report import cuda_snapshots

    segments = [{"address": 0, "total_size": 2 << 20, "device": 0,
                 "blocks": [{"size": 1 << 20, "state": "active_allocated"}, {"size": 1 << 20, "state": "inactive"}]}]
    (tmp_path / "cuda_snapshot-paged.json").write_text(json.dumps({"t_s": 4.2, "segments": segments}))
    [part] = cuda_snapshots(tmp_path)
    assert "first OOM" in part and "1 segments reserved, 2.0 MiB" in part and "1.0 MiB cached but free" in part
