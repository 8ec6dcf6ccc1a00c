"""Visits: an engine's server under one load generator whose schedule the knee search writes as it goes
(workloads/schedule.py), and one point measured on it (harness/run/points.py), its record in run.json as it is
produced. What an engine holds across its visits (its searches, cursors, provisional verdicts) lives on its
`EngineRun` (harness/run/engine_run.py)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import numpy as np

from harness.analysis.capacity import SLO
from harness.results import JournalTail
from harness.run.clock import Clock
from harness.run.config import BenchConfig
from harness.run.console import Console, Show
from harness.run.engine_run import EngineRun, Searched
from harness.run.loadargs import start_loadgen, stop_loadgen
from harness.run.points import PointJob, PointResult, PointRunner
from harness.run.record import RunWriter
from harness.run.servers import ServerFailed
from harness.run.supervisor import Supervisor
from workloads.schedule import ScheduleWriter
from workloads.streams import Streams, key_of, paired_turn


@dataclass
class Visit:
    """An engine's server under one load generator: the points measured in one go."""

    run: EngineRun
    runner: PointRunner
    writer: ScheduleWriter
    loadgen: subprocess.Popen
    number: int  # the engine's visits at this budget before it (its schedule file's number)
    last_rate: float | None = None  # the rate its last point ended at: the next at that rate needs no warm-up
    last_key: str | None = None  # and the stream it read: another replication of one rate is warmed up again
    missed: bool = False  # its last point missed the SLO: its backlog drains before the next point begins


class Visits:
    """Servers and load generators for the search: each visit an engine's server under one load generator, each
    point measured on it. The run's pieces it is handed: its configuration, clock, record (run.json, events),
    the engines' supervision, the console and the streams the points read."""

    def __init__(self, cfg: BenchConfig, clock: Clock, record: RunWriter, servers: Supervisor, console: Console,
                 streams: Streams | None):
        self.cfg, self.clock, self.record, self.servers, self.console = cfg, clock, record, servers, console
        self.streams = streams
        self.slo = SLO(cfg.slo_ttft_s, cfg.slo_tpot_s, cfg.slo_attainment)

    def open_visit(self, run: EngineRun) -> Visit:
        n = sum(1 for _ in (self.record.dir / "engines" / run.engine).glob(f"schedule-{run.budget}-*.jsonl")) \
            if (self.record.dir / "engines" / run.engine).exists() else 0
        path = self.record.dir / "engines" / run.engine / f"schedule-{run.budget}-{n}.jsonl"
        writer = ScheduleWriter(path)
        # the generator's own bound: the bench's time left, on the engine's clock
        bound_s = time.time() - run.t0 + max(self.clock.left_s, 0.0) + 120.0
        load = self.servers.load_args(run, duration_s=round(bound_s, 1), start_at_s=0.0, schedule=path)
        out = load.out
        with open(out / "loadgen.log", "ab") as log:
            loadgen = start_loadgen(load, stdout=log, stderr=subprocess.STDOUT)
        runner = PointRunner(writer, JournalTail(out / "requests.jsonl"),
                             JournalTail(out / "progress.jsonl"), self.streams, self.slo,
                             clock=lambda: time.time() - run.t0, supervise=lambda: self.supervise(run))
        return Visit(run, runner, writer, loadgen, n)

    def close_visit(self, visit: Visit) -> None:
        """The schedule stops; what is in flight has the grace period; the load generator then ends."""
        visit.writer.stop()
        deadline = time.time() + self.cfg.grace_s + 15
        while visit.loadgen.poll() is None and time.time() < deadline:
            self.supervise(visit.run)
            time.sleep(0.3)
        stop_loadgen(visit.loadgen)

    def supervise(self, run: EngineRun) -> None:
        """Called between a point's looks: OOMs the server recorded, a crashed server restarted, a target's
        down time."""
        self.servers.supervise(run, run.sampler)

    def searched(self, run: EngineRun) -> Searched:
        if run.budget not in run.searched:
            points = self.record.points(run.engine)
            run.searched[run.budget] = Searched(points=[p for p in points if p.get("kv_budget") == str(run.budget)])
        return run.searched[run.budget]

    def measure(self, visit: Visit, rate: float, show: Show, replication: int = 0, key: str | None = None,
                **rules) -> PointResult:
        """One point (a new rate, a replication of one measured: an independent realization of its stream, a
        paired stream given by its `key`, or more of a point already measured) on the visit's server, its record
        in run.json as it is produced."""
        run, st = visit.run, self.searched(visit.run)
        key = key or key_of(rate, replication)
        at = st.of_key(key)
        if at is None:
            mine = self.record.points(run.engine)
            record = {"point": len(mine), "offered_rps": rate, "key": key, "kv_budget": str(run.budget), "segments": []}
            mine.append(record)
            st.points.append(record)
            at = len(st.points) - 1
        record = st.points[at]
        same = visit.last_rate == rate and visit.last_key == key  # the point goes on: nothing to warm up
        if visit.missed and not same:
            self.drain_visit(visit)
        job = PointJob(record["point"], rate, key, st.cursors.get(key, 0), target=self.slo.attainment,
                       warmup_guess_s=st.warmup_s, warm=not same,
                       earlier=tuple(p for p in st.judged_points() if p.key != key), **rules)
        res = visit.runner.run(job, lambda text: show(f"{run.engine:<6} {text}", self.clock.spent_s))
        visit.last_rate, visit.last_key = rate, key
        record["segments"] += [{**seg, "visit": visit.number} for seg in res.segments]
        record["start_s"], record["end_s"] = record["segments"][0]["start_s"], record["segments"][-1]["end_s"]
        record["warmup_s"] = record["segments"][0]["warmup_s"]
        self.record.write()
        met, index = st.judged.get(at, (np.zeros(0), np.zeros(0, dtype=int)))
        st.judged[at] = (np.concatenate([met, res.met]), np.concatenate([index, res.index]))
        st.cursors[key] = res.next_index
        st.warmup_s = max(res.warmup_s, 1.0)
        att = float(st.judged[at][0].mean()) if len(st.judged[at][0]) else None
        visit.missed = att is None or att < self.slo.attainment
        known = len(st.judged[at][0])
        rep = f" (stream {key})" if paired_turn(key) is not None else f" (replication {replication})" \
            if replication else ""
        self.console.plain(f"{run.engine}: {rate:g} req/s{rep}: {res.judged} judged after a {res.warmup_s:.1f} s "
                           f"warm-up, SLO attainment {'n/a' if att is None else f'{100 * att:.0f} %'} of the {known} "
                           "verdicts known on this stream; "
                           + self.servers.figures(run, run.sampler))
        return res

    def drain_visit(self, visit: Visit, timeout_s: float = 60.0) -> None:
        """No arrivals until the engine holds no request (a missed point's backlog would be the next point's
        warm-up, however long): the next point starts from an idle engine, as the first one did."""
        self.servers.drain(visit.run, timeout_s, poll_s=0.3, each_look=lambda: self.supervise(visit.run))
        visit.last_rate = visit.last_key = None

    def attainment(self, run: EngineRun, rate: float) -> float | None:
        """At `rate`, its replications' verdicts together."""
        st = self.searched(run)
        met = np.concatenate([st.judged[i][0] for i in st.of_rate(rate) if i in st.judged] or [np.zeros(0)])
        return float(met.mean()) if len(met) else None

    def revisit(self, run: EngineRun) -> Visit | None:
        """The engine's server again (a target is still running), a sampler and a load generator on it."""
        if run.engine not in self.servers.targets:
            try:
                run.server = self.servers.start(run)
            except ServerFailed as e:
                self.record.event(run, "crash", detail=f"did not start again at {run.budget}: {e}")
                return None
        run.sampler = run.sampler.resumed(run.server.url, run.server.proc.pid if run.server.proc else None)
        targets = self.servers.targets
        run.sampler.fetch = targets[run.engine].stats if run.engine in targets else run.sampler.fetch
        run.sampler.start()
        return self.open_visit(run)

    def end_visit(self, visit: Visit) -> None:
        run = visit.run
        try:
            self.close_visit(visit)
        finally:
            run.sampler.stop()
            self.servers.collect_ooms(run, run.sampler.last)
            if run.engine not in self.servers.targets:
                run.server.stop()

