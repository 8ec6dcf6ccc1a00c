"""What `fragbench allocator replay` costs per trace event: the caching allocator emulator replaying a trace of
1,000,000 allocations and frees, beside a plain best-fit arena (engines/memory/arena.Arena, bookkeeping only) replaying
the same events, in one run. Goal: the emulator under 20 s for 1,000,000 events on one core.

Run by hand:  .venv/bin/python benchmarks/allocator_replay.py [--events 1000000] [--alloc-conf CONF]

The events: a serving-shaped mix of sizes (activations of a few KiB to a few MiB, KV buffers of 8-200 MiB that
live long), at most 2,000 live blocks, frees in random order; the same seed gives the same events. The emulator
replays them through engines/memory/snapshot_replay.replay (the CLI's own path, its segment-matching bookkeeping
included) without a cap; the arena serves them from a heap large enough never to fail.
"""

from __future__ import annotations

import argparse
import random
import time

from engines.memory.allocconf import parse_alloc_conf
from engines.memory.arena import Arena
from engines.memory.snapshot_replay import Event, Trace, replay

MiB = 2**20
SMALL = [512, 2048, 8192, 65_536, 300_000, MiB]
LARGE = [int(1.5 * MiB), 3 * MiB, 6 * MiB, 12 * MiB, 24 * MiB, 64 * MiB, 200 * MiB]


def events(n: int, seed: int = 0, max_live: int = 2000) -> list[Event]:
    rng = random.Random(seed)
    out, live, next_addr = [], [], 1 << 40
    while len(out) < n:
        if live and (len(live) >= max_live or rng.random() < 0.5):
            addr, size = live.pop(rng.randrange(len(live)))
            out.append(Event("free", addr, size, 0))
            continue
        size = rng.choice(SMALL) if rng.random() < 0.8 else rng.choice(LARGE)
        size += rng.randrange(0, 4096)
        out.append(Event("alloc", next_addr, size, 0))
        live.append((next_addr, size))
        next_addr += size + 4096
    return out


def arena_replay(evs: list[Event]) -> int:
    """The same events through a best-fit arena: the reference cost of placement without a cache."""
    arena = Arena(64 * 2**30, backing_device=None)
    live, peak = {}, 0
    for e in evs:
        if e.action == "alloc":
            live[e.addr] = arena.allocate(e.size)
            peak = max(peak, arena._allocated)
        else:
            arena.free(live.pop(e.addr))
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000, help="trace events (default: 1000000)")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the emulator (default: none)")
    args = p.parse_args()
    evs = events(args.events)
    t0 = time.perf_counter()
    result = replay(Trace(evs, 0, 0), None, parse_alloc_conf(args.alloc_conf))
    emulator_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    arena_peak = arena_replay(evs)
    arena_s = time.perf_counter() - t0
    print(f"{len(evs)} events")
    print(f"caching emulator ({result.alloc_conf}): {emulator_s:.2f} s ({emulator_s / len(evs) * 1e6:.1f} us/event), "
          f"peak reserved {result.peak_reserved_bytes / MiB:.0f} MiB, peak allocated "
          f"{result.peak_allocated_bytes / MiB:.0f} MiB, segments max {result.segments_max}")
    print(f"best-fit arena:   {arena_s:.2f} s ({arena_s / len(evs) * 1e6:.1f} us/event), peak allocated "
          f"{arena_peak / MiB:.0f} MiB")
    print(f"emulator / arena: {emulator_s / arena_s:.2f}x; goal: emulator < 20 s for 1,000,000 events: "
          f"{'met' if emulator_s < 20 * len(evs) / 1e6 else 'NOT met'}")


if __name__ == "__main__":
    main()
