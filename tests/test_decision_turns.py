"""The run side of issue 71: the rival measured second and every other engine screened by one point; a search
that always measures a point; decision turns on paired streams, kept where the fit is in doubt about the
crossing and bounded in time. Fakes stand in for the servers: these are the rules, not a run."""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from harness.analysis.design import GUARD_S, TURN_SHARE, Design
from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeEstimate, fit
from harness.analysis.placement import next_rate, reach
from harness.analysis.ruled_out import evidence_of, rulings
from harness.analysis.summary_records import CapacityBlock, RulingBlock
from harness.run.engine_run import EngineRun, Searched
from harness.run.search import PER_VISIT, KneeSearching, likely_rival, turns_of
from harness.run.verdicts import Verdict
from harness.units import KvBudget
from workloads.streams import STEPS_PER_OCTAVE, grid_index, grid_rate, key_of, paired_key, snap

BUDGET = KvBudget.parse("16MiB")
ENGINES = ["hf", "static-max", "static-oracle", "paged"]


def judged(rate: float, met: int, n: int, key: str | None = None) -> Judged:
    return Judged(rate, key or key_of(rate), (np.arange(n) < met).astype(float), np.arange(n))


# -- the fakes: what KneeSearching is handed
class FakeVisits:
    """Points measured at once: each judges what `attainment_at` says of its rate."""

    def __init__(self, attainment_at, n: int = 25):
        self.attainment_at, self.n, self.st, self.calls = attainment_at, n, {}, []

    def searched(self, run):
        return self.st.setdefault(run.engine, Searched(points=[]))

    def measure(self, visit, rate, show, replication=0, key=None, **rules):
        st = self.searched(visit.run)
        key = key or key_of(rate, replication)
        self.calls.append({"engine": visit.run.engine, "rate": rate, "key": key, **rules})
        st.points.append({"point": len(st.points), "offered_rps": rate, "key": key, "segments": []})
        met = (np.arange(self.n) < round(self.attainment_at(rate) * self.n)).astype(float)
        st.judged[len(st.points) - 1] = (met, np.arange(self.n))

    def attainment(self, run, rate):
        st = self.searched(run)
        met = np.concatenate([st.judged[i][0] for i in st.of_rate(rate)])
        return float(met.mean())


class FakeRecord:
    def __init__(self):
        self.meta, self.dir = {}, Path(".")

    def screen(self, engine, screened):
        self.meta.setdefault("screens", {})[engine] = screened

    def operating_point(self, *a):
        pass

    def write(self):
        pass

    def setups_s(self):
        return [25.0]


class Lines:
    def __init__(self):
        self.lines = []

    def plain(self, text):
        self.lines.append(text)

    say = plain


NOTHING = Verdict({}, {}, {}, None, None)


def searching(visits, engine_order=("paged", "static-oracle", "hf", "static-max"), left_s=600.0, search_s=None,
              verdict=NOTHING):
    cfg = SimpleNamespace(engines=ENGINES, kv_budget=BUDGET, workload="mixed-churn", model="models/tiny-llama",
                          search_s=search_s)
    clock = SimpleNamespace(left_s=left_s, started=time.time())
    s = KneeSearching(cfg, Design.of(830, 1.5, 0.9, dispersion=2.0), clock, FakeRecord(), Lines(), visits,
                      list(engine_order), [BUDGET], [])
    s.verdict = verdict if callable(verdict) else lambda visit=None: verdict
    return s


def rival_verdict(ci=(2.2, 3.4), visits: FakeVisits | None = None, reach_rps: float = 5.0):
    """The run after paged's and static-oracle's searches: static-oracle the rival, its knee in `ci`. With
    `visits`, a function of the visit that gives the run as the summary would then: each engine the visits
    measured with its ruling (analysis/ruled_out.py) read from its points, its fitted reach `reach_rps` (a
    one-point fit's upper end, far above what it missed)."""
    est = KneeEstimate("static-oracle", 2.7, ci, 4, 4, 100, True)
    fitted = SimpleNamespace(estimates={"static-oracle": est})
    head = SimpleNamespace(against="static-oracle", engine="paged", stop="time spent")
    if visits is None:
        return Verdict({}, {}, {}, head, fitted)

    def now(visit=None) -> Verdict:
        pts = {e: [Judged(p["offered_rps"], p["key"], *st.judged[i]) for i, p in enumerate(st.points)]
               for e, st in visits.st.items()}
        knees = {"static-oracle": (est.rps, est.ci[1], True), **{e: (0.5, reach_rps, False) for e in pts}}
        ruling = rulings(knees, evidence_of(pts, 0.9))
        capacity = {e: CapacityBlock(sustained_rps=0.5, ruling=RulingBlock.model_validate(ruling[e].written()))
                    for e in pts}
        return Verdict(pts, capacity, {}, head, fitted)
    return now


def visit_of(engine: str):
    return SimpleNamespace(run=EngineRun(engine, time.time(), 0, budget=BUDGET))


# -- the order, the screen, the first point
def test_the_rival_is_measured_second_by_the_operating_table_then_the_scheduler():
    assert likely_rival(ENGINES, "mixed-churn", BUDGET, "models/tiny-llama") == "static-oracle"
    # no table for this workload: an engine the scheduler runs before the naive generate loop, then as given
    assert likely_rival(["hf", "static-max", "paged"], "azure-conv", BUDGET, "models/tiny-llama") == "static-max"
    assert likely_rival(["paged"], "mixed-churn", BUDGET, "models/tiny-llama") is None


def test_a_screen_measures_one_point_under_the_rivals_interval_and_a_clear_miss_rules_the_engine_out():
    """Run 5: hf calibrated at 0.084 req/s searched its 128 s and ended with no point (summary.json had no hf in
    `capacity`, its search booked as 0 s). Screened, it is measured once, at or under the rival's lower end."""
    visits = FakeVisits(lambda rate: 0.1)
    s = searching(visits, search_s=128.0, verdict=rival_verdict(visits=visits))
    s.search(visit_of("hf"), lambda *a: None, calibrated_rps=0.084)
    assert [c["rate"] for c in visits.calls] == [grid_rate(math.floor(STEPS_PER_OCTAVE * math.log2(2.2)))]
    assert [c["key"] for c in visits.calls] == [key_of(visits.calls[0]["rate"])]  # a search's stream
    assert visits.calls[0]["rate"] <= 2.2 and visits.calls[0]["stop_by_s"] < 200
    screened = s.record.meta["screens"]["hf"]
    assert screened["ruled_out"] and screened["rival"] == "static-oracle" and screened["judged"] == 25
    assert any("hf: ruled out" in line and "search done" in line for line in s.console.lines)
    kept = visits.searched(visit_of("hf").run).search  # kept: the decision steps down from it, were hf the rival
    assert kept.measured == [(visits.calls[0]["rate"], 0.08)]


def test_a_screen_whose_interval_lies_under_the_target_says_ruled_out_whatever_the_fits_reach():
    """Run 3 printed "hf: not ruled out: 12 of 63 judged met at 1.09051 req/s (Wilson 90 % [0.07, 0.43] ...)": the
    run's headline had taken hf for its rival on its one-point fit's reach. The screen now prints the one rule's
    ruling (analysis/ruled_out.py), which the fit's reach does not enter."""
    visits = FakeVisits(lambda rate: 12 / 63, n=63)
    base = rival_verdict(ci=(1.1, 2.43), visits=visits, reach_rps=2.2)
    s = searching(visits, verdict=lambda visit=None: replace_against(base(visit), "hf" if visit else None))
    s.search(visit_of("hf"), lambda *a: None, calibrated_rps=1.0)
    assert len(visits.calls) == 1 and s.record.meta["screens"]["hf"]["ruled_out"]
    [said] = [line for line in s.console.lines if "12 of 63" in line]
    assert said.startswith("hf: ruled out: 12 of 63 judged met at 1.09051 req/s") and "under the target" in said


def replace_against(v: Verdict, against: str | None) -> Verdict:
    """The verdict with the headline's rival as a fit's reach alone would have it (`against`)."""
    if against is None:
        return v
    head = SimpleNamespace(**{**vars(v.headline), "against": against})
    return Verdict(v.points, v.capacity, v.ratios, head, v.fit)


def test_a_screen_that_does_not_clearly_miss_goes_on_to_a_search_from_its_point():
    visits = FakeVisits(lambda rate: 1.0 if rate < 2.5 else 0.2)  # as good as the rival: not ruled out
    s = searching(visits, verdict=rival_verdict(visits=visits))
    s.search(visit_of("static-max"), lambda *a: None, calibrated_rps=1.0)
    rates = [c["rate"] for c in visits.calls]
    assert len(rates) == 2 and rates[1] > rates[0]  # the screen met: the search steps up from it and brackets
    assert visits.searched(visit_of("static-max").run).search.bracket() == tuple(rates)
    assert not s.record.meta["screens"]["static-max"]["ruled_out"]


def test_a_search_whose_calibrated_start_does_not_fit_its_share_still_measures_a_point():
    """The rival itself is not screened: its first rate is raised to one whose clear miss fits half its share."""
    visits = FakeVisits(lambda rate: 0.0)
    s = searching(visits, engine_order=("paged", "hf"), search_s=128.0, verdict=NOTHING)
    s.cfg.engines = ["hf", "paged"]
    s.search(visit_of("hf"), lambda *a: None, calibrated_rps=0.084)
    assert visits.calls and visits.calls[0]["rate"] >= s.design.early_judged / 64 / 2 ** (1 / 16)
    assert visits.searched(visit_of("hf").run).points


def test_a_screened_engine_takes_no_share_of_the_headline_engines_time():
    s = searching(FakeVisits(lambda rate: 1.0), verdict=NOTHING)
    assert s.units_left(visit_of("paged").run) == 2 and s.units_left(visit_of("static-oracle").run) == 1
    assert s.units_left(visit_of("hf").run) == 1
    assert s.setups_after(visit_of("paged").run) == 3  # every later engine is still set up


# -- the decision's turns
def run4_points() -> list[Judged]:
    """static-oracle in run 4: attainment at the target over a wide range (fragmentation OOMs miss a share at
    every load), its search's bracket 2.83 to 7.34 req/s."""
    return [judged(snap(1.48), 22, 25), judged(snap(1.76), 47, 50), judged(snap(2.83), 45, 50),
            judged(snap(7.34), 2, 25)]


def test_run_4_a_turn_stays_within_a_grid_step_of_the_lowest_rate_that_met():
    """Run 4's fit: a shallow slope, an interval far wider than the bracket; its first turn went to 0.229 req/s,
    a twelfth of the bracket's lower end, and its 35 judged requests took the decision's whole 237 s."""
    wide = KneeEstimate("static-oracle", 1.2, (0.03, 8.0), 4, 4, 150, True)
    lowest_met, highest_missed, met_end = reach(run4_points(), 0.9)
    assert (lowest_met, highest_missed, met_end) == (snap(1.76), snap(7.34), snap(2.83))
    below = next_rate(wide, 1, lowest_met, highest_missed)
    assert below == grid_rate(grid_index(snap(1.76)) - 1) and below > 1.6
    assert next_rate(wide, 1) < 0.35  # unclamped, the turn falls near where run 4's did
    assert next_rate(wide, 0, lowest_met, highest_missed) <= grid_rate(grid_index(snap(7.34)) + 1)
    # with the bracket's met end: the knee estimate (1.2) lies under it, so no turn goes under 2.83 req/s
    assert next_rate(wide, 1, lowest_met, highest_missed, met_end) == snap(2.83)


def test_no_turn_goes_under_halfway_from_the_brackets_met_end_to_the_knee():
    """A fresh-clone run of be5c217: static-oracle met 77 % at its operating point (1.61 req/s) and 86 % at 1.76,
    its search stepped down to 0.386 req/s to meet, and the decision's first turn went to 0.386 again, a quarter
    of its knee, where every request met. A fit as flat as that engine's puts its knee low and wide; the turn's
    floor (placement.floor_rps) keeps it off the rate already known to meet."""
    pts = [judged(0.386, 12, 12), judged(snap(1.61), 24, 31), judged(snap(1.76), 43, 50)]
    low = KneeEstimate("static-oracle", 0.6, (0.3, 1.7), 3, 3, 93, True)
    lowest_met, highest_missed, met_end = reach(pts, 0.9)
    assert met_end == lowest_met == 0.386 and highest_missed == snap(1.76)
    assert next_rate(low, 1, lowest_met, highest_missed) < 0.39  # the rule before: where the run's turn went
    floor = math.sqrt(0.386 * 0.6)
    assert all(next_rate(low, t, lowest_met, highest_missed, met_end) >= snap(floor) > 0.386 * 1.2 for t in range(4))
    est = fit({"static-oracle": pts}, 0.9).estimates["static-oracle"]  # the fit itself: no turn under its floor
    assert all(next_rate(est, t, lowest_met, highest_missed, met_end) >= snap(math.sqrt(0.386 * est.rps))
               for t in range(4))


def test_the_nth_turn_of_each_headline_engine_reads_one_paired_stream_and_no_turn_reuses_one():
    rng = np.random.default_rng(4)

    def pts(knee):
        return [judged(snap(knee * f), int(25 * (0.97 if f < 1 else 0.3)) + int(rng.integers(0, 2)), 25)
                for f in (0.6, 0.8, 1.25, 1.6)]

    points = {"paged": pts(3.5), "static-oracle": pts(2.4)}
    v = Verdict(points, {}, {}, None, fit(points, 0.9))
    visits = FakeVisits(lambda rate: 0.9)
    s = searching(visits, verdict=v)
    keys = {}
    for engine in ("paged", "paged", "static-oracle", "static-oracle", "paged", "static-oracle"):
        run = visit_of(engine).run
        st = visits.searched(run)
        st.search = object()
        rate, key = s.turn_plan(run, v)
        assert key == paired_key(turns_of(st))
        keys.setdefault(engine, []).append(key)
        s.visits.measure(SimpleNamespace(run=run), rate, None, key=key)
    assert keys["paged"] == keys["static-oracle"] == ["p0", "p1", "p2"]


def test_a_turn_ends_at_its_time_bound_not_at_its_judged_count():
    """A turn's judged arrivals take at most TURN_SHARE of the time left: at 0.229 req/s, 50 judged requests
    would take 218 s of a decision that had 237."""
    visits = FakeVisits(lambda rate: 1.0)
    s = searching(visits, left_s=237.0, verdict=NOTHING)
    visit = visit_of("static-oracle")
    visits.searched(visit.run).warmup_s = 4.0
    began = time.time() - visit.run.t0
    s.turn(visit, (0.229, paired_key(0)), lambda *a: None, 1)
    bound = visits.calls[0]["stop_by_s"] - began
    assert bound <= 4.0 + TURN_SHARE * 237.0 + 1.0 and bound < s.design.min_judged / 0.229
    assert s.turn_cost(visit.run, 0.229, restart=False) <= 4.0 + TURN_SHARE * 237.0 + 1e-9
    assert TURN_SHARE <= 1 / (2 * PER_VISIT)  # the rule: one round of both engines' visits fits after a turn


def test_a_point_ends_at_its_time_bound_with_fewer_judged_requests_than_its_count(tmp_path, monkeypatch):
    """The point runner itself, on a fake clock: every request met the SLO at once, the point asked for 50 judged
    requests at 0.229 req/s (218 s of arrivals), and its time bound came first."""
    from harness.analysis.capacity import SLO
    from harness.run import points
    from harness.run.points import PointJob, PointRunner
    from workloads.schedule import ScheduleWriter
    from workloads.spec import load_spec
    from workloads.streams import Streams

    now = [100.0]
    monkeypatch.setattr(points.time, "sleep", lambda s: now.__setitem__(0, now[0] + max(s, 0.01)))
    streams = Streams(load_spec("mixed-churn"), 0)

    class Done:  # every request sent so far ended 0.2 s after it arrived, within the SLO
        def read(self):
            rows = []
            for seg in runner.segments:
                for r in streams.arrivals(seg, now[0] - 0.2):
                    rows.append({"request_id": r.request_id, "status": "ok", "ttft_s": 0.05, "tpot_s": 0.01,
                                 "e2e_s": 0.2, "end_s": r.arrival_s + 0.2, "output_tokens": r.max_tokens})
            return rows

    class Nothing:
        def read(self):
            return []

    runner = PointRunner(ScheduleWriter(tmp_path / "schedule.jsonl"), Done(), Nothing(), streams, SLO(2.0, 0.25, 0.9),
                         clock=lambda: now[0], supervise=lambda: None)
    job = PointJob(0, 0.229, paired_key(0), 0, min_judged=50, max_judged=50, early_judged=10, stop_by_s=160.0,
                   warmup_guess_s=3.0)
    res = runner.run(job)
    assert 0 < res.judged < 50 and res.attainment == 1.0
    assert res.segments[-1]["judged_end_s"] <= 160.0 + points.TICK_S
    assert res.segments[-1]["end_s"] <= 160.0 + points.TICK_S + GUARD_S[1]  # then its tail guard, and no more


def test_the_decision_visits_abba_and_turn_n_of_each_engine_reads_one_paired_stream():
    """decide() on fakes: visits alternate (the rival's first, two turns each), every turn a paired stream, turn n
    of paged and of static-oracle the same key, no key twice for one engine, every rate within a grid step of
    the engine's lowest met and highest missed rates."""
    rng = np.random.default_rng(5)

    def pts(knee):
        return [judged(snap(knee * f), int(25 * (0.97 if f < 1 else 0.3)) + int(rng.integers(0, 2)), 25)
                for f in (0.6, 0.8, 1.25, 1.6)]

    points = {"paged": pts(3.5), "static-oracle": pts(2.4)}
    headline = SimpleNamespace(engine="paged", against="static-oracle", stop="time spent", ratio=1.4,
                               ratio_ci=(1.1, 1.8), bracketed={}, decided=True, precise=False, precision=1.5,
                               figure=lambda k: None)
    v = Verdict(points, {}, {}, headline, fit(points, 0.9))
    visits = FakeVisits(lambda rate: 0.9)
    s = searching(visits, left_s=400.0, verdict=v)
    s.record.decision_log = lambda: []
    visits.revisit = lambda run: SimpleNamespace(run=run)
    visits.end_visit = lambda visit: None
    measure = visits.measure

    def spend(visit, rate, show, **kw):  # each turn takes 30 s of the run's time
        s.clock.left_s -= 30.0
        measure(visit, rate, show, **kw)

    visits.measure = spend
    runs = {e: visit_of(e).run for e in ("paged", "static-oracle")}
    for run in runs.values():
        visits.searched(run).search = object()
    s.decide(runs, lambda label, total: (lambda *a: None))
    engines = [c["engine"] for c in visits.calls]
    assert engines[:8] == ["static-oracle"] * 2 + ["paged"] * 2 + ["static-oracle"] * 2 + ["paged"] * 2
    keys = {e: [c["key"] for c in visits.calls if c["engine"] == e] for e in runs}
    n = min(len(k) for k in keys.values())
    assert n >= 4 and keys["paged"][:n] == keys["static-oracle"][:n] == [paired_key(i) for i in range(n)]
    for e in runs:
        lowest_met, highest_missed, _ = reach(points[e], 0.9)
        rates = [c["rate"] for c in visits.calls if c["engine"] == e]
        assert all(grid_rate(grid_index(lowest_met) - 1) <= r <= grid_rate(grid_index(highest_missed) + 1)
                   for r in rates)
