"""The CUDA side of device memory: PyTorch's caching allocator under a per-process cap (`CudaMemory`), and
what the device says of itself (the allocator's counters, NVML) for the samples and run.json. Imported only
where a GPU path runs or is described; `engines/memory.py` holds the arena every machine has."""

from __future__ import annotations

import torch

from engines.memory import Allocation, DeviceMemory, MemoryStats, OOMEvent, OutOfMemory, round_size
from engines.nvml import memory_info, nvml

# What a forward takes from the same per-process cap as the KV: cuBLAS's workspace (":4096:8", eight 4 MiB
# chunks, the default on sm90; less on older GPUs) beside the activations the caller sizes.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20


def cuda_device(device: str | torch.device) -> torch.device:
    """A CUDA device with its index: set_per_process_memory_fraction and memory_stats need one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the cuda memory backend needs a CUDA device, not {dev}: use --device cuda[:N] (or auto)")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaMemory(DeviceMemory):
    """The real PyTorch CUDA caching allocator, capped at the KV budget, plus the headroom a forward needs,
    above what is already in use. The cap is process-wide: `close` restores the one it replaced."""

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda", headroom_bytes: int = 0):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda memory backend needs a CUDA device; this machine has none")
        self.device = cuda_device(device)
        self.capacity_bytes = capacity_bytes
        self.headroom_bytes = headroom_bytes + CUBLAS_WORKSPACE_BYTES
        total = torch.cuda.get_device_properties(self.device).total_memory
        in_use = torch.cuda.memory_reserved(self.device)
        self._previous_fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        cap = min(1.0, (in_use + capacity_bytes + self.headroom_bytes) / total)
        torch.cuda.set_per_process_memory_fraction(cap, self.device)
        self._baseline = torch.cuda.memory_allocated(self.device)
        self._live: dict[int, Allocation] = {}
        self._requested = 0
        self.first_oom_snapshot: list[dict] | None = None  # the allocator's segments at the first OOM

    @property
    def backed(self) -> bool:
        return True

    def rounded(self, nbytes: int) -> int:
        return round_size(nbytes)

    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            if self.first_oom_snapshot is None:
                self.first_oom_snapshot = cuda_segments(self.device)
            s = self.stats()
            raise OutOfMemory(
                OOMEvent.classify(round_size(nbytes), s.free_bytes, s.largest_free_bytes, owner)
            ) from None
        alloc = Allocation(0, round_size(nbytes), nbytes, owner, tensor)
        self._live[id(alloc)] = alloc
        self._requested += nbytes
        return alloc

    def free(self, alloc: Allocation) -> None:
        if self._live.pop(id(alloc), None) is None:
            raise ValueError("double free or foreign allocation")
        self._requested -= alloc.requested
        alloc.tensor = None

    def stats(self) -> MemoryStats:
        s = torch.cuda.memory_stats(self.device)
        allocated = s.get("allocated_bytes.all.current", 0) - self._baseline
        reserved = s.get("reserved_bytes.all.current", 0)
        free = max(0, self.capacity_bytes - allocated)
        return MemoryStats(
            capacity_bytes=self.capacity_bytes,
            allocated_bytes=allocated,
            requested_bytes=self._requested,
            free_bytes=free,
            largest_free_bytes=min(free, self._largest_free_block(reserved)),
            num_allocations=len(self._live),
            reserved_bytes=reserved,
        )

    def _largest_free_block(self, reserved: int) -> int:
        """The largest inactive block in the cache, or the never-reserved rest of the cap if larger."""
        inactive = [
            b["size"]
            for seg in torch.cuda.memory_snapshot()
            for b in seg["blocks"]
            if b["state"] == "inactive"
        ]
        unreserved = max(0, self._baseline + self.capacity_bytes - reserved)
        return max([unreserved, *inactive])

    def extents(self) -> list[tuple[int, int, str | None]]:
        out: list[tuple[int, int, str | None]] = []
        for seg in torch.cuda.memory_snapshot():
            addr = seg["address"]
            for b in seg["blocks"]:
                out.append((addr, b["size"], "allocated" if b["state"] == "active_allocated" else None))
                addr += b["size"]
        return sorted(out)

    def view(self, alloc: Allocation) -> torch.Tensor:
        assert alloc.tensor is not None
        return alloc.tensor

    def close(self) -> None:
        """The process's cap as it was before this memory: a later one (another engine, test or check) is not
        held to this budget."""
        torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)


def cuda_segments(device: torch.device | None = None) -> list[dict]:
    """torch.cuda.memory_snapshot() cut to what the report draws: each segment's blocks, in address order."""
    index = None if device is None else torch.device(device).index
    return [{"address": seg["address"], "total_size": seg["total_size"], "device": seg.get("device"),
             "blocks": [{"size": b["size"], "state": b["state"]} for b in seg["blocks"]]}
            for seg in torch.cuda.memory_snapshot() if index is None or seg.get("device") in (None, index)]


# torch.cuda.memory_stats fields sampled beside the allocator totals: the gap between reserved and allocated
# that the caching allocator keeps, how much of it is split blocks no request fits, and its retries and OOMs
ALLOCATOR_FIELDS = {
    "torch_active_bytes": "active_bytes.all.current",
    "torch_inactive_split_bytes": "inactive_split_bytes.all.current",
    "torch_segments": "segment.all.current",
    "torch_alloc_retries": "num_alloc_retries",
    "torch_ooms": "num_ooms",
}


def device_info(device: str) -> dict:
    """What run.json records of the device a run used."""
    info = {"device": device, "name": None, "driver": None, "cuda": None}
    if device.startswith("cuda"):
        info.update(name=torch.cuda.get_device_name(torch.device(device)), cuda=torch.version.cuda)
        try:
            info["driver"] = nvml().nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing or refusing: the rest still stands
            pass
    return info


def device_snapshot(device: str = "cuda") -> dict:
    """What the device the engine runs on says: the PyTorch CUDA allocator and NVML, or None where the engine
    is not on a GPU."""
    out: dict = {"torch_allocated_bytes": None, "torch_reserved_bytes": None, "device_used_bytes": None,
                 **dict.fromkeys(ALLOCATOR_FIELDS)}
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        dev = cuda_device(device)
        stats = torch.cuda.memory_stats(dev)
        out["torch_allocated_bytes"] = stats.get("allocated_bytes.all.current", 0)
        out["torch_reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
        out.update({column: stats.get(key, 0) for column, key in ALLOCATOR_FIELDS.items()})
        try:
            out["device_used_bytes"] = memory_info(nvml_index(dev.index)).used
        except Exception:  # NVML missing or refusing: the allocator's numbers still stand
            pass
    return out


def nvml_index(torch_index: int) -> int:
    """NVML numbers every GPU of the machine; torch only those CUDA_VISIBLE_DEVICES shows, renumbered from 0.
    The device's UUID (or PCI bus id) is the same in both."""
    lib = nvml()
    props = torch.cuda.get_device_properties(torch_index)
    uuid = getattr(props, "uuid", None)
    for i in range(lib.nvmlDeviceGetCount()):
        handle = lib.nvmlDeviceGetHandleByIndex(i)
        if uuid is not None and str(lib.nvmlDeviceGetUUID(handle)).removeprefix("GPU-") == str(uuid):
            return i
    raise LookupError(f"NVML has no GPU with the UUID of torch's cuda:{torch_index}")


def device_note() -> str:
    """One clear line on what device memory the run can see."""
    if not torch.cuda.is_available():
        return "no CUDA device: KV memory is the arena's; PyTorch allocator and NVML figures are absent"
    try:
        import pynvml

        pynvml.nvmlInit()
        return f"CUDA device {torch.cuda.get_device_name()}; NVML driver {pynvml.nvmlSystemGetDriverVersion()}"
    except Exception as e:
        return f"CUDA device {torch.cuda.get_device_name()}; NVML unavailable ({type(e).__name__})"
