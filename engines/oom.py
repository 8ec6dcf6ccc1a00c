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


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def tried_to_allocate(err: Exception) -> int:
    """The bytes a torch.cuda.OutOfMemoryError says it tried to allocate ("Tried to allocate 262.00 MiB"), or 0."""
    wanted = re.search(r"Tried to allocate ([\d.]+) ([KMG]i?B|B)", str(err))
    return int(float(wanted.group(1)) * UNITS[wanted.group(2)]) if wanted else 0
