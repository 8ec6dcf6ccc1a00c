"""Visits: an engine's server under one load generator whose schedule the knee search writes as it goes
(workloads/schedule.py), and one point measured on it (harness/run/points.py), its record in run.json as it is
produced. What an engine holds across its visits (its searches, cursors, provisional verdicts) lives on its
`EngineRun`."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from harness.analysis.capacity import SLO
from harness.analysis.design import Design
from harness.analysis.knee import Judged, KneeSearch
from harness.results import JournalTail
from harness.run.loadargs import LoadArgs, start_loadgen, stop_loadgen
from harness.run.points import PointJob, PointResult, PointRunner
from harness.run.sampler import Sampler
from harness.run.servers import ServerFailed, ServerProcess
from harness.units import KvBudget
from workloads.schedule import ScheduleWriter
from workloads.streams import Streams, key_of


@dataclass
class EngineRun:
    """One engine of the run: its clock, its server now, what happened to it, what its searches found."""

    engine: str
    t0: float  # wall clock: the origin of this engine's samples, events and request times
    port: int
    server: ServerProcess | None = None
    crashes: int = 0
    down: list[tuple[float, float]] = field(default_factory=list)  # (crash, back up), engine time
    budget: KvBudget | None = None  # the KV budget its server runs at now
    oom_seen: int = 0
    checked_s: float = -1e9  # a target: when it was last asked whether it answers, engine time
    down_since: float | None = None  # a target that stopped answering: since when
    searched: dict[KvBudget, Searched] = field(default_factory=dict)  # by KV budget (its bytes)
    sampler: Sampler | None = None  # the latest one (a revisit resumes it)
    setup_s: float = 0.0  # server start, debugging pass and calibration, as measured


@dataclass
class Searched:
    """One engine's points at one KV budget: its knee search, run.json's point records (the same objects),
    what each point judged so far (provisional verdicts, for the decision phase), and where it stands in each
    stream (a point continued later goes on from there)."""

    points: list[dict]
    search: KneeSearch | None = None
    judged: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # point -> (met, index)
    cursors: dict[str, int] = field(default_factory=dict)
    warmup_s: float = 3.0  # the last point's warm-up: the next one's plan

    def of_key(self, key: str) -> int | None:
        """The point that judged stream `key` (a rate and its replication: workloads/streams.key_of)."""
        return next((i for i, p in enumerate(self.points) if p["key"] == key), None)

    def of_rate(self, rate: float) -> list[int]:
        """Every point at `rate`: its replications."""
        return [i for i, p in enumerate(self.points) if p["offered_rps"] == rate]

    def judged_points(self) -> list[Judged]:
        return [Judged(p["offered_rps"], p["key"], *self.judged[i]) for i, p in enumerate(self.points)
                if i in self.judged]


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


class Host(Protocol):
    """What the visits and the search need of the run that holds them (harness/run/bench.Bench): its
    configuration and design, its results folder and run.json, the engines' servers and their supervision, and
    the console. Nothing else of the bench is read."""

    cfg: Any  # the BenchConfig (harness/run/bench.py): time, grace, engines, budgets
    design: Design
    dir: Path
    run_meta: dict
    targets: dict
    streams: Streams | None
    started: float  # wall clock of the bench's start

    @property
    def slo(self) -> SLO: ...

    @property
    def left_s(self) -> float: ...

    @property
    def budgets(self) -> list[KvBudget]: ...

    def order(self) -> list[str]: ...

    def write_meta(self) -> None: ...

    def plain(self, line: str) -> None: ...

    def say(self, line: str) -> None: ...

    def load_args(self, run: EngineRun, **changes) -> LoadArgs: ...

    def start(self, run: EngineRun) -> ServerProcess: ...

    def restart(self, run: EngineRun, sampler: Sampler | None) -> None: ...

    def watch(self, run: EngineRun) -> None: ...

    def collect_ooms(self, run: EngineRun, stats: dict | None) -> None: ...

    def stats_of(self, run: EngineRun) -> dict | None: ...

    def figures(self, run: EngineRun, sampler: Sampler | None) -> str: ...

    def event(self, run: EngineRun, kind: str, t_s: float | None = None, **fields) -> None: ...


class Visits:
    """Servers and load generators for the search: each visit an engine's server under one load generator, each
    point measured on it. Everything else it needs of the run (its configuration, streams, journals, clock and
    the engine's supervision) it asks of its `host`, whose contract `Host` states."""

    def __init__(self, host: Host):
        self.host = host

    def open_visit(self, run: EngineRun) -> Visit:
        n = sum(1 for _ in (self.host.dir / "engines" / run.engine).glob(f"schedule-{run.budget}-*.jsonl")) \
            if (self.host.dir / "engines" / run.engine).exists() else 0
        path = self.host.dir / "engines" / run.engine / f"schedule-{run.budget}-{n}.jsonl"
        writer = ScheduleWriter(path)
        # the generator's own bound: the bench's time left, on the engine's clock
        bound_s = time.time() - run.t0 + max(self.host.left_s, 0.0) + 120.0
        load = self.host.load_args(run, duration_s=round(bound_s, 1), start_at_s=0.0, schedule=path)
        out = load.out
        with open(out / "loadgen.log", "ab") as log:
            loadgen = start_loadgen(load, stdout=log, stderr=subprocess.STDOUT)
        runner = PointRunner(writer, JournalTail(out / "requests.jsonl"),
                             JournalTail(out / "progress.jsonl"), self.host.streams, self.host.slo,
                             clock=lambda: time.time() - run.t0, supervise=lambda: self.supervise(run))
        return Visit(run, runner, writer, loadgen, n)

    def close_visit(self, visit: Visit) -> None:
        """The schedule stops; what is in flight has the grace period; the load generator then ends."""
        visit.writer.stop()
        deadline = time.time() + self.host.cfg.grace_s + 15
        while visit.loadgen.poll() is None and time.time() < deadline:
            self.supervise(visit.run)
            time.sleep(0.3)
        stop_loadgen(visit.loadgen)

    def supervise(self, run: EngineRun) -> None:
        """Called between a point's looks: OOMs the server recorded, a crashed server restarted, a target's
        down time."""
        if run.sampler is not None:
            self.host.collect_ooms(run, run.sampler.last)
        if run.engine in self.host.targets:
            self.host.watch(run)
        elif not run.server.alive():
            self.host.restart(run, run.sampler)

    def searched(self, run: EngineRun) -> Searched:
        if run.budget not in run.searched:
            points = self.host.run_meta["sweep"]["points"].setdefault(run.engine, [])
            run.searched[run.budget] = Searched(points=[p for p in points if p.get("kv_budget") == str(run.budget)])
        return run.searched[run.budget]

    def measure(self, visit: Visit, rate: float, show, replication: int = 0, **rules) -> PointResult:
        """One point (a new rate, a replication of one measured: an independent realization of its stream, or more
        of a point already measured) on the visit's server, its record in run.json as it is produced."""
        run, st = visit.run, self.searched(visit.run)
        key = key_of(rate, replication)
        at = st.of_key(key)
        if at is None:
            mine = self.host.run_meta["sweep"]["points"].setdefault(run.engine, [])
            record = {"point": len(mine), "offered_rps": rate, "key": key, "kv_budget": str(run.budget), "segments": []}
            mine.append(record)
            st.points.append(record)
            at = len(st.points) - 1
        record = st.points[at]
        same = visit.last_rate == rate and visit.last_key == key  # the point goes on: nothing to warm up
        if visit.missed and not same:
            self.drain_visit(visit)
        job = PointJob(record["point"], rate, key, st.cursors.get(key, 0), target=self.host.slo.attainment,
                       warmup_guess_s=st.warmup_s, warm=not same,
                       earlier=tuple(p for p in st.judged_points() if p.key != key), **rules)
        res = visit.runner.run(job, lambda text: show(f"{run.engine:<6} {text}",
                                                      self.host.cfg.time_s - self.host.left_s))
        visit.last_rate, visit.last_key = rate, key
        record["segments"] += [{**seg, "visit": visit.number} for seg in res.segments]
        record["start_s"], record["end_s"] = record["segments"][0]["start_s"], record["segments"][-1]["end_s"]
        record["warmup_s"] = record["segments"][0]["warmup_s"]
        self.host.write_meta()
        met, index = st.judged.get(at, (np.zeros(0), np.zeros(0, dtype=int)))
        st.judged[at] = (np.concatenate([met, res.met]), np.concatenate([index, res.index]))
        st.cursors[key] = res.next_index
        st.warmup_s = max(res.warmup_s, 1.0)
        att = float(st.judged[at][0].mean()) if len(st.judged[at][0]) else None
        visit.missed = att is None or att < self.host.slo.attainment
        known = len(st.judged[at][0])
        rep = f" (replication {replication})" if replication else ""
        self.host.plain(f"{run.engine}: {rate:g} req/s{rep}: {res.judged} judged after a {res.warmup_s:.1f} s "
                        f"warm-up, SLO attainment {'n/a' if att is None else f'{100 * att:.0f} %'} of the {known} "
                        "verdicts known on this stream; "
                   + self.host.figures(run, run.sampler))
        return res

    def drain_visit(self, visit: Visit, timeout_s: float = 60.0) -> None:
        """No arrivals until the engine holds no request (a missed point's backlog would be the next point's
        warm-up, however long): the next point starts from an idle engine, as the first one did."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.supervise(visit.run)
            stats = self.host.stats_of(visit.run) if visit.run.server.alive() else None
            if stats and not stats.get("running") and not stats.get("waiting"):
                break
            time.sleep(0.3)
        visit.last_rate = visit.last_key = None

    def attainment(self, run: EngineRun, rate: float) -> float | None:
        """At `rate`, its replications' verdicts together."""
        st = self.searched(run)
        met = np.concatenate([st.judged[i][0] for i in st.of_rate(rate) if i in st.judged] or [np.zeros(0)])
        return float(met.mean()) if len(met) else None

    def revisit(self, run: EngineRun) -> Visit | None:
        """The engine's server again (a target is still running), a sampler and a load generator on it."""
        if run.engine not in self.host.targets:
            try:
                run.server = self.host.start(run)
            except ServerFailed as e:
                self.host.event(run, "crash", detail=f"did not start again at {run.budget}: {e}")
                return None
        run.sampler = run.sampler.resumed(run.server.url, run.server.proc.pid if run.server.proc else None)
        targets = self.host.targets
        run.sampler.fetch = targets[run.engine].stats if run.engine in targets else run.sampler.fetch
        run.sampler.start()
        return self.open_visit(run)

    def end_visit(self, visit: Visit) -> None:
        run = visit.run
        try:
            self.close_visit(visit)
        finally:
            run.sampler.stop()
            self.host.collect_ooms(run, run.sampler.last)
            if run.engine not in self.host.targets:
                run.server.stop()

