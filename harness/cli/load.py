"""`fragbench load`: replay a workload against a server, in the load generator's own process (Locust)."""

from __future__ import annotations

import argparse

from harness.cli.args import (
    UsageError,
    add_api_flag,
    http_url,
    positive_float,
    positive_int,
    workload_checked,
)
from harness.cli.bounds import vocab_size_arg
from harness.cli.seeds import seed_arg
from harness.cli.user_paths import folder_out, user_path, user_workload
from harness.fetch import SERVER_PATHS, bearer, round_trip_s


def register(sub) -> None:
    load = sub.add_parser("load", help="replay a workload against a server (Locust, its own process; exit 1: "
                                     "every request failed)")
    load.add_argument("--target", help="the server's base URL, e.g. http://127.0.0.1:8000 (needed but by --worker)")
    load.add_argument("--workload", help="a workload name or a spec's YAML path (needed but by --worker)")
    load.add_argument("--duration", type=positive_float, default=60.0, help="seconds of the trace's arrivals replayed")
    load.add_argument("--workers", type=positive_int, default=1,
                      help="load-generator processes on this machine, sharing the trace")
    load.add_argument("--out", type=folder_out, default="results/load", metavar="DIR",
                      help="directory requests.jsonl and requests.parquet go to")
    load.add_argument("--seed", type=seed_arg, default=0, help="the workload's seed")
    load.add_argument("--max-seq-len", type=positive_int, default=2048,
                      help="tokens per request (prompt + output) the trace is cut to")
    load.add_argument("--vocab-size", type=vocab_size_arg, default=4096,
                      help="token ids of synthetic prompts are drawn below this")
    load.add_argument("--engine-label", default="target", help="the engine column of the rows written")
    load.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: none)")
    add_api_flag(load)
    spread = load.add_argument_group("over several machines (Locust's master/worker protocol)")
    spread.add_argument("--master", action="store_true", help="hand the trace out to --expect-workers workers")
    spread.add_argument("--expect-workers", type=positive_int, default=1,
                        help="--master: workers it waits for before the trace starts")
    spread.add_argument("--master-bind", default="0.0.0.0:5557",
                        help="HOST:PORT the master listens on (its workers may be on other machines)")
    spread.add_argument("--worker", action="store_true", help="take a share of a master's trace")
    spread.add_argument("--master-host", default="127.0.0.1:5557", help="HOST[:PORT] of the master")
    spread.add_argument("--connect-timeout", type=positive_float, default=30.0,
                        help="seconds a worker waits for its master, and a master for its workers")
    load.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load the load generator's arguments
    from harness.run.loadargs import LoadArgs, run_loadgen, worker_argv

    if args.worker:  # everything else comes from the master
        return run_loadgen(worker_argv(args.master_host, args.connect_timeout))
    if not args.target or not args.workload:
        raise UsageError("load needs --target and --workload (a --worker takes them from its master)")
    target = http_url("--target", args.target).rstrip("/")
    workload = user_workload(args.workload)
    workload_checked(workload)  # fail here, not in the child
    # before the run, as check does: not N requests of errors (a master's workers, maybe elsewhere, send the load);
    # its round trip recorded in load.json, so that a remote target's network is told from its serving
    rtt = None if args.master else round_trip_s(target, bearer(args.api_key))
    if not args.master and rtt is None:
        raise UsageError(f"--target {target} does not answer (tried {' and '.join(SERVER_PATHS)})")
    return run_loadgen(LoadArgs(target=target, workload=workload, out=user_path(args.out),
                                duration_s=args.duration, seed=args.seed, max_seq_len=args.max_seq_len,
                                vocab_size=args.vocab_size, engine=args.engine_label, api_key=args.api_key,
                                workers=args.expect_workers if args.master else args.workers,
                                master_bind=args.master_bind if args.master else None,
                                connect_timeout_s=args.connect_timeout, api=args.api, network_rtt_s=rtt))
