"""expandable_segments:True under a `set_per_process_memory_fraction` cap, as c10/cuda/CUDACachingAllocator.cpp has
it (current main, cross-read with commit 001074d25084), each rule on the minimal trace that tells it apart. A trace
is `aN=SIZE` (allocate block N) and `fN` (free it), replayed through `allocator replay`'s own path. The expected
figures are worked out by hand from the C++ lines each test cites; the device is an 80 GiB GPU (its size only sets
the virtual range, 90 GiB, which no trace here comes near)."""

import pickle

import pytest

from engines.memory.allocconf import parse_alloc_conf
from engines.memory.caching import CachingAllocator
from engines.memory.snapshot_replay import Event, Trace, replay
from harness.cli import main

MiB = 2**20
GiB = 2**30
DEVICE_BYTES = 80 * GiB
EXPANDABLE = "expandable_segments:True"


def size_of(text: str) -> int:
    return int(float(text.removesuffix("MiB")) * MiB) if text.endswith("MiB") else int(text)


def trace_of(text: str) -> Trace:
    """`a0=12MiB a1=10MiB f0` as a device trace: block N at a fake address of its own."""
    events, sizes = [], {}
    for i, word in enumerate(text.split()):
        n = int(word[1:].split("=")[0])
        if word[0] == "a":
            sizes[n] = size_of(word.split("=")[1])
            events.append(Event("alloc", 0x1000 * (n + 1), sizes[n], 0, i))
        else:
            events.append(Event("free", 0x1000 * (n + 1), sizes[n], 0, i))
    return Trace(events, 0, 0)


def replayed(text: str, capacity: int, conf: str):
    return replay(trace_of(text), capacity, parse_alloc_conf(conf), device_bytes=DEVICE_BYTES)


def test_the_cap_is_checked_once_before_pages_map():
    """alloc_block: `if (set_fraction && total_allocated_memory + size > allowed_memory_maximum)` with `size =
    p.alloc_size`, before `try_allocate_expandable_block`; map_block and ExpandableSegment::map fail only when
    cuMemCreate does (the device is out). Cap 30 MiB: a0=12MiB passes 0 + 12 <= 30 and maps one 20 MiB page
    (a0 [0, 12), free [12, 20)); a1=10MiB finds no cached block of 10 MiB, passes 20 + 10 <= 30, and
    find_expandable_block starts at the free [12, 20) before the unmapped range: 8 MiB < 10, so map_block maps the
    next page. Reserved 40 MiB, no OOM. Without expandable segments the same trace reserves 12 + 10 MiB."""
    expandable = replayed("a0=12MiB a1=10MiB", 30 * MiB, EXPANDABLE)
    assert (expandable.peak_reserved_bytes, expandable.oom) == (40 * MiB, None)
    default = replayed("a0=12MiB a1=10MiB", 30 * MiB, "")
    assert (default.peak_reserved_bytes, default.oom) == (22 * MiB, None)


def test_the_virtual_range_is_the_devices_and_sets_best_fit():
    """ExpandableSegment: `max_handles_ = numSegments(prop.totalGlobalMem + prop.totalGlobalMem / 8)`, not the
    cap's; get_free_block takes, among expandable blocks, the one whose `expandable_size` (its size plus the
    unmapped range after it) is least. Cap 100 MiB: a0=30MiB maps [0, 40), a1=10MiB takes [30, 40), a2=58MiB maps
    [40, 100) (40 + 58 <= 100) leaving a free [98, 100); f0 frees [0, 30). a3=1.5MiB (large pool): the 2 MiB block
    at 98 MiB has the rest of the 90 GiB range after it, so the 30 MiB hole (30 + nothing unmapped) is the better
    fit: a3 at [0, 1.5). a4=29MiB finds no 29 MiB block (28.5 and 2 cached), 100 + 30 > 100, the last retry unmaps
    no whole page: OOM, 100 MiB reserved, 69.5 MiB allocated. A 112.5 MiB range (9/8 of the cap) would have put a3
    at 98 MiB (2 + 20 unmapped < 30) and a4 in the hole."""
    result = replayed("a0=30MiB a1=10MiB a2=58MiB f0 a3=1.5MiB a4=29MiB", 100 * MiB, EXPANDABLE)
    assert result.oom is not None and result.oom.event_index == 5
    assert (result.oom.requested_bytes, result.oom.reserved_bytes, result.oom.allocated_bytes) == (
        29 * MiB, 100 * MiB, int(69.5 * MiB))
    assert result.alloc_retries == 1
    alloc = CachingAllocator(100 * MiB, EXPANDABLE, device_bytes=DEVICE_BYTES)
    a0 = alloc.malloc(30 * MiB)
    alloc.malloc(10 * MiB)
    alloc.malloc(58 * MiB)
    hole = a0.addr
    alloc.free(a0)
    assert alloc.malloc(int(1.5 * MiB)).addr == hole


def test_the_oversize_release_skips_expandable_blocks():
    """release_available_cached_blocks: the search sends a found `(*it)->expandable_segment_` to the several-blocks
    path, whose loop releases only `if (!(*cur)->expandable_segment_)`; release_block asserts it never sees one.
    expandable_segments:True,max_split_size_mb:21, cap 100 MiB: a0=30MiB maps [0, 40), a1=10MiB takes [30, 40),
    f0 leaves a free 30 MiB expandable block. a2=70MiB: 40 + 70 > 100; the oversize release skips that block
    (nothing released, false); the last retry unmaps page [0, 20) (the block's one whole page), 20 + 70 <= 100,
    and a2 maps four pages after a1: reserved 20 + 80 = 100 MiB, no OOM."""
    result = replayed("a0=30MiB a1=10MiB f0 a2=70MiB", 100 * MiB, f"{EXPANDABLE},max_split_size_mb:21")
    assert (result.peak_reserved_bytes, result.oom, result.alloc_retries) == (100 * MiB, None, 1)


def test_a_freed_expandable_segment_is_never_released_as_a_whole_block(tmp_path, capsys):
    """The trace that crashed the CLI (IndexError in Pool.remove): a0=40MiB maps [0, 40); f0; a1=100MiB: 40 + 100 >
    100, the oversize release skips the expandable block, the last retry unmaps both pages, the segment left with
    nothing mapped is released whole (release_expandable_segment), 0 + 100 <= 100, and a new segment maps five
    pages: 100 MiB reserved, no OOM."""
    conf = f"{EXPANDABLE},max_split_size_mb:21"
    result = replayed("a0=40MiB f0 a1=100MiB", 100 * MiB, conf)
    assert (result.peak_reserved_bytes, result.oom, result.alloc_retries) == (100 * MiB, None, 1)
    path = tmp_path / "snap.pickle"
    entries = [{"action": "alloc" if e.action == "alloc" else "free_completed", "addr": e.addr, "size": e.size,
                "stream": 0, "frames": []} for e in trace_of("a0=40MiB f0 a1=100MiB").events]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    assert main(["allocator", "replay", str(path), "--capacity", "100MiB", "--device-memory", "80GiB",
                 "--alloc-conf", conf]) == 0
    assert "first OOM none" in capsys.readouterr().out


def test_the_cli_says_when_expandable_segments_pass_the_cap(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    entries = [{"action": "alloc", "addr": e.addr, "size": e.size, "stream": 0, "frames": []}
               for e in trace_of("a0=12MiB a1=10MiB").events]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    assert main(["allocator", "replay", str(path), "--capacity", "30MiB", "--alloc-conf", "",
                 "--alloc-conf", EXPANDABLE]) == 0
    out = capsys.readouterr().out
    assert "default: peak reserved 22" in out
    assert "reserved 10.00 MiB past the cap" in out


@pytest.mark.parametrize("conf,request_bytes,rounded", [("", 3000, 3072),
                                                        ("roundup_power2_divisions:4", 5 * MiB + 1, 6 * MiB)])
def test_the_oom_records_the_rounded_request(conf, request_bytes, rounded):
    """malloc's OOM: `record_trace(TraceEntry::OOM, device_free, params.size(), ...)`, and params' size is
    `round_size(orig_size)`. 3000 B: 512 B granules, 3072. 5 MiB + 1 B under four divisions: between 4 and 8 MiB
    the steps are 1 MiB, 6 MiB. Both need a segment (2 MiB, 20 MiB) a 1 MiB cap cannot hold."""
    result = replay(Trace([Event("alloc", 0x1000, request_bytes, 0, 0)], 0, 0), MiB, parse_alloc_conf(conf))
    assert result.oom is not None and result.oom.requested_bytes == rounded
