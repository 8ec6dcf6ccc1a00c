"""`fragbench allocator replay`: a real `torch.cuda.memory._snapshot()` pickle's device trace (recorded with
`torch.cuda.memory._record_memory_history`) replayed through the caching allocator emulator under one or more
PYTORCH_CUDA_ALLOC_CONF settings and a cap: peak reserved and allocated, segments, retries and the first OOM of
each, and how many of the trace's own segment events the emulator reproduced (same action and size, caused by
the same allocation or free).

A trace that began after the program's first allocations frees blocks it never saw allocated: those frees are
skipped and counted. An `oom` entry is the request that failed, replayed as one (the program caught it and went
on; the allocator's releases before it happened all the same). Frees take effect at `free_completed` (when the
block is reusable), or at `free_requested` in a trace that has no completions."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.allocconf import AllocConf
from engines.caching import AllocatorOOM, CachingAllocator
from engines.snapshot import ClassInPickle, load_data, write_snapshot

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
UNCAPPED = 2**62  # no --capacity: the emulated device never refuses a segment


class SnapshotError(ValueError):
    """A file that is not a torch.cuda.memory._snapshot() pickle with a device trace."""


@dataclass(frozen=True)
class Event:
    action: str  # alloc, free (completed, or requested in a trace without completions), or a segment action
    addr: int
    size: int
    stream: int


@dataclass(frozen=True)
class Trace:
    events: list[Event]
    device: int
    skipped: int  # entries of other kinds (oom, snapshot, free_requested beside completions, ...)


@dataclass(frozen=True)
class ReplayOOM:
    event_index: int
    requested_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    cached_free_bytes: int
    device_free_bytes: int


@dataclass(frozen=True)
class ReplayResult:
    alloc_conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    segments_max: int
    alloc_retries: int
    oom: ReplayOOM | None
    segment_events_trace: int  # the trace's own segment events
    segment_events_matched: int  # of those, reproduced by the emulator exactly
    unknown_frees: int  # frees of blocks the trace never showed allocated (recorded after them)
    failed_allocs: int

    def contract(self) -> dict:
        """The --json object: exactly the contract's fields."""
        return {"alloc_conf": self.alloc_conf, "peak_reserved_bytes": self.peak_reserved_bytes,
                "peak_allocated_bytes": self.peak_allocated_bytes, "segments_max": self.segments_max,
                "alloc_retries": self.alloc_retries, "oom": asdict(self.oom) if self.oom else None}


def dump_paths(path: Path, settings: int) -> list[Path]:
    """One dump per setting: FILE itself for one, FILE-1, FILE-2... (before its suffix) for several."""
    if settings == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(1, settings + 1)]


def load_trace(path: str | Path) -> Trace:
    """The busiest device's trace of a snapshot pickle, as replayable events."""
    try:
        with open(path, "rb") as f:
            data = load_data(f)
    except ClassInPickle as e:  # a pickle naming a class: never run, never a snapshot
        raise SnapshotError(str(e)) from None
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except Exception as e:
        raise SnapshotError(f"{path} is not a torch.cuda.memory._snapshot() pickle ({type(e).__name__})") from None
    traces = data.get("device_traces") if isinstance(data, dict) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{path} is not a torch.cuda.memory._snapshot() pickle (no device_traces)")
    device = max(range(len(traces)), key=lambda i: len(traces[i]), default=0)
    entries = traces[device] if traces else []
    if not entries:
        raise SnapshotError(f"{path} has no device trace: record one with "
                            "torch.cuda.memory._record_memory_history() before taking the snapshot")
    try:
        return _events(entries, device)
    except (KeyError, TypeError) as e:
        raise SnapshotError(f"{path}: a trace entry lacks {e}: not a memory snapshot's trace") from None


def _events(entries: list[dict], device: int) -> Trace:
    completes = any(e.get("action") == "free_completed" for e in entries)
    free_action = "free_completed" if completes else "free_requested"
    events, skipped = [], 0
    for e in entries:
        action = e["action"]
        if action == free_action:
            events.append(Event("free", e["addr"], e["size"], e.get("stream", 0)))
        elif action == "oom":  # a request that failed (and was caught): the allocator's retries still ran
            events.append(Event("oom", 0, e["size"], e.get("stream", 0)))
        elif action == "alloc" or action in SEGMENT_ACTIONS:
            events.append(Event(action, e["addr"], e["size"], e.get("stream", 0)))
        else:
            skipped += 1
    return Trace(events, device, skipped)


def replay(trace: Trace, capacity_bytes: int | None, conf: AllocConf, dump: Path | None = None) -> ReplayResult:
    """The trace's allocations and frees through a fresh emulator: its peaks, retries and first OOM; `dump`
    receives its final state as a snapshot pickle."""
    emitted: list = []
    alloc = CachingAllocator(capacity_bytes or UNCAPPED, conf, events=emitted)
    live: dict[int, object] = {}
    pending: Counter = Counter()  # the trace's segment events since the last allocation or free
    expected: list[Counter] = []  # per replayed allocation/free: the trace's segment events it caused
    produced: list[Counter] = []
    oom, unknown, failed, index = None, 0, 0, -1
    malloc, free = alloc.malloc, alloc.free
    for index, event in enumerate(trace.events):
        action = event.action
        if action == "alloc" or action == "oom":
            mark = len(emitted)
            try:
                block = malloc(event.size, event.stream)
                if action == "alloc":
                    live[event.addr] = block
                else:  # the program never held what failed for it: a success here is given back at once
                    free(block)
            except AllocatorOOM as e:
                failed += 1
                if oom is None:
                    i = e.info
                    oom = ReplayOOM(index, i.requested_bytes, i.reserved_bytes, i.allocated_bytes,
                                    i.cached_free_bytes, i.device_free_bytes)
            if pending or len(emitted) > mark:
                expected.append(pending)
                produced.append(Counter((a, s) for a, _, s, _ in emitted[mark:]))
                pending = Counter()
        elif action == "free":
            block = live.pop(event.addr, None)
            if block is None:
                unknown += 1
                continue
            mark = len(emitted)
            free(block)
            if pending or len(emitted) > mark:
                expected.append(pending)
                produced.append(Counter((a, s) for a, _, s, _ in emitted[mark:]))
                pending = Counter()
        else:
            pending[(action, event.size)] += 1
    total = sum(sum(c.values()) for c in expected) + sum(pending.values())
    matched = sum(sum((want & got).values()) for want, got in zip(expected, produced, strict=True))
    if dump is not None:
        write_snapshot(alloc, dump)
    stats = alloc.stats()
    return ReplayResult(conf.label, stats.peak_reserved_bytes, stats.peak_allocated_bytes, stats.peak_segments,
                        stats.alloc_retries, oom, total, matched, unknown, failed)
