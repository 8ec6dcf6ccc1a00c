"""Which points a bench measures: each engine's knee search within its share of the time, then the decision
phase, which gives the headline's two engines more judged requests where they narrow its interval most
(harness/analysis/design.py says the rules, harness/analysis/headline.py what is decided)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from harness.analysis.design import share_s
from harness.analysis.headline import PAGED, Headline, bracket_ends, headline, reference_of
from harness.analysis.knee import Judged, KneeSearch, central, design_effect, ratio_replicates, replicate_knees
from harness.analysis.steady import wilson
from harness.run.visits import EngineRun, Visit
from workloads.streams import grid_index, grid_rate

SEARCH_START = 0.75  # the knee search's first rate, as a share of the engine's calibrated saturation rate
INTERIM_REPLICATES = 400  # the decision phase's joint bootstrap, between points (the summary's has 2,000)
DECISION_JUDGED = 2  # the decision phase takes a bracket end up to this many times the search's most
SETUP_GUESS_S = 45.0  # an engine's set-up (server, debugging pass, calibration) before any has been measured


class KneeSearching:
    """The search and the decision, on a Bench (its configuration, design, clock and visits)."""

    def search(self, visit: Visit, show, calibrated_rps: float) -> None:
        """The knee search (harness/analysis/knee.py) on the visit's server, within the engine's share of the
        time; an engine other than the reference stops once its ratio to the reference is decided."""
        run, d = visit.run, self.design
        st = self.searched(run)
        st.search = KneeSearch(max(SEARCH_START * calibrated_rps, 0.05), d.target, d.tolerance, d.step,
                               max_points=d.max_points)
        budget_s = share_s(self.left_s, self.units_left(run), self.setup_s(), self.headline_possible())
        if self.cfg.search_s is not None:
            budget_s = min(budget_s, self.cfg.search_s)
        stop_by = time.time() - run.t0 + budget_s
        self.plain(f"{run.engine}: searching for {budget_s:.0f} s")
        while (rate := st.search.next_rate()) is not None:
            if not self.fits(run, rate, stop_by):
                self.plain(f"{run.engine}: search stopped, its {budget_s:.0f} s spent")
                break
            self.measure(visit, rate, show, min_judged=d.min_judged, max_judged=d.max_judged,
                         min_judged_s=d.min_judged_s, early_judged=d.early_judged, stop_by_s=stop_by)
            st.search.record(rate, self.attainment(run, rate))
            if self.far_enough(run):
                self.plain(f"{run.engine}: its ratio to {reference_of(self.cfg.engines)} is decided: search done")
                break
        lo, hi = st.search.bracket()
        self.plain(f"{run.engine}: knee between {lo} and {hi} req/s after {len(st.search.measured)} points")

    def fixed_rates(self, visit: Visit, show) -> None:
        """--rates: every engine at the same given rates, each judged for --point-duration seconds (and
        --point-requests requests) past its warm-up."""
        n, secs = self.cfg.point_requests or 1, self.cfg.point_s if self.cfg.point_s is not None else 20.0
        for rate in self.cfg.rates:
            self.measure(visit, rate, show, min_judged=n, max_judged=n, min_judged_s=secs, fixed=True)

    def headline_possible(self) -> bool:
        """A paged reference and at least one contiguous engine: a ratio for the decision to decide."""
        engines = [*self.cfg.engines, *self.targets]
        ref = reference_of(self.cfg.engines)
        return ref is not None and any(e not in PAGED for e in engines)

    def units_left(self, run: EngineRun) -> int:
        """Engine-budget searches still to run, this one included."""
        order = self.order()
        later = order[order.index(run.engine) + 1:]
        budgets = self.budgets
        here = len(budgets) - budgets.index(run.budget) if run.engine not in self.targets else 1
        return here + sum(len(budgets) if e not in self.targets else 1 for e in later)

    def setup_s(self) -> float:
        """An engine's set-up as measured so far (the first one's is a guess)."""
        done = [r for r in self.run_meta.get("setup_s", {}).values()]
        return float(np.mean(done)) if done else SETUP_GUESS_S

    def fits(self, run: EngineRun, rate: float, stop_by: float) -> bool:
        """A point's least time: its warm-up as last measured and the fewest judged requests to decide a miss."""
        need = self.searched(run).warmup_s + self.design.early_judged / rate
        return time.time() - run.t0 + need <= stop_by and self.left_s > need

    def judged_now(self, budget: str | None = None) -> dict[str, list[Judged]]:
        budget = budget or self.cfg.kv_budget
        return {e: r.searched[budget].judged_points() for e, r in self.runs.items() if budget in r.searched}

    def interim(self) -> Headline | None:
        return headline(self.judged_now(), self.slo, self.design.step, self.design.precision, INTERIM_REPLICATES)

    def far_enough(self, run: EngineRun) -> bool:
        """An engine other than the reference whose ratio to the reference's knee has an interval that
        excludes 1.0 needs no more points in the search (the decision phase comes back to it if it turns out
        the best contiguous engine): a bracket and the joint interval, or one missed rate under the
        reference's interval (its knee is lower still), or one met rate over it."""
        ref = reference_of(self.cfg.engines)
        st = self.searched(run)
        if ref is None or run.engine == ref or run.budget != self.cfg.kv_budget:
            return False
        pts = {e: p for e, p in self.judged_now().items() if e in (ref, run.engine)}
        if len(pts) < 2 or not all(pts.values()):
            return False
        knees = replicate_knees(pts, self.slo, self.design.step, INTERIM_REPLICATES)
        lo, hi = st.search.bracket()
        if lo is None or hi is None:
            ref_lo, ref_hi = central(knees[ref])
            return (hi is not None and hi < ref_lo) or (lo is not None and lo > ref_hi)
        lo, hi = central(ratio_replicates(knees[ref], knees[run.engine]))
        return not lo <= 1.0 <= hi

    def decide(self, runs: dict[str, EngineRun], shower) -> None:
        """The decision phase: while the headline ratio's interval holds 1.0 or is wider than asked, more
        judged requests where they narrow it most: the engine of the two whose knee is less certain, a
        bisection while its bracket is wider than the tolerance, else its bracket end with the fewest."""
        show = shower("decision", max(1.0, self.left_s))
        visit: Visit | None = None
        log = self.run_meta.setdefault("decision", [])
        try:
            while (h := self.interim()) is not None and all(runs[e].searched.get(self.cfg.kv_budget) and
                                                            runs[e].searched[self.cfg.kv_budget].search
                                                            for e in (h.engine, h.against)):
                log.append({"t_s": round(time.time() - self.started, 1), **h.to_json()})
                self.write_meta()
                if h.decided and h.precise:
                    self.plain(f"decision: {h.engine} / {h.against} = {h.ratio:.2f} {h.ratio_ci}: decided")
                    break
                todo = {e: step for e in (h.engine, h.against) if (step := self.next_for(runs[e])) is not None}
                if not todo:
                    self.plain(f"decision: {h.engine} / {h.against} = {h.ratio:.2f} {h.ratio_ci}: both brackets at "
                               "the grid's resolution")
                    break
                engine = max(todo, key=lambda e: h.log_sd[e])
                if visit is not None and visit.run.engine in todo and visit.run.engine != engine and \
                        h.log_sd[visit.run.engine] >= 0.8 * h.log_sd[engine]:
                    engine = visit.run.engine  # a switch costs a restart and a warm-up: stay while nearly as good
                run = runs[engine]
                rate, extend = todo[engine]
                restart = visit is None or visit.run.engine != engine
                need = (self.setup_s() / 3 if restart else 0) + self.searched(run).warmup_s + \
                    self.design.min_judged / rate
                if self.left_s < need:
                    self.plain(f"decision: {h.engine} / {h.against} = {h.ratio:.2f} {h.ratio_ci}: time spent")
                    break
                if restart:
                    if visit is not None:
                        self.end_visit(visit)
                    visit = self.revisit(run)
                    if visit is None:
                        break
                stop_by = time.time() - run.t0 + self.left_s
                d = self.design
                self.measure(visit, rate, show, min_judged=d.min_judged,
                             max_judged=d.min_judged if extend else d.max_judged, early_judged=d.early_judged,
                             fixed=extend, stop_by_s=stop_by)
        finally:
            if visit is not None:
                self.end_visit(visit)

    def next_for(self, run: EngineRun) -> tuple[float, bool] | None:
        """(rate, extend): a bisection while the bracket is wider than the tolerance (a wide bracket is the
        knee's widest uncertainty); then a bracket end whose Wilson interval (at the effective size) still
        holds the target gets more requests, up to the decision's most; then bisections down to one grid step;
        None when nothing is left to do (the bracket one grid step, both ends told from the target)."""
        st = self.searched(run)
        now = replace(st.search, max_points=10**6, measured=[(p.offered_rps, p.attainment)
                                                             for p in st.judged_points()])
        lo, hi = now.bracket()
        if lo is None or hi is None:
            rate = now.next_rate()
            return None if rate is None else (rate, False)
        middle = grid_rate((grid_index(lo) + grid_index(hi)) // 2)
        if hi > lo * (1 + self.design.tolerance) + 1e-9 and grid_index(hi) - grid_index(lo) > 1:
            return middle, False
        points = st.judged_points()
        d = design_effect(points)
        ends = bracket_ends(points, self.slo)
        open_ends = [p for p in ends if len(p.met) < DECISION_JUDGED * self.design.max_judged and
                     wilson(float(p.met.sum()) / d, len(p.met) / d)[0] <= self.slo.attainment
                     <= wilson(float(p.met.sum()) / d, len(p.met) / d)[1]]
        if open_ends:
            return min(open_ends, key=lambda p: len(p.met)).offered_rps, True
        return (middle, False) if grid_index(hi) - grid_index(lo) > 1 else None

