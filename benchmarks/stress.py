"""`make stress`: the long forms of the reliability checks, with the figures they must keep at zero.

- a cancel storm of 1,000 requests (half cut at random tokens) against each in-house engine;
- 2,000 random request bodies against the paged server;
- a bench run in which every engine is SIGKILLed mid-churn (and hf also OOM-crashes), restarted, measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd

from harness.run.servers import start_server
from harness.run.storm import cancel_storm

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "tiny-llama")


def stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats", timeout=30) as r:
        return json.load(r)


def wait_drained(url: str) -> dict:
    import time

    for _ in range(100):
        s = stats(url)
        if s["allocated_bytes"] == 0 and s["running"] == 0:
            break
        time.sleep(0.2)
    return s


def random_body(rng: random.Random) -> bytes:
    values = [None, True, "x" * rng.randrange(30), rng.randrange(-10, 5000), rng.random() * 3 - 1,
              [rng.randrange(-5, 5000) for _ in range(rng.randrange(10))], {"a": 1}, ["hi", 3]]
    keys = ["prompt", "max_tokens", "n", "stream", "temperature", "top_p", "seed", "ignore_eos", "model", "zzz"]
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    body = {k: rng.choice(values) for k in rng.sample(keys, rng.randrange(len(keys)))}
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 32)
    return json.dumps(body).encode()


def fuzz(url: str, count: int, seed: int) -> int:
    rng, status_5xx = random.Random(seed), 0
    for _ in range(count):
        req = urllib.request.Request(f"{url}/v1/completions", random_body(rng), {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except urllib.error.HTTPError as e:
            status_5xx += e.code >= 500
    return status_5xx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--bodies", type=int, default=2000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fragbench-stress-"))
    for engine in ("paged", "static", "hf"):
        with start_server(engine, MODEL, "32MiB", tmp / f"{engine}.log", extra=["--max-seq-len", "256"]) as srv:
            r = asyncio.run(cancel_storm(srv.url, args.requests, concurrency=64, seed=7))
            s = wait_drained(srv.url)
            print(f"cancel storm {engine:<6}: requests sent {r.sent}, cancellations {r.cancelled}, completed "
                  f"{r.completed}, rejected for memory {r.oom}, 5xx {r.status_5xx}, client errors {len(r.errors)}, "
                  "leaked bytes "
                  f"{s['allocated_bytes']}, release p99 {s['abort_release_p99_steps']} engine steps", flush=True)
    with start_server("paged", MODEL, "32MiB", tmp / "fuzz.log", extra=["--max-seq-len", "256"]) as srv:
        bad = fuzz(srv.url, args.bodies, seed=11)
        s = wait_drained(srv.url)
        print(f"fuzz: bodies sent {args.bodies}, 5xx {bad}, server alive {srv.alive()}, leaked bytes "
              f"{s['allocated_bytes']}", flush=True)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "harness.cli", "bench", "--engines", "hf,paged", "--model", MODEL,
                          "--duration", "40", "--kill-after", "15", "--kv-budget", "16MiB", "--out", str(tmp),
                          "--reports", str(tmp), "--run-id", "stress"], cwd=ROOT, capture_output=True, text=True)
    run_dir = tmp / "stress"
    events = pd.read_parquet(run_dir / "events.parquet")
    rows = pd.read_parquet(run_dir / "requests.parquet")
    journal = sum(len(p.read_text().splitlines()) for p in run_dir.glob("engines/*/requests*.jsonl"))
    print(f"faults: bench exit {run.returncode}, engine restarts survived {(events.kind == 'restart').sum()}, "
          f"crashed requests {(rows.status == 'crashed').sum()}, results rows lost {journal - len(rows)}, "
          f"report {tmp / 'stress.html'}")


if __name__ == "__main__":
    main()
