"""NVML (the `nvidia-ml-py` package, module `pynvml`), initialised once per process: the sampler reads it
at 10 Hz, and `check` and `run.json` read it too."""

from __future__ import annotations

import functools


@functools.cache
def nvml():
    """The initialised pynvml module. Raises where NVML is missing or refuses (no driver, no GPU); a failure
    is not remembered, so a later call tries again."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def memory_info(index: int):
    """NVML's view of one GPU's memory: total, used and free bytes."""
    lib = nvml()
    return lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(index))


def fullest_gpu() -> tuple[int, object] | None:
    """(NVML index, memory info) of the GPU with the least memory free: where a server fragbench did not start
    (and whose device it cannot ask) binds. None where NVML is missing or sees no GPU."""
    try:
        lib = nvml()
        mems = [lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(i)) for i in range(lib.nvmlDeviceGetCount())]
    except Exception:  # no driver, no GPU
        return None
    return min(enumerate(mems), key=lambda m: m[1].total - m[1].used) if mems else None
