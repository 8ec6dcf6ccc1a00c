"""The caching allocator emulator's state as `torch.cuda.memory._snapshot()` writes it, so PyTorch's own
`python -m torch.cuda._memory_viz stats FILE` reads it offline: one entry per segment (per mapped range of an
expandable segment, as PyTorch reports those), its blocks in address order with their states."""

from __future__ import annotations

import pickle
from pathlib import Path

from engines.memory.blocks import Block
from engines.memory.caching import CachingAllocator


def snapshot(alloc: CachingAllocator, device: int = 0, traces: list[dict] | None = None) -> dict:
    """{"segments": [...], "device_traces": [[...]]}: the allocator's segments now, and a trace if given."""
    segments = []
    for head in alloc.segment_heads():
        for run in _mapped_runs(head):
            segments.append(_segment(run, device, head.segment is not None))
    return {"segments": segments, "device_traces": [traces or []]}


def write_snapshot(alloc: CachingAllocator, path: str | Path, traces: list[dict] | None = None) -> Path:
    return write_state(snapshot(alloc, traces=traces), path)


# a dict: torch.cuda.memory._snapshot()'s own structure, pickled as PyTorch's _memory_viz reads it (no record of ours)
def write_state(state: dict, path: str | Path) -> Path:
    """A snapshot taken earlier (`snapshot()`'s dict: a server keeps the one of its first OOM) as its pickle."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(state, f)
    return path


class ClassInPickle(pickle.UnpicklingError):
    """The pickle names a class: it is not a snapshot, and it is not run."""


class _DataOnly(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: a pickle naming a class is not one (and is not run)."""

    def find_class(self, module, name):
        raise ClassInPickle(f"not a memory snapshot: the pickle names {module}.{name}")


def load_data(f) -> object:
    """A pickle's data, refusing (pickle.UnpicklingError) one that names a class: the snapshot readers' one loader."""
    return _DataOnly(f).load()


def read_snapshot(path: str | Path) -> dict:
    """A snapshot pickle read back as data alone (the report draws its segments); ValueError if it is not one."""
    try:
        with Path(path).open("rb") as f:
            data = load_data(f)
    except (pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{path}: not a memory snapshot ({e})") from None
    if isinstance(data, list):  # segments alone, as torch.cuda.memory_snapshot() returns them
        data = {"segments": data}
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise ValueError(f"{path}: not a memory snapshot (no segments)")
    return data


def _mapped_runs(head: Block) -> list[list[Block]]:
    runs: list[list[Block]] = []
    current: list[Block] = []
    b: Block | None = head
    while b is not None:
        if b.mapped:
            current.append(b)
        elif current:
            runs.append(current)
            current = []
        b = b.next
    if current:
        runs.append(current)
    return runs


def _segment(blocks: list[Block], device: int, expandable: bool) -> dict:
    out = [{"address": b.addr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
            "state": "active_allocated" if b.allocated else "inactive", "frames": []} for b in blocks]
    allocated = sum(b.size for b in blocks if b.allocated)
    return {"device": device, "address": blocks[0].addr, "total_size": sum(b.size for b in blocks),
            "stream": blocks[0].stream, "segment_type": "small" if blocks[0].small else "large",
            "segment_pool_id": (0, 0), "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b.requested for b in blocks if b.allocated), "is_expandable": expandable,
            "frames": [], "blocks": out}
