"""The caching allocator emulator under random traces, settings, caps and devices (hypothesis): after every
allocation, free, second free and empty_cache the state keeps its invariants (engines/memory/audit.py: allocated
<= reserved <= the cap or the device, no block freed twice, every segment's blocks add up to it, the pools hold
exactly the free blocks), nothing raises but an OOM, and `allocator replay` of the same trace, as a snapshot
pickle through the CLI, exits 0 with the same peaks. A snapshot the replay cannot read exits 2 in one line.
benchmarks/allocator_fuzz.py runs 100,000 such events."""

import json
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.memory.audit import audit, exercise
from engines.memory.caching import CachingAllocator
from harness.cli import main

MiB = 2**20

confs = st.builds(
    lambda expandable, split, divisions, gc: ",".join(
        p for p in (expandable and "expandable_segments:True", split and f"max_split_size_mb:{split}",
                    divisions and f"roundup_power2_divisions:{divisions}",
                    gc and f"garbage_collection_threshold:{gc}") if p),
    st.booleans(), st.sampled_from([0, 20, 21, 40, 300]), st.sampled_from([0, 2, 4, 8]),
    st.sampled_from([0, 0.5, 0.8]))
sizes = st.one_of(st.integers(1, MiB), st.integers(MiB + 1, 10 * MiB), st.integers(10 * MiB, 300 * MiB))
ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 40), sizes, st.sampled_from([0, 0, 1])),
    st.tuples(st.just("free"), st.integers(0, 40)),
    st.tuples(st.just("empty_cache"))), max_size=120)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=confs, cap_mib=st.integers(1, 600), device=st.sampled_from([None, 1, 2, 1000]), trace=ops)
def test_random_traces_keep_the_invariants(conf, cap_mib, device, trace):
    cap = cap_mib * MiB
    alloc = CachingAllocator(cap, conf, device_bytes=None if device is None else device * cap)
    assert exercise(alloc, trace) == []


def snapshot_of(trace: list[tuple]) -> dict:
    """The trace as PyTorch records one: an alloc at a fresh address per block number, a free_completed of it."""
    entries, live, addr = [], {}, 1 << 40
    for op in trace:
        if op[0] == "alloc":
            addr += 1 << 30
            live[op[1]] = (addr, op[2], op[3])
            entries.append({"action": "alloc", "addr": addr, "size": op[2], "stream": op[3], "frames": []})
        elif op[0] == "free" and op[1] in live:
            a, size, stream = live.pop(op[1])
            entries.append({"action": "free_completed", "addr": a, "size": size, "stream": stream, "frames": []})
    return {"segments": [], "device_traces": [entries]}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(conf=confs, cap_mib=st.integers(1, 600), trace=ops)
def test_the_cli_replays_random_snapshots(tmp_path_factory, capsys, conf, cap_mib, trace):
    path = tmp_path_factory.mktemp("fuzz") / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot_of(trace)))
    if not any(op[0] == "alloc" for op in trace):
        return
    capsys.readouterr()
    assert main(["allocator", "replay", str(path), "--capacity", f"{cap_mib}MiB", "--device-memory", "80GiB",
                 "--alloc-conf", conf, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    alloc = CachingAllocator(cap_mib * MiB, conf, device_bytes=80 * 2**30)
    exercise(alloc, [op for op in trace if op[0] != "empty_cache"], check=False)
    stats = alloc.stats()
    assert (row["peak_reserved_bytes"], row["peak_allocated_bytes"]) == (stats.peak_reserved_bytes,
                                                                          stats.peak_allocated_bytes)


def test_the_audit_sees_a_broken_state():
    alloc = CachingAllocator(100 * MiB, "expandable_segments:True")
    kept = alloc.malloc(30 * MiB)
    alloc.free(alloc.malloc(5 * MiB))
    assert audit(alloc) == []
    alloc.reserved += 512
    assert any(w.startswith("reserved: counted") for w in audit(alloc))
    alloc.reserved -= 512
    alloc.large.remove(next(iter(alloc.large.free.values())))  # a free block dropped from its pool
    assert audit(alloc)
    kept.prev = kept  # a chain that loops
    assert audit(alloc)


BAD_ENTRIES = [
    ["not a dict"],
    [{"action": "alloc", "addr": 4096, "size": -5, "stream": 0}],
    [{"action": "alloc", "addr": "0x1000", "size": 512, "stream": 0}],
    [{"action": "alloc", "addr": 4096, "size": 512.5, "stream": 0}],
    [{"action": "alloc", "addr": 4096, "size": 512, "stream": None}],
    [{"addr": 4096, "size": 512}],
    [{"action": "alloc", "addr": 4096}],
]


@pytest.mark.parametrize("entries", BAD_ENTRIES)
def test_a_snapshot_it_cannot_read_exits_2_in_one_line(tmp_path, capsys, entries):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    try:
        code = main(["allocator", "replay", str(path)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err


values = st.one_of(st.integers(0, 2**48), st.integers(-5, 5), st.none(), st.text(max_size=3), st.booleans())
entries = st.lists(st.fixed_dictionaries(
    {"action": st.sampled_from(["alloc", "free_requested", "free_completed", "oom", "segment_alloc", "segment_free",
                                "segment_map", "segment_unmap", "snapshot", "user_defined"])},
    optional={"addr": st.one_of(values, st.sampled_from([4096, 8192])), "size": values, "stream": values}),
    max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(trace=entries, conf=confs)
def test_any_trace_replays_or_exits_2_in_one_line(tmp_path_factory, capsys, trace, conf):
    """Whatever the entries hold, the replay answers (0) or refuses the file in one line (2): never a traceback."""
    path = tmp_path_factory.mktemp("any") / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    capsys.readouterr()
    try:
        code = main(["allocator", "replay", str(path), "--capacity", "100MiB", "--alloc-conf", conf])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 0 or (code == 2 and len(err.splitlines()) == 1), err
