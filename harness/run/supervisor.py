"""The engines' servers under supervision: started with the run's flags, watched (a target) or restarted after a
crash (one of ours), their OOMs collected, every crash, restart and OOM an event in the run's record, and the
restarts counted for Prometheus (results.write_restarts)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import replace

import psutil

from engines import SCHEDULED
from engines.api.stats import OomEventRow, StatsPayload
from engines.registry import entry
from harness.results import write_restarts, write_whole
from harness.run.config import BenchConfig
from harness.run.engine_run import EngineRun
from harness.run.loadargs import LoadArgs
from harness.run.record import RunWriter
from harness.run.servers import ServerFailed, ServerProcess, start_server
from harness.run.stats_poller import StatsPoller, fetch_stats
from harness.run.targets import Target

CRASH_LINE = re.compile(r"^fragbench-crash (\{.*\})$", re.M)
SNAPSHOT_SUFFIX = {"cuda": ".json", "caching": ".pickle"}  # the emulator's: PyTorch's own _snapshot() pickle


class Supervisor:
    """Every engine of the run (`runs`, by name), ours started and restarted here, targets only watched."""

    def __init__(self, cfg: BenchConfig, targets: dict[str, Target], record: RunWriter):
        self.cfg, self.targets, self.record = cfg, targets, record
        self.dir = record.dir
        self.runs: dict[str, EngineRun] = {}

    def server_args(self, engine: str, port: int) -> list[str]:
        args = ["--port", str(port), "--max-seq-len", str(self.cfg.max_seq_len), *self.cfg.engine_args.get(engine, [])]
        return args if not entry(engine).in_house else [*args, "--threads", str(self.cfg.threads), "--device",
                                                        self.cfg.device, "--memory", self.cfg.memory,
                                                        *(["--alloc-conf", self.cfg.alloc_conf] if self.cfg.alloc_conf
                                                          else [])]

    def start(self, run: EngineRun) -> ServerProcess:
        log = self.dir / "logs" / f"{run.engine}.log"
        extra = self.server_args(run.engine, run.port)
        if run.engine in SCHEDULED:  # the rows the twin's step model is fitted on (harness/sim/twin.py)
            extra += ["--step-log", str(self.dir / "engines" / run.engine / f"steps-{run.budget}.csv")]
        if self.cfg.memory in SNAPSHOT_SUFFIX and entry(run.engine).in_house:  # the allocator at the first OOM
            name = f"{self.cfg.memory}_snapshot-{run.engine}" + ("" if run.budget == self.cfg.kv_budget
                                                                else f"-{run.budget}")
            extra += ["--oom-snapshot", str(self.dir / f"{name}{SNAPSHOT_SUFFIX[self.cfg.memory]}")]
        server = start_server(run.engine, self.cfg.model, run.budget, log, extra=extra, threads=self.cfg.threads,
                              alloc_conf=self.cfg.alloc_conf if self.cfg.memory == "cuda" else None)
        stats = fetch_stats(server.url)
        config = stats.engine_config if stats is not None else None
        if config is not None and config.written():  # as the server sent it: run.json records it
            self.record.engine_config(run.engine, run.budget, config)
        return server

    def load_args(self, run: EngineRun, **changes) -> LoadArgs:
        target = self.targets.get(run.engine)
        mine = {"model": target.model, "api_key": target.api_key} if target else {}
        return replace(LoadArgs.of(self.cfg, target=run.server.url, out=self.dir / "engines" / run.engine, t0=run.t0,
                                   engine=run.engine, **mine), **changes)

    def stats_of(self, run: EngineRun) -> StatsPayload | None:
        return run.server.stats() if run.engine in self.targets else fetch_stats(run.server.url)

    def drain(self, run: EngineRun, timeout_s: float = 20.0, poll_s: float = 0.2,
              each_look: Callable[[], None] = lambda: None) -> None:
        """Until the engine holds no request, running or waiting (or `timeout_s`): a calibration window's requests
        finish before the next begins, a point's before the next point. `each_look`: what the caller does at every
        look first (a visit supervises its server: OOMs recorded, a crashed one restarted)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            each_look()
            stats = self.stats_of(run) if run.server.alive() else None
            if stats and not stats.running and not stats.waiting:
                return
            time.sleep(poll_s)

    def supervise(self, run: EngineRun, sampler: StatsPoller | None) -> None:
        """Called between looks at a running load: OOMs the server recorded, a crashed server restarted, a
        target's down time."""
        if sampler is not None:
            self.collect_ooms(run, sampler.last)
        if run.engine in self.targets:
            self.watch(run)
        elif not run.server.alive():
            self.restart(run, sampler)

    def watch(self, run: EngineRun) -> None:
        """A target that stops answering is down from then until it answers again; the run goes on."""
        now = time.time() - run.t0
        if now - run.checked_s < 2.0:
            return
        run.checked_s = now
        up = run.server.alive()
        if not up and run.down_since is None:
            run.down_since = now
            self.record.event(run, "crash", now, detail="the target stopped answering /v1/models (fragbench never "
                                                        "restarts a target)")
        elif up and run.down_since is not None:
            self.record.event(run, "restart", now,
                              detail=f"the target answers again, down {now - run.down_since:.1f} s")
            run.down.append((run.down_since, now))
            run.down_since = None
            (self.dir / "engines" / run.engine).mkdir(parents=True, exist_ok=True)
            write_whole(self.dir / "engines" / run.engine / "down.json", json.dumps(run.down))  # rewritten: whole

    def restart(self, run: EngineRun, sampler: StatsPoller | None) -> None:
        crashed_at = time.time() - run.t0
        log = run.server.log_path.read_text(errors="replace")
        crash = CRASH_LINE.findall(log)
        detail = json.loads(crash[-1]) if crash else {}
        if detail:
            self.record.oom_event(run, crashed_at, OomEventRow.model_validate(detail), "the engine crashed on it")
        self.record.event(run, "crash", crashed_at, detail=f"exit code {run.server.proc.returncode}",
                          cause=detail.get("cause"))
        run.crashes += 1
        self.export_restarts()
        run.oom_seen = 0  # a new process counts from zero
        try:
            run.server = self.start(run)
        except ServerFailed as e:
            self.record.event(run, "crash", detail=f"restart failed: {e}")
            raise
        back = time.time() - run.t0
        run.down.append((crashed_at, back))
        if sampler is not None:
            sampler.process = psutil.Process(run.server.proc.pid)
        self.record.event(run, "restart", back, detail=f"down {back - crashed_at:.1f} s")
        (self.dir / "engines" / run.engine).mkdir(parents=True, exist_ok=True)
        write_whole(self.dir / "engines" / run.engine / "down.json", json.dumps(run.down))

    def export_restarts(self) -> None:
        """A server cannot count its own deaths, its supervisor can (results.write_restarts)."""
        write_restarts(self.dir / "metrics" / "supervisor.prom", {name: r.crashes for name, r in self.runs.items()})

    def collect_ooms(self, run: EngineRun, stats: StatsPayload | None) -> None:
        """OOM events the server recorded since the last look (it keeps its latest 100)."""
        if not stats or (stats.oom_total or 0) <= run.oom_seen:
            return
        new = stats.oom_total - run.oom_seen
        offset = time.time() - run.t0 - (stats.t_s or 0)  # server uptime -> engine time
        for ev in (stats.oom_events or [])[-new:]:
            assert ev.t_s is not None, "an OOM event of /stats carries its server time (only a crash line lacks it)"
            self.record.oom_event(run, ev.t_s + offset, ev, "the request failed")
        run.oom_seen = stats.oom_total

    @staticmethod
    def figures(run: EngineRun, sampler: StatsPoller | None) -> str:
        last = (sampler.last if sampler else None) or StatsPayload()

        def said(name: str):  # "n/a" where the server's stats lack the counter (a target's metrics)
            return last.figure(name) if last.has(name) else "n/a"

        return (f"{said('oom_total')} OOMs ({said('oom_fragmentation')} fragmentation) so far, "
                f"{run.crashes} crashes, {said('preempted_total')} preemptions")
