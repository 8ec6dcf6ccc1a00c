"""What one `GET /metrics` costs at a real model's pool size, beside `GET /stats` (the reference: the same
snapshot, encoded as JSON), in one run. Goal: under 5 ms at a 100 GiB paged budget.

Run by hand:  .venv/bin/python benchmarks/metrics_cost.py --model models/tiny-llama [--budgets 16,60,100]

The pool is stats_cost.py's: the tiny model's paged engine with its KV policy swapped for a bookkeeping-only
pool of the budget's size in 2 MiB blocks (Llama-3-8B in bf16; 51,200 blocks at 100 GiB), four-fifths full.
A scrape is the engine thread's snapshot (`EngineThread._stats`), the collector's families over it (the
histograms filled by 10,000 requests, 1,000 failed allocations read once), and the text prometheus-client
encodes; median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from stats_cost import big_pool, timed

from engines.api.metrics import MetricsCollector
from engines.api.server import EngineThread
from engines.engine import TokenEvent
from engines.factory import EngineSpec, make_engine
from engines.memory.arena import OOMEvent
from engines.sequence import SamplingParams, Sequence


def filled(collector: MetricsCollector, engine, requests: int = 10_000, ooms: int = 1_000) -> None:
    """Histograms that have seen `requests` requests (their cost is their buckets, not their count) and an
    OOM list the failed-bytes counter has read."""
    for i in range(requests):
        seq = Sequence(f"r{i}", [3] * (1 + i % 500), SamplingParams(4), 2048, f"r{i}", arrival_s=time.monotonic())
        seq.token_ids.append(5)
        collector.requests.on_event(TokenEvent(seq, 5, True, request_done=True))
    engine.oom_events.extend((time.monotonic(), OOMEvent.classify(2**20, 2**21 * (i % 2), 2**19), {})
                             for i in range(ooms))
    collector.failed.update(engine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="16,60,100", help="GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    engine = make_engine(EngineSpec("paged", args.model, 16 * 2**20, max_seq_len=2048))
    thread = EngineThread(engine, lambda crash: None, lambda message: None)
    collector = MetricsCollector(Counter(), engine)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    filled(collector, engine)

    def scrape() -> bytes:
        collector.stats = thread._stats()
        return generate_latest(registry)

    print(f"{'budget':>8} {'blocks':>7} {'/stats':>10} {'/metrics':>10} {'encode':>9} {'page KiB':>9}")
    for gib in (int(x) for x in args.budgets.split(",")):
        big_pool(engine, gib)
        stats = timed(lambda: json.dumps(thread._stats()), args.repeats)
        metrics = timed(scrape, args.repeats)
        encode = timed(lambda: generate_latest(registry), args.repeats)
        print(f"{gib:>5} GiB {len(engine.kv.pool.blocks):>7} {1e3 * stats:>7.3f} ms {1e3 * metrics:>7.3f} ms "
              f"{1e3 * encode:>6.3f} ms {len(scrape()) / 1024:>9.1f}")
    engine.close()


if __name__ == "__main__":
    main()
