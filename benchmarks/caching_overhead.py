"""What `--memory caching` costs an engine's step: the same engine serving the same requests on the arena and on the
caching allocator emulator (engines/memory/caching_memory.py), side by side in one run, at the default bench's KV budget
(16 MiB) on the tiny model. Goal: the emulator costs at most 5 % of a step.

Run by hand:  .venv/bin/python benchmarks/caching_overhead.py [--model models/tiny-llama] [--rounds 3]

Engines: paged (one pool allocation: the emulator is asked for stats alone), static-oracle (one buffer per request)
and growth (a buffer re-allocated as its sequence fills: the most allocator calls per step). static (max) is left
out: at max_seq_len 2048 its 8 MiB reservation asks the allocator for a 20 MiB segment, which a 16 MiB cap never
holds, so under --memory caching it serves nothing to time. The requests: 48 of 48-256 tokens (prompt + output:
every contiguous buffer <= 1 MiB, the small pool), at most 8 running: both memories serve the same requests in the
same steps, with no OOM (the table prints both counts).

Per engine and memory: the mean step time (best of --rounds, arena and caching alternated so a slow spell of the
machine hits both), and the time spent inside the KV memory's own calls (allocate, free, stats, free_bytes_below,
rounded, max_units), measured around each call: the emulator's cost with the model's compute left out.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engines.engine import Request
from engines.factory import EngineSpec, make_engine
from engines.memory.allocstats import kv_memory
from engines.sequence import SamplingParams

MiB = 2**20
ENGINES = ("paged", "static-oracle", "growth")
MEMORIES = ("arena", "caching")
BUDGET_BYTES = 16 * MiB  # the default bench's --kv-budget
MAX_NUM_SEQS = 8  # at most 8 buffers of <= 1 MiB live: no OOM on either memory, the same steps on both
MEMORY_CALLS = ("allocate", "free", "stats", "free_bytes_below", "rounded", "max_units")


def requests(n: int = 48, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): prompt + output <= 256 tokens, 4 KiB a token on the tiny model: <= 1 MiB."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len, max_tokens = rng.randint(16, 160), rng.randint(32, 96)
        out.append(([(31 * i + 7 * j) % 4000 + 3 for j in range(prompt_len)], max_tokens))
    return out


class CallTimer:
    """Seconds spent inside a memory's public calls: each wrapped on the instance, the class left alone."""

    def __init__(self, memory):
        self.seconds = 0.0
        for name in MEMORY_CALLS:
            setattr(memory, name, self._timed(getattr(memory, name)))

    def _timed(self, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def serve(engine, reqs: list[tuple[list[int], int]], tag: str) -> tuple[int, float, int]:
    """Steps, seconds and OOMs of serving every request at once (admitted as memory allows: churn)."""
    steps0, ooms0 = engine.steps, len(engine.oom_events)
    engine.sink = lambda event: None
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(Request(f"{tag}-{i}", prompt, SamplingParams(max_tokens, ignore_eos=True), 1))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return engine.steps - steps0, time.perf_counter() - start, len(engine.oom_events) - ooms0


def measure(model: str, rounds: int) -> dict[tuple[str, str], dict]:
    reqs = requests()
    engines = {(e, m): make_engine(EngineSpec(e, model, BUDGET_BYTES, max_seq_len=2048, prefix_caching=False,
                                              max_num_seqs=MAX_NUM_SEQS, memory=m))
               for e in ENGINES for m in MEMORIES}
    timers = {key: CallTimer(kv_memory(engine)) for key, engine in engines.items()}
    for engine in engines.values():
        serve(engine, reqs[:2], "warm")  # warm-up: first-call costs out of the timed rounds
    best: dict[tuple[str, str], dict] = {}
    for round_ in range(rounds):
        for key, engine in engines.items():  # arena and caching of one engine back to back, every round
            timers[key].seconds = 0.0
            steps, seconds, ooms = serve(engine, reqs, str(round_))
            row = {"steps": steps, "step_s": seconds / steps, "memory_s": timers[key].seconds / steps, "ooms": ooms}
            if key not in best or row["step_s"] < best[key]["step_s"]:
                best[key] = row
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-llama", help="model directory (default: models/tiny-llama)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and memory (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    best = measure(args.model, args.rounds)
    print(f"KV budget {BUDGET_BYTES // MiB} MiB, {len(requests())} requests, torch threads {args.threads}, "
          f"best of {args.rounds} rounds")
    print(f"{'engine':<15}{'memory':<9}{'steps':>7}{'OOMs':>6}{'step ms':>10}{'in memory ms':>14}{'memory share':>14}"
          f"{'vs arena':>10}")
    for engine in ENGINES:
        arena = best[(engine, "arena")]
        for memory in MEMORIES:
            r = best[(engine, memory)]
            print(f"{engine:<15}{memory:<9}{r['steps']:>7}{r['ooms']:>6}{1e3 * r['step_s']:>10.3f}"
                  f"{1e3 * r['memory_s']:>14.4f}{100 * r['memory_s'] / r['step_s']:>13.2f}%"
                  f"{100 * (r['step_s'] / arena['step_s'] - 1):>+9.1f}%")
    worst = max((best[(e, "caching")]["memory_s"] - best[(e, "arena")]["memory_s"]) / best[(e, "arena")]["step_s"]
                for e in ENGINES)
    print(f"the emulator's own cost beyond the arena's, at most {100 * worst:.2f} % of a step; goal <= 5 %: "
          f"{'met' if worst <= 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
