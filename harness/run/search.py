"""Which points a bench measures: each engine's knee search within its share of the time, then the decision
phase, which gives the headline's two engines more judged requests where they narrow its interval most
(harness/analysis/design.py says the rules, harness/analysis/headline.py what is decided)."""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import replace

import numpy as np

from engines.registry import REGISTRY, Kind
from harness.analysis.design import TURN_SHARE, Design, share_s
from harness.analysis.headline import PAGED, reference_of
from harness.analysis.knee import KneeSearch, knee_points, pooled
from harness.analysis.operating import OPERATING_JUDGED, OPERATING_REPLICATION, operating_key, operating_rate
from harness.analysis.placement import next_rate, reach
from harness.analysis.records import SearchSettings
from harness.analysis.summary_records import RulingBlock
from harness.run.clock import Clock
from harness.run.config import BenchConfig
from harness.run.console import Console, Show, Shower
from harness.run.engine_run import EngineRun, Searched
from harness.run.record import RunWriter
from harness.run.verdicts import Verdict, verdict_now
from harness.run.visits import Visit, Visits
from harness.units import KvBudget
from workloads.streams import STEPS_PER_OCTAVE, grid_rate, paired_key, paired_turn

SEARCH_START = 0.75  # the knee search's first rate, as a share of the engine's calibrated saturation rate
PER_VISIT = 2  # turns an engine takes per visit in the decision: a restart shared by a point above and one below

SETUP_GUESS_S = 45.0  # an engine's set-up (server, debugging pass, calibration) before any has been measured


class KneeSearching:
    """The search and the decision: which points each engine's visits measure. It is handed the run's
    configuration, design, clock, record (run.json) and console, and the engines and budgets in the order they
    are searched (`targets`: the engines that are not ours, searched at one budget); the points themselves it
    measures through `visits`."""

    def __init__(self, cfg: BenchConfig, design: Design, clock: Clock, record: RunWriter, console: Console,
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
        time; an engine other than the headline's two is screened first (`screen`), and one other than the
        reference stops once its ratio to the reference is decided."""
        run, d = visit.run, self.design
        st = self.visits.searched(run)
        budget_s = share_s(self.clock.left_s, self.units_left(run), self.setup_s(), self.headline_possible(),
                           setups_after=self.setups_after(run))
        if self.cfg.search_s is not None:
            budget_s = min(budget_s, self.cfg.search_s)
        stop_by = time.time() - run.t0 + budget_s
        self.operating_point(visit, show, stop_by)
        screened = self.screen(visit, show, stop_by) if self.screened(run) else None
        # the first rate: 0.75x the calibrated one, raised where need be to the rate at which a clear miss's judged
        # requests arrive within half the engine's share, so that the search measures a point (a naive engine
        # calibrated at 0.084 req/s once searched its 128 s and ended with none); a calibration that found nothing
        # (a naive engine that crashed in its window) starts there too
        start = max(SEARCH_START * calibrated_rps, d.early_judged / max(budget_s / 2, 1e-9))
        st.search = KneeSearch(max(start, 0.05), d.target, math.inf if d.tolerance is None else d.tolerance, d.step,
                               max_points=d.max_points)
        if screened is not None:  # the screen's point is the search's first
            st.search.record(screened[0], self.visits.attainment(run, screened[0]))
            if screened[1]:  # ruled out: the search is kept (the decision steps down from it were it the rival)
                return
        self.console.plain(f"{run.engine}: searching for {budget_s:.0f} s")
        while (rate := st.search.next_rate()) is not None:
            if not self.fits(run, rate, stop_by):
                self.console.plain(f"{run.engine}: search stopped, its {budget_s:.0f} s spent"
                                   + ("" if st.search.measured else f": {self.unfit(run, rate, stop_by)}"))
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

    # -- screening: an engine other than the headline's two, ruled out by as little as does it safely
    def rival(self) -> str | None:
        """The contiguous engine measured second, the decision's likely rival (`likely_rival`)."""
        ref = reference_of(self.cfg.engines)
        return next((e for e in self.order if e != ref and e not in PAGED), None) if ref else None

    def screened(self, run: EngineRun) -> bool:
        return self.screened_at(run.engine, run.budget)

    def screened_at(self, engine: str, budget: KvBudget) -> bool:
        """Whether the engine is screened before it is searched: neither the reference nor the likely rival, at
        the run's own budget (the headline's), in a run with a headline to decide."""
        return (self.headline_possible() and budget == self.cfg.kv_budget
                and engine not in (reference_of(self.cfg.engines), self.rival()))

    def screen(self, visit: Visit, show: Show, stop_by: float) -> tuple[float, bool] | None:
        """One point at the grid rate at or under the lower end of the headline rival's interval, as the run says
        now, then the one rule for "ruled out" (analysis/ruled_out.py, as summary.json's `capacity.ENGINE.ruling`
        computes it): a clear miss there (its Wilson 90 % interval at the effective size wholly under the target:
        the point's own early stop) at or under the leading contiguous knee puts the engine's knee under it: it is
        ruled out, its knee a bound, its search stops, and the headline never takes it for the rival unless later
        evidence the rule reads brings it back. The ruling is said on the console in its own words and recorded in
        run.json's `screens`. (rate, ruled out), or None where there is no rival's interval to screen against (the
        engine is searched) or no point fits (said)."""
        run, d = visit.run, self.design
        v = self.verdict()
        rival = v.headline.against if v.headline is not None else None
        est = v.fit.estimates.get(rival) if rival is not None and v.fit is not None else None
        if est is None or est.ci[0] <= 0:
            return None
        # the grid rate at or under it (within the grid's own rounding to a millionth)
        rate = grid_rate(math.floor(STEPS_PER_OCTAVE * math.log2(est.ci[0]) + 1e-6))
        if not self.fits(run, rate, stop_by):
            why = self.unfit(run, rate, stop_by)
            self.console.plain(f"{run.engine}: not screened: {why}")
            self.record.screen(run.engine, {"rival": rival, "rival_ci": list(est.ci), "offered_rps": rate,
                                            "ruled_out": False, "why": why})
            return None
        self.console.plain(f"{run.engine}: screened at {rate:g} req/s, at or under {rival}'s lower end "
                           f"{est.ci[0]:.3g} req/s")
        n = d.screen_judged
        self.visits.measure(visit, rate, show, min_judged=n, max_judged=n, min_judged_s=d.min_judged_s,
                            early_judged=min(d.early_judged, n), stop_by_s=stop_by)
        block = self.verdict(visit).capacity.get(run.engine)
        ruling = block.ruling if block is not None and block.ruling is not None else RulingBlock(
            offered_rps=rate, words=f"{run.engine}: not ruled out: no judged point a knee rests on")
        out = ruling.ruled_out
        self.record.screen(run.engine, {"rival": rival, "rival_ci": list(est.ci), "offered_rps": rate,
                                        "judged": ruling.judged, "met": ruling.met, "wilson_90": ruling.wilson_90,
                                        "ruled_out": out, "leader": ruling.leader, "leader_rps": ruling.leader_rps,
                                        "ruled_at_rps": ruling.offered_rps, "words": ruling.words})
        self.record.write()
        self.console.plain(ruling.words + ("; search done" if out else "; searched"))
        return rate, out

    def unfit(self, run: EngineRun, rate: float, stop_by: float) -> str:
        """Why no point fits: what the least one needs against what is left."""
        warm = self.visits.searched(run).warmup_s
        left = min(stop_by - (time.time() - run.t0), self.clock.left_s)
        return (f"no point fits in the {max(left, 0.0):.0f} s left (one at {rate:g} req/s needs {warm:.0f} s of "
                f"warm-up and {self.design.early_judged} judged arrivals, {self.design.early_judged / rate:.0f} s)")

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
        """Engine-budget searches still to run, this one included; a later engine that will be screened counts
        for none (its screen takes a point, and a search only where it is not ruled out: then its share is
        reckoned from what is left)."""
        order = self.order
        later = order[order.index(run.engine) + 1:]
        budgets = self.budgets
        here = len(budgets) - budgets.index(run.budget) if run.engine not in self.targets else 1
        return here + sum((len(budgets) - int(self.screened_at(e, self.cfg.kv_budget))) if e not in self.targets
                          else 1 - int(self.screened_at(e, self.cfg.kv_budget)) for e in later)

    def setups_after(self, run: EngineRun) -> int:
        """Engine-budget set-ups still to come after this one, screened engines' included."""
        order, budgets = self.order, self.budgets
        here = len(budgets) - budgets.index(run.budget) - 1 if run.engine not in self.targets else 0
        return here + sum(len(budgets) if e not in self.targets else 1 for e in order[order.index(run.engine) + 1:])

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
        (`turn_plan`): a new rate past an open bracket's open side, else a rate placed around the engine's
        fitted knee (harness/analysis/placement.py), on the paired stream of its turn: turn n of each engine
        reads the same requests. The fit is redone after every turn; the decision stops once the headline (as
        summary.json computes it) says `stop: precise`, or when the next turn does not fit in the time left."""
        show = shower("decision", max(1.0, self.clock.left_s))
        log = self.record.decision_log()
        v, visits = self.verdict(), 0
        while v.headline is not None and self.log_look(log, v, visits):
            h = v.headline
            engine = (h.against, h.engine)[visits % 2]
            if engine not in runs or (visit := self.afford(runs[engine], v)) is None:
                planned = engine in runs and self.turn_plan(runs[engine], v) is not None
                self.console.say(v.line("time spent" if planned else f"no turn left to place for {engine}"))
                break
            visits += 1
            try:
                for _ in range(PER_VISIT):
                    plan = self.turn_plan(runs[engine], v)
                    if plan is None or not self.fits(runs[engine], plan[0], time.time() - runs[engine].t0
                                                     + self.clock.left_s):
                        break
                    self.turn(visit, plan, show, visits)
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

    def afford(self, run: EngineRun, v: Verdict) -> Visit | None:
        """The engine's server again, where its next turn fits in the time left (a restart and one point)."""
        plan = self.turn_plan(run, v)
        if plan is None or self.clock.left_s < self.turn_cost(run, plan[0], restart=True):
            return None
        return self.visits.revisit(run)

    def turn(self, visit: Visit, plan: tuple[float, str], show: Show, visits: int) -> None:
        rate, key = plan
        d, run = self.design, visit.run
        self.console.plain(f"deciding, visit {visits}: {run.engine} at {rate:g} req/s (paired stream {key})")
        now = time.time() - run.t0
        self.visits.measure(visit, rate, show, key=key, min_judged=d.min_judged, max_judged=d.min_judged,
                            early_judged=d.early_judged,
                            stop_by_s=now + self.visits.searched(run).warmup_s + self.turn_judging_s())

    def turn_judging_s(self) -> float:
        """The most seconds of judged arrivals a decision turn takes: `TURN_SHARE` of the time left, so that a
        turn at a slow rate ends with fewer judged requests (its interval says so) rather than taking the
        decision whole."""
        return TURN_SHARE * max(self.clock.left_s, 0.0)

    def turn_cost(self, run: EngineRun, rate: float, restart: bool) -> float:
        """Seconds a turn takes at the least: a restart where the server is down, a warm-up and the point's
        judged arrivals (at most its time bound)."""
        warm = self.visits.searched(run).warmup_s
        judging = min(self.design.min_judged / rate, self.turn_judging_s())
        return (self.setup_s() / 3 if restart else 0.0) + warm + judging

    def turn_plan(self, run: EngineRun, v: Verdict) -> tuple[float, str] | None:
        """(rate, stream key) of an engine's next turn: while its knee is not bracketed, a new rate past its open
        side (the search's own step); then the rate placement.next_rate gives for this turn, within a grid step
        of the lowest rate that met and the highest that missed. The key is the paired stream of the engine's
        turn (workloads/streams.paired_key): turn n of each headline engine reads the same requests. None where
        nothing is left to measure."""
        st = self.visits.searched(run)
        est = v.fit.estimates.get(run.engine) if v.fit is not None else None
        if st.search is None or est is None:
            return None
        turn = turns_of(st)
        key = paired_key(turn)
        if not est.bracketed:
            usable = pooled(knee_points(v.points.get(run.engine, [])))
            now = replace(st.search, max_points=10**6, measured=[(p.offered_rps, p.attainment) for p in usable])
            rate = now.next_rate()
            return None if rate is None else (rate, key)
        return next_rate(est, turn, *reach(v.points.get(run.engine, []), self.design.target)), key


def likely_rival(engines: list[str], workload: str, budget: KvBudget, model: str) -> str | None:
    """The contiguous engine measured second, before any is measured: the one whose rate in the operating-point
    table is highest (harness/analysis/operating_points.json: from recorded runs of this workload, budget and model,
    the best evidence there is before the run; the table leaves out an engine whose 30 judged requests would take
    over a minute, a slow one), then an engine the fragbench scheduler runs (continuous batching) before one it
    does not (the naive generate loop), then the order given. Every other contiguous engine is screened against
    it; a wrong guess costs a search, not the answer (a screen that does not clearly miss is searched)."""
    contiguous = [e for e in engines if e not in PAGED]

    def rank(e: str) -> tuple[float, int, int]:
        rate = operating_rate(workload, budget.bytes, model, e)
        scheduled = e in REGISTRY and REGISTRY[e].kind is Kind.SCHEDULED
        return -(rate or 0.0), int(not scheduled), contiguous.index(e)

    return min(contiguous, key=rank, default=None)


def turns_of(st: Searched) -> int:
    """The decision turns an engine has taken at this budget: the paired streams its points read (a turn cut
    short still read its stream, which no later turn of the engine reads again)."""
    return sum(1 for p in st.points if paired_turn(p["key"]) is not None)
