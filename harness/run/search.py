"""Which points a bench measures: each engine's knee search within its share of the time, then the decision
phase, which gives the headline's two engines more judged requests where they narrow its interval most
(harness/analysis/design.py says the rules, harness/analysis/headline.py what is decided)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from harness.analysis.design import MIN_REPLICATIONS, share_s
from harness.analysis.headline import PAGED, bracketed, raw_bracket_ends, reference_of
from harness.analysis.knee import Judged, KneeSearch, knee_points, pooled
from harness.run.verdicts import Verdict, verdict_now
from harness.run.visits import EngineRun, Host, Visit, Visits
from workloads.streams import grid_index, grid_rate

SEARCH_START = 0.75  # the knee search's first rate, as a share of the engine's calibrated saturation rate
DECISION_JUDGED = 2  # the decision phase takes an unsteady bracket end up to this many times the search's most

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
        v = self.verdict(visit)
        ci = v.ratio_ci(ref, run.engine)
        closed = all(bracketed(v.points.get(e, []), self.host.slo) for e in (ref, run.engine))
        return ci is not None and not ci[0] <= 1.0 <= ci[1] and closed

    def decide(self, runs: dict[str, EngineRun], shower) -> None:
        """The decision phase, in rounds: each round visits the headline's two engines one after the other (the
        order alternating, ABBA, so that neither is always measured second) and gives each its next step
        (`round_plan`): a new rate while its bracket is open, a fresh replication of both bracket ends until each
        stands on `MIN_REPLICATIONS` realizations, then a bisection while it is wider than the tolerance. It
        stops once the headline (as summary.json computes it, every row final) is decided and as precise as
        asked with each engine's bracket ends judged on at least `MIN_REPLICATIONS` independent realizations,
        or when the next round does not fit in the time left."""
        show = shower("decision", max(1.0, self.host.left_s))
        log = self.host.run_meta.setdefault("decision", [])
        rounds = 0
        while (v := self.verdict()).headline is not None:
            h = v.headline
            log.append({"t_s": round(time.time() - self.host.started, 1), "round": rounds,
                        **{k: h.get(k) for k in ("engine", "against", "ratio", "ratio_ci", "decided", "precise",
                                                 "replications", "run_to_run_share")}})
            if h["decided"] and h["precise"] and min(h["replications"].values()) >= MIN_REPLICATIONS:
                self.host.say(v.line("search done"))
                break
            pair = [h["engine"], h["against"]] if rounds % 2 == 0 else [h["against"], h["engine"]]
            plans = {e: self.round_plan(runs[e], v.points.get(e, [])) for e in pair if e in runs}
            if not any(plans.values()):
                self.host.say(v.line("every bracket at the grid's resolution, replicated, or its points spent"))
                break
            if self.host.left_s < sum(self.round_cost(runs[e], plan) for e, plan in plans.items()):
                plans = self.what_fits(plans, runs, v)
                if not plans:
                    self.host.say(v.line("time spent"))
                    break
            rounds += 1
            for engine in pair:
                self.visit_round(runs[engine], plans.get(engine) or [], show, rounds)
        self.host.write_meta()

    def what_fits(self, plans: dict[str, list], runs: dict[str, EngineRun], v: Verdict) -> dict[str, list]:
        """Where a whole round does not fit in the time left: the one engine's turn that does, an engine whose
        bracket is still open first (a knee bracketed is worth more than a replication), its points cut to the
        first if all of them do not fit; empty when nothing fits."""
        order = sorted(plans, key=lambda e: bracketed(v.points.get(e, []), self.host.slo))
        for engine in order:
            for plan in (plans[engine], plans[engine][:1]):
                if plan and self.host.left_s >= self.round_cost(runs[engine], plan):
                    return {engine: plan}
        return {}

    def visit_round(self, run: EngineRun, plan: list[tuple[float, int, bool]], show, rounds: int) -> None:
        """One engine's turn in a round: its server again, its planned points, then the server stops."""
        if not plan or (visit := self.visits.revisit(run)) is None:
            return
        d = self.host.design
        try:
            for rate, replication, extend in plan:
                what = "more arrivals" if extend else (f"replication {replication}" if replication else "a new rate")
                self.host.plain(f"deciding, round {rounds}: {run.engine} at {rate:g} req/s ({what})")
                self.visits.measure(visit, rate, show, replication=replication, min_judged=d.min_judged,
                                    max_judged=d.min_judged if extend else d.max_judged, early_judged=d.early_judged,
                                    fixed=extend, stop_by_s=time.time() - run.t0 + self.host.left_s)
        finally:
            self.visits.end_visit(visit)

    def round_cost(self, run: EngineRun, plan: list[tuple[float, int, bool]]) -> float:
        """Seconds an engine's turn takes at the least: a restart, and each point's warm-up and fewest arrivals."""
        if not plan:
            return 0.0
        warm = self.visits.searched(run).warmup_s
        return self.setup_s() / 3 + sum(warm + self.host.design.min_judged / rate for rate, _, _ in plan)

    def round_plan(self, run: EngineRun, points: list[Judged]) -> list[tuple[float, int, bool]]:
        """(rate, replication, extend) for one engine's turn, on the points as the summary judges them: while the
        knee's bracket (on the points a knee rests on, replications pooled) is open, a new rate past its open side;
        then a bracket end whose halves fall on two sides of the target gets more arrivals on its stream, up to
        the decision's most; then each bracket end's next independent realization until both stand on
        `MIN_REPLICATIONS`; then a bisection while the bracket is wider than the tolerance; else the next
        realizations (the ratio narrows by replications once the bracket is as narrow as asked). Replications
        come before bisection because an interval must first hold across runs: a bracket narrowed inside one
        realization gives an interval the next run's realization need not share (two fresh clones of 3163d95
        bisected paged to [2.86, 3.63] and [1.93, 2.17] req/s on one realization each, and the nightly gate
        called the pair a regression). Empty when nothing is left to do."""
        most = DECISION_JUDGED * self.host.design.max_judged
        usable = pooled(knee_points(points))
        st = self.visits.searched(run)
        if st.search is None:
            return []
        now = replace(st.search, max_points=10**6, measured=[(p.offered_rps, p.attainment) for p in usable])
        lo, hi = now.bracket()
        if lo is None or hi is None:
            rate = now.next_rate()
            return [] if rate is None else [(rate, 0, False)]
        raw = {p.offered_rps for p in raw_bracket_ends(points, self.host.slo)}  # where an unsteady point would put it
        for p in points:
            if p.offered_rps in raw and p.use == "unsteady" and len(p.met) < most:
                return [(p.offered_rps, p.replication, True)]
        realizations = {rate: {p.replication for p in points if p.offered_rps == rate} for rate in (lo, hi)}
        wide = hi > lo * (1 + self.host.design.tolerance) + 1e-9 and grid_index(hi) - grid_index(lo) > 1
        if wide and min(map(len, realizations.values())) >= MIN_REPLICATIONS:
            return [(grid_rate((grid_index(lo) + grid_index(hi)) // 2), 0, False)]
        return [(rate, 1 + max(reps), False) for rate, reps in realizations.items()]
