"""The CUDA side of device memory: PyTorch's caching allocator under a per-process cap (`CudaMemory`), and
what the device says of itself (the allocator's counters, NVML) for the samples and run.json. Imported only
where a GPU path runs or is described; `engines/memory/arena.py` holds the arena every machine has."""

from __future__ import annotations

import inspect

import torch

from engines.memory.allocconf import cuda_memory_refusal, parse_alloc_conf, torch_alloc_conf
from engines.memory.allocstats import DeviceFigures
from engines.memory.arena import Allocation, DeviceMemory, MemoryStats, OOMEvent, OutOfMemory
from engines.memory.blocks import LARGE_BUFFER_BYTES, round_size, smallest_request_for_segment
from engines.memory.nvml import memory_info, nvml

# What a forward takes from the same per-process cap as the KV: cuBLAS's workspace (":4096:8", eight 4 MiB
# chunks, the default on sm90; less on older GPUs) beside the activations the caller sizes.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
SEGMENT_SLACK_BYTES = LARGE_BUFFER_BYTES  # the caching allocator's large segment: what packing may add past the budget


def cuda_device(device: str | torch.device) -> torch.device:
    """A CUDA device with its index: set_per_process_memory_fraction and memory_stats need one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the cuda memory backend needs a CUDA device, not {dev}: use --device cuda[:N] (or auto)")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaMemory(DeviceMemory):
    """The real PyTorch CUDA caching allocator holding the KV: every allocation a tensor of its own, inside a
    process-wide cap of what is already in use + the KV budget + the headroom a forward needs (so that the
    activations never fail first), restored by `close`.

    The budget itself is a KV cap, counted here in PyTorch's own rounding (engines/memory/blocks.py: 512 B granules,
    or the power-of-two divisions its settings set, read as the installed torch reads them:
    allocconf.torch_alloc_conf; the one source the emulator uses), so the KV's count is at most what
    torch.cuda.memory_allocated counts for the same tensors (a block PyTorch leaves unsplit is larger, never
    smaller) and so at most what it reserves: allocated <= reserved always. An allocation whose rounded size would
    take the KV past `capacity_bytes` fails with cause `capacity`, whatever the process cap would still allow. One
    the allocator itself refuses (torch.cuda.OutOfMemoryError) is judged from the allocator's state, as the emulator
    judges it (OOMEvent.judge): `fragmentation` where the cached free bytes and the room left under the cap would
    hold it, `capacity` where they would not (the activations, the weights or another process took the slack). Only
    the KV tensors count toward the budget: cuBLAS's workspace, the weights and what a forward keeps are the cap's,
    not the budget's."""

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda", headroom_bytes: int = 0):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda memory backend needs a CUDA device; this machine has none")
        self.device = cuda_device(device)
        self.capacity_bytes = capacity_bytes
        if refused := cuda_memory_refusal(torch_alloc_conf()):  # before the cap: nothing to restore
            raise ValueError(refused)
        # the settings the real allocator read when CUDA started: its rounding (roundup_power2_divisions) is ours
        self.conf = parse_alloc_conf(torch_alloc_conf())
        self.headroom_bytes = headroom_bytes + CUBLAS_WORKSPACE_BYTES
        total = torch.cuda.get_device_properties(self.device).total_memory
        # the cap binds reserved bytes, so what is in use is what stays reserved once the cache has given its free
        # segments back: the weights' originals, freed into it as they were fused (8 GiB for Llama-3-8B), would
        # otherwise count as in use and loosen the cap by as much (a live segment's free tail stays counted: the
        # cap counts it too)
        torch.cuda.empty_cache()
        in_use = torch.cuda.memory_reserved(self.device)
        self._previous_fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        # the allocator packs requests under 10 MiB into 20 MiB segments: the cap leaves a segment's slack above
        # the budget, so that a KV within budget is refused only by the cache's own holes
        cap = min(1.0, (in_use + capacity_bytes + SEGMENT_SLACK_BYTES + self.headroom_bytes) / total)
        torch.cuda.set_per_process_memory_fraction(cap, self.device)
        self._live: dict[int, Allocation] = {}
        self._allocated = 0  # the KV's bytes as the allocator rounds them
        self._requested = 0
        self.first_oom_snapshot: list[dict] | None = None  # the allocator's segments at the first OOM

    @property
    def backed(self) -> bool:
        return True

    def rounded(self, nbytes: int) -> int:
        return round_size(nbytes, self.conf)

    def allocate(self, nbytes: int, owner: str = "") -> Allocation:
        size = self.rounded(nbytes)
        if self._allocated + size > self.capacity_bytes:  # the budget's own check: the policy's OOM
            self._keep_snapshot()
            s = self.stats()
            raise OutOfMemory(OOMEvent.classify(size, s.free_bytes, s.largest_free_bytes, owner))
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            raise OutOfMemory(self._judged(size, owner)) from None
        alloc = Allocation(0, size, nbytes, owner, tensor)
        self._live[id(alloc)] = alloc
        self._allocated += size
        self._requested += nbytes
        return alloc

    def device_oom(self, segment_bytes: int, owner: str) -> OOMEvent:
        """A forward's torch.cuda.OutOfMemoryError, given the segment its message says the allocator tried to
        allocate (engines/oom.segment_asked): judged on the smallest request that asks for that segment (a 20 MiB
        segment is asked for a request just over 1 MiB), since the message names no request. A 3 MiB activation
        refused with 10 MiB free in 2 MiB holes and 8 MiB under the cap is fragmentation, not capacity against
        20 MiB."""
        return self._judged(smallest_request_for_segment(segment_bytes), owner)

    def _judged(self, rounded_bytes: int, owner: str) -> OOMEvent:
        """A torch.cuda.OutOfMemoryError (a KV tensor's, or a forward's activations'), judged from the allocator's
        state as it failed: its cached free bytes (reserved less everything allocated, KV or not) and the room
        left under the cap (and on the device); the snapshot kept for the first."""
        self._keep_snapshot()
        stats = torch.cuda.memory_stats(self.device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        cached_free = max(0, reserved - stats.get("allocated_bytes.all.current", 0))
        device_free = max(0, min(int(self._cap_bytes()) - reserved, torch.cuda.mem_get_info(self.device)[0]))
        return OOMEvent.judge(rounded_bytes, cached_free, device_free, self._largest_free_block(), owner,
                              "allocator")

    def _keep_snapshot(self) -> None:
        if self.first_oom_snapshot is None:
            self.first_oom_snapshot = cuda_segments(self.device)

    def free(self, alloc: Allocation) -> None:
        if self._live.pop(id(alloc), None) is None:
            raise ValueError("double free or foreign allocation")
        self._allocated -= alloc.size
        self._requested -= alloc.requested
        alloc.tensor = None

    def stats(self) -> MemoryStats:
        free = max(0, self.capacity_bytes - self._allocated)
        return MemoryStats(
            capacity_bytes=self.capacity_bytes,
            allocated_bytes=self._allocated,
            requested_bytes=self._requested,
            free_bytes=free,
            largest_free_bytes=min(free, self._largest_free_block()),
            num_allocations=len(self._live),
            reserved_bytes=torch.cuda.memory_reserved(self.device),
        )

    def _largest_free_block(self) -> int:
        """The largest inactive block in this device's cache, or the never-reserved rest of the cap if larger."""
        segments = cuda_segments(self.device)
        inactive = [b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive"]
        reserved = sum(seg["total_size"] for seg in segments)
        return max([int(max(0.0, self._cap_bytes() - reserved)), *inactive])

    def _cap_bytes(self) -> float:
        return torch.cuda.get_per_process_memory_fraction(self.device) * \
            torch.cuda.get_device_properties(self.device).total_memory

    def extents(self) -> list[tuple[int, int, str | None]]:
        """The KV's own tensors, by address: what the cache holds for anything else is not the budget's."""
        return sorted((a.tensor.data_ptr(), a.size, a.owner) for a in self._live.values() if a.tensor is not None)

    def view(self, alloc: Allocation) -> torch.Tensor:
        assert alloc.tensor is not None
        return alloc.tensor

    def close(self) -> None:
        """The process's cap as it was before this memory: a later one (another engine, test or check) is not
        held to this budget."""
        torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)


def cuda_segments(device: torch.device | None = None) -> list[dict]:
    """torch.cuda.memory_snapshot() cut to what the report draws: each segment's blocks, in address order."""
    index = None if device is None else cuda_device(device).index
    return [{"address": seg["address"], "total_size": seg["total_size"], "device": seg.get("device"),
             "blocks": [{"size": b["size"], "state": b["state"]} for b in seg["blocks"]]}
            for seg in segments_only() if index is None or seg.get("device") in (None, index)]


def segments_only() -> list[dict]:
    """The allocator's segments, without its trace where the installed torch can leave it out (memory_snapshot's
    include_traces, in recent releases): under serve --record-memory-history every stats() (each /stats poll)
    converted the whole trace ring, up to RECORD_MAX_ENTRIES events, into Python on the engine's thread. An older
    torch has no such switch, and still converts it."""
    snapshot = torch.cuda.memory_snapshot
    if "include_traces" in inspect.signature(snapshot).parameters:
        return snapshot(include_traces=False)
    return snapshot()


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


def device_snapshot(device: str = "cuda") -> DeviceFigures:
    """What the device the engine runs on says: the PyTorch CUDA allocator and NVML, or None where the engine
    is not on a GPU."""
    if not (torch.cuda.is_available() and str(device).startswith("cuda")):
        return DeviceFigures()
    dev = cuda_device(device)
    stats = torch.cuda.memory_stats(dev)
    try:
        used = memory_info(nvml_index(dev.index)).used
    except Exception:  # NVML missing or refusing: the allocator's numbers still stand
        used = None
    return DeviceFigures(torch_allocated_bytes=stats.get("allocated_bytes.all.current", 0),
                         torch_reserved_bytes=stats.get("reserved_bytes.all.current", 0), device_used_bytes=used,
                         **{column: stats.get(key, 0) for column, key in ALLOCATOR_FIELDS.items()})


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


def device_note(device: str = "cuda") -> str:
    """One clear line on what device memory the run can see: the device it runs on, by its own index."""
    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        why = "no CUDA device" if not torch.cuda.is_available() else f"the run is on {device}"
        return f"{why}: KV memory is the arena's; PyTorch allocator and NVML figures are absent"
    dev = cuda_device(device)
    name = torch.cuda.get_device_name(dev)
    try:
        driver = nvml().nvmlSystemGetDriverVersion()
        return f"CUDA device {dev} ({name}); NVML driver {driver}"
    except Exception as e:
        return f"CUDA device {dev} ({name}); NVML unavailable ({type(e).__name__})"
