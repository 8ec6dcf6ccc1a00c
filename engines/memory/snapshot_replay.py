"""`fragbench allocator replay`: a real `torch.cuda.memory._snapshot()` pickle's device trace (recorded with
`torch.cuda.memory._record_memory_history`) replayed through the caching allocator emulator under one or more
PYTORCH_CUDA_ALLOC_CONF settings and a cap: peak reserved and allocated, segments, retries and the first OOM of
each, and the trace's own segment events set one for one against the emulator's, each disagreement named with
the allocator rule it most likely breaks (`segment_mismatches`).

A trace that began after the program's first allocations frees blocks it never saw allocated: those frees are
skipped and counted. An `oom` entry is the request that failed, replayed as one (the program caught it and went
on; the allocator's releases before it happened all the same). Frees take effect at `free_completed` (when the
block is reusable), or at `free_requested` in a trace that has no completions. A run of segment frees that no
allocation follows is `torch.cuda.empty_cache()` (inside a malloc, PyTorch frees segments only to make room for
the one it then maps, or before the OOM it then records): the replay empties the emulator's cache there too.

The cap is a `set_per_process_memory_fraction` cap on a device of `device_bytes` (the device's total memory: an
expandable segment's virtual range is sized from it, and pages map past the cap until it runs out, caching.py).

`serve --record-memory-history FILE` records such a pickle of a whole server (`MemoryRecording`), with the cap
its allocator ran under, the device's memory and its PYTORCH_CUDA_ALLOC_CONF beside the trace (`RECORDING_KEY`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from pathlib import Path

from engines.memory.allocconf import NO_LIMIT, AllocConf, parse_alloc_conf, torch_alloc_conf
from engines.memory.blocks import (
    LARGE_BUFFER_BYTES,
    MIN_LARGE_ALLOC_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_SIZE_BYTES,
    round_size,
    segment_size,
)
from engines.memory.caching import AllocatorOOM, CachingAllocator
from engines.memory.snapshot import ClassInPickle, load_data, write_snapshot, write_state

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
RELEASE_ACTIONS = ("segment_free", "segment_unmap")
# what an event does to the reserved bytes: two events of one kind at one step are one disagreement (of size,
# or of a segment against expandable segments' page), not two
KIND = {"segment_alloc": "grow", "segment_map": "grow", "segment_free": "shrink", "segment_unmap": "shrink",
        "oom": "oom"}
# no --capacity, no device size: neither refuses a segment. 64 TiB, more than any device holds, keeps an expandable
# segment's range (9/8 of it) and so every address under 2**53, where the snapshot viewer's numbers stay exact
UNCAPPED = 2**46
RECORDING_KEY = "fragbench_recording"  # beside segments and device_traces: {"capacity_bytes", "device_bytes", ...}
RECORD_MAX_ENTRIES = 2_000_000  # the trace's ring buffer: a long server keeps its last events, not all memory

# the rules of engines/memory/caching.py a disagreeing segment event points at
ROUNDING_RULE = "rounding to 512 B / roundup_power2_divisions"
SMALL_POOL_RULE = "small pool 2 MiB segments for <= 1 MiB"
LARGE_POOL_RULE = "large pool: 1-10 MiB requests carve a 20 MiB segment"
LARGE_ROUNDED_RULE = "larger requests: segment rounded to 2 MiB"
BEST_FIT_RULE = "best fit: the smallest cached block that fits, split when >= 512 B (small) or > 1 MiB (large) remain"
MAX_SPLIT_RULE = "max_split_size_mb: oversize blocks not split"
RELEASE_RULE = "on a failed cudaMalloc: free one oversize cached block, then every unsplit cached segment, retry"
GC_RULE = "garbage_collection_threshold"
EMPTY_CACHE_RULE = "torch.cuda.empty_cache(): every unsplit cached segment released between requests"
EXPANDABLE_RULE = "expandable_segments page mapping"


class SnapshotError(ValueError):
    """A file that is not a torch.cuda.memory._snapshot() pickle with a device trace."""


@dataclass(frozen=True)
class Event:
    action: str  # alloc, free (completed, or requested in a trace without completions), or a segment action
    addr: int
    size: int
    stream: int
    entry: int = -1  # its index in the snapshot's device trace, where a reader finds it


@dataclass(frozen=True)
class Trace:
    events: list[Event]
    device: int
    skipped: int  # entries of other kinds (oom, snapshot, free_requested beside completions, ...)
    capacity_bytes: int | None = None  # the cap its allocator ran under, where the recording noted it
    alloc_conf: str | None = None  # its PYTORCH_CUDA_ALLOC_CONF, where the recording noted it
    device_bytes: int | None = None  # the device's total memory, where the recording noted it


@dataclass(frozen=True)
class SegmentGroup:
    """One replayed step's segment events: the trace's own, recorded before its request, and the emulator's."""

    cause: Event  # the alloc, oom or free they came with; action empty_cache for a run of frees alone
    trace: tuple[Event, ...]  # an oom cause comes last: the trace's allocator refused the request
    emulated: tuple[tuple[str, int, int], ...]  # (action, size, stream); ("oom", ...) last: the emulator refused


@dataclass(frozen=True)
class SegmentMismatch:
    entry_index: int  # the trace entry of the segment event; of its request where the trace had none
    cause_action: str
    cause_bytes: int
    trace: tuple[str, int, int] | None  # (action, size, stream) the trace had (oom: refused); None: nothing
    emulator: tuple[str, int, int] | None  # what the emulator did instead (oom: refused); None: nothing
    rule: str

    def describe(self) -> str:
        return (f"trace entry {self.entry_index} ({self.cause_action} of {self.cause_bytes} B): trace "
                f"{_said(self.trace)}, emulator {_said(self.emulator)}; rule: {self.rule}")


@dataclass(frozen=True)
class ReplayOOM:
    event_index: int
    requested_bytes: int  # rounded, as PyTorch's OOM trace entry records the request (params.size())
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
    segment_events_matched: int  # of those, reproduced by the emulator exactly, in order
    unknown_frees: int  # frees of blocks the trace never showed allocated (recorded after them)
    failed_allocs: int
    mismatches: tuple[SegmentMismatch, ...] = ()  # in trace order: the first is the likeliest root cause

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
        trace = _events(entries, device)
    except KeyError as e:
        raise SnapshotError(f"{path}: a trace entry lacks {e}: not a memory snapshot's trace") from None
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"{path}: not a memory snapshot's trace ({e})") from None
    noted = data.get(RECORDING_KEY)
    if not isinstance(noted, dict):
        return trace
    capacity, conf, total = (_size(noted.get("capacity_bytes")), noted.get("alloc_conf"),
                             _size(noted.get("device_bytes")))
    return Trace(trace.events, device, trace.skipped, capacity, conf if isinstance(conf, str) else None, total)


def _size(value: object) -> int | None:
    """A noted byte count: a positive int, else none noted."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# `entry`: one of a PyTorch memory snapshot's own entries (a segment or a trace event), as torch pickled it
def _field(entry: dict, key: str, default: int | None = None) -> int:
    """An entry's address, size or stream: a non-negative int, as PyTorch writes them (a stream is a handle)."""
    value = entry.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"entry {key} {value!r} is not a non-negative integer")
    return value


def _events(entries: list[dict], device: int) -> Trace:
    strange = next((e for e in entries if not isinstance(e, dict)), None)
    if strange is not None:
        raise TypeError(f"an entry is a {type(strange).__name__}, not a dict")
    completes = any(e.get("action") == "free_completed" for e in entries)
    free_action = "free_completed" if completes else "free_requested"
    events, skipped = [], 0
    for i, e in enumerate(entries):
        action = e["action"]
        if action == free_action:
            events.append(Event("free", _field(e, "addr"), _field(e, "size"), _field(e, "stream", 0), i))
        elif action == "oom":  # a request that failed (and was caught): the allocator's retries still ran
            events.append(Event("oom", 0, _field(e, "size"), _field(e, "stream", 0), i))
        elif action == "alloc" or action in SEGMENT_ACTIONS:
            events.append(Event(action, _field(e, "addr"), _field(e, "size"), _field(e, "stream", 0), i))
        else:
            skipped += 1
    return Trace(events, device, skipped)


def replay(trace: Trace, capacity_bytes: int | None, conf: AllocConf, dump: Path | None = None,
           device_bytes: int | None = None) -> ReplayResult:
    """The trace's allocations and frees through a fresh emulator on a device of `device_bytes` (default: what the
    recording noted, else UNCAPPED): its peaks, retries and first OOM, and its segment events against the trace's;
    `dump` receives its final state as a snapshot pickle."""
    device = device_bytes or trace.device_bytes or UNCAPPED
    run = _Replay(CachingAllocator(capacity_bytes or UNCAPPED, conf, events=[], device_bytes=device))
    for index, event in enumerate(trace.events):
        run.step(index, event)
    run.flush_releases(None)  # frees at the very end: an empty_cache() the trace ends with
    total = sum(e.action in SEGMENT_ACTIONS for g in run.groups for e in g.trace) + len(run.pending)
    matched = sum(_matched(g) for g in run.groups)
    if dump is not None:
        write_snapshot(run.alloc, dump)
    stats = run.alloc.stats()
    return ReplayResult(conf.label, stats.peak_reserved_bytes, stats.peak_allocated_bytes, stats.peak_segments,
                        stats.alloc_retries, run.oom, total, matched, run.unknown, run.failed,
                        tuple(segment_mismatches(run.groups, conf)))


def replay_recorded(trace: Trace) -> ReplayResult:
    """A trace under the cap and allocator settings its recording noted (none noted: uncapped, PyTorch's)."""
    return replay(trace, trace.capacity_bytes, parse_alloc_conf(trace.alloc_conf), device_bytes=trace.device_bytes)


class _Replay:
    """One replay's state: the emulator, the trace's live blocks, and its segment events grouped by step."""

    def __init__(self, alloc: CachingAllocator):
        self.alloc, self.emitted = alloc, alloc.events
        self.live: dict[int, object] = {}
        self.pending: list[Event] = []  # the trace's segment events since the last replayed step
        self.groups: list[SegmentGroup] = []
        self.oom: ReplayOOM | None = None
        self.unknown = self.failed = 0

    def step(self, index: int, event: Event) -> None:
        if event.action in SEGMENT_ACTIONS:
            self.pending.append(event)
            return
        self.flush_releases(event)
        if event.action == "free":
            block = self.live.pop(event.addr, None)
            if block is None:
                self.unknown += 1
                return
            self._group(event, lambda: self.alloc.free(block))
        else:
            self._group(event, lambda: self._malloc(index, event))

    def flush_releases(self, event: Event | None) -> None:
        """Segment frees with no new segment after them, before a free or an allocation, or at the end: the
        program emptied the cache."""
        if self.pending and all(e.action in RELEASE_ACTIONS for e in self.pending) and (
                event is None or event.action in ("alloc", "free")):
            first = self.pending[0]
            self._group(Event("empty_cache", 0, 0, first.stream, first.entry), self.alloc.empty_cache)

    def _malloc(self, index: int, event: Event) -> bool:
        """Whether the emulator served the request."""
        try:
            block = self.alloc.malloc(event.size, event.stream)
        except AllocatorOOM as e:
            self.failed += 1
            if self.oom is None:
                i = e.info
                self.oom = ReplayOOM(index, i.rounded_bytes, i.reserved_bytes, i.allocated_bytes,
                                     i.cached_free_bytes, i.device_free_bytes)
            return False
        if event.action == "alloc":
            self.live[event.addr] = block
        else:  # the program never held what failed for it: a success here is given back at once
            self.alloc.free(block)
        return True

    def _group(self, cause: Event, act) -> None:
        """Run one step on the emulator; keep its segment events beside the trace's, and a refusal on either
        side as an oom after them (where PyTorch records it: after the releases its retries made)."""
        mark = len(self.emitted)
        served = act()
        made = [(a, size, stream) for a, _, size, stream in self.emitted[mark:]]
        if served is False:
            made.append(("oom", cause.size, cause.stream))
        trace = [*self.pending, cause] if cause.action == "oom" else self.pending
        if trace or made:
            self.groups.append(SegmentGroup(cause, tuple(trace), tuple(made)))
            self.pending = []


def _keys(group: SegmentGroup) -> list[tuple[str, int, int]]:
    return [(e.action, e.size, e.stream) for e in group.trace]


def _matched(group: SegmentGroup) -> int:
    """The trace's segment events the emulator did alike, in order (an OOM both sides met is no segment)."""
    want = _keys(group)
    matcher = SequenceMatcher(None, want, list(group.emulated), autojunk=False)
    return sum(want[b.a + k][0] in SEGMENT_ACTIONS for b in matcher.get_matching_blocks() for k in range(b.size))


def segment_mismatches(groups: list[SegmentGroup], conf: AllocConf) -> list[SegmentMismatch]:
    """The trace's segment events against the emulator's, one for one and in order within each step (so that
    one disagreement is one record, not a shift of every later event): each event the other side did not do
    alike, with the rule the sizes involved point at. Empty when the emulator reproduced the trace."""
    out: list[SegmentMismatch] = []
    for group in groups:
        want, got = _keys(group), list(group.emulated)
        refused = group.cause.action == "oom" or ("oom", group.cause.size, group.cause.stream) in got
        for tag, i1, i2, j1, j2 in SequenceMatcher(None, want, got, autojunk=False).get_opcodes():
            if tag != "equal":
                out.extend(_unmatched(group, group.trace[i1:i2], got[j1:j2], refused, conf))
    return out


def _unmatched(group: SegmentGroup, trace_events: tuple[Event, ...], emulated: list[tuple[str, int, int]],
               refused: bool, conf: AllocConf) -> list[SegmentMismatch]:
    """Within one disagreeing stretch, a trace event and an emulator event of one kind are one record (the same
    step made a segment of another size); the rest are events one side alone did."""
    left = list(emulated)
    out = []
    for event in trace_events:
        twin = next((e for e in left if KIND[e[0]] == KIND[event.action]), None)
        if twin is not None:
            left.remove(twin)
        trace = (event.action, event.size, event.stream)
        out.append(_mismatch(group.cause, event.entry, trace, twin, refused, conf))
    out.extend(_mismatch(group.cause, group.cause.entry, None, e, refused, conf) for e in left)
    return out


def _mismatch(cause: Event, entry: int, trace: tuple[str, int, int] | None, emulator: tuple[str, int, int] | None,
              refused: bool, conf: AllocConf) -> SegmentMismatch:
    rule = likely_rule(cause, trace, emulator, refused, conf)
    return SegmentMismatch(entry, cause.action, cause.size, trace, emulator, rule)


def likely_rule(cause: Event, trace: tuple[str, int, int] | None, emulator: tuple[str, int, int] | None,
                refused: bool, conf: AllocConf) -> str:
    """The allocator rule an event the two sides did not do alike most likely breaks, from the sizes: a
    request one side refused (`refused`: either did), or a segment freed by one side alone, is the release
    path; a page mapped otherwise is expandable segments'; a new segment of another size for a request is a
    rounding or pool rule; a new segment one side made where the other served the request from its cache is
    block reuse."""
    action = (trace or emulator)[0]
    if action == "oom" or (refused and action == "segment_alloc"):
        return _release_rule(cause, conf)
    if conf.expandable_segments or action in ("segment_map", "segment_unmap"):
        return EXPANDABLE_RULE
    if action == "segment_free":
        return _release_rule(cause, conf)
    if trace is not None and (emulator is not None or trace[1] != segment_size(round_size(cause.size, conf))):
        return _size_rule(cause.size, trace[1], conf)  # the trace's segment is not the one the rules give
    if conf.max_split_size_bytes < NO_LIMIT:
        return MAX_SPLIT_RULE
    return BEST_FIT_RULE


def _release_rule(cause: Event, conf: AllocConf) -> str:
    if cause.action in ("free", "empty_cache"):  # no request was being served: the program emptied the cache
        return EMPTY_CACHE_RULE
    return GC_RULE if conf.garbage_collection_threshold > 0 else RELEASE_RULE


def _size_rule(request_bytes: int, trace_segment_bytes: int, conf: AllocConf) -> str:
    """The rule that sets the segment for a request of this size: the emulator's size came from it, the
    trace's disagrees with it."""
    rounded = round_size(request_bytes, conf)
    if rounded != round_size(request_bytes, AllocConf()):  # power-of-two divisions set this request's size
        return ROUNDING_RULE
    if rounded <= SMALL_SIZE_BYTES:
        return SMALL_POOL_RULE
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_POOL_RULE
    whole_granules = -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
    if trace_segment_bytes != LARGE_BUFFER_BYTES and trace_segment_bytes > whole_granules:
        return ROUNDING_RULE  # the real allocator rounded the request up further than 512 B granules
    return LARGE_ROUNDED_RULE


def _said(event: tuple[str, int, int] | None) -> str:
    if event is None:
        return "nothing"
    if event[0] == "oom":
        return f"refused the {event[1]} B request (oom)"
    return f"{event[0]} of {event[1]} B on stream {event[2]}"


class MemoryRecording:
    """`serve --record-memory-history FILE`: PyTorch's trace of every allocator action from before the model
    touches CUDA (no stack traces: the replay reads none, and they would make the file large), written with the
    cap the allocator ran under and its settings when the server stops."""

    def __init__(self, path: Path, max_entries: int = RECORD_MAX_ENTRIES):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--record-memory-history records PyTorch's CUDA caching allocator; this machine "
                               "has no CUDA device")
        self.path = path
        self.capacity_bytes: int | None = None
        self.device_bytes: int | None = None
        torch.cuda.init()  # the device's allocator exists before it is told to record: one made later may not
        torch.cuda.memory._record_memory_history("all", context=None, max_entries=max_entries)

    def note_cap(self, device: str) -> None:
        """The per-process cap in force once the engine is built (--memory cuda sets it then; what was reserved
        before lies under it): the replay's capacity, as the allocator computes it from the fraction."""
        # torch.cuda's side, here alone: `fragbench allocator` (cli/allocator.py) imports this module without torch
        import torch

        from engines.memory.cuda import cuda_device

        dev = cuda_device(device)
        total_bytes = torch.cuda.mem_get_info(dev)[1]
        self.capacity_bytes = int(torch.cuda.get_per_process_memory_fraction(dev) * total_bytes)
        self.device_bytes = total_bytes

    def dump(self) -> Path:
        import torch

        state = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        conf = torch_alloc_conf() or ""
        state[RECORDING_KEY] = {"capacity_bytes": self.capacity_bytes, "device_bytes": self.device_bytes,
                                "alloc_conf": conf}
        return write_state(state, self.path)
