"""The randomized differential check of the caching allocator emulator at scale (tests/test_allocator_fuzz.py runs
a few hundred traces; this runs --events of them, 100,000 by default): random traces under random settings
(expandable segments, max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold), caps and
devices, each run twice: on the allocator with every invariant audited after every event
(engines/memory/audit.exercise), and through `allocator replay`'s own path
(engines/memory/snapshot_replay.replay), whose peaks must equal the first run's. Goal: no exception, no broken
invariant, no disagreement.

Run by hand:  .venv/bin/python benchmarks/allocator_fuzz.py [--events 100000] [--seed 0]
Prints one line per finding (at most 20) and a summary; exits 1 on any finding.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback

from engines.memory.allocconf import parse_alloc_conf
from engines.memory.audit import exercise
from engines.memory.caching import CachingAllocator
from engines.memory.snapshot_replay import Event, Trace, replay

MiB = 2**20
GiB = 2**30


def random_conf(rng: random.Random) -> str:
    parts = []
    if rng.random() < 0.6:
        parts.append("expandable_segments:True")
    if rng.random() < 0.5:
        parts.append(f"max_split_size_mb:{rng.choice([20, 21, 40, 100, 300])}")
    if rng.random() < 0.3:
        parts.append(f"roundup_power2_divisions:{rng.choice([2, 4, 8])}")
    if rng.random() < 0.3:
        parts.append(f"garbage_collection_threshold:{rng.choice([0.5, 0.7, 0.9])}")
    return ",".join(parts)


def random_ops(rng: random.Random, n: int, cap: int) -> list[tuple]:
    """Allocations of all three size classes (the largest up to the cap), frees of random live blocks (and of
    freed ones: a second free), a few empty_cache calls, on two streams."""
    ops: list[tuple] = []
    for i in range(n):
        r = rng.random()
        if r < 0.5:
            k = rng.random()
            size = (rng.randrange(1, MiB + 1) if k < 0.4 else rng.randrange(MiB, 10 * MiB) if k < 0.7
                    else rng.randrange(10 * MiB, max(11 * MiB, cap)))
            ops.append(("alloc", i, size, rng.choice([0, 0, 0, 1])))
        elif r < 0.97:
            ops.append(("free", rng.randrange(i + 1)))
        else:
            ops.append(("empty_cache",))
    return ops


def as_trace(ops: list[tuple]) -> Trace:
    """The ops as a device trace (empty_cache calls left out: a trace shows them as segment frees alone)."""
    events, live = [], {}
    for i, op in enumerate(ops):
        if op[0] == "alloc":
            live[op[1]] = Event("alloc", (i + 1) << 32, op[2], op[3], i)
            events.append(live[op[1]])
        elif op[0] == "free" and op[1] in live:
            e = live.pop(op[1])
            events.append(Event("free", e.addr, e.size, e.stream, i))
    return Trace(events, 0, 0)


def one(rng: random.Random, n: int) -> tuple[str, list[str], int]:
    conf = random_conf(rng)
    cap = rng.choice([2, 10, 30, 100, 300, 1000]) * MiB + rng.randrange(0, 4 * MiB)
    device = rng.choice([None, cap, 2 * cap, 80 * GiB])
    ops = random_ops(rng, n, cap)
    label = f"conf {conf or 'default'!r}, cap {cap} B, device {device}"
    alloc = CachingAllocator(cap, conf, device_bytes=device)
    found = exercise(alloc, ops)
    plain = [op for op in ops if op[0] != "empty_cache"]
    again = CachingAllocator(cap, conf, device_bytes=device)
    exercise(again, plain, check=False)
    result = replay(as_trace(plain), cap, parse_alloc_conf(conf), device_bytes=device or cap)
    s = again.stats()
    if (result.peak_reserved_bytes, result.peak_allocated_bytes) != (s.peak_reserved_bytes, s.peak_allocated_bytes):
        found.append(f"replay's peaks {result.peak_reserved_bytes}/{result.peak_allocated_bytes} B, the "
                     f"allocator's {s.peak_reserved_bytes}/{s.peak_allocated_bytes} B")
    return label, found, alloc.stats().ooms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000, help="events in all (default: 100000)")
    ap.add_argument("--per-trace", type=int, default=300, help="events per trace (default: 300)")
    ap.add_argument("--seed", type=int, default=0, help="the random seed (default: 0)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    began, done, traces, ooms, findings = time.perf_counter(), 0, 0, 0, []
    while done < args.events:
        n = min(args.per_trace, args.events - done)
        try:
            label, found, oom_count = one(rng, n)
        except Exception:  # a crash is the finding this looks for: keep going, report it
            findings.append(f"trace {traces}: raised\n{traceback.format_exc()}")
        else:
            ooms += oom_count
            findings.extend(f"trace {traces} ({label}): {f}" for f in found)
        done += n
        traces += 1
    for f in findings[:20]:
        print(f)
    print(f"{done} events in {traces} traces, {ooms} OOMs answered, {len(findings)} findings, "
          f"{time.perf_counter() - began:.1f} s")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
