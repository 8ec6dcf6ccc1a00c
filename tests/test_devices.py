"""Device selection: the GPU where CUDA is available, the CPU elsewhere, one flag to override."""

import pytest
import torch

from engines.memory import device_info, resolve_device
from tests.conftest import run_cli


def test_without_cuda_auto_is_the_cpu_and_asking_for_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    assert device_info("cpu") == {"device": "cpu", "name": None, "driver": None, "cuda": None}


def test_with_cuda_auto_is_the_gpu_and_cpu_still_overrides(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no real device is touched
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_bench_on_cuda_without_cuda_exits_2_with_one_line(tiny_model, tmp_path):
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--device", "cuda", "--out", str(tmp_path))
    assert r.returncode == 2 and "no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
