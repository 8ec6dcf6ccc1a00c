"""What one `GET /stats` costs the engine thread at a real model's pool size: the snapshot the samplers take
ten times a second, beside the same snapshot with its memory maps (`/stats?map=1`, what it cost on every call
before the maps were made on demand), in one run.

Run by hand:  .venv/bin/python benchmarks/stats_cost.py --model models/tiny-llama [--budgets 16,60,100]

A real model's paged pool: 16-token blocks of 128 KiB rows (Llama-3-8B in bf16), 2 MiB a block, so a 100 GiB
budget is 51,200 blocks. The tiny model's paged engine is built as the server builds it, then its KV policy is
swapped for a bookkeeping-only pool of that size (no bytes behind it: /stats reads the bookkeeping alone), up
to 256 sequences holding up to four-fifths of it, one in four sharing a prefix. Each budget times the engine
thread's own work for one snapshot (`EngineThread._stats`, then `_maps` for the full one) and the JSON a reply encodes,
median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engines.api.server import EngineThread
from engines.factory import EngineSpec, make_engine
from engines.kv import PagedKV
from engines.memory.arena import Arena
from engines.sequence import SamplingParams, Sequence

ROW_BYTES = 128 * 2**10  # Llama-3-8B, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B
BLOCK = 16
GiB = 2**30


def big_pool(engine, budget_gib: int, seqs: int = 256) -> None:
    """The engine's KV policy replaced by a bookkeeping pool of `budget_gib`, with `seqs` running sequences."""
    kv = PagedKV(Arena(budget_gib * GiB, backing_device=None), ROW_BYTES, 8192, BLOCK)
    engine.kv = engine.scheduler.kv = kv
    running = []
    for i in range(seqs):
        prefix = [7] * 512 if i % 4 == 0 else []
        s = Sequence(f"s{i}", prefix + [3 + i % 4000] * (600 + 37 * (i % 50)), SamplingParams(100), 8192, f"r{i}")
        if kv.pool.num_free - -(-s.num_tokens // BLOCK) < 0.2 * len(kv.pool.blocks):
            break  # a pool four-fifths full
        kv.allocate(s, s.num_tokens)
        running.append(s)
    engine.scheduler.running = running


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="16,60,100", help="GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    engine = make_engine(EngineSpec("paged", args.model, 16 * 2**20, max_seq_len=2048))
    thread = EngineThread(engine, lambda crash: None, lambda message: None)
    print(f"{'budget':>8} {'blocks':>7} {'/stats':>10} {'encode':>9} {'/stats?map=1':>13} {'encode':>9} {'map KiB':>8}")
    for gib in (int(x) for x in args.budgets.split(",")):
        big_pool(engine, gib)
        plain = timed(thread._stats, args.repeats)
        plain_json = timed(lambda: json.dumps(thread._stats()), args.repeats) - plain
        full = timed(lambda: {**thread._stats(), **thread._maps()}, args.repeats)
        body = {**thread._stats(), **thread._maps()}
        full_json = timed(lambda body=body: json.dumps(body), args.repeats)
        print(f"{gib:>5} GiB {len(engine.kv.pool.blocks):>7} {1e3 * plain:>8.3f} ms {1e3 * plain_json:>6.3f} ms "
              f"{1e3 * full:>10.3f} ms {1e3 * full_json:>6.2f} ms {len(json.dumps(body['memory_map'])) / 1024:>8.0f}")
    engine.close()


if __name__ == "__main__":
    main()
