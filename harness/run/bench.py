"""`fragbench bench`: every engine on the same model, KV budget, threads and request stream, one after
another; memory sampled at 10 Hz; a crashed engine recorded, restarted, and the run goes on.
Everything is written as it is produced: a killed bench leaves a readable partial run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from engines import SCHEDULED
from engines.procs import free_port
from engines.registry import entry
from engines.shapes import load_shape
from harness.analysis.capacity import SLO
from harness.analysis.design import Design
from harness.analysis.headline import reference_of
from harness.analysis.integrity import sentence
from harness.analysis.steady import fewest_to_pass
from harness.results import Journal, read_journals, token_times, write_restarts
from harness.run.alloc_settings import run_settings
from harness.run.config import BenchConfig
from harness.run.debug_pass import debug_row, request_alone
from harness.run.integrity import Integrity
from harness.run.loadargs import LoadArgs, start_loadgen, stop_loadgen
from harness.run.provenance import git_sha, hardware, versions
from harness.run.sampler import Sampler, fetch_json, fetch_stats
from harness.run.search import SEARCH_START, KneeSearching
from harness.run.servers import ServerFailed, ServerProcess, start_server
from harness.run.targets import Target
from harness.run.verdicts import decision_line
from harness.run.visits import EngineRun, Visits
from harness.sim.twin import twin_of
from harness.units import KvBudget
from workloads.spec import load_spec
from workloads.streams import Streams, dispersion

ROOT = Path(__file__).resolve().parents[2]
CRASH_LINE = re.compile(r"^fragbench-crash (\{.*\})$", re.M)
OOM_STATE = ("running", "waiting", "live_tokens", "kv_usage")  # the engine when an allocation failed
SNAPSHOT_SUFFIX = {"cuda": ".json", "caching": ".pickle"}  # the emulator's: PyTorch's own _snapshot() pickle
OOM_LAYER = ("layer", "cached_free_bytes", "device_free_bytes")  # policy or allocator, and the bytes that tell
LOADGEN_STARTUP_S = 3.0  # the load generator starts its trace this long after it is launched: none late


class Bench:
    """One bench run: its engines one after another (harness/run/visits.py: how a point is measured on one;
    harness/run/search.py: which points)."""

    def __init__(self, cfg: BenchConfig, console: Console | None = None):
        self.cfg = cfg
        self.started = time.time()
        self.console = console or Console(stderr=True)
        searching = cfg.sweep and not cfg.rates
        spec = load_spec(cfg.workload)
        bursts = dispersion(spec, cfg.seed, fewest_to_pass(cfg.slo_attainment)) if searching else 1.0
        self.design = Design.of(cfg.time_s, cfg.precision, cfg.slo_attainment, cfg.point_requests, cfg.point_s,
                                cfg.knee_tolerance, cfg.points, dispersion=bursts)
        self.streams = Streams(spec, cfg.seed, cfg.max_seq_len) if cfg.sweep else None
        self.runs: dict[str, EngineRun] = {}
        self.visits = Visits(self)  # servers, load generators and points (harness/run/visits.py)
        self.searching = KneeSearching(self, self.visits)  # which points: the search and the decision
        cfg.run_id = cfg.run_id or datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{Path(cfg.workload).stem}"
        self.dir = cfg.out_dir / cfg.run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.samples = Journal(self.dir / "samples.jsonl")
        self.events = Journal(self.dir / "events.jsonl")
        self.debug = Journal(self.dir / "debug.jsonl")
        self.targets = {name: Target.restore(name, d, cfg.api_key) for name, d in cfg.targets.items()}
        self.run_meta = {
            "run_id": cfg.run_id, "status": "partial", "started": datetime.now(timezone.utc).isoformat(),
            "config": {**cfg.record(), "out_dir": str(cfg.out_dir), "api_key": "(given)" if cfg.api_key else None},
            "git_sha": git_sha(),
            "versions": versions(), "hardware": hardware(cfg.device), "engines_done": [], "command": sys.argv,
        }
        self.write_meta()

    def write_meta(self) -> None:
        tmp = self.dir / "run.json.tmp"
        tmp.write_text(json.dumps(self.run_meta, indent=2, default=str))
        tmp.replace(self.dir / "run.json")  # atomic: a kill never leaves half a run.json

    # -- the whole run
    def run(self) -> Path:
        from harness.analysis.summary import finalize

        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=self.console) as progress:
            def shower(engine: str, total: float):
                task = progress.add_task(f"{engine:<6} starting", total=max(total, 1.0))
                return lambda text, done: progress.update(task, description=text, completed=min(done, total))

            if self.cfg.sweep:
                self.run_meta["sweep"] = {"rates": self.cfg.rates, "point_s": self.cfg.point_s, "points": {},
                                          "design": self.design.to_json(),
                                          "search": None if self.cfg.rates else self.search_settings()}
                self.write_meta()
            runs = {}
            for engine in self.order():
                runs[engine] = self.run_engine(engine, shower)
                self.run_meta["engines_done"].append(engine)
                self.write_meta()
            if self.cfg.sweep and not self.cfg.rates:
                self.searching.decide(runs, shower)
        run_settings(self.cfg, self.dir, lambda cfg: Bench(cfg, self.console), self.plain)  # --compare-alloc-conf
        self.run_meta["status"] = "complete"
        self.run_meta["finished"] = datetime.now(timezone.utc).isoformat()
        self.run_meta["bench_s"] = round(time.time() - self.started, 1)
        self.write_meta()
        if self.cfg.sweep:
            self.plain("simulating the run's twin")
        summary = finalize(self.dir, twin_of(self.dir) if self.cfg.sweep else None)  # written once, whole
        if self.cfg.sweep and not self.cfg.rates:  # the last word: summary.json's own headline
            self.say(decision_line(summary.get("headline"), "as summary.json and the report say"))
        return self.dir

    def order(self) -> list[str]:
        """The engines in the order they are measured: in a knee search the paged reference first (every other
        engine's search may stop once its ratio to it is decided), then the rest as given, targets last."""
        engines = [*self.cfg.engines, *self.targets]
        ref = reference_of(self.cfg.engines) if self.cfg.sweep and not self.cfg.rates else None
        return [ref, *(e for e in engines if e != ref)] if ref else engines

    @property
    def left_s(self) -> float:
        return self.started + self.cfg.time_s - time.time()

    # -- one engine
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
        config = (fetch_stats(server.url) or {}).get("engine_config")
        if config:
            self.run_meta.setdefault("engine_config", {}).setdefault(run.engine, {})[str(run.budget)] = config
            self.write_meta()
        return server

    def event(self, run: EngineRun, kind: str, t_s: float | None = None, **fields) -> None:
        t = t_s if t_s is not None else time.time() - run.t0
        self.events.write({"engine": run.engine, "t_s": round(t, 4), "t_wall": run.t0 + t, "kind": kind, **fields})

    # -- calibration: how fast each engine can go on this workload and hardware
    def calibrate(self, run: EngineRun, show) -> float:
        """The requests/s an engine sustains when saturated: output tokens it streamed per second inside the
        window (requests still running count: an engine that runs many at once finishes them later) over
        the workload's mean output per request. The offered rate starts at four times the workload's own and
        doubles until the engine falls behind (at most four windows)."""
        from workloads.generate import trace
        from workloads.spec import load_spec

        reqs = trace(load_spec(self.cfg.workload), self.cfg.seed, self.cfg.max_seq_len).requests
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        offered = 4 * (len(reqs) - 1) / span if span > 0 else 10.0
        tokens_per_request = sum(r.max_tokens * r.n for r in reqs) / len(reqs)
        achieved = 0.0
        for attempt in range(4):
            out = self.dir / "engines" / run.engine / "calibrate" / f"{run.budget}-{attempt}"
            start = time.time() - run.t0 + LOADGEN_STARTUP_S
            self.churn(run, None, show, self.load_args(run, out=out, duration_s=self.cfg.calibrate_s, grace_s=2,
                                                       rate=offered, start_at_s=start), start)
            self.drain(run)
            rows = read_journals([out / "requests.jsonl"], "requests")
            end = start + self.cfg.calibrate_s
            tokens = sum(start <= t <= end for row in rows.itertuples() for t in token_times(row))
            achieved = tokens / self.cfg.calibrate_s / tokens_per_request
            if achieved < 0.8 * offered:  # it fell behind: that is its pace
                break
            offered *= 2
        return round(achieved, 3)

    @property
    def budgets(self) -> list[KvBudget]:
        """The KV budgets every engine is run at: the run's own first, then --kv-budgets' others (by bytes)."""
        return list(dict.fromkeys([self.cfg.kv_budget, *self.cfg.kv_budgets]))

    @property
    def slo(self) -> SLO:
        return SLO(self.cfg.slo_ttft_s, self.cfg.slo_tpot_s, self.cfg.slo_attainment)

    def search_settings(self) -> dict:
        d = self.design
        return {"max_points": d.max_points, "tolerance": d.tolerance, "step": d.step,
                "start_share_of_calibration": SEARCH_START, "min_judged": d.min_judged, "max_judged": d.max_judged,
                "search_s": self.cfg.search_s, "time_s": d.time_s, "precision": d.precision, "target": d.target}

    def run_engine(self, engine: str, shower) -> EngineRun:
        """Every budget of one engine on one clock: a server per budget, the debugging pass on the first."""
        run = self.runs[engine] = EngineRun(engine, time.time(), free_port())
        self.export_restarts()  # every engine from zero, so that a rate() over it starts at its first scrape
        # a target serves from its own memory: it is run once, its windows labelled with the run's budget
        for budget in self.budgets if engine not in self.targets else [self.cfg.kv_budget]:
            run.budget = budget
            label = engine if budget == self.cfg.kv_budget else f"{engine}@{budget}"
            total = self.cfg.duration_s if not self.cfg.sweep else max(1.0, self.left_s)
            self.run_budget(run, shower(label, total))
        run.budget = self.cfg.kv_budget
        return run

    def run_budget(self, run: EngineRun, show) -> None:
        engine, first = run.engine, run.budget == self.cfg.kv_budget
        target = self.targets.get(engine)
        began = time.time()
        try:
            run.server = target or self.start(run)
        except ServerFailed as e:
            self.event(run, "crash", detail=f"did not start at {run.budget}: {e}")
            show(f"{engine:<6} did not start", 0)
            return
        map_path = self.dir / (f"memory_map-{engine}.json" if first else f"memory_map-{engine}-{run.budget}.json")
        sampler = run.sampler = Sampler(engine, run.server.url, run.server.proc.pid if run.server.proc else None,
                                        self.samples, run.t0, map_path,
                                        fetch=target.stats if target else None).start()
        if target:
            self.run_meta.setdefault("targets", {})[engine] = target.describe()
            self.write_meta()
        own = first and target is None  # the debugging pass needs the server's process and its /stats
        try:
            if own:
                self.debug_passes(run, show)
            check = self.integrity_idle(run, show) if first else None
            searching = self.cfg.sweep and not self.cfg.rates
            with check if searching and check else nullcontext():  # probes into the saturating calibration
                calibrated = self.calibrate_at(run, show) if searching else None
            if first:
                run.t0 = time.time()  # the churn starts the engine's clock; finalize re-bases earlier rows
                self.run_meta.setdefault("engine_t0", {})[engine] = run.t0
                self.write_meta()
            sampler.t0 = run.t0
            run.setup_s += time.time() - began
            self.run_meta.setdefault("setup_s", {})[engine] = round(run.setup_s, 1)
            if self.cfg.sweep:
                visit = self.visits.open_visit(run)
                try:
                    if calibrated is not None:
                        self.searching.search(visit, show, calibrated)
                    else:
                        with check or nullcontext():  # --rates: no calibration; the probes run beside the points
                            self.searching.fixed_rates(visit, show)
                finally:
                    self.visits.close_visit(visit)
            else:
                with check or nullcontext():
                    self.churn(run, sampler, show, self.load_args(run, start_at_s=LOADGEN_STARTUP_S))
                self.plain(f"{engine}: churn done at {time.time() - run.t0:.0f} s; {self.figures(run, sampler)}")
            if check:
                self.plain(f"{engine}: KV integrity: {sentence(check.result())}")
            if own:
                time.sleep(1.0)
                self.debug_pass(run, "after the churn mix")
                self.releases(run)
        finally:
            sampler.stop()
            self.collect_ooms(run, sampler.last)
            run.server.stop()

    def debug_passes(self, run: EngineRun, show) -> None:
        show(f"{run.engine:<6} debug pass", 0)
        self.plain(f"{run.engine}: server up, debugging pass")
        self.debug_pass(run, "after model load")
        self.debug_pass(run, "short request alone", request_alone(run.server.url, prompt_tokens=16, max_tokens=16))
        self.debug_pass(run, "long request alone", request_alone(run.server.url, int(self.cfg.max_seq_len * 0.75), 32))
        self.debug_pass(run, "after those requests complete")

    def integrity_idle(self, run: EngineRun, show) -> Integrity:
        """The KV-integrity probes served alone on the idle engine (harness/run/integrity.py): the answers the
        ones sent into its load are judged against. Rows in engines/<name>/integrity.jsonl as they come."""
        show(f"{run.engine:<6} integrity probes", 0)
        d = self.dir / "engines" / run.engine
        journal = Journal(d / "integrity.jsonl")
        target = self.targets.get(run.engine)
        check = Integrity(run.server.url, self.cfg.max_seq_len, load_shape(self.cfg.model).dtype, self.cfg.api,
                          target.model if target else None, target.api_key if target else None,
                          state=lambda: self.stats_of(run) if run.server.alive() else None, on_row=journal.write)
        (d / "integrity.json").write_text(json.dumps(check.idle(), indent=2))
        return check

    def debug_pass(self, run: EngineRun, phase: str, stats: dict | None = None) -> None:
        row = debug_row(run.engine, run.server.url, run.server.proc.pid, phase, stats)
        if row is not None:
            self.debug.write(row)

    def calibrate_at(self, run: EngineRun, show) -> float:
        rate = self.calibrate(run, lambda text, done: show(f"{run.engine:<6} calibrating", 0))
        self.plain(f"{run.engine}: calibrated at {rate:g} req/s ({run.budget})")
        self.run_meta.setdefault("calibration", {}).setdefault(run.engine, {})[str(run.budget)] = rate
        self.write_meta()
        return rate

    def load_args(self, run: EngineRun, **changes) -> LoadArgs:
        target = self.targets.get(run.engine)
        mine = {"model": target.model, "api_key": target.api_key} if target else {}
        return replace(LoadArgs.of(self.cfg, target=run.server.url, out=self.dir / "engines" / run.engine, t0=run.t0,
                                   engine=run.engine, **mine), **changes)

    def drain(self, run: EngineRun, timeout_s: float = 20.0) -> None:
        """A calibration window's requests finish before the next begins."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            stats = self.stats_of(run) if run.server.alive() else None
            if stats and not stats.get("running") and not stats.get("waiting"):
                return
            time.sleep(0.2)

    def stats_of(self, run: EngineRun) -> dict | None:
        return run.server.stats() if run.engine in self.targets else fetch_stats(run.server.url)

    def watch(self, run: EngineRun) -> None:
        """A target that stops answering is down from then until it answers again; the run goes on."""
        now = time.time() - run.t0
        if now - run.checked_s < 2.0:
            return
        run.checked_s = now
        up = run.server.alive()
        if not up and run.down_since is None:
            run.down_since = now
            self.event(run, "crash", now, detail="the target stopped answering /v1/models (fragbench never "
                                                 "restarts a target)")
        elif up and run.down_since is not None:
            self.event(run, "restart", now, detail=f"the target answers again, down {now - run.down_since:.1f} s")
            run.down.append((run.down_since, now))
            run.down_since = None
            (self.dir / "engines" / run.engine).mkdir(parents=True, exist_ok=True)
            (self.dir / "engines" / run.engine / "down.json").write_text(json.dumps(run.down))

    @staticmethod
    def figures(run: EngineRun, sampler: Sampler | None) -> str:
        last = (sampler.last if sampler else None) or {}
        return (f"{last.get('oom_total', 'n/a')} OOMs ({last.get('oom_fragmentation', 'n/a')} fragmentation) so far, "
                f"{run.crashes} crashes, {last.get('preempted_total', 'n/a')} preemptions")

    def say(self, line: str) -> None:
        """A line every console shows, a terminal's too (the verdict)."""
        if self.console.is_terminal:
            self.console.print(line, markup=False, highlight=False)
        else:
            self.plain(line)

    def plain(self, line: str) -> None:
        """Progress where no terminal shows the bars (cron, CI logs): one line per phase."""
        if not self.console.is_terminal:
            print(f"fragbench bench: {line}", file=sys.stderr, flush=True)

    def churn(self, run: EngineRun, sampler: Sampler | None, show, load: LoadArgs, start_s: float = 0.0) -> None:
        out = load.out
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "loadgen.log", "ab") as log:
            loadgen = start_loadgen(load, stdout=log, stderr=subprocess.STDOUT)
        killed = False
        try:
            while loadgen.poll() is None:
                elapsed = time.time() - run.t0
                if self.cfg.kill_after_s is not None and not killed and elapsed >= self.cfg.kill_after_s \
                        and run.server.proc is not None:
                    run.server.proc.kill()  # fault injection: the engine dies mid-run, as a GPU fault would
                    run.server.proc.wait()
                    killed = True
                show(f"{run.engine:<6} churn ({run.crashes} crashes)", max(0.0, elapsed - start_s))
                if sampler is not None:
                    self.collect_ooms(run, sampler.last)
                if run.engine in self.targets:
                    self.watch(run)
                elif not run.server.alive():
                    self.restart(run, sampler)
                time.sleep(0.3)
        finally:
            stop_loadgen(loadgen)
        show(f"{run.engine:<6} done ({run.crashes} crashes)", load.duration_s)

    def restart(self, run: EngineRun, sampler: Sampler | None) -> None:
        crashed_at = time.time() - run.t0
        log = run.server.log_path.read_text(errors="replace")
        crash = CRASH_LINE.findall(log)
        detail = json.loads(crash[-1]) if crash else {}
        if detail:
            self.oom_event(run, crashed_at, detail, "the engine crashed on it")
        self.event(run, "crash", crashed_at, detail=f"exit code {run.server.proc.returncode}",
                   cause=detail.get("cause"))
        run.crashes += 1
        self.export_restarts()
        run.oom_seen = 0  # a new process counts from zero
        try:
            run.server = self.start(run)
        except ServerFailed as e:
            self.event(run, "crash", detail=f"restart failed: {e}")
            raise
        back = time.time() - run.t0
        run.down.append((crashed_at, back))
        if sampler is not None:
            sampler.process = psutil.Process(run.server.proc.pid)
        self.event(run, "restart", back, detail=f"down {back - crashed_at:.1f} s")
        (self.dir / "engines" / run.engine).mkdir(parents=True, exist_ok=True)
        with open(self.dir / "engines" / run.engine / "down.json", "w") as f:
            json.dump(run.down, f)

    def export_restarts(self) -> None:
        """A server cannot count its own deaths, its supervisor can (results.write_restarts)."""
        write_restarts(self.dir / "metrics" / "supervisor.prom", {name: r.crashes for name, r in self.runs.items()})

    def collect_ooms(self, run: EngineRun, stats: dict | None) -> None:
        """OOM events the server recorded since the last look (it keeps its latest 100)."""
        if not stats or stats.get("oom_total", 0) <= run.oom_seen:
            return
        new = stats["oom_total"] - run.oom_seen
        offset = time.time() - run.t0 - stats.get("t_s", 0)  # server uptime -> engine time
        for ev in stats.get("oom_events", [])[-new:]:
            self.oom_event(run, ev["t_s"] + offset, ev, "the request failed")
        run.oom_seen = stats["oom_total"]

    def oom_event(self, run: EngineRun, t_s: float, ev: dict, outcome: str) -> None:
        """One failed allocation with the engine's state then, as columns (and a sentence in `detail`)."""
        state = {k: ev.get(k) for k in OOM_STATE}
        words = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                          for k, v in state.items() if v is not None)
        # which layer failed, where a caching allocator holds the KV (engines/memory/caching_memory.py); null elsewhere
        layer = {k: ev.get(k) if self.cfg.memory == "caching" else None for k in OOM_LAYER}
        self.event(run, "oom", t_s, requested_bytes=ev.get("requested_bytes"), free_bytes=ev.get("free_bytes"),
                   largest_free_bytes=ev.get("largest_free_bytes"), cause=ev.get("cause"),
                   detail=f"{outcome}; {words}", **state, **layer)

    def releases(self, run: EngineRun) -> None:
        stats = fetch_json(f"{run.server.url}/stats?releases=1", timeout_s=10)
        for value in (stats or {}).get("abort_release_s") or []:
            self.event(run, "cancel_release", detail=f"{value:.6f}", requested_bytes=None,
                       cause=None, release_s=value)
