"""The load generator, always in a process of its own (`import locust` monkey-patches the interpreter).

    python -m harness.loadgen --target URL --workload NAME --out DIR [--duration S] [--workers N]

One process runs a Locust LocalRunner; with --workers N it runs Locust's master and N worker processes,
each replaying every N-th request of the same deterministic trace. Rows go to DIR/requests*.jsonl as
requests finish, and to DIR/requests.parquet at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from gevent import monkey

monkey.patch_all()

import gevent  # noqa: E402
from locust.env import Environment  # noqa: E402

from engines.percentile import percentile  # noqa: E402
from engines.procs import exit_on_sigterm, spawn, stop  # noqa: E402
from harness.results import Journal, request_row, to_parquet  # noqa: E402
from workloads.generate import at_rate, trace  # noqa: E402
from workloads.replay import ReplayPlan, ReplayUser  # noqa: E402
from workloads.spec import SpecError, load_spec  # noqa: E402
from workloads.traces import TraceError  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="harness.loadgen")
    ap.add_argument("--target", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default="target", help="label for the rows")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--t0", type=float, help="wall-clock origin of the trace's arrival times")
    ap.add_argument("--rate", type=float, help="offer the workload at this many requests/s (its arrival shape "
                                               "kept, its clock rescaled); each row records it as offered_rps")
    ap.add_argument("--start-at", type=float, default=0.0,
                    help="seconds after --t0 when the first arrival falls; --duration counts from there")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="the 'model' field of each request")
    ap.add_argument("--master-port", type=int, help=argparse.SUPPRESS)  # set for worker processes
    return ap.parse_args(argv)


def environment(args: argparse.Namespace, journal_path: Path) -> Environment:
    t = trace(load_spec(args.workload), args.seed, args.max_seq_len, args.vocab_size)
    requests = at_rate(t.requests, args.rate, args.start_at) if args.rate else [
        replace(r, arrival_s=r.arrival_s + args.start_at) for r in t.requests]
    journal = Journal(journal_path)
    env = Environment(user_classes=[ReplayUser], host=args.target.rstrip("/"))
    env.replay_plan = ReplayPlan(
        requests=requests, t0=args.t0, duration_s=args.start_at + args.duration,
        on_outcome=lambda o: journal.write({**request_row(args.engine, o), "offered_rps": args.rate}),
        closed_concurrency=t.closed_concurrency, grace_s=args.grace, api_key=args.api_key, model=args.model,
    )
    env.replay_workers = args.workers
    env.replay_done = False
    return env


def wait(env: Environment, args: argparse.Namespace) -> None:
    deadline = args.t0 + args.start_at + args.duration + args.grace + 5
    while time.time() < deadline and not env.replay_done:
        gevent.sleep(0.2)


def run_local(args: argparse.Namespace, out: Path) -> None:
    env = environment(args, out / "requests.jsonl")
    runner = env.create_local_runner()
    runner.start(1, spawn_rate=1)
    wait(env, args)
    runner.quit()


def run_worker(args: argparse.Namespace, out: Path) -> None:
    env = environment(args, out / f"requests.w{time.monotonic_ns()}.jsonl")
    runner = env.create_worker_runner("127.0.0.1", args.master_port)
    runner.greenlet.join()


def run_master(args: argparse.Namespace, out: Path, argv: list[str]) -> None:
    env = Environment(user_classes=[ReplayUser], host=args.target.rstrip("/"))
    runner = env.create_master_runner("127.0.0.1", 0)
    port = runner.server.port
    workers = [
        spawn([sys.executable, "-m", "harness.loadgen", *argv, "--t0", str(args.t0), "--master-port", str(port)])
        for _ in range(args.workers)
    ]
    while len(runner.clients.ready) < args.workers:
        gevent.sleep(0.1)
    runner.start(args.workers, spawn_rate=args.workers)
    deadline = args.t0 + args.start_at + args.duration + args.grace + 5
    gevent.sleep(2)  # heartbeats report the spawned users
    while time.time() < deadline and runner.user_count > 0:
        gevent.sleep(0.5)
    runner.quit()
    for w in workers:
        stop(w, timeout_s=30)


def summarize(df) -> str:
    ok = df[df.status == "ok"]
    parts = [f"{len(df)} requests: " + ", ".join(f"{k} {v}" for k, v in df.status.value_counts().items())]
    if len(ok) and ok.ttft_s.notna().any():
        p50, p99 = percentile(ok.ttft_s, 0.5), percentile(ok.ttft_s, 0.99)
        parts.append(f"TTFT p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    late = (df.late_s > 0.01).sum() if "late_s" in df else 0
    parts.append(f"{late} sent more than 10 ms late")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    exit_on_sigterm()
    args.t0 = args.t0 or time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.master_port:
            run_worker(args, out)
            return 0
        if args.workers > 1:
            run_master(args, out, argv)
        else:
            run_local(args, out)
    except (SpecError, TraceError) as e:
        print(f"fragbench: error: {e}", file=sys.stderr)
        return 2
    df = to_parquet(out, "requests")
    print(summarize(df), flush=True)
    (out / "load.json").write_text(json.dumps({"target": args.target, "workload": args.workload,
                                               "seed": args.seed, "duration_s": args.duration,
                                               "workers": args.workers, "t0": args.t0}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
