"""`fragbench allocator replay` on snapshots built in torch.cuda.memory._snapshot()'s format (no GPU here): a
synthetic trace whose segment events come from the emulator itself must replay to the same events (plumbing: the
format, the loader, the replay), its segments checked against sizes worked by hand from the C++; the --json
contract holds, a file that is not a snapshot exits 2 in one line, and --dump is read by PyTorch's _memory_viz.
Hand-built traces show each segment event the emulator does not do alike named with the rule it breaks. The
snapshot `make gpu-check` records of hf serving on CUDA would show the emulator against the real allocator: none
has been recorded yet (no GPU so far), so that test skips, and nothing here compares the emulator with PyTorch's
own allocator."""

import json
import pickle
import random
import subprocess
import sys

import pytest

import engines.memory.snapshot_replay as ar
from engines.memory.allocconf import parse_alloc_conf
from engines.memory.caching import AllocatorOOM, CachingAllocator
from engines.memory.snapshot import snapshot
from engines.memory.snapshot_replay import dump_paths, load_trace, replay
from harness.cli import main
from tests.conftest import ROOT

MiB = 2**20
GPU_CHURN_FIXTURE = ROOT / "tests" / "fixtures" / "gpu_hf_churn_snapshot.pickle"
SIZES = [512, 3000, 200_000, MiB, int(1.5 * MiB), 3 * MiB, 9 * MiB, 12 * MiB, 30 * MiB]
# The segment each request of SIZES carves, worked by hand from CUDACachingAllocator.cpp: round_size (a multiple of
# 512 B), then get_allocation_size: at most kSmallSize (1 MiB) -> kSmallBuffer (2 MiB); under kMinLargeAlloc
# (10 MiB) -> kLargeBuffer (20 MiB); larger -> rounded up to kRoundLarge (2 MiB). Under expandable_segments a pool
# maps pages of those buffers' sizes instead: 2 MiB for the small pool, 20 MiB for the large one.
SEGMENT_OF = {512: 2 * MiB, 3000: 2 * MiB, 200_000: 2 * MiB, MiB: 2 * MiB, int(1.5 * MiB): 20 * MiB,
              3 * MiB: 20 * MiB, 9 * MiB: 20 * MiB, 12 * MiB: 12 * MiB, 30 * MiB: 30 * MiB}
PAGE_OF = {size: 2 * MiB if size <= MiB else 20 * MiB for size in SIZES}


def synthetic_snapshot(path, n_ops: int, capacity: int | None = None, conf: str = "", seed: int = 0) -> dict:
    """A snapshot pickle as PyTorch records one: every alloc and free with its segment events before it, as the
    emulator under `conf` and `capacity` made them; an OOM entry where it failed. Returns the allocator's stats,
    and each request served with the segment events it caused (`grew`: (request bytes, action, segment bytes))."""
    rng = random.Random(seed)
    events: list = []
    alloc = CachingAllocator(capacity or ar.UNCAPPED, conf, events=events, device_bytes=ar.UNCAPPED)  # the replay's
    trace, live, grew = [], [], []

    def flush(mark):
        trace.extend({"action": a, "addr": addr, "size": size, "stream": s, "frames": []}
                     for a, addr, size, s in events[mark:])

    for _ in range(n_ops):
        mark = len(events)
        if live and rng.random() < 0.45:
            block = live.pop(rng.randrange(len(live)))
            addr, requested = block.addr, block.requested  # a freed block merging with the one before moves
            trace.append({"action": "free_requested", "addr": addr, "size": requested, "stream": 0, "frames": []})
            alloc.free(block)
            flush(mark)
            trace.append({"action": "free_completed", "addr": addr, "size": requested, "stream": 0, "frames": []})
            continue
        size = rng.choice(SIZES)
        try:
            block = alloc.malloc(size)
        except AllocatorOOM:
            flush(mark)
            trace.append({"action": "oom", "addr": 0, "size": size, "stream": 0, "device_free": 0, "frames": []})
            continue
        flush(mark)
        grew += [(size, a, bytes_) for a, _, bytes_, _ in events[mark:] if a in ("segment_alloc", "segment_map")]
        trace.append({"action": "alloc", "addr": block.addr, "size": size, "stream": 0, "frames": []})
        live.append(block)
    data = snapshot(alloc, traces=trace)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    s = alloc.stats()
    return {"peak_reserved": s.peak_reserved_bytes, "peak_allocated": s.peak_allocated_bytes,
            "retries": s.alloc_retries, "ooms": s.ooms, "segment_events": sum(e["action"].startswith("segment")
                                                                              for e in trace), "grew": grew}


@pytest.mark.parametrize("conf,capacity", [("", None), ("", 80 * MiB), ("expandable_segments:True", 80 * MiB),
                                           ("max_split_size_mb:24,garbage_collection_threshold:0.6", 90 * MiB)])
def test_the_emulators_own_trace_replays_through_the_snapshot_format_and_its_segments_follow_the_cpp(
        tmp_path, conf, capacity):
    """Plumbing first: the trace's segment events and peaks are the emulator's own, so that they come back
    through the snapshot's format, the loader and the replay says nothing of whether the emulator's rules are
    PyTorch's. That the segments are is checked against figures worked by hand from the C++ (SEGMENT_OF,
    PAGE_OF): every segment a request carved, or every page run it mapped, is that request's size class."""
    path = tmp_path / "snap.pickle"
    truth = synthetic_snapshot(path, 1500, capacity, conf)
    if "expandable_segments:True" in conf:
        wrong = [(r, a, b) for r, a, b in truth["grew"] if a != "segment_map" or b % PAGE_OF[r]]
    else:
        wrong = [(r, a, b) for r, a, b in truth["grew"] if a != "segment_alloc" or b != SEGMENT_OF[r]]
    assert not wrong, f"segments against the C++ rule (request, event, bytes): {wrong[:10]}"
    # not vacuous: both pools grew, and a request of 10 MiB or more (rounded to 2 MiB, not a 20 MiB segment) did
    assert {PAGE_OF[r] for r, _, _ in truth["grew"]} == {2 * MiB, 20 * MiB}, truth["grew"]
    assert any(r >= 10 * MiB for r, _, _ in truth["grew"]), truth["grew"]
    from engines.memory.allocconf import parse_alloc_conf

    result = replay(load_trace(path), capacity, parse_alloc_conf(conf))
    assert truth["segment_events"] > 0
    assert result.segment_events_trace == truth["segment_events"] == result.segment_events_matched
    assert result.mismatches == ()
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes, result.alloc_retries) == (
        truth["peak_reserved"], truth["peak_allocated"], truth["retries"])
    assert result.unknown_frees == 0


def test_another_setting_changes_what_is_reproduced(tmp_path):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 1500, 80 * MiB)
    from engines.memory.allocconf import parse_alloc_conf

    other = replay(load_trace(path), 80 * MiB, parse_alloc_conf("expandable_segments:True"))
    assert other.segment_events_matched < other.segment_events_trace


def test_json_contract_and_first_oom(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 400)
    code = main(["allocator", "replay", str(path), "--capacity", "40MiB", "--alloc-conf", "expandable_segments:True",
                 "--alloc-conf", "max_split_size_mb:20", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["alloc_conf"] for r in rows] == ["expandable_segments:True", "max_split_size_mb:20"]
    for row in rows:
        assert set(row) == {"alloc_conf", "peak_reserved_bytes", "peak_allocated_bytes", "segments_max",
                            "alloc_retries", "oom"}
        # segments reach the cap exactly at most; expandable segments map whole pages after the cap's check, so
        # they may end less than a 20 MiB page past it
        if "expandable" in row["alloc_conf"]:
            assert row["peak_reserved_bytes"] < 40 * MiB + 20 * MiB
        else:
            assert row["peak_reserved_bytes"] <= 40 * MiB
        assert set(row["oom"]) == {"event_index", "requested_bytes", "reserved_bytes", "allocated_bytes",
                                   "cached_free_bytes", "device_free_bytes"}
        oom = row["oom"]
        assert oom["cached_free_bytes"] + oom["device_free_bytes"] + oom["allocated_bytes"] == max(
            40 * MiB, oom["reserved_bytes"])


def test_text_output_says_what_was_reproduced(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 300)
    assert main(["allocator", "replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "default: peak reserved" in out and "first OOM none" in out
    assert "segment events reproduced exactly:" in out


@pytest.mark.parametrize("content,why", [
    (b"not a pickle at all", "bad.pickle is not a torch.cuda.memory._snapshot() pickle (UnpicklingError)"),
    (pickle.dumps({"segments": []}), "bad.pickle is not a torch.cuda.memory._snapshot() pickle (no device_traces)"),
    (pickle.dumps([1, 2, 3]), "bad.pickle is not a torch.cuda.memory._snapshot() pickle (no device_traces)"),
    (pickle.dumps(ValueError("x")), "not a memory snapshot: the pickle names builtins.ValueError")],
    ids=["not-a-pickle", "no-device-traces", "a-list", "a-class-instance"])
def test_a_file_that_is_not_a_snapshot_exits_2_in_one_line(tmp_path, capsys, content, why):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    assert main(["allocator", "replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and len(err.splitlines()) == 1, err  # one line, never a traceback
    assert err.startswith("fragbench: error: ") and why in err, err


def test_a_bad_alloc_conf_exits_2_naming_the_key(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 50)
    assert main(["allocator", "replay", str(path), "--alloc-conf", "expandable_segment:True"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expandable_segment" in err


def test_dump_is_read_by_pytorchs_memory_viz(tmp_path, capsys):
    path, dump = tmp_path / "snap.pickle", tmp_path / "final.pickle"
    synthetic_snapshot(path, 600, 80 * MiB, "expandable_segments:True")
    assert main(["allocator", "replay", str(path), "--capacity", "80MiB", "--dump", str(dump),
                 "--alloc-conf", "expandable_segments:True"]) == 0
    capsys.readouterr()
    state = pickle.loads(dump.read_bytes())
    reserved = sum(s["total_size"] for s in state["segments"])
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(dump)], capture_output=True,
                         text=True, check=True).stdout
    assert f"segments: {len(state['segments'])}" in out
    from torch.cuda._memory_viz import _format_size

    assert f"total_reserved: {_format_size(reserved)}" in out
    assert reserved > 0


def test_several_settings_dump_one_file_each(tmp_path):
    assert dump_paths(tmp_path / "s.pickle", 1) == [tmp_path / "s.pickle"]
    assert dump_paths(tmp_path / "s.pickle", 2) == [tmp_path / "s-1.pickle", tmp_path / "s-2.pickle"]


# -- the trace's segment events against the emulator's, one for one, each disagreement with its rule
A, B, X = 0x7A0000000000, 0x7B0000000000, 0x7C0000000000  # addresses as the trace has them (never the emulator's)


def hand_trace(tmp_path, rows: list[tuple], recorded: dict | None = None) -> ar.Trace:
    """(action, addr, size) rows as PyTorch's device trace records them, through load_trace."""
    entries = [{"action": a, "addr": addr, "size": size, "stream": 0, "frames": []} for a, addr, size in rows]
    data = {"segments": [], "device_traces": [entries], **({ar.RECORDING_KEY: recorded} if recorded else {})}
    path = tmp_path / "hand.pickle"
    path.write_bytes(pickle.dumps(data))
    return load_trace(path)


def test_a_trace_the_rules_produce_has_no_mismatch(tmp_path):
    trace = hand_trace(tmp_path, [("segment_alloc", A, 2 * MiB), ("alloc", A, 1000), ("alloc", A + 1024, 3000),
                                  ("free_completed", A, 1000), ("segment_alloc", B, 20 * MiB),
                                  ("alloc", B, 5 * MiB), ("alloc", A, 700)])
    result = replay(trace, None, parse_alloc_conf(""))
    assert result.mismatches == ()
    assert result.segment_events_trace == result.segment_events_matched == 2


@pytest.mark.parametrize("request_bytes,trace_segment,emulator_segment,conf,rule", [
    (600_000, 20 * MiB, 2 * MiB, "", ar.SMALL_POOL_RULE),  # the trace put a <= 1 MiB request in the large pool
    (3 * MiB, 4 * MiB, 20 * MiB, "", ar.LARGE_POOL_RULE),
    (12 * MiB + 1, 12 * MiB, 14 * MiB, "", ar.LARGE_ROUNDED_RULE),
    (12 * MiB + 1, 16 * MiB, 14 * MiB, "", ar.ROUNDING_RULE),  # rounded up past 2 MiB: power-of-two divisions
    (9 * MiB, 20 * MiB, 10 * MiB, "roundup_power2_divisions:4", ar.ROUNDING_RULE),
])
def test_a_segment_of_another_size_names_the_rounding_or_pool_rule(tmp_path, request_bytes, trace_segment,
                                                                   emulator_segment, conf, rule):
    full = [("segment_alloc", X, 2 * MiB), ("alloc", X, MiB), ("alloc", X + MiB, MiB)]  # a small segment, full
    trace = hand_trace(tmp_path, [*full, ("segment_alloc", B, trace_segment), ("alloc", B, request_bytes)])
    result = replay(trace, None, parse_alloc_conf(conf))
    (mismatch,) = result.mismatches
    assert (mismatch.entry_index, mismatch.cause_action, mismatch.cause_bytes) == (3, "alloc", request_bytes)
    assert mismatch.trace == ("segment_alloc", trace_segment, 0)
    assert mismatch.emulator == ("segment_alloc", emulator_segment, 0)
    assert mismatch.rule == rule
    assert result.segment_events_matched == 1 < result.segment_events_trace
    assert rule in mismatch.describe() and "trace entry 3" in mismatch.describe()


@pytest.mark.parametrize("conf,rule", [("", ar.RELEASE_RULE),
                                       ("garbage_collection_threshold:0.5", ar.GC_RULE)])
def test_a_segment_free_the_emulator_did_not_do_names_the_release_rule(tmp_path, conf, rule):
    """The trace gave its cached 20 MiB segment back before carving a small one: with room under the cap
    the emulator keeps it (the request needs a segment of the other pool)."""
    trace = hand_trace(tmp_path, [("segment_alloc", A, 20 * MiB), ("alloc", A, 5 * MiB),
                                  ("free_completed", A, 5 * MiB), ("segment_free", A, 20 * MiB),
                                  ("segment_alloc", B, 2 * MiB), ("alloc", B, 1000)])
    result = replay(trace, None, parse_alloc_conf(conf))
    (mismatch,) = result.mismatches
    assert (mismatch.entry_index, mismatch.trace, mismatch.emulator) == (3, ("segment_free", 20 * MiB, 0), None)
    assert mismatch.rule == rule
    assert result.segment_events_trace == 3 and result.segment_events_matched == 2


def test_a_run_of_frees_between_requests_is_empty_cache(tmp_path):
    """Frees no new segment follows are torch.cuda.empty_cache(): replayed, they match; one the emulator's
    empty_cache would not do (the segment still holds a block) is named as that."""
    rows = [("segment_alloc", X, 2 * MiB), ("alloc", X, 1000), ("segment_alloc", A, 20 * MiB),
            ("alloc", A, 5 * MiB), ("free_completed", A, 5 * MiB), ("segment_free", A, 20 * MiB),
            ("free_completed", X, 1000)]
    result = replay(hand_trace(tmp_path, rows), None, parse_alloc_conf(""))
    assert result.mismatches == () and result.segment_events_matched == result.segment_events_trace == 3
    rows[5] = ("segment_free", X, 2 * MiB)  # the small segment, while its block is still allocated
    (mismatch,) = replay(hand_trace(tmp_path, rows), None, parse_alloc_conf("")).mismatches
    assert mismatch.trace == ("segment_free", 2 * MiB, 0) and mismatch.rule == ar.EMPTY_CACHE_RULE


def test_a_request_the_emulator_refuses_is_a_mismatch_of_the_release_path(tmp_path):
    trace = hand_trace(tmp_path, [("segment_alloc", A, 20 * MiB), ("alloc", A, 5 * MiB)])
    result = replay(trace, 10 * MiB, parse_alloc_conf(""))
    assert [(m.trace, m.emulator) for m in result.mismatches] == [
        (("segment_alloc", 20 * MiB, 0), None), (None, ("oom", 5 * MiB, 0))]
    assert {m.rule for m in result.mismatches} == {ar.RELEASE_RULE}
    # an OOM both sides met is no mismatch
    oom = hand_trace(tmp_path, [("oom", 0, 5 * MiB)])
    assert replay(oom, 10 * MiB, parse_alloc_conf("")).mismatches == ()


def test_expandable_segments_pages_are_named_as_such(tmp_path):
    trace = hand_trace(tmp_path, [("segment_alloc", A, 20 * MiB), ("alloc", A, 5 * MiB)])
    (mismatch,) = replay(trace, 80 * MiB, parse_alloc_conf("expandable_segments:True")).mismatches
    assert mismatch.emulator == ("segment_map", 20 * MiB, 0) and mismatch.rule == ar.EXPANDABLE_RULE


def test_a_recording_carries_its_cap_and_settings_to_the_replay(tmp_path):
    rows = [("segment_alloc", A, 20 * MiB), ("alloc", A, 5 * MiB), ("oom", 0, 30 * MiB)]
    trace = hand_trace(tmp_path, rows, {"capacity_bytes": 40 * MiB, "alloc_conf": "max_split_size_mb:24"})
    assert (trace.capacity_bytes, trace.alloc_conf) == (40 * MiB, "max_split_size_mb:24")
    result = ar.replay_recorded(trace)
    assert result.alloc_conf == "max_split_size_mb:24" and result.mismatches == ()  # 20 + 30 MiB passes 40
    assert replay(trace, None, parse_alloc_conf("")).mismatches  # uncapped, the emulator serves the 30 MiB


def test_recording_memory_history_needs_cuda():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        ar.MemoryRecording(ROOT / "never-written.pickle")


@pytest.mark.skipif(not GPU_CHURN_FIXTURE.exists(),
                    reason="no tests/fixtures/gpu_hf_churn_snapshot.pickle yet: `make gpu-check` records it on a "
                           "CUDA machine (its churn item)")
def test_the_hf_churn_recorded_on_cuda_replays_event_for_event():
    """The real allocator's segment events, serving hf on a GPU, are the emulator's one for one under the cap
    and settings the server ran with."""
    trace = load_trace(GPU_CHURN_FIXTURE)
    assert trace.capacity_bytes, "the fixture carries no cap: record it with serve --record-memory-history"
    result = ar.replay_recorded(trace)
    assert result.mismatches == (), "\n".join(m.describe() for m in result.mismatches[:40])
    assert result.segment_events_trace > 0 and result.unknown_frees == 0
    assert result.segment_events_matched == result.segment_events_trace
