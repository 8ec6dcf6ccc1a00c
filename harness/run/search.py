"""Which points a bench measures: each engine's knee search within its share of the time, then the decision
phase, which gives the headline's two engines more judged requests where they narrow its interval most
(harness/analysis/design.py says the rules, harness/analysis/headline.py what is decided)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from harness.analysis.design import share_s
from harness.analysis.headline import PAGED, bracket_ends, raw_bracket_ends, reference_of
from harness.analysis.knee import Judged, KneeSearch, design_effect, knee_points
from harness.analysis.steady import wilson
from harness.run.verdicts import Verdict, verdict_now
from harness.run.visits import EngineRun, Host, Visit, Visits
from workloads.streams import grid_index, grid_rate

SEARCH_START = 0.75  # the knee search's first rate, as a share of the engine's calibrated saturation rate
DECISION_JUDGED = 2  # the decision phase takes a bracket end up to this many times the search's most
SETUP_GUESS_S = 45.0  # an engine's set-up (server, debugging pass, calibration) before any has been measured


class KneeSearching:
    """The search and the decision: which points each engine's visits measure. What it needs of the run (its
    configuration, design, clock, run.json, console) it asks of its `host` (visits.Host); the points themselves
    it measures through `visits`."""

    def __init__(self, host: Host, visits: Visits):
        self.host, self.visits = host, visits

    def search(self, visit: Visit, show, calibrated_rps: float) -> None:
        """The knee search (harness/analysis/knee.py) on the visit's server, within the engine's share of the
        time; an engine other than the reference stops once its ratio to the reference is decided."""
        run, d = visit.run, self.host.design
        st = self.visits.searched(run)
        budget_s = share_s(self.host.left_s, self.units_left(run), self.setup_s(), self.headline_possible())
        if self.host.cfg.search_s is not None:
            budget_s = min(budget_s, self.host.cfg.search_s)
        # a calibration that found nothing (a naive engine that crashed in its window) starts at the rate at which
        # a clear miss is judged in half the engine's share: a point it can afford
        start = SEARCH_START * calibrated_rps if calibrated_rps > 0 else d.early_judged / max(budget_s / 2, 1e-9)
        st.search = KneeSearch(max(start, 0.05), d.target, d.tolerance, d.step, max_points=d.max_points)
        stop_by = time.time() - run.t0 + budget_s
        self.host.plain(f"{run.engine}: searching for {budget_s:.0f} s")
        while (rate := st.search.next_rate()) is not None:
            if not self.fits(run, rate, stop_by):
                self.host.plain(f"{run.engine}: search stopped, its {budget_s:.0f} s spent")
                break
            self.visits.measure(visit, rate, show, min_judged=d.min_judged, max_judged=d.max_judged,
                                min_judged_s=d.min_judged_s, early_judged=d.early_judged, stop_by_s=stop_by)
            st.search.record(rate, self.visits.attainment(run, rate))
            if self.far_enough(run, visit):
                ref = reference_of(self.host.cfg.engines)
                self.host.plain(f"{run.engine}: its ratio to {ref} is decided: search done")
                break
        lo, hi = st.search.bracket()
        self.host.plain(f"{run.engine}: knee between {lo} and {hi} req/s after {len(st.search.measured)} points")

    def fixed_rates(self, visit: Visit, show) -> None:
        """--rates: every engine at the same given rates, each judged for --point-duration seconds (and
        --point-requests requests) past its warm-up."""
        cfg = self.host.cfg
        n, secs = cfg.point_requests or 1, cfg.point_s if cfg.point_s is not None else 20.0
        for rate in cfg.rates:
            self.visits.measure(visit, rate, show, min_judged=n, max_judged=n, min_judged_s=secs, fixed=True)

    def headline_possible(self) -> bool:
        """A paged reference and at least one contiguous engine: a ratio for the decision to decide."""
        engines = [*self.host.cfg.engines, *self.host.targets]
        ref = reference_of(self.host.cfg.engines)
        return ref is not None and any(e not in PAGED for e in engines)

    def units_left(self, run: EngineRun) -> int:
        """Engine-budget searches still to run, this one included."""
        order = self.host.order()
        later = order[order.index(run.engine) + 1:]
        budgets = self.host.budgets
        here = len(budgets) - budgets.index(run.budget) if run.engine not in self.host.targets else 1
        return here + sum(len(budgets) if e not in self.host.targets else 1 for e in later)

    def setup_s(self) -> float:
        """An engine's set-up as measured so far (the first one's is a guess)."""
        done = [r for r in self.host.run_meta.get("setup_s", {}).values()]
        return float(np.mean(done)) if done else SETUP_GUESS_S

    def fits(self, run: EngineRun, rate: float, stop_by: float) -> bool:
        """A point's least time: its warm-up as last measured and the fewest judged requests to decide a miss."""
        need = self.visits.searched(run).warmup_s + self.host.design.early_judged / rate
        return time.time() - run.t0 + need <= stop_by and self.host.left_s > need

    def verdict(self, visit: Visit | None = None) -> Verdict:
        """What the run says now, as summary.json will say it (harness/run/verdicts.py): the journals so far, the
        open visit's requests in flight judged by the summary's cut-off rule."""
        self.host.write_meta()
        live = visit.runner.in_flight(visit.run.engine) if visit is not None else []
        return verdict_now(self.host.dir, self.host.run_meta, live)

    def far_enough(self, run: EngineRun, visit: Visit) -> bool:
        """An engine other than the reference whose ratio to the reference (summary.json's `capacity_ratios`,
        computed as the summary computes it) excludes 1.0 needs no more points in the search: the decision
        phase comes back to it if it turns out the best contiguous engine and the headline is not decided."""
        ref = reference_of(self.host.cfg.engines)
        if ref is None or run.engine == ref or run.budget != self.host.cfg.kv_budget:
            return False
        ci = self.verdict(visit).ratio_ci(ref, run.engine)
        return ci is not None and not ci[0] <= 1.0 <= ci[1]

    def decide(self, runs: dict[str, EngineRun], shower) -> None:
        """The decision phase: while the headline (as summary.json computes it) is undecided or wider than asked,
        one more step where it narrows the ratio most for its time (`choose`). When the open visit's verdicts
        say decided, the visit ends (its requests in flight finish) and the final rows decide again: the phase
        stops only on the verdict the summary will print."""
        show = shower("decision", max(1.0, self.host.left_s))
        visit: Visit | None = None
        log = self.host.run_meta.setdefault("decision", [])
        try:
            while (v := self.verdict(visit)).headline is not None:
                h = v.headline
                log.append({"t_s": round(time.time() - self.host.started, 1), "settled": visit is None,
                            **{k: h[k] for k in ("engine", "against", "ratio", "ratio_ci", "decided", "precise")}})
                if h["decided"] and h["precise"]:
                    if visit is not None:  # settle: what is in flight finishes, then the final rows decide
                        self.visits.end_visit(visit)
                        visit = None
                        continue
                    self.host.say(v.line("search done"))
                    break
                step = self.choose(runs, v, visit)
                if step is None:
                    self.host.say(v.line("every bracket at the grid's resolution and steady, or its points spent"))
                    break
                engine, rate, extend, need = step
                if self.host.left_s < need:
                    self.host.say(v.line("time spent"))
                    break
                run = runs[engine]
                if visit is None or visit.run.engine != engine:
                    if visit is not None:
                        self.visits.end_visit(visit)
                    visit = self.visits.revisit(run)
                    if visit is None:
                        break
                what = "the same point, more arrivals" if extend else "a new point"
                self.host.plain(f"deciding: {engine} at {rate:g} req/s ({what}); so far {v.line()[len('decision: '):]}")
                stop_by = time.time() - run.t0 + self.host.left_s
                d = self.host.design
                self.visits.measure(visit, rate, show, min_judged=d.min_judged,
                                    max_judged=d.min_judged if extend else d.max_judged,
                                    early_judged=d.early_judged, fixed=extend, stop_by_s=stop_by)
        finally:
            if visit is not None:
                self.visits.end_visit(visit)
        self.host.write_meta()

    def choose(self, runs: dict[str, EngineRun], v: Verdict, visit: Visit | None):
        """(engine, rate, extend, seconds it needs) of the step that narrows the ratio most per second: each of
        the two engines' next step (`next_for`), valued at its engine's share of the ratio's variance (its log
        knee's variance over the joint replicates) over the seconds the step takes (a restart when the engine
        is not the one running, its warm-up, its fewest judged arrivals). None: neither has a step left."""
        h, best = v.headline, None
        for engine in (h["engine"], h["against"]):
            run = runs.get(engine)
            if run is None or not (run.searched.get(self.host.cfg.kv_budget) and
                                   run.searched[self.host.cfg.kv_budget].search):
                continue
            step = self.next_for(run, v.points.get(engine, []))
            if step is None:
                continue
            rate, extend = step
            restart = visit is None or visit.run.engine != engine
            need = (self.setup_s() / 3 if restart else 0.0) + self.visits.searched(run).warmup_s + \
                self.host.design.min_judged / rate
            value = v.log_sd.get(engine, 0.0) ** 2 / need
            if best is None or value > best[0]:
                best = (value, engine, rate, extend, need)
        return None if best is None else best[1:]

    def next_for(self, run: EngineRun, points: list[Judged]) -> tuple[float, bool] | None:
        """(rate, extend), on the points as the summary judges them: while the knee's bracket (on the points a knee
        rests on) is open, a new rate past its open side (the widest uncertainty there is); then a bracket end
        whose halves disagree gets more arrivals at its rate (the same stream read on) until they agree or it is
        over its knee, up to the decision's most; then a bisection while the bracket is wider than the
        tolerance; then a bracket end whose Wilson interval (at the effective size) still holds the target gets
        more requests, up to the decision's most; then bisections down to one grid step; None when nothing is
        left to do."""
        most = DECISION_JUDGED * self.host.design.max_judged
        usable = knee_points(points)
        st = self.visits.searched(run)
        now = replace(st.search, max_points=10**6, measured=[(p.offered_rps, p.attainment) for p in usable])
        lo, hi = now.bracket()
        if lo is None or hi is None:
            rate = now.next_rate()
            return None if rate is None else (rate, False)
        for p in raw_bracket_ends(points, self.host.slo):
            if p.use == "unsteady" and len(p.met) < most:
                return p.offered_rps, True
        middle = grid_rate((grid_index(lo) + grid_index(hi)) // 2)
        if hi > lo * (1 + self.host.design.tolerance) + 1e-9 and grid_index(hi) - grid_index(lo) > 1:
            return middle, False
        d = design_effect(usable)
        ends = [p for p in bracket_ends(points, self.host.slo) if p.use == "steady"]
        open_ends = [p for p in ends if len(p.met) < most and
                     wilson(float(p.met.sum()) / d, len(p.met) / d)[0] <= self.host.slo.attainment
                     <= wilson(float(p.met.sum()) / d, len(p.met) / d)[1]]
        if open_ends:
            return min(open_ends, key=lambda p: len(p.met)).offered_rps, True
        return (middle, False) if grid_index(hi) - grid_index(lo) > 1 else None
