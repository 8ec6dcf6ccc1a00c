"""Which points a bench measures: each engine's knee search within its share of the time, then the decision
phase, which gives the headline's two engines more judged requests where they narrow its interval most
(harness/analysis/design.py says the rules, harness/analysis/headline.py what is decided)."""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import replace

import numpy as np

from harness.analysis.design import Design, share_s
from harness.analysis.headline import PAGED, reference_of
from harness.analysis.knee import KneeSearch, knee_points, pooled
from harness.analysis.operating import OPERATING_JUDGED, OPERATING_REPLICATION, operating_key, operating_rate
from harness.analysis.placement import next_rate
from harness.analysis.records import SearchSettings
from harness.run.clock import Clock
from harness.run.config import BenchConfig
from harness.run.console import Console, Show, Shower
from harness.run.engine_run import EngineRun, Searched
from harness.run.record import RunRecord
from harness.run.verdicts import Verdict, verdict_now
from harness.run.visits import Visit, Visits
from harness.units import KvBudget
from workloads.streams import replication_of

SEARCH_START = 0.75  # the knee search's first rate, as a share of the engine's calibrated saturation rate
PER_VISIT = 2  # turns an engine takes per visit in the decision: a restart shared by a point above and one below

SETUP_GUESS_S = 45.0  # an engine's set-up (server, debugging pass, calibration) before any has been measured


class KneeSearching:
    """The search and the decision: which points each engine's visits measure. It is handed the run's
    configuration, design, clock, record (run.json) and console, and the engines and budgets in the order they
    are searched (`targets`: the engines that are not ours, searched at one budget); the points themselves it
    measures through `visits`."""

    def __init__(self, cfg: BenchConfig, design: Design, clock: Clock, record: RunRecord, console: Console,
                 visits: Visits, order: list[str], budgets: list[KvBudget], targets: Collection[str]):
        self.cfg, self.design, self.clock, self.record, self.console = cfg, design, clock, record, console
        self.visits, self.order, self.budgets, self.targets = visits, order, budgets, targets

    def settings(self) -> SearchSettings:
        """run.json's `sweep.search`: the rules the searches run by."""
        d = self.design
        return SearchSettings(max_points=d.max_points, tolerance=d.tolerance, step=d.step,
                              start_share_of_calibration=SEARCH_START, min_judged=d.min_judged,
                              max_judged=d.max_judged, search_s=self.cfg.search_s, time_s=d.time_s,
                              precision=d.precision, target=d.target)

    def search(self, visit: Visit, show: Show, calibrated_rps: float) -> None:
        """The knee search (harness/analysis/knee.py) on the visit's server, within the engine's share of the
        time; an engine other than the reference stops once its ratio to the reference is decided."""
        run, d = visit.run, self.design
        st = self.visits.searched(run)
        budget_s = share_s(self.clock.left_s, self.units_left(run), self.setup_s(), self.headline_possible())
        if self.cfg.search_s is not None:
            budget_s = min(budget_s, self.cfg.search_s)
        # a calibration that found nothing (a naive engine that crashed in its window) starts at the rate at which
        # a clear miss is judged in half the engine's share: a point it can afford
        start = SEARCH_START * calibrated_rps if calibrated_rps > 0 else d.early_judged / max(budget_s / 2, 1e-9)
        st.search = KneeSearch(max(start, 0.05), d.target, math.inf if d.tolerance is None else d.tolerance, d.step,
                               max_points=d.max_points)
        stop_by = time.time() - run.t0 + budget_s
        self.operating_point(visit, show, stop_by)
        self.console.plain(f"{run.engine}: searching for {budget_s:.0f} s")
        while (rate := st.search.next_rate()) is not None:
            if not self.fits(run, rate, stop_by):
                self.console.plain(f"{run.engine}: search stopped, its {budget_s:.0f} s spent")
                break
            self.visits.measure(visit, rate, show, min_judged=d.min_judged, max_judged=d.max_judged,
                                min_judged_s=d.min_judged_s, early_judged=d.early_judged, stop_by_s=stop_by)
            st.search.record(rate, self.visits.attainment(run, rate))
            if self.far_enough(run, visit):
                ref = reference_of(self.cfg.engines)
                self.console.plain(f"{run.engine}: its ratio to {ref} is decided: search done")
                break
        lo, hi = st.search.bracket()
        self.console.plain(f"{run.engine}: knee between {lo} and {hi} req/s after {len(st.search.measured)} points")

    def operating_point(self, visit: Visit, show: Show, stop_by: float) -> None:
        """The engine's fixed operating point first (analysis/operating.py: a rate from the repository's table
        for this workload, budget and model, on its own stream), at the run's own budget, where the table has
        one: the point every pair of default runs shares, which the nightly gate compares."""
        cfg, run = self.cfg, visit.run
        if run.budget != cfg.kv_budget or run.engine in self.targets:
            return
        rate = operating_rate(cfg.workload, run.budget.bytes, cfg.model, run.engine)
        if rate is None:
            return
        self.record.operating_point(run.engine, rate, [operating_key(rate)])
        self.console.plain(f"{run.engine}: its operating point, {rate:g} req/s on its fixed stream")
        self.visits.measure(visit, rate, show, replication=OPERATING_REPLICATION, min_judged=OPERATING_JUDGED,
                            max_judged=OPERATING_JUDGED, early_judged=OPERATING_JUDGED, fixed=True, stop_by_s=stop_by)

    def fixed_rates(self, visit: Visit, show: Show) -> None:
        """--rates: every engine at the same given rates, each judged for --point-duration seconds (and
        --point-requests requests) past its warm-up."""
        cfg = self.cfg
        n, secs = cfg.point_requests or 1, cfg.point_s if cfg.point_s is not None else 20.0
        for rate in cfg.rates:
            self.visits.measure(visit, rate, show, min_judged=n, max_judged=n, min_judged_s=secs, fixed=True)

    def headline_possible(self) -> bool:
        """A paged reference and at least one contiguous engine: a ratio for the decision to decide."""
        engines = [*self.cfg.engines, *self.targets]
        ref = reference_of(self.cfg.engines)
        return ref is not None and any(e not in PAGED for e in engines)

    def units_left(self, run: EngineRun) -> int:
        """Engine-budget searches still to run, this one included."""
        order = self.order
        later = order[order.index(run.engine) + 1:]
        budgets = self.budgets
        here = len(budgets) - budgets.index(run.budget) if run.engine not in self.targets else 1
        return here + sum(len(budgets) if e not in self.targets else 1 for e in later)

    def setup_s(self) -> float:
        """An engine's set-up as measured so far (the first one's is a guess)."""
        done = self.record.setups_s()
        return float(np.mean(done)) if done else SETUP_GUESS_S

    def fits(self, run: EngineRun, rate: float, stop_by: float) -> bool:
        """A point's least time: its warm-up as last measured and the fewest judged requests to decide a miss."""
        need = self.visits.searched(run).warmup_s + self.design.early_judged / rate
        return time.time() - run.t0 + need <= stop_by and self.clock.left_s > need

    def verdict(self, visit: Visit | None = None) -> Verdict:
        """What the run says now, as summary.json will say it (harness/run/verdicts.py): the journals so far, the
        open visit's requests in flight judged by the summary's cut-off rule."""
        self.record.write()
        live = visit.runner.in_flight(visit.run.engine) if visit is not None else []
        return verdict_now(self.record.dir, self.record.typed(), live)

    def far_enough(self, run: EngineRun, visit: Visit) -> bool:
        """An engine other than the reference whose ratio to the reference (summary.json's `capacity_ratios`,
        computed as the summary computes it) excludes 1.0 needs no more points in the search: the decision
        phase comes back to it if it turns out the best contiguous engine and the headline is not decided."""
        ref = reference_of(self.cfg.engines)
        if ref is None or run.engine == ref or run.budget != self.cfg.kv_budget:
            return False
        v = self.verdict(visit)
        ci = v.ratio_ci(ref, run.engine)
        closed = v.fit is not None and all(e in v.fit.estimates and v.fit.estimates[e].bracketed
                                           for e in (ref, run.engine))
        return ci is not None and not ci[0] <= 1.0 <= ci[1] and closed

    def decide(self, runs: dict[str, EngineRun], shower: Shower) -> None:
        """The decision phase, in visits that alternate between the headline's two engines (ABBA: each visit
        gives its engine two turns, so the order of turns runs A A B B A A ...), each turn one point
        (`turn_plan`): a new rate past an open bracket's open side, else a fresh stream placed around the
        engine's fitted knee (harness/analysis/placement.py). The fit is redone after every turn; the decision
        stops once the headline (as summary.json computes it) says `stop: precise`, or when the next turn does
        not fit in the time left."""
        show = shower("decision", max(1.0, self.clock.left_s))
        log = self.record.decision_log()
        turns: dict[str, int] = {}
        v, visits = self.verdict(), 0
        while v.headline is not None and self.log_look(log, v, visits):
            h = v.headline
            engine = (h.against, h.engine)[visits % 2]
            if engine not in runs or (visit := self.afford(runs[engine], v, turns)) is None:
                self.console.say(v.line("time spent"))
                break
            visits += 1
            try:
                for _ in range(PER_VISIT):
                    plan = self.turn_plan(runs[engine], v, turns.get(engine, 0))
                    if plan is None or not self.fits(runs[engine], plan[0], time.time() - runs[engine].t0
                                                     + self.clock.left_s):
                        break
                    self.turn(visit, plan, show, visits)
                    turns[engine] = turns.get(engine, 0) + 1
                    v = self.verdict(visit)
                    if v.headline is None or v.headline.stop == "precise":
                        break
            finally:
                self.visits.end_visit(visit)
            v = self.verdict()
        self.record.write()

    def log_look(self, log: list, v: Verdict, visits: int) -> bool:
        """Record the headline as it stands in run.json's decision log; False once it says stop."""
        h = v.headline
        log.append({"t_s": round(time.time() - self.clock.started, 1), "visit": visits,
                    **{k: h.figure(k) for k in ("engine", "against", "ratio", "ratio_ci", "decided", "precise",
                                                "points", "stop", "run_to_run_share")}})
        if h.stop == "precise":
            self.console.say(v.line("search done"))
            return False
        return True

    def afford(self, run: EngineRun, v: Verdict, turns: dict[str, int]) -> Visit | None:
        """The engine's server again, where its next turn fits in the time left (a restart and one point)."""
        plan = self.turn_plan(run, v, turns.get(run.engine, 0))
        if plan is None or self.clock.left_s < self.turn_cost(run, plan[0], restart=True):
            return None
        return self.visits.revisit(run)

    def turn(self, visit: Visit, plan: tuple[float, int], show: Show, visits: int) -> None:
        rate, replication = plan
        d, run = self.design, visit.run
        what = f"replication {replication}" if replication else "a new rate"
        self.console.plain(f"deciding, visit {visits}: {run.engine} at {rate:g} req/s ({what})")
        self.visits.measure(visit, rate, show, replication=replication, min_judged=d.min_judged,
                            max_judged=d.min_judged, early_judged=d.early_judged,
                            stop_by_s=time.time() - run.t0 + self.clock.left_s)

    def turn_cost(self, run: EngineRun, rate: float, restart: bool) -> float:
        """Seconds a turn takes at the least: a restart where the server is down, a warm-up and the point's
        judged arrivals."""
        warm = self.visits.searched(run).warmup_s
        return (self.setup_s() / 3 if restart else 0.0) + warm + self.design.min_judged / rate

    def turn_plan(self, run: EngineRun, v: Verdict, turn: int) -> tuple[float, int] | None:
        """(rate, replication) of an engine's next point: while its knee is not bracketed, a new rate past its
        open side (the search's own step); then a fresh stream at the rate placement.next_rate gives for this
        turn, replication the next unused at that rate. None where nothing is left to measure."""
        st = self.visits.searched(run)
        est = v.fit.estimates.get(run.engine) if v.fit is not None else None
        if st.search is None or est is None:
            return None
        if not est.bracketed:
            usable = pooled(knee_points(v.points.get(run.engine, [])))
            now = replace(st.search, max_points=10**6, measured=[(p.offered_rps, p.attainment) for p in usable])
            rate = now.next_rate()
            return None if rate is None else (rate, self.fresh(st, rate))
        rate = next_rate(est, turn)
        return rate, self.fresh(st, rate)

    @staticmethod
    def fresh(st: Searched, rate: float) -> int:
        """The next unused replication of `rate` in this engine's points (0 where none was measured)."""
        used = [replication_of(st.points[i]["key"]) for i in st.of_rate(rate)]
        return 1 + max(used) if used else 0
