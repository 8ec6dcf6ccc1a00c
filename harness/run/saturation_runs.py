"""The saturation sets after the decision (harness/analysis/saturation.py holds the rules and judges them;
docs/method.md, "Saturation throughput beside the headline"): each headline engine serves one fixed request set
offered all at once, as `vllm bench throughput` does, on fresh sets (stream `sat<r>`, both engines the same),
the order alternating A B B A ...; one set a load generator reading a one-segment schedule (workloads/schedule.py),
its rows in `engines/ENGINE/saturation/sat<r>/` (outside the journals the summary's engine figures read), one row
a set in `saturation.jsonl`. Servers are started here without the step log: the twin is fitted on the search's
steps alone."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from engines.procs import free_port
from harness.analysis.saturation import JOURNAL, SET_TARGET_S, set_key, set_order, set_size
from harness.results import Journal
from harness.run.calibration import LOADGEN_STARTUP_S
from harness.run.config import BenchConfig
from harness.run.console import Console
from harness.run.debug_pass import request_alone
from harness.run.loadargs import LoadArgs, start_loadgen, stop_loadgen
from harness.run.servers import ServerFailed, ServerProcess, start_server
from harness.run.stats_poller import fetch_stats
from harness.run.supervisor import Supervisor
from workloads.schedule import ScheduleWriter
from workloads.spec import load_spec
from workloads.streams import Segment, Streams

SPAN_S = 0.01  # the set's arrivals fall within this: all at once, yet each its own instant on the schedule
BOUND_S = 6 * SET_TARGET_S  # a set's requests still running this long after the last arrival are cut off


def plain_workload(workload: str, run_dir: Path) -> str:
    """The workload without its clients' cancels and slow readers (vLLM's throughput benchmark reads every answer
    whole, as fast as it comes): a spec file in the run's folder, or the workload itself where it has neither."""
    spec = load_spec(workload)
    if not any(c.cancel or c.slow_readers for c in spec.classes):
        return workload
    plain = spec.model_copy(update={"classes": [c.model_copy(update={"cancel": None, "slow_readers": None})
                                                for c in spec.classes]})
    path = run_dir / "saturation-workload.json"
    path.write_text(json.dumps(plain.model_dump(mode="json", exclude_none=True), indent=2))
    return str(path)


def one_segment(streams: Streams, key: str, n: int, start_s: float) -> Segment:
    """Requests 0..n-1 of stream `key` arriving within SPAN_S from `start_s`: its rate is the stream's native one
    scaled so, its end halfway between the n-th arrival and the next."""
    origin, nth, next_ = (streams.item(key, i).arrival_s for i in (0, n - 1, n))
    rate = streams.native_rps * max(next_ - origin, 1e-9) / SPAN_S
    stretch = streams.native_rps / rate
    end = start_s + ((nth - origin) + (next_ - origin)) / 2 * stretch
    return Segment(point=-1, key=key, rate_rps=rate, start_s=start_s, first=0, end_s=round(end, 6))


def counters(url: str) -> tuple[float, float]:
    """The server's OOMs and preemptions so far (0 where it does not say)."""
    s = fetch_stats(url)
    return (float(s.oom_total or 0), float(s.preempted_total or 0)) if s is not None else (0.0, 0.0)


class SaturationRuns:
    """The sets of one run: its configuration, folder, servers' flags (the supervisor's) and console."""

    def __init__(self, cfg: BenchConfig, run_dir: Path, servers: Supervisor, console: Console):
        self.cfg, self.dir, self.servers, self.console = cfg, run_dir, servers, console
        self.journal = Journal(run_dir / JOURNAL)

    def run(self, engine: str, against: str, calibrated_rps: dict[str, float], repeats: int,
            requests: int | None = None) -> None:
        """`repeats` pairs of sets, ABBA; one server per run of consecutive sets of one engine. A set's size is
        the rule's (analysis/saturation.set_size), or `requests` (a test's tiny sets)."""
        n = requests or set_size([calibrated_rps.get(e, 0.0) for e in (engine, against)])
        workload = plain_workload(self.cfg.workload, self.dir)
        streams = Streams(load_spec(workload), self.cfg.seed, self.cfg.max_seq_len)
        self.console.plain(f"saturation throughput: {repeats} pairs of {n} requests offered at once, {engine} and "
                           f"{against} in ABBA order")
        server: ServerProcess | None = None
        held = None
        try:
            for position, (rep, name) in enumerate(set_order(repeats, engine, against)):
                if held != name or server is None or not server.alive():
                    if server is not None:
                        server.stop()
                    server, held = self.start(name), name
                row = {"engine": name, "pair": [engine, against], "repetition": rep, "position": position % 2,
                       "requests": n, "repeats": repeats, "key": set_key(rep)}
                self.journal.write({**row, **self.serve(server, name, streams, workload, set_key(rep), n)})
        finally:
            if server is not None:
                server.stop()

    def start(self, engine: str) -> ServerProcess:
        """The engine's server at the run's budget and flags, warmed by one short request alone."""
        cfg = self.cfg
        log = self.dir / "logs" / f"{engine}-saturation.log"
        try:
            server = start_server(engine, cfg.model, cfg.kv_budget, log,
                                  extra=self.servers.server_args(engine, free_port()), threads=cfg.threads,
                                  alloc_conf=cfg.alloc_conf if cfg.memory == "cuda" else None)
        except ServerFailed as e:
            self.console.plain(f"saturation throughput: {engine} did not start: {e}")
            raise
        request_alone(server.url, 32, 4)
        return server

    def serve(self, server: ServerProcess, engine: str, streams: Streams, workload: str, key: str, n: int) -> dict:
        """One set: a load generator on a one-segment schedule, waited for; the server's OOMs and preemptions
        over it."""
        out = self.dir / "engines" / engine / "saturation" / key
        writer = ScheduleWriter(out / "schedule.jsonl")
        writer.start(one_segment(streams, key, n, LOADGEN_STARTUP_S))
        writer.stop()
        before = counters(server.url)
        t0 = time.time()
        load = replace(LoadArgs.of(self.cfg, target=server.url, out=out, t0=t0, engine=engine,
                                   schedule=out / "schedule.jsonl"),
                       workload=workload, duration_s=LOADGEN_STARTUP_S + 1, start_at_s=0.0, grace_s=BOUND_S)
        with open(out / "loadgen.log", "ab") as log:
            loadgen = start_loadgen(load, stdout=log, stderr=subprocess.STDOUT)
        try:
            loadgen.wait(LOADGEN_STARTUP_S + BOUND_S + 30)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_loadgen(loadgen)
        after = counters(server.url) if server.alive() else before
        self.console.plain(f"saturation throughput: {engine} served set {key} in {time.time() - t0:.1f} s")
        return {"out": str(out.relative_to(self.dir)), "oom_total": after[0] - before[0],
                "preemptions": after[1] - before[1], "crashed": not server.alive()}
