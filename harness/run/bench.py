"""`fragbench bench`: every engine on the same model, KV budget, threads and request stream, one after
another; memory sampled at 10 Hz; a crashed engine recorded, restarted, and the run goes on.
Everything is written as it is produced: a killed bench leaves a readable partial run."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from pathlib import Path

from rich.console import Console as RichConsole

from engines.procs import free_port
from harness.analysis.design import Design
from harness.analysis.headline import reference_of
from harness.analysis.integrity import sentence
from harness.analysis.rundir import request_rows
from harness.analysis.saturation import repeats_by_rule, reserve_s, saturation_words
from harness.analysis.steady import fewest_to_pass
from harness.analysis.summary import finalize
from harness.results import Journal, measured_nothing
from harness.run.alloc_settings_runs import run_settings
from harness.run.calibration import LOADGEN_STARTUP_S, Calibration
from harness.run.clock import Clock
from harness.run.config import BenchConfig
from harness.run.console import Console, Show, Shower
from harness.run.engine_run import EngineRun
from harness.run.probes import Probes
from harness.run.record import RunWriter, claim_run_dir
from harness.run.saturation_runs import SaturationRuns
from harness.run.search import KneeSearching, likely_rival
from harness.run.servers import ServerFailed
from harness.run.stats_poller import StatsPoller
from harness.run.supervisor import Supervisor
from harness.run.targets import Target
from harness.run.verdicts import decision_line
from harness.run.visits import Visits
from harness.sim.spread_prior import STREAMS, prior_block, timed_priors
from harness.sim.stepfit import run_steps
from harness.sim.twin import twin_of, twins_of
from harness.units import KvBudget
from workloads.generate import has_shared_prefixes
from workloads.spec import load_spec
from workloads.streams import Streams, dispersion

ROOT = Path(__file__).resolve().parents[2]


class Bench:
    """One bench run: its engines one after another. It builds the run's pieces and hands each the ones it
    needs: the clock and console, the record (harness/run/record.py: run.json and the events), the servers'
    supervision (supervisor.py), calibration, the probes outside the load (probes.py), the visits that measure
    a point (visits.py) and the search that picks them (search.py). None of them holds the bench."""

    def __init__(self, cfg: BenchConfig, console: RichConsole | None = None):
        self.cfg = cfg
        self.clock = Clock(cfg.time_s)
        self.console = Console(console)
        searching = cfg.sweep and not cfg.rates
        spec = load_spec(cfg.workload)
        bursts = dispersion(spec, cfg.seed, fewest_to_pass(cfg.slo_attainment)) if searching else 1.0
        self.design = Design.of(cfg.time_s, cfg.precision, cfg.slo_attainment, cfg.point_requests, cfg.point_s,
                                cfg.knee_tolerance, cfg.points, dispersion=bursts)
        streams = Streams(spec, cfg.seed, cfg.max_seq_len) if cfg.sweep else None
        default_id = datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{Path(cfg.workload).stem}"
        self.dir = claim_run_dir(cfg.out_dir, cfg.run_id or default_id, numbered=not cfg.run_id)  # its own, alone
        cfg.run_id = self.dir.name
        self.samples = Journal(self.dir / "samples.jsonl")
        self.targets = {name: Target.restore(name, d, cfg.api_key) for name, d in cfg.targets.items()}
        self.record = RunWriter.start(cfg, self.dir)
        self.servers = Supervisor(cfg, self.targets, self.record)
        self.calibration = Calibration(cfg, self.servers)
        self.probes = Probes(cfg, self.servers, self.record, self.console)
        self.visits = Visits(cfg, self.clock, self.record, self.servers, self.console, streams)  # a point measured
        self.started: set[str] = set()  # engines whose server started (at any budget)
        self.unstarted: dict[str, str] = {}  # engine: why its server did not start (its first refusal)
        self.failure: str | None = None  # why the run measured nothing, once it is over
        repeats = cfg.throughput_repeats if cfg.throughput_repeats is not None else repeats_by_rule(cfg.time_s)
        self.saturation_repeats = repeats if searching else 0  # pairs of saturation sets after the decision
        self.clock.reserved_s = reserve_s(self.saturation_repeats)  # held back from the search and the decision
        self.searching = KneeSearching(cfg, self.design, self.clock, self.record, self.console, self.visits,
                                       self.order(), self.budgets, self.targets)  # which points: search, decision

    # -- the whole run
    def run(self) -> Path:
        with self.console.progress() as shower:
            if self.cfg.sweep:
                self.record.sweep(self.cfg.rates, self.cfg.point_s, self.design,
                                  None if self.cfg.rates else self.searching.settings())
            runs = {}
            order = self.order()
            self.record.speed_probe("start")  # the machine's speed, with no server up (run/speed_probes.py)
            for i, engine in enumerate(order):
                runs[engine] = self.run_engine(engine, shower)
                self.record.engine_done(engine)
                if i == (len(order) - 1) // 2:
                    self.record.speed_probe("middle")
            if self.cfg.sweep and not self.cfg.rates:
                self.spread_prior()
                self.searching.decide(runs, shower)
                self.saturation()
            self.record.speed_probe("end")
        run_settings(self.cfg, self.dir, lambda cfg: Bench(cfg, self.console.rich),  # --compare-alloc-conf
                     self.console.plain)
        self.failure = self.measured_nothing()  # before the summary: its status says so too
        self.record.complete(self.clock.started, self.failure)
        if self.cfg.sweep and self.started:
            self.console.plain("simulating the run's twin")
        summary = finalize(self.dir, twin_of(self.dir) if self.cfg.sweep and self.started else None)  # whole, once
        if self.failure is None and self.cfg.sweep and not self.cfg.rates:  # the last word: summary.json's headline
            self.console.say(decision_line(summary.headline, "as summary.json and the report say"))
        if summary.saturation_throughput is not None:  # beside the headline, never instead of it
            self.console.say(saturation_words(summary.saturation_throughput))
        return self.dir

    def measured_nothing(self) -> str | None:
        """Why the run measured nothing (no engine's server started, or every request failed), or None."""
        if not self.started:
            return "no engine started: " + "; ".join(self.unstarted.values()) if self.unstarted else "no engine ran"
        why = measured_nothing(request_rows(self.dir))
        return f"{', '.join(sorted(self.started))}: {why}" if why else None

    def saturation(self) -> None:
        """The saturation sets beside the headline (run/saturation_runs.py), on the time held back for them: the
        headline's two engines as the decision left them, each set sized by their calibrated rates."""
        self.clock.reserved_s = 0.0
        h = self.searching.verdict().headline
        if not self.saturation_repeats or h is None or {h.engine, h.against} & set(self.targets):
            return
        rates = {e: self.record.meta.get("calibration", {}).get(e, {}).get(str(self.cfg.kv_budget), 0.0)
                 for e in (h.engine, h.against)}
        try:
            SaturationRuns(self.cfg, self.dir, self.servers, self.console).run(h.engine, h.against, rates,
                                                                               self.saturation_repeats)
        except ServerFailed:
            pass  # said on the console; the pairs served so far are the record

    def spread_prior(self) -> None:
        """The headline engines' stream-spread priors from their twins (harness/sim/spread_prior.py), once, before
        the decision: each twin fitted on the steps its engine ran so far, offered fresh streams around its own
        knee; run.json records them and every fit from then on reads them there. An engine without a twin (no
        steps, or not an engine fragbench schedules) keeps the half-t."""
        v = self.searching.verdict()
        if v.headline is None or v.fit is None:
            return
        meta, cfg = self.record.typed(), self.cfg
        pair = (v.headline.engine, v.headline.against)
        twins = {e: t for e, t in twins_of(meta, run_steps(self.dir), has_shared_prefixes(load_spec(cfg.workload)))
                 .items() if e in pair}
        knees = {e: v.fit.estimates[e].rps for e in twins if e in v.fit.estimates}
        if not knees:
            return
        judged = self.design.min_judged
        try:
            priors, seconds = timed_priors(twins, knees, meta.config.slo, meta.config.budget.bytes, cfg.workload,
                                           int(cfg.seed or 0), cfg.max_seq_len, judged)
        except (ValueError, KeyError) as e:  # a twin that cannot run this budget or configuration: the half-t
            self.console.plain(f"no spread prior from the twins ({type(e).__name__}: {e}): the half-t")
            return
        self.record.spread_prior(prior_block(priors, seconds, STREAMS, judged))
        c = priors.correlation
        self.console.plain("spread prior from the twins (" + f"{seconds:.1f} s): " + "; ".join(
            f"{e} s {p.prior.centre:.3f}, gain {p.prior.gain:.2f} (twin's knee {p.twin_knee_rps:.3g} req/s)"
            for e, p in priors.engines.items()) + ("" if c is None else f"; residual correlation {c.estimate:.2f}, "
                                                   f"the joint fit uses its lower bound {c.lower:.2f}"))

    def order(self) -> list[str]:
        """The engines in the order they are measured: in a knee search the paged reference first (every other
        engine's search may stop once its ratio to it is decided), then the contiguous engine likeliest to be its
        rival (search.likely_rival: every other engine is screened against it), then the rest as given, targets
        last."""
        cfg = self.cfg
        engines = [*cfg.engines, *self.targets]
        ref = reference_of(cfg.engines) if cfg.sweep and not cfg.rates else None
        if ref is None:
            return engines
        rival = likely_rival(cfg.engines, cfg.workload, cfg.kv_budget, cfg.model)
        first = [ref, *([rival] if rival else [])]
        return [*first, *(e for e in engines if e not in first)]

    @property
    def budgets(self) -> list[KvBudget]:
        """The KV budgets every engine is run at: the run's own first, then --kv-budgets' others (by bytes)."""
        return list(dict.fromkeys([self.cfg.kv_budget, *self.cfg.kv_budgets]))

    # -- one engine
    def run_engine(self, engine: str, shower: Shower) -> EngineRun:
        """Every budget of one engine on one clock: a server per budget, the debugging pass on the first."""
        run = self.servers.runs[engine] = EngineRun(engine, time.time(), free_port())
        self.servers.export_restarts()  # every engine from zero, so that a rate() over it starts at its first scrape
        # a target serves from its own memory: it is run once, its windows labelled with the run's budget
        for budget in self.budgets if engine not in self.targets else [self.cfg.kv_budget]:
            run.budget = budget
            label = engine if budget == self.cfg.kv_budget else f"{engine}@{budget}"
            total = self.cfg.duration_s if not self.cfg.sweep else max(1.0, self.clock.left_s)
            self.run_budget(run, shower(label, total))
        run.budget = self.cfg.kv_budget
        return run

    def run_budget(self, run: EngineRun, show: Show) -> None:
        engine, first = run.engine, run.budget == self.cfg.kv_budget
        target = self.targets.get(engine)
        began = time.time()
        try:
            run.server = target or self.servers.start(run)
        except ServerFailed as e:
            self.record.event(run, "crash", detail=f"did not start at {run.budget}: {e}")
            show(f"{engine:<6} did not start", 0)
            self.console.plain(f"{engine}: did not start at {run.budget}: {e}")  # the server's own error, on screen
            self.unstarted.setdefault(engine, str(e))
            return
        self.started.add(engine)
        map_path = self.dir / (f"memory_map-{engine}.json" if first else f"memory_map-{engine}-{run.budget}.json")
        sampler = run.sampler = StatsPoller(engine, run.server.url, run.server.proc.pid if run.server.proc else None,
                                        self.samples, run.t0, map_path,
                                        fetch=target.stats if target else None).start()
        if target:
            self.record.target(engine, target.describe())
        own = first and target is None  # the debugging pass needs the server's process and its /stats
        try:
            if own:
                self.probes.debug_passes(run, show)
            check = self.probes.integrity_idle(run, show) if first else None
            searching = self.cfg.sweep and not self.cfg.rates
            with check if searching and check else nullcontext():  # probes into the saturating calibration
                calibrated = self.calibrate_at(run, show) if searching else None
            if first:
                run.t0 = time.time()  # the churn starts the engine's clock; finalize re-bases earlier rows
                self.record.engine_t0(engine, run.t0)
            sampler.t0 = run.t0
            run.setup_s += time.time() - began
            self.record.setup_s(engine, run.setup_s)
            if self.cfg.sweep:
                self.measure_points(run, show, calibrated, check)
            else:
                with check or nullcontext():
                    self.calibration.churn(run, sampler, show,
                                           self.servers.load_args(run, start_at_s=LOADGEN_STARTUP_S))
                self.console.plain(f"{engine}: churn done at {time.time() - run.t0:.0f} s; "
                                   f"{self.servers.figures(run, sampler)}")
            if check:
                self.console.plain(f"{engine}: KV integrity: {sentence(check.judged())}")
            if own:
                self.probes.after_churn(run)
        finally:
            sampler.stop()
            self.servers.collect_ooms(run, sampler.last)
            run.server.stop()

    def measure_points(self, run: EngineRun, show: Show, calibrated: float | None,
                       check: AbstractContextManager | None) -> None:
        """--sweep: one visit of the engine's server, its knee search (or --rates' points) measured on it."""
        visit = self.visits.open_visit(run)
        try:
            if calibrated is not None:
                self.searching.search(visit, show, calibrated)
            else:
                with check or nullcontext():  # --rates: no calibration; the probes run beside the points
                    self.searching.fixed_rates(visit, show)
        finally:
            self.visits.close_visit(visit)

    def calibrate_at(self, run: EngineRun, show: Show) -> float:
        rate = self.calibration.calibrate(run, lambda text, done: show(f"{run.engine:<6} calibrating", 0))
        self.console.plain(f"{run.engine}: calibrated at {rate:g} req/s ({run.budget})")
        self.record.calibration(run.engine, run.budget, rate)
        return rate
