"""`fragbench allocator replay` on snapshots built in torch.cuda.memory._snapshot()'s format (no GPU here): a
synthetic trace whose segment events come from the emulator itself must replay to the same events, the --json
contract holds, a file that is not a snapshot exits 2 in one line, and --dump is read by PyTorch's _memory_viz."""

import json
import pickle
import random
import subprocess
import sys

import pytest

from engines.caching import AllocatorOOM, CachingAllocator
from engines.snapshot import snapshot
from harness.allocreplay import dump_paths, load_trace, replay
from harness.cli import main

MiB = 2**20
SIZES = [512, 3000, 200_000, MiB, int(1.5 * MiB), 3 * MiB, 9 * MiB, 12 * MiB, 30 * MiB]


def synthetic_snapshot(path, n_ops: int, capacity: int | None = None, conf: str = "", seed: int = 0) -> dict:
    """A snapshot pickle as PyTorch records one: every alloc and free with its segment events before it, as the
    emulator under `conf` and `capacity` made them; an OOM entry where it failed. Returns the allocator's stats."""
    rng = random.Random(seed)
    events: list = []
    alloc = CachingAllocator(capacity or 2**62, conf, events=events)
    trace, live = [], []

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
        trace.append({"action": "alloc", "addr": block.addr, "size": size, "stream": 0, "frames": []})
        live.append(block)
    data = snapshot(alloc, traces=trace)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    s = alloc.stats()
    return {"peak_reserved": s.peak_reserved_bytes, "peak_allocated": s.peak_allocated_bytes,
            "retries": s.alloc_retries, "ooms": s.ooms, "segment_events": sum(e["action"].startswith("segment")
                                                                              for e in trace)}


@pytest.mark.parametrize("conf,capacity", [("", None), ("", 80 * MiB), ("expandable_segments:True", 80 * MiB),
                                           ("max_split_size_mb:24,garbage_collection_threshold:0.6", 90 * MiB)])
def test_a_trace_replays_to_its_own_segment_events(tmp_path, conf, capacity):
    path = tmp_path / "snap.pickle"
    truth = synthetic_snapshot(path, 1500, capacity, conf)
    from engines.allocconf import parse_alloc_conf

    result = replay(load_trace(path), capacity, parse_alloc_conf(conf))
    assert truth["segment_events"] > 0
    assert result.segment_events_trace == truth["segment_events"] == result.segment_events_matched
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes, result.alloc_retries) == (
        truth["peak_reserved"], truth["peak_allocated"], truth["retries"])
    assert result.unknown_frees == 0


def test_another_setting_changes_what_is_reproduced(tmp_path):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 1500, 80 * MiB)
    from engines.allocconf import parse_alloc_conf

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
        assert row["peak_reserved_bytes"] <= 40 * MiB
        assert set(row["oom"]) == {"event_index", "requested_bytes", "reserved_bytes", "allocated_bytes",
                                   "cached_free_bytes", "device_free_bytes"}
        oom = row["oom"]
        assert oom["cached_free_bytes"] + oom["device_free_bytes"] + oom["allocated_bytes"] == 40 * MiB


def test_text_output_says_what_was_reproduced(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    synthetic_snapshot(path, 300)
    assert main(["allocator", "replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "default: peak reserved" in out and "first OOM none" in out
    assert "segment events reproduced exactly:" in out


@pytest.mark.parametrize("content", [b"not a pickle at all", pickle.dumps({"segments": []}),
                                     pickle.dumps([1, 2, 3]), pickle.dumps(ValueError("x"))])
def test_a_file_that_is_not_a_snapshot_exits_2_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    assert main(["allocator", "replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.pickle" in err or "not a memory snapshot" in err


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
