"""What every engine does with a failed KV allocation: the choices it may make, the state it records, and
the crash a naive server meets. Shared by the scheduled engines and the naive ones."""

from __future__ import annotations

import re
from typing import Literal

from engines.memory.arena import OOMEvent
from engines.sequence import Sequence

# reject: the request fails; crash: the engine goes down; wait: the request waits (or is preempted) and
# retries once memory frees, as a scheduler that finds free bytes but no extent would do
OnOOM = Literal["reject", "crash", "wait"]
FRAGMENTATION_MAPS = 5  # memory maps kept at fragmentation OOMs (each is every extent of the arena)


def oom_context(running: list[Sequence], waiting: int, allocated_bytes: int, capacity_bytes: int) -> dict:
    """What an engine looked like when an allocation failed: every engine records the same fields."""
    return {"running": len(running), "waiting": waiting, "live_tokens": sum(s.num_tokens for s in running),
            "kv_usage": allocated_bytes / (capacity_bytes or 1)}


class EngineCrash(RuntimeError):
    """An allocation failed under `--on-oom crash`: the engine goes down as a naive server would."""

    def __init__(self, event: OOMEvent):
        super().__init__(f"engine crashed on a KV allocation: {event.cause}, requested {event.requested_bytes} B")
        self.event = event


UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}  # c10's format_size: two decimals
SEGMENT_GRANULE_BYTES = 2 * 2**20  # every segment the allocator asks the device for is whole 2 MiB


def segment_asked(err: Exception) -> int:
    """The segment a torch.cuda.OutOfMemoryError says the allocator tried to allocate ("Tried to allocate 20.00
    MiB"), or 0. That is the segment it asked the device for (2 MiB for a request of 1 MiB or less, 20 MiB for one
    up to 10 MiB, the request rounded up to 2 MiB above), not the request: a 3 MiB activation reads "20.00 MiB".
    Printed in GiB it is rounded to 0.01 GiB; the low end of that, in whole 2 MiB, is taken."""
    wanted = re.search(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB)", str(err))
    if not wanted:
        return 0
    printed, unit = float(wanted.group(1)), UNITS[wanted.group(2)]
    low = (printed - 0.005) * unit if unit == UNITS["GiB"] else printed * unit
    return max(SEGMENT_GRANULE_BYTES, -(-int(low) // SEGMENT_GRANULE_BYTES) * SEGMENT_GRANULE_BYTES)
