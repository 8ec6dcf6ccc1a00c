"""The load generator, always in a process of its own (`import locust` monkey-patches the interpreter).

    python -m harness.run.loadgen --target URL --workload NAME --out DIR [--duration S] [--workers N]
    python -m harness.run.loadgen --master --expect-workers N [--master-bind HOST:PORT] --target ... --out DIR
    python -m harness.run.loadgen --worker --master-host HOST[:PORT]

One process runs a Locust LocalRunner. A master (--workers N spawns N workers on this machine; --master
waits for N from anywhere) hands its workers the plan through Locust's own protocol; each worker replays
every N-th request of the same deterministic trace and sends its rows back, so the master writes one
DIR/requests.jsonl as requests finish, and DIR/requests.parquet at the end.
"""

from __future__ import annotations

import argparse
import json
import os
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
from harness.results import Journal, measured_nothing, read_journals, request_row, to_parquet, write_whole  # noqa: E402
from workloads.generate import at_rate, trace  # noqa: E402
from workloads.replay import ReplayPlan, ReplayUser  # noqa: E402
from workloads.schedule import ScheduleReader  # noqa: E402
from workloads.spec import SpecError, load_spec  # noqa: E402
from workloads.streams import Streams  # noqa: E402
from workloads.traces import TraceError  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="harness.run.loadgen")
    ap.add_argument("--target")
    ap.add_argument("--workload")
    ap.add_argument("--out")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default="target", help="label for the rows")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=1, help="Locust workers on this machine (a master spawns them)")
    ap.add_argument("--t0", type=float, help="wall-clock origin of the trace's arrival times")
    ap.add_argument("--rate", type=float, help="offer the workload at this many requests/s (its arrival shape "
                                               "kept, its clock rescaled); each row records it as offered_rps")
    ap.add_argument("--start-at", type=float, default=0.0,
                    help="seconds after --t0 when the first arrival falls; --duration counts from there")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--api-key")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--network-rtt-s", type=float, help="the round trip to the target its caller measured (load.json)")
    ap.add_argument("--model", help="the 'model' field of each request")
    ap.add_argument("--master", action="store_true", help="wait for --expect-workers workers from other machines")
    ap.add_argument("--expect-workers", type=int, default=1)
    ap.add_argument("--master-bind", default="127.0.0.1:5557", help="HOST:PORT the master listens on")
    ap.add_argument("--worker", action="store_true", help="take a share of a master's trace")
    ap.add_argument("--master-host", default="127.0.0.1:5557", help="HOST[:PORT] of the master")
    ap.add_argument("--connect-timeout", type=float, default=30.0,
                    help="seconds a worker waits for its master, or a master for its workers")
    ap.add_argument("--schedule", help="a JSONL file of segments the caller appends while the generator runs "
                                       "(workloads/schedule.py); --duration then bounds the whole run")
    return ap.parse_args(argv)


class Unconnected(RuntimeError):
    """A master without its workers, or a worker without its master: one line, exit 2."""


# what a master hands its workers: everything a worker needs to build the same trace and send its share
PLAN_FIELDS = ("target", "workload", "duration", "seed", "engine", "max_seq_len", "vocab_size", "t0", "rate",
               "start_at", "grace", "api_key", "model", "api")


def host_port(text: str, default_port: int = 5557) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", str(default_port))
    return host, int(port)


def trace_requests(args: argparse.Namespace):
    """The workload's requests at the offered rate, shifted to start_at; and its closed-loop concurrency."""
    t = trace(load_spec(args.workload), args.seed, args.max_seq_len, args.vocab_size)
    requests = at_rate(t.requests, args.rate, args.start_at) if args.rate else [
        replace(r, arrival_s=r.arrival_s + args.start_at) for r in t.requests]
    return requests, t.closed_concurrency


def environment(args: argparse.Namespace, on_row) -> Environment:
    return configure(Environment(user_classes=[ReplayUser]), args, on_row)


def configure(env: Environment, args: argparse.Namespace, on_row, workers: int = 1) -> Environment:
    """The plan a replay user reads from its environment: the trace (or the schedule), its clock, where its
    rows go."""
    schedule = getattr(args, "schedule", None)
    requests, closed = ([], None) if schedule else trace_requests(args)
    reader = ScheduleReader(Path(schedule), Streams(load_spec(args.workload), args.seed, args.max_seq_len,
                                                    args.vocab_size), gevent.sleep) if schedule else None
    env.host = args.target.rstrip("/")
    env.replay_plan = ReplayPlan(
        requests=requests, t0=args.t0, duration_s=args.start_at + args.duration,
        on_outcome=lambda o: on_row({**request_row(args.engine, o), "offered_rps": args.rate,
                                     **(o.tags.to_json() if o.tags else {})}),
        closed_concurrency=closed, grace_s=args.grace, api_key=args.api_key, model=args.model, api=args.api,
        schedule=reader, on_first_token=first_tokens(args) if schedule else None,
    )
    env.replay_workers = workers
    env.replay_done = False
    return env


def first_tokens(args: argparse.Namespace):
    """A schedule's caller learns of each stream's first token as it comes (DIR/progress.jsonl): a point's
    missed TTFTs are known long before those requests end."""
    journal = Journal(Path(args.out) / "progress.jsonl")
    return lambda o: journal.write({"request_id": o.request.request_id, "first_token_s": o.first_token_s,
                                    "sent_s": o.sent_s, "due_s": o.due_s})


def deadline(args: argparse.Namespace) -> float:
    return args.t0 + args.start_at + args.duration + args.grace + 5


def run_local(args: argparse.Namespace, out: Path) -> None:
    env = environment(args, Journal(out / "requests.jsonl").write)
    runner = env.create_local_runner()
    if args.t0 is None:  # the trace's clock starts now that it is built, so its first requests are not late
        args.t0 = env.replay_plan.t0 = time.time()
    runner.start(1, spawn_rate=1)
    while time.time() < deadline(args) and not env.replay_done:
        gevent.sleep(0.2)
    runner.quit()


def give_up_after(seconds: float, why: str) -> gevent.Greenlet:
    def give_up() -> None:
        print(f"fragbench: error: {why}", file=sys.stderr, flush=True)
        os._exit(2)

    return gevent.spawn_later(seconds, give_up)


def run_worker(args: argparse.Namespace) -> None:
    """Connect, take the master's plan, send every row back to it, say when done."""
    host, port = host_port(args.master_host)
    watchdog = give_up_after(args.connect_timeout, f"worker: no plan from a master at {host}:{port} within "
                                                   f"{args.connect_timeout:g} s")
    env = Environment(user_classes=[ReplayUser])
    runner = env.create_worker_runner(host, port)

    def take_plan(environment, msg, **kwargs) -> None:
        watchdog.kill()
        plan = argparse.Namespace(**msg.data)
        configure(env, plan, lambda row: runner.send_message("fragbench-rows", row), plan.workers)
        gevent.spawn(report_done, env, runner)

    runner.register_message("fragbench-plan", take_plan)
    runner.greenlet.join()


def report_done(env: Environment, runner) -> None:
    while not env.replay_done:
        gevent.sleep(0.2)
    runner.send_message("fragbench-done", runner.worker_index)


def run_master(args: argparse.Namespace, out: Path, expected: int, bind: tuple[str, int],
               local_workers: int = 0) -> None:
    """Locust's master: hands its workers the plan (each sends every expected-th request), writes the rows
    they send back, and when a worker goes silent finishes with what it has and says what was lost."""
    env = Environment(user_classes=[ReplayUser], host=(args.target or "").rstrip("/"))
    runner = env.create_master_runner(*bind)
    journal, done = Journal(out / "requests.jsonl"), set()
    runner.register_message("fragbench-rows", lambda environment, msg, **kw: journal.write(msg.data))
    runner.register_message("fragbench-done", lambda environment, msg, **kw: done.add(msg.data))
    children = [spawn([sys.executable, "-m", "harness.run.loadgen", "--worker", "--master-host",
                       f"127.0.0.1:{runner.server.port}", "--connect-timeout", str(args.connect_timeout)])
                for _ in range(local_workers)]
    try:
        waited = time.time() + args.connect_timeout
        while len(runner.clients.ready) < expected:
            if time.time() > waited:
                raise Unconnected(f"master: {len(runner.clients.ready)} of {expected} workers connected to "
                                  f"{bind[0]}:{runner.server.port} within {args.connect_timeout:g} s")
            gevent.sleep(0.1)
        if args.t0 is None:  # a second for every worker to build its trace before the first arrival
            args.t0 = time.time() + 1.0
        plan = {k: getattr(args, k) for k in PLAN_FIELDS} | {"workers": expected}
        runner.send_message("fragbench-plan", plan)
        runner.start(expected, spawn_rate=expected)
        while time.time() < deadline(args) and len(done) < expected and runner.clients.ready + runner.clients.running \
                + runner.clients.spawning:
            gevent.sleep(0.2)
        gevent.sleep(0.5)  # the last rows travel behind the done message
        say_lost(args, out, expected, done)
        runner.quit()
    finally:
        for child in children:
            stop(child, timeout_s=30)


def say_lost(args: argparse.Namespace, out: Path, expected: int, done: set) -> None:
    """Which share of the trace no worker reported, when a worker stopped before its share was sent."""
    if len(done) == expected:
        return
    requests, closed = trace_requests(args)
    due = {r.request_id for r in requests if closed or r.arrival_s < args.start_at + args.duration}
    got = set(read_journals([out / "requests.jsonl"], "requests").request_id.dropna())
    lost = len(due - got)
    silent = sorted(set(range(expected)) - done)
    print(f"fragbench: workers {silent} stopped reporting; {lost} of {len(due)} requests of the trace "
          f"({100 * lost / max(1, len(due)):.1f} %) were lost", file=sys.stderr, flush=True)


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
    try:
        if args.worker:
            run_worker(args)
            return 0
        missing = [f"--{k}" for k in ("target", "workload", "out") if not getattr(args, k)]
        if missing:
            raise Unconnected(f"{', '.join(missing)} required (but for --worker)")
        if args.schedule and (args.master or args.workers > 1):
            raise Unconnected("--schedule runs in one process: it takes neither --master nor --workers")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.master:
            run_master(args, out, args.expect_workers, host_port(args.master_bind))
        elif args.workers > 1:
            run_master(args, out, args.workers, ("127.0.0.1", 0), local_workers=args.workers)
        else:
            run_local(args, out)
    except (SpecError, TraceError, Unconnected, ConnectionError) as e:
        print(f"fragbench: error: {e or 'the master did not answer'}", file=sys.stderr)
        return 2
    df = to_parquet(out, "requests")
    print(summarize(df), flush=True)
    write_whole(out / "load.json", json.dumps({"target": args.target, "workload": args.workload,  # a rerun: whole
                                               "seed": args.seed, "duration_s": args.duration,
                                               "workers": args.expect_workers if args.master else args.workers,
                                               "t0": args.t0, "network_rtt_s": args.network_rtt_s}) + "\n")
    if why := measured_nothing(df):  # a load that measured nothing is a failure, not a run of zeros
        print(f"fragbench: error: {args.target}: {why}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
