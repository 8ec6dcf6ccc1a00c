"""The A/B gate's blocks: one build's server of an engine under one long-lived load generator (its schedule written
as the gate goes, workloads/schedule.py), and each block a fixed-rate point on it (harness/run/points.py, `fixed`):
a stretch of one stream at one rate, judged at steady state after its warm-up, its judged requests finishing under
their own load before the next block begins. A pair is one block of each build on the same stream
(harness/analysis/ab.py); no process starts per block."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from engines.procs import stop
from harness.analysis.capacity import SLO, meets_slo
from harness.results import JournalTail
from harness.run.loadargs import LoadArgs, start_loadgen, stop_loadgen
from harness.run.points import PointJob, PointRunner, cancelled
from harness.run.servers import tail
from workloads.schedule import ScheduleWriter
from workloads.streams import Streams

COLUMNS = ["stream_index", "status", "met", "ttft_s", "tpot_s", "output_tokens"]
FINISH_S = 60.0  # the longest a block waits for its judged requests to end (a long answer near the SLO: ~40 s)
WARMUP_S = 3.0  # a block's first seconds of arrivals, sent and not judged: the same requests on both builds


class Crashed(RuntimeError):
    """A build's server died while the gate measured it: `side` names the build, the message its log's last lines."""

    def __init__(self, name: str, side: str, message: str):
        super().__init__(message)
        self.name, self.side = name, side


@dataclass
class BlockServer:
    """One build's server of one engine and the load generator that sends it every block of the gate."""

    name: str  # engine.side
    side: str
    proc: subprocess.Popen
    log: Path
    writer: ScheduleWriter
    loadgen: subprocess.Popen
    runner: PointRunner

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise Crashed(self.name, self.side, f"{self.name}'s server exited ({self.proc.returncode}): "
                                                f"{tail(self.log)}")


def open_server(name: str, side: str, url: str, proc: subprocess.Popen, log: Path, out: Path, traffic: LoadArgs,
                streams: Streams, slo: SLO) -> BlockServer:
    """The server's load generator, started once with a schedule the blocks append to; `traffic` gives the
    workload, seed, context, clock origin (t0) and the generator's bound."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ScheduleWriter(out / "schedule.jsonl")
    args = replace(traffic, target=url, out=out, engine=name, schedule=out / "schedule.jsonl")
    with open(out / "loadgen.log", "ab") as f:
        loadgen = start_loadgen(args, stdout=f, stderr=subprocess.STDOUT)
    t0 = traffic.t0 or time.time()
    server: BlockServer | None = None

    def supervise() -> None:
        if server is not None:
            server.check()

    runner = PointRunner(writer, JournalTail(out / "requests.jsonl"), JournalTail(out / "progress.jsonl"), streams,
                         slo, clock=lambda: time.time() - t0, supervise=supervise)
    server = BlockServer(name, side, proc, log, writer, loadgen, runner)
    return server


def run_block(server: BlockServer, number: int, key: str, rate_rps: float, judged: int, limit_s: float,
              show: Callable[[str], None] = lambda text: None) -> pd.DataFrame:
    """One block: `judged` requests of stream `key` at `rate_rps` after its warm-up, at most `limit_s` of judging;
    their rows (COLUMNS). The warm-up is a fixed count of the stream's first requests (WARMUP_S of arrivals at the
    rate), not one read off each block's own latencies, and the block waits (up to FINISH_S) for every judged
    request to end: both builds of a pair judge the same requests, whatever each met, and a slow build's long
    requests are judged, not left out as still running. A rate well under the knee needs little warm-up."""
    server.check()
    skip = math.ceil(WARMUP_S * rate_rps)
    job = PointJob(number, rate_rps, key, 0, min_judged=judged + skip, max_judged=judged + skip, fixed=True,
                   target=server.runner.slo.attainment, warm=False, stop_by_s=server.runner.clock() + limit_s)
    server.runner.run(job, show)
    runner = server.runner
    segments = [seg for seg in runner.segments if seg.key == key and seg.point == number]
    sent = [(r, i) for r, i in runner.sent(segments, float("inf")) if i >= skip and not cancelled(r)][:judged]
    deadline = time.monotonic() + FINISH_S
    while any(r.request_id not in runner.rows for r, _ in sent) and time.monotonic() < deadline:
        server.check()
        time.sleep(0.25)
        runner.refresh()
    server.check()
    return judged_rows([(i, runner.rows.get(r.request_id)) for r, i in sent], runner.slo)


def judged_rows(sent: list[tuple[int, dict | None]], slo: SLO) -> pd.DataFrame:
    """The block's judged requests (stream index, its row or None), each with its verdict by the SLO's rule: a
    request that did not complete, or never ended, missed."""
    out = pd.DataFrame([{"stream_index": i, "status": "error", "ttft_s": None, "tpot_s": None, "output_tokens": 0,
                         "e2e_s": None, **{k: row.get(k) for k in ("status", "ttft_s", "tpot_s", "output_tokens",
                                                                   "e2e_s") if row}}
                        for i, row in sent],
                       columns=["stream_index", "status", "ttft_s", "tpot_s", "output_tokens", "e2e_s"])
    ok = out.status == "ok"
    out["met"] = False
    if ok.any():
        out.loc[ok, "met"] = meets_slo(out[ok], slo).fillna(False).astype(bool).to_numpy()
    return out[COLUMNS]


def close_server(server: BlockServer, grace_s: float = 10.0) -> None:
    """The schedule stops, what is in flight has the grace period, then the generator and the server end."""
    try:
        server.writer.stop()
    except ValueError:  # already closed
        pass
    deadline = time.time() + grace_s + 5
    while server.loadgen.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    stop_loadgen(server.loadgen)
    stop(server.proc)
