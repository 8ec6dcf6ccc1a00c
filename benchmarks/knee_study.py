"""A simulation study of the knee estimate (harness/analysis/kneefit.py), the placement of points and the stop
(harness/analysis/placement.py) as the bench uses them: how often the headline ratio's 90 % interval covers the
true ratio, how wide it is, and how often it decides, at known true ratios (issue 58).

Run by hand:  .venv/bin/python benchmarks/knee_study.py [--runs 200] [--json] [--seed S] [--jobs 2]

The truth is the field's sustained rate (kneefit.DEFINITION, docs/method.md "The sustained rate"): each engine's
long-run rate, where the share of all its requests meeting the SLO, every stream pooled, is the target; its curve's
knee (the median stream's crossing) is set from it (`engine_of`), and the true ratio is the long-run rates' ratio.
The long-run check (`--long-run N`, issue 86): beside each run, on draws of its own, a long simulated run of N fresh
streams (each a point's length, its shift and the machine's drift drawn afresh) at the true rate and at the
reported one; its pooled attainment and Monte Carlo error (`long_run`). At the true rate it must be the target
within that error (the truth and the fit read one definition); at the reported rate it is the target as often
above as below, and the interval's ends straddle it as often as the interval covers.

The paired ratio (harness/analysis/kneepaired.py, issue 86 parts 2-3) is read on each run's final points beside
the joint fit (columns p: each engine its own slope, q: one slope for both; same seeds, same points), so that the
two are compared on one set of runs; `--placer paired` lets it place the turns and read the stop instead, the
joint fit then made once, on the final points (docs/performance.md, "The paired ratio").

Each synthetic run has two engines, paged and static-oracle, with true knees k_paged = true_ratio x k_static.
An engine's requests meet the SLO with probability

    p(r) = sigmoid(logit(0.9) - b * (log r + u - log k))

at offered rate r, u ~ Normal(0, s^2) drawn afresh for each point (every point is a fresh stream). Within a point
requests come in bursts of geometric length (mean `--burst-mean`, 1.5: a design effect of 2 x 1.5 - 1 = 2) that
share one outcome, as requests caught in one episode of queueing do. A point judges `--judged` requests; one whose
Wilson interval at its effective size lies under the target stops as soon as it has `--early-judged` (the bench's
clear miss). A point costs warm-up + judged / rate + drain seconds. With `--spread-exponent g` a stream's shift
and its offered load's spread narrow as (judged / `--spread-judged-ref`)^-g: a longer point averages more of its
arrivals (the twin's streams: g about 0.34 to 0.78, benchmarks/pairing_study.py at 25 and 100 judged), so that the
study can weigh a point's length against its fixed costs (issue 79 part 6: design.POINT_LENGTH).

The flow mirrors the bench: each engine's knee bracketed by knee.KneeSearch from 0.75 x its calibrated rate (the
calibration drawn around 1.6 x its true knee), stepping by 1.6, stopping once bracketed or its search time spent;
then decision turns in ABBA order (paged, static, static, paged, ...), each giving one engine one point at
placement.next_rate(its estimate, its turn) on a fresh stream, the fit redone after every turn, until
placement.done(...) or the decision's time is spent. Beside each run, on draws of its own, a third contiguous
engine (`--screened-knee` x static-oracle's knee) is screened by one point as the bench screens one, and the
headline's rival is chosen by the bench's rule (headline.rival_of, analysis/ruled_out.py): `rival ok` is the share
of runs whose rival is the contiguous engine with the highest true knee.

Where the defaults come from (estimates from recorded runs, to be replaced by measured values once issue 58's
replication study has measured them):
- b = 25: the issue's recorded run b3 had paged's bracket at 3.36 req/s met and 3.83 req/s at 22-33 % attainment,
  the logit falling about 3.5 over log(3.83 / 3.36) = 0.13 in log rate, b ~ 25.
- s = 0.08: adjacent streams of mixed-churn ask up to a quarter more or fewer output tokens in their first 30 s
  (the issue), a shift in log load of up to about +-0.2, sd about 0.08.
- k_static = 2.0 req/s: static-oracle's bracket in the issue's first run, [1.48, 2.38] req/s.
- 450 s of decision and 120 s of search per engine: the shares of the bench's default budget (issue 58: about
  250 s of 830 went to the decision before the time given to hf and static-max was moved to it).
- warm-up 4 s and drain 3 s a point, burst mean 1.5 (design effect 2): what recorded runs' points spent and showed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from harness.analysis import kneefit, placement, stream_priors
from harness.analysis.design import TURN_SHARE
from harness.analysis.headline import rival_of
from harness.analysis.knee import CONFIDENCE, Judged, KneeSearch, central, design_effect, knee_points
from harness.analysis.kneefit import KneeEstimate, KneeFit, fit
from harness.analysis.kneejoint import joint_fit
from harness.analysis.kneepaired import PairedRatio, paired_ratio
from harness.analysis.ruled_out import evidence_of, rulings
from harness.analysis.steady import wilson
from harness.analysis.stream_priors import SpreadPrior
from workloads.streams import STEPS_PER_OCTAVE, grid_index, grid_rate

PAGED, STATIC = "paged", "static-oracle"
SCREENED = "hf"  # a third contiguous engine, screened by one point (the rival check: `rival_check`)
ABBA = (PAGED, STATIC, STATIC, PAGED)  # the decision's turn order, repeated
# the paired estimator's readings of each run's final points (kneepaired.paired_ratio): each engine its own slope
# (sep, p: in the table) or one slope for both (shared, q:)
PAIRED_SLOPES = {"sep": False, "shared": True}
TARGET = 0.9
RATIOS = (1.0, 1.3, 1.7)
PRECISION = 1.5  # the headline's hi / lo asked (the bench's default --precision)
# a normal's sd as the scale of the Student-t of kneefit.TAIL_DF degrees of freedom that fits it best (maximum
# likelihood on 400,000 normal draws): what the fit's s reads off streams whose leftover shift is normal, as the
# twin's spread prior is the fit's own s on the twin's streams
T4_SCALE_OF_NORMAL = 0.83


def remembered(likelihood):
    """kneefit's likelihood grid, remembered for inputs it has seen: a decision turn adds a point to one engine,
    and the fit after it recomputes the other's grid from the same points (nine tenths of a fit's time). The same
    function on the same inputs: the fit's figures are unchanged, only computed once."""
    memo: dict[tuple, np.ndarray] = {}

    def cached(data, log_knees, target, *args, **kwargs):
        key = (data.log_rate.tobytes(), data.load.tobytes(), data.met.tobytes(), data.judged.tobytes(),
               log_knees.tobytes(), target, kneefit.TAIL_DF,
               repr(args), repr(sorted(kwargs.items())))
        if key not in memo:
            if len(memo) > 64:
                memo.clear()
            memo[key] = likelihood(data, log_knees, target, *args, **kwargs)
        return memo[key]

    cached.remembers = True
    return cached


if not getattr(kneefit.log_likelihood, "remembers", False):
    kneefit.log_likelihood = remembered(kneefit.log_likelihood)


@dataclass(frozen=True)
class Params:
    """One study's settings: the truth, the points and the time, as the CLI sets them."""

    k_static_rps: float = 2.0
    slope_b: float = 25.0
    spread_s: float = 0.08  # paged's stream spread: the sd of a stream's whole shift in log load
    spread_ratio: float = 1.0  # static-oracle's spread over paged's
    slope_ratio: float = 1.0  # static-oracle's true slope over paged's
    paired: bool = True  # the decision's n-th turn of each engine reads the same stream (the bench's paired streams)
    explained: float = 0.38  # the share of a stream's shift its offered token load explains (twin: 0.34 and 0.42)
    residual_rho: float = 0.11  # what the load leaves, correlated between two engines on one stream (twin: 0.11)
    fit_rho: float = 0.0  # the correlation the fit is told (kneejoint.joint_fit; 0: each engine fitted alone)
    load_sd: float = 0.28  # the sd of a point's log offered token load (25 requests of mixed-churn's lengths)
    judged: int = 50
    early_judged: int = 10
    burst_mean: float = 1.5
    warmup_s: float = 4.0
    drain_s: float = 3.0
    switch_s: float = 0.0  # a server restart when the decision turns from one engine to the other
    search_s: float = 120.0
    decision_s: float = 450.0
    calibration_factor: float = 1.6
    calibration_sd: float = 0.2
    search_start: float = 0.75
    step: float = 1.6
    search_points: int = 8
    decide_confidence: float = CONFIDENCE  # the interval "decided" reads (the bench: the reported 90 % one)
    stop: str = "rule"  # rule: placement.done; time: until the time is spent; decided: the former rule
    screened_knee: float = 0.7  # the screened engine's true knee over static-oracle's (hf's in a recorded run)
    drift_sd: float = 0.0  # the machine's drift: each visit of an engine shifts its log load by N(0, drift_sd^2)
    # the fit's spread prior: None, the half-t (the fit's default); else the twin's prior
    # (stream_priors.SpreadPrior) centred on the truth's s and gain (without the drift: the twin has none) times
    # this factor (0.5, 2: the twin off)
    prior_factor: float | None = None
    prior_below: float = stream_priors.PRIOR_BELOW  # the prior's width in log s toward narrower
    prior_above: float = stream_priors.PRIOR_ABOVE  # and toward wider
    # how a stream's shift narrows as its point judges more requests: spread_s and load_sd hold at
    # `spread_judged_ref` judged requests and scale as (judged / ref)^-spread_exponent (0: a point's length does
    # not matter; the twin's streams: about 0.4, a longer window averages more of its arrivals' load)
    spread_exponent: float = 0.0
    spread_judged_ref: int = 50
    long_run_streams: int = 0  # the long-run check's streams per long run (0: not run)
    placer: str = "fit"  # what places the decision's turns and stops it: fit (the bench's), paired (`placing`)
    placer_shared: bool = False  # the paired placer's slope: one for both engines

    def length_factor(self, judged: int) -> float:
        """How much a stream's shift (and its offered load's spread) a point of `judged` requests keeps, against
        one of `spread_judged_ref`."""
        return (max(1, judged) / self.spread_judged_ref) ** -self.spread_exponent


@dataclass(frozen=True)
class Engine:
    """An engine's truth: where its curve crosses the target for the median stream (its knee), how steeply it falls
    there, and its sustained rate (the long-run crossing, every stream pooled: `engine_of`)."""

    name: str
    knee_rps: float
    slope_b: float
    spread_s: float = 0.08
    sustained_rps: float | None = None


def shift_sd(prm: Params, spread: float) -> float:
    """The sd of a point's whole shift in log load: the stream's (its load's part and what the load leaves, at the
    points' length) and the machine's drift between visits, all normal."""
    return math.hypot(spread * prm.length_factor(prm.judged), prm.drift_sd)


LONG_RUN_NODES = np.linspace(-8.0, 8.0, 2001)  # the shift's nodes, in its sd (the curve is resolved at b 25, sd 0.5)
LONG_RUN_WEIGHTS = np.exp(-LONG_RUN_NODES ** 2 / 2) / np.exp(-LONG_RUN_NODES ** 2 / 2).sum()


def true_long_run(slope: float, sd: float, z: float) -> float:
    """The true long-run attainment at log r - log knee = z: the curve averaged over the shift's normal."""
    eta = math.log(TARGET / (1 - TARGET)) - slope * (z + sd * LONG_RUN_NODES)
    return float((1 / (1 + np.exp(-eta))) @ LONG_RUN_WEIGHTS)


def long_run_offset(slope: float, sd: float) -> float:
    """z where the true long-run attainment is the target (log sustained rate - log knee), by bisection."""
    lo, hi = -(8 * sd + 40 / slope), 8 * sd + 40 / slope
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if true_long_run(slope, sd, mid) >= TARGET else (lo, mid)
    return (lo + hi) / 2


def engine_of(name: str, sustained_rps: float, slope: float, spread: float, prm: Params) -> Engine:
    """An engine whose sustained rate (the long-run crossing) is `sustained_rps`: its knee set above it by the
    long-run offset of its slope and shift."""
    knee = sustained_rps * math.exp(-long_run_offset(slope, shift_sd(prm, spread)))
    return Engine(name, knee, slope, spread, sustained_rps)


@dataclass(frozen=True)
class Stream:
    """A stream's truth: its log offered token load (known to the fit) and the shared part of what it leaves."""

    load: float
    shared: float  # a standard normal: the part of the leftover shift two engines on this stream share


@dataclass
class Run:
    """One synthetic run as it goes: its points, a serial for fresh stream keys, its streams, its random draws."""

    prm: Params
    rng: np.random.Generator
    points: dict[str, list[Judged]]
    serial: int = 0
    streams: dict[str, Stream] = field(default_factory=dict)
    visit: dict[str, int] = field(default_factory=dict)  # per engine, its visit of the server now (0: the search)
    drifts: dict[tuple[str, int], float] = field(default_factory=dict)  # per engine and visit, the machine's drift

    def drift(self, engine: str) -> float:
        """The machine's drift in log load for the engine's present visit, drawn once per visit."""
        at = (engine, self.visit.get(engine, 0))
        if at not in self.drifts:
            self.drifts[at] = float(self.rng.normal(0.0, self.prm.drift_sd)) if self.prm.drift_sd > 0 else 0.0
        return self.drifts[at]

    def key(self, rate_rps: float) -> str:
        """A fresh stream for a search point: no other point reads it."""
        self.serial += 1
        return f"g{grid_index(rate_rps)}r{self.serial}"

    def stream(self, key: str) -> Stream:
        if key not in self.streams:
            self.streams[key] = Stream(float(self.rng.normal(0.0, self.prm.load_sd)), float(self.rng.normal()))
        return self.streams[key]

    def shift(self, engine: Engine, key: str, judged: int) -> tuple[float, float]:
        """(the stream's log offered token load, the engine's whole shift in log load on it) for a point of
        `judged` requests: the load's part explains `explained` of the engine's spread; the rest correlates
        `residual_rho` between two engines. Both shrink by the point's length factor (Params.length_factor)."""
        prm, st = self.prm, self.stream(key)
        f = prm.length_factor(judged)
        load = st.load * f
        gain = math.sqrt(prm.explained) * engine.spread_s / prm.load_sd
        rest = engine.spread_s * math.sqrt(1 - prm.explained) * f
        rho = prm.residual_rho
        return load, gain * load + rest * (math.sqrt(rho) * st.shared + math.sqrt(1 - rho) * self.rng.normal())


def attainment_p(engine: Engine, rate_rps: float, shift_u: float) -> float:
    """The true probability that a request meets the SLO at this rate on a stream whose load is shifted by u."""
    eta = math.log(TARGET / (1 - TARGET)) - engine.slope_b * (math.log(rate_rps) + shift_u - math.log(engine.knee_rps))
    return 1.0 / (1.0 + math.exp(-eta))


def bursty_verdicts(rng: np.random.Generator, p: float, n: int, burst_mean: float) -> np.ndarray:
    """n verdicts in arrival order, in bursts of geometric length sharing one outcome: a design effect over 1,
    as real runs show (one episode of queueing decides a burst)."""
    lengths = rng.geometric(1.0 / burst_mean, size=n)
    outcomes = (rng.random(n) < p).astype(float)
    return np.repeat(outcomes, lengths)[:n]


def long_run(prm: Params, rng: np.random.Generator, engine: Engine, rate_rps: float, streams: int
             ) -> tuple[float, float]:
    """A long simulated run at one rate: `streams` fresh streams of a point's length, each its own shift and drift
    (normal, `shift_sd`), its requests in bursts sharing a fate; (the pooled attainment, its Monte Carlo standard
    error: the per-stream shares' sd over sqrt(streams), the streams being of one length)."""
    n, shift = prm.judged, shift_sd(prm, engine.spread_s) * rng.standard_normal(streams)
    z = math.log(rate_rps) + shift - math.log(engine.knee_rps)
    p = 1 / (1 + np.exp(-(math.log(TARGET / (1 - TARGET)) - engine.slope_b * z)))
    ends = np.cumsum(rng.geometric(1.0 / prm.burst_mean, size=(streams, n)), axis=1)
    lengths = np.diff(np.minimum(ends, n), axis=1, prepend=0)  # each burst's requests within the stream's n
    share = (lengths * (rng.random((streams, n)) < p[:, None])).sum(axis=1) / n
    return float(share.mean()), float(share.std(ddof=1) / math.sqrt(streams))


def clear_miss_at(met: np.ndarray, early: int, d: float) -> int | None:
    """Where a point whose Wilson interval (at the effective size, judged over the design effect d) lies under
    the target stops, as the bench's points do; None when it never does."""
    for k in range(early, len(met)):
        if wilson(float(met[:k].sum()) / d, k / d)[1] < TARGET:
            return k
    return None


def measure(run: Run, engine: Engine, rate_rps: float, left_s: float, key: str | None = None,
            most_s: float = math.inf) -> tuple[Judged, float]:
    """One point on stream `key` (a fresh one by default): its judged verdicts and the seconds it took. Judging
    stops at a clear miss or when the time left is spent (the bench's stop_by); the design effect for the
    clear-miss test is the engine's, from its earlier points and this one's first `early_judged` verdicts."""
    prm = run.prm
    key = key or run.key(rate_rps)
    n = max(1, int(min(prm.judged, (left_s - prm.warmup_s) * rate_rps, most_s * rate_rps)))
    load, shift = run.shift(engine, key, n)
    p = attainment_p(engine, rate_rps, shift + run.drift(engine.name))
    met = bursty_verdicts(run.rng, p, n, prm.burst_mean)
    early = min(prm.early_judged, n)
    d = design_effect([*run.points[engine.name], Judged(rate_rps, key, met[:early], np.arange(early))])
    stop = clear_miss_at(met, early, d)
    met = met[:stop] if stop is not None else met
    point = Judged(rate_rps, key, met, np.arange(len(met)), log_load=load)
    run.points[engine.name].append(point)
    return point, prm.warmup_s + len(met) / rate_rps + prm.drain_s


def fits(prm: Params, rate_rps: float, left_s: float, judged: int) -> bool:
    """A point fits when its warm-up and `judged` arrivals do (the bench's least time for a point)."""
    return prm.warmup_s + judged / rate_rps <= left_s


def search(run: Run, engine: Engine) -> KneeSearch:
    """The bracket: from 0.75 x a calibration drawn around 1.6 x the true knee, stepping by 1.6, until a rate
    that met the target lies below one that missed it, or the search's time is spent."""
    prm = run.prm
    calibrated = prm.calibration_factor * engine.knee_rps * math.exp(run.rng.normal(0.0, prm.calibration_sd))
    ks = KneeSearch(max(prm.search_start * calibrated, 0.05), TARGET, step=prm.step, max_points=prm.search_points)
    left_s = prm.search_s
    while (rate := ks.next_rate()) is not None and fits(prm, rate, left_s, prm.early_judged):
        point, took_s = measure(run, engine, rate, left_s)
        left_s -= took_s
        ks.record(rate, point.attainment)
        if all(end is not None for end in ks.bracket()):
            break
    return ks


def headline(kf: KneeFit, decide_confidence: float = CONFIDENCE) -> tuple[float, float, float, bool, bool]:
    """(ratio, lo, hi, decided, precise) as the bench reads them: decided when the interval excludes 1.0 and
    both knees are bracketed; precise when hi / lo is at most the precision asked. A `decide_confidence` other
    than the bench's 90 % reads "excludes 1.0" off that central interval of the same joint draws instead (a
    stricter decision, against the many looks a stop after every turn takes); lo and hi stay the 90 % ones."""
    ratio, (lo, hi) = kf.ratio(PAGED, STATIC)
    d_lo, d_hi = (lo, hi) if decide_confidence == CONFIDENCE else central(
        np.exp(kf.log_knees[PAGED] - kf.log_knees[STATIC]), decide_confidence)
    both = all(kf.estimates[e].bracketed for e in (PAGED, STATIC))
    return ratio, lo, hi, both and not d_lo <= 1.0 <= d_hi, hi <= PRECISION * lo


def turn_rate(estimates: dict[str, KneeEstimate], engine: str, searches: dict[str, KneeSearch], turns: dict[str, int],
              points: list[Judged]) -> float:
    """An engine's next rate: its search's next while its knee is not bracketed (the bench brackets first),
    else placement's, alternating sides around the fitted knee, kept where its points leave the crossing in
    doubt (placement.reach)."""
    if not estimates[engine].bracketed:
        ks = replace(searches[engine], max_points=10**6)
        rate = ks.next_rate()
        if rate is not None:
            return rate
    rate = placement.next_rate(estimates[engine], turns[engine], *placement.reach(points, TARGET))
    turns[engine] += 1
    return rate


def stops(rule: str, decided: bool, precise: bool, counts: dict[str, int]) -> bool:
    """Whether the decision stops now: `rule` is placement.done (precise, each engine on MIN_POINTS points);
    `decided` the rule it replaced (decided too: optional stopping, kept to show what it did); `time` never (a
    fixed design, to tell the interval's calibration from the stop's looks)."""
    if rule == "decided":
        return decided and precise and min(counts.values()) >= placement.MIN_POINTS
    return rule == "rule" and placement.done(precise, counts)


def twin_priors(prm: Params, engines: dict[str, Engine]) -> dict[str, SpreadPrior] | None:
    """What the twin's spread prior would say of each engine (stream_priors.SpreadPrior): the fit's s on its streams'
    leftover shift (normal, its sd the part of the spread the load leaves) and the load's gain, both times
    `prior_factor` (the twin off); the machine's drift is not in it. None: no prior (the half-t)."""
    if prm.prior_factor is None:
        return None
    out, f = {}, prm.length_factor(prm.judged)  # the twin judges the run's points' length
    for name, e in engines.items():
        leftover = T4_SCALE_OF_NORMAL * e.spread_s * f * math.sqrt(1 - prm.explained)
        gain = math.sqrt(prm.explained) * e.spread_s / prm.load_sd
        out[name] = SpreadPrior(max(leftover, 1e-3), prm.prior_below, prm.prior_above, gain).scaled(prm.prior_factor)
    return out


def placing(run: Run, prm: Params, priors: dict[str, SpreadPrior] | None
            ) -> tuple[dict[str, KneeEstimate], bool, bool]:
    """What the next turn reads: (each engine's estimate, decided, precise). `placer` fit: the bench's (the joint
    fit's knees, its headline); paired: kneepaired's (each engine's long-run rate and its jackknife interval, the
    paired ratio's interval for the stop), a fit taking milliseconds where the joint fit takes seconds, so that a
    study of a few hundred runs fits in an hour; the joint fit is then made once, on the final points."""
    if prm.placer == "paired":
        pr = paired_ratio(run.points, PAGED, STATIC, TARGET, shared=prm.placer_shared)
        if pr is not None:
            pts = {e: knee_points(run.points[e]) for e in (PAGED, STATIC)}
            est = {e: KneeEstimate(e, pr.rates_rps[e], pr.rates_ci[e], sum(map(kneefit.informs, pts[e])),
                                   len({p.key for p in pts[e]}), int(sum(len(p.met) for p in pts[e])),
                                   kneefit.bracketed(pts[e], TARGET)) for e in (PAGED, STATIC)}
            both = all(e.bracketed for e in est.values())
            return est, both and not pr.ci[0] <= 1.0 <= pr.ci[1], pr.ci[1] <= PRECISION * pr.ci[0]
    kf = joint_fit(run.points, TARGET, {(PAGED, STATIC): prm.fit_rho}, priors=priors)
    _, _, _, decided, precise = headline(kf, prm.decide_confidence)
    return kf.estimates, decided, precise


def decide(run: Run, engines: dict[str, Engine], searches: dict[str, KneeSearch],
           priors: dict[str, SpreadPrior] | None = None) -> tuple[KneeFit, str, float]:
    """The decision's turns (ABBA), refitting after each, until placement.done or the time is spent: the last
    fit, why it stopped, and the seconds it used. Each engine's two turns in a row are one visit of its server
    (the bench's PER_VISIT), which the machine's drift may shift as a whole."""
    prm = run.prm
    left_s, turns, turn, last = prm.decision_s, {PAGED: 0, STATIC: 0}, 0, None
    served = {PAGED: 0, STATIC: 0}  # decision turns each engine has had: its next paired stream

    def final() -> KneeFit:
        return joint_fit(run.points, TARGET, {(PAGED, STATIC): prm.fit_rho}, priors=priors)

    while True:
        estimates, decided, precise = placing(run, prm, priors)
        counts = {e: estimates[e].points for e in (PAGED, STATIC)}
        if stops(prm.stop, decided, precise, counts):
            return final(), "precise", prm.decision_s - left_s
        engine = ABBA[turn % len(ABBA)]
        rate = turn_rate(estimates, engine, searches, turns, run.points[engine])
        switch_s = prm.switch_s if last not in (None, engine) else 0.0
        if not fits(prm, rate, left_s - switch_s - prm.drain_s, prm.judged):
            return final(), "time spent", prm.decision_s - left_s
        key = f"p{served[engine]}" if prm.paired else None  # paired: each engine's n-th turn reads stream n
        run.visit[engine] = 1 + served[engine] // 2  # visit 0 is the search's
        # a turn's judged arrivals take at most TURN_SHARE of the time left, as the bench's do
        _, took_s = measure(run, engines[engine], rate, left_s - switch_s, key, most_s=TURN_SHARE * left_s)
        served[engine] += 1
        left_s -= took_s + switch_s
        turn, last = turn + 1, engine


def rival_check(prm: Params, rng: np.random.Generator, static: Engine, after_search: list[Judged],
                at_end: list[Judged], kf: KneeFit) -> str | None:
    """Issue 79's check, beside the run and on its own draws (the run's own are unchanged): a third contiguous
    engine whose true knee is `screened_knee` x static-oracle's, screened as the bench screens one (one point
    at the grid rate at or under the lower end of static-oracle's interval after its search, stopping at a clear
    miss) and, where the one rule for "ruled out" (analysis/ruled_out.py) does not rule it out, searched as the
    bench then searches it (from its calibrated rate, its screen's point kept); then the headline's rival chosen
    at the run's end by headline.rival_of with that rule, over the final fit's knees (static-oracle's points
    `at_end`) and the screened engine's own fit. The rival's name (None: none). The decision's turns stay the
    run's: where the bench would turn to the screened engine, this check does not."""
    static_fit = fit({STATIC: after_search}, TARGET).estimates
    rate = grid_rate(math.floor(STEPS_PER_OCTAVE * math.log2(static_fit[STATIC].ci[0]) + 1e-6))
    run = Run(prm, rng, {SCREENED: []})
    screened = Engine(SCREENED, prm.screened_knee * static.knee_rps, static.slope_b, static.spread_s)
    measure(run, screened, rate, prm.search_s)

    def knees(estimates) -> dict[str, tuple[float, float, bool]]:
        return {e: (k.rps, k.ci[1], k.bracketed) for e, k in {**estimates, **fit(run.points, TARGET).estimates}.items()}

    if not rulings(knees(static_fit), evidence_of({STATIC: after_search, **run.points}, TARGET))[SCREENED].out:
        search(run, screened)
    return rival_of(knees(kf.estimates), evidence_of({STATIC: at_end, **run.points}, TARGET))


def one_run(prm: Params, true_ratio: float, seed: int, index: int) -> dict:
    """One synthetic run at a true ratio, from its own seed (the same whatever else runs beside it)."""
    ratio_key = round(true_ratio * 1000)
    run = Run(prm, np.random.default_rng([seed, ratio_key, index]), {PAGED: [], STATIC: []})
    engines = {PAGED: engine_of(PAGED, true_ratio * prm.k_static_rps, prm.slope_b, prm.spread_s, prm),
               STATIC: engine_of(STATIC, prm.k_static_rps, prm.slope_b * prm.slope_ratio,
                                 prm.spread_s * prm.spread_ratio, prm)}
    searches = {e: search(run, engines[e]) for e in (PAGED, STATIC)}
    search_points = {e: len(run.points[e]) for e in (PAGED, STATIC)}
    after_search = list(run.points[STATIC])
    kf, stop, used_s = decide(run, engines, searches, twin_priors(prm, engines))
    ratio, lo, hi, decided, precise = headline(kf, prm.decide_confidence)
    both = all(kf.estimates[e].bracketed for e in (PAGED, STATIC))
    readings = {tag: paired_of(paired_ratio(run.points, PAGED, STATIC, TARGET, shared=shared), true_ratio, both)
                for tag, shared in PAIRED_SLOPES.items()}
    rival = rival_check(prm, np.random.default_rng([seed, ratio_key, index, 79]), engines[STATIC], after_search,
                        run.points[STATIC], kf)
    best = STATIC if prm.screened_knee < 1 else SCREENED  # the contiguous engine with the highest true knee
    return {"true_ratio": true_ratio, **cell_of(prm), "ratio": ratio, "lo": lo,
            "hi": hi, "covered": lo <= true_ratio <= hi,
            "decided": decided, "precise": precise, "stop": stop, "decision_used_s": used_s,
            "points": {e: kf.estimates[e].points for e in (PAGED, STATIC)}, "search_points": search_points,
            "spread_s_fit": float(np.mean(list(kf.spread_s.values()))),
            "knee_covered": {e: kf.estimates[e].ci[0] <= engines[e].sustained_rps <= kf.estimates[e].ci[1]
                             for e in (PAGED, STATIC)}, "rival_is_best": rival == best,
            "long_run": long_run_checks(prm, np.random.default_rng([seed, ratio_key, index, 86]), engines, kf),
            "kneepaired": readings}


def paired_of(pr: PairedRatio | None, true_ratio: float, bracketed: bool) -> dict:
    """The paired estimator's reading of the run's final points (kneepaired.py), beside the fit's: its ratio,
    interval, whether it covers the truth, decides (excludes 1.0, both knees bracketed) and is precise. Where it
    gives none (fewer than three streams) it reads as undecided, uncovered and infinitely wide."""
    if pr is None:  # fewer than three streams
        return {"ratio": math.nan, "lo": 0.0, "hi": math.inf, "covered": False, "decided": False, "precise": False}
    lo, hi = pr.ci
    return {"ratio": pr.ratio, "lo": lo, "hi": hi, "covered": lo <= true_ratio <= hi,
            "decided": bracketed and not lo <= 1.0 <= hi, "precise": hi <= PRECISION * lo}


def long_run_checks(prm: Params, rng: np.random.Generator, engines: dict[str, Engine], kf: KneeFit) -> dict:
    """Per headline engine, long simulated runs (`long_run`) at its true sustained rate and at the reported rate and
    its interval's ends: {engine: {"true" | "rps" | "lo" | "hi": [pooled attainment, Monte Carlo error]}}; {}
    where the check is off."""
    if not prm.long_run_streams:
        return {}
    out = {}
    for e in (PAGED, STATIC):
        est = kf.estimates[e]
        rates = {"true": engines[e].sustained_rps, "rps": est.rps, "lo": est.ci[0], "hi": est.ci[1]}
        out[e] = {k: long_run(prm, rng, engines[e], r, prm.long_run_streams) for k, r in rates.items()}
    return out


# what tells one cell's rows from another's
CELL = ("spread", "paired", "slope_ratio", "drift_sd", "prior_factor", "fit_rho", "judged", "spread_exponent",
        "residual_rho")


def cell_of(prm: Params) -> dict:
    return {"spread": prm.spread_s, "paired": prm.paired, "slope_ratio": prm.slope_ratio, "drift_sd": prm.drift_sd,
            "prior_factor": prm.prior_factor, "fit_rho": prm.fit_rho, "judged": prm.judged,
            "spread_exponent": prm.spread_exponent, "residual_rho": prm.residual_rho}


def _task(args: tuple) -> dict:
    return one_run(*args)


def summarize(true_ratio: float, runs: list[dict]) -> dict:
    """A row of the table: coverage (with its Monte Carlo standard error), width, decisions, points and stops,
    and where the misses fall (true ratio above the interval or below it)."""
    n = len(runs)
    cover = sum(r["covered"] for r in runs) / n
    return {"true_ratio": true_ratio, **{k: runs[0][k] for k in CELL}, "runs": n,
            "coverage": round(cover, 4),
            "coverage_se": round(math.sqrt(cover * (1 - cover) / n), 4),
            "median_hi_lo": round(float(np.median([r["hi"] / r["lo"] for r in runs])), 4),
            "decided_share": round(sum(r["decided"] for r in runs) / n, 4),
            "precise_stop_share": round(sum(r["stop"] == "precise" for r in runs) / n, 4),
            "time_spent_share": round(sum(r["stop"] == "time spent" for r in runs) / n, 4),
            "median_points_paged": float(np.median([r["points"][PAGED] for r in runs])),
            "median_points_static": float(np.median([r["points"][STATIC] for r in runs])),
            "median_ratio": round(float(np.median([r["ratio"] for r in runs])), 4),
            "miss_below": round(sum(r["hi"] < true_ratio for r in runs) / n, 4),  # interval under the truth
            "miss_above": round(sum(r["lo"] > true_ratio for r in runs) / n, 4),  # interval over the truth
            "knee_coverage_paged": round(sum(r["knee_covered"][PAGED] for r in runs) / n, 4),
            "knee_coverage_static": round(sum(r["knee_covered"][STATIC] for r in runs) / n, 4),
            "median_spread_s_fit": round(float(np.median([r["spread_s_fit"] for r in runs])), 4),
            "median_decision_used_s": round(float(np.median([r["decision_used_s"] for r in runs])), 1),
            # issue 79: the share of runs whose headline rival is the contiguous engine with the highest true knee
            "rival_best_share": round(sum(r["rival_is_best"] for r in runs) / n, 4), **long_run_row(runs),
            **paired_row(true_ratio, runs)}


def paired_row(true_ratio: float, runs: list[dict]) -> dict:
    """The paired estimator's columns, each slope setting's (`PAIRED_SLOPES`), on the same runs' points as the
    fit's (kneepaired.py)."""
    out, n = {}, len(runs)
    for tag in PAIRED_SLOPES:
        pr = [r["kneepaired"][tag] for r in runs]
        cover = sum(p["covered"] for p in pr) / n
        out.update({
            f"{tag}_coverage": round(cover, 4), f"{tag}_coverage_se": round(math.sqrt(cover * (1 - cover) / n), 4),
            f"{tag}_median_hi_lo": round(float(np.median([p["hi"] / p["lo"] if p["lo"] > 0 else math.inf
                                                          for p in pr])), 4),
            f"{tag}_decided_share": round(sum(p["decided"] for p in pr) / n, 4),
            f"{tag}_precise_share": round(sum(p["precise"] for p in pr) / n, 4),
            f"{tag}_median_ratio": round(float(np.nanmedian([p["ratio"] for p in pr])), 4),
            f"{tag}_miss_below": round(sum(p["hi"] < true_ratio for p in pr) / n, 4),
            f"{tag}_miss_above": round(sum(p["lo"] > true_ratio for p in pr) / n, 4)})
    return out


def long_run_row(runs: list[dict]) -> dict:
    """The long-run check's columns (issue 86): at the true sustained rate, the pooled attainment of every run's
    long runs (both engines) and its Monte Carlo error, and how many errors it lies from the target; per engine,
    the median over runs of the long run's attainment at the reported rate, the share of runs where it met the
    target, and the share whose interval's ends straddle the target (attainment at lo >= target >= at hi, each
    within two of its errors)."""
    checks = [r["long_run"] for r in runs if r.get("long_run")]
    if not checks:
        return {}
    true = [c[e]["true"] for c in checks for e in (PAGED, STATIC)]
    mean = float(np.mean([a for a, _ in true]))
    se = math.sqrt(sum(err ** 2 for _, err in true)) / len(true)
    out = {"long_run_true": round(mean, 4), "long_run_true_se": round(se, 4),
           "long_run_true_z": round((mean - TARGET) / se, 2) if se > 0 else 0.0}
    for e, tag in ((PAGED, "paged"), (STATIC, "static")):
        at = [c[e]["rps"][0] for c in checks]
        out[f"long_run_at_rps_{tag}"] = round(float(np.median(at)), 4)
        out[f"long_run_met_{tag}"] = round(sum(a >= TARGET for a in at) / len(at), 4)
        out[f"long_run_straddle_{tag}"] = round(sum(
            c[e]["lo"][0] + 2 * c[e]["lo"][1] >= TARGET >= c[e]["hi"][0] - 2 * c[e]["hi"][1] for c in checks)
            / len(checks), 4)
    return out


def study(prm: Params | list[Params], ratios: tuple[float, ...] = RATIOS, runs: int = 200, seed: int = 0,
          jobs: int = 1, progress=None) -> dict:
    """Every setting's and true ratio's runs, summarized: {"rows": [...]} (the issue's contract), one row per
    (spread, pairing, true ratio). The runs go round the cells (run 0 of each, then run 1...), so that a study cut
    short still has every cell; run i of every cell draws from the same seed (common random numbers between the
    cells); `progress(results, total)` sees the runs as they finish."""
    prms = prm if isinstance(prm, list) else [prm]
    tasks = [(p, r, seed, i) for i in range(runs) for p in prms for r in ratios]
    results: list[dict] = []
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for res in pool.imap_unordered(_task, tasks):
                results.append(res)
                progress and progress(results, len(tasks))
    else:
        for t in tasks:
            results.append(_task(t))
            progress and progress(results, len(tasks))
    return rows_of(results, ratios)


def rows_of(results: list[dict], ratios: tuple[float, ...]) -> dict:
    """One row per cell and true ratio, in the order the cells' settings sort (pairing on before off)."""
    def cell(x: dict) -> tuple:
        return tuple(x[k] for k in CELL)

    def order(c: tuple) -> tuple:
        return c[0], not c[1], c[2], c[3], -1.0 if c[4] is None else c[4], c[5]

    cells = sorted({cell(x) for x in results}, key=order)
    of: dict[tuple, list[dict]] = {}
    for x in results:
        of.setdefault((*cell(x), x["true_ratio"]), []).append(x)
    return {"rows": [summarize(r, of[(*c, r)]) for c in cells for r in ratios if (*c, r) in of]}


def progress_to(partial_path: str | None, ratios: tuple[float, ...]):
    """Progress on stderr (--json's stdout stays one JSON document) and, with --partial, the rows so far written
    to a file every few runs: a long study read before it ends."""

    def show(results: list[dict], total: int) -> None:
        done = len(results)
        if done == total or done % 5 == 0:
            end = "\n" if done == total else ""
            print(f"\rknee study: {done}/{total} runs", end=end, file=sys.stderr, flush=True)
            if partial_path:
                Path(partial_path).write_text(json.dumps(rows_of(results, ratios)))

    return show


COLUMNS = [("spread", "spread", "{:.2f}"), ("paired", "paired", "{!s}"), ("slope_ratio", "slope x", "{:.2f}"),
           ("drift_sd", "drift", "{:.2f}"), ("prior_factor", "prior", "{!s}"), ("fit_rho", "fit rho", "{:.2f}"),
           ("judged", "judged", "{:d}"), ("spread_exponent", "s exp", "{:.2f}"), ("residual_rho", "rho", "{:.2f}"),
           ("true_ratio", "true", "{:.2f}"),
           ("runs", "runs", "{:d}"), ("coverage", "coverage", "{:.3f}"),
           ("coverage_se", "+-se", "{:.3f}"), ("median_hi_lo", "hi/lo", "{:.3f}"),
           ("decided_share", "decided", "{:.3f}"), ("precise_stop_share", "stop:precise", "{:.3f}"),
           ("time_spent_share", "stop:time", "{:.3f}"), ("median_points_paged", "pts paged", "{:.1f}"),
           ("median_points_static", "pts static", "{:.1f}"), ("median_ratio", "med ratio", "{:.3f}"),
           ("miss_below", "miss<", "{:.3f}"), ("miss_above", "miss>", "{:.3f}"),
           ("median_spread_s_fit", "s fit", "{:.3f}"), ("rival_best_share", "rival ok", "{:.3f}"),
           *[col for tag, short in (("sep", "p"), ("shared", "q")) for col in (
               (f"{tag}_coverage", f"{short}:cover", "{:.3f}"), (f"{tag}_coverage_se", "+-se", "{:.3f}"),
               (f"{tag}_median_hi_lo", f"{short}:hi/lo", "{:.3f}"),
               (f"{tag}_decided_share", f"{short}:decided", "{:.3f}"),
               (f"{tag}_median_ratio", f"{short}:med", "{:.3f}"),
               (f"{tag}_miss_below", f"{short}:miss<", "{:.3f}"), (f"{tag}_miss_above", f"{short}:miss>", "{:.3f}"))]]
LONG_RUN_COLUMNS = [("long_run_true", "lr@true", "{:.4f}"), ("long_run_true_se", "+-se", "{:.4f}"),
                    ("long_run_true_z", "z", "{:.2f}"), ("long_run_at_rps_paged", "lr@rps pg", "{:.3f}"),
                    ("long_run_met_paged", "met pg", "{:.2f}"), ("long_run_straddle_paged", "strad pg", "{:.2f}"),
                    ("long_run_at_rps_static", "lr@rps st", "{:.3f}"), ("long_run_met_static", "met st", "{:.2f}"),
                    ("long_run_straddle_static", "strad st", "{:.2f}")]


def table(result: dict, prm: Params) -> str:
    """The readable form: the settings (the first cell's: spread and pairing are columns), then one line per cell."""
    columns = COLUMNS + (LONG_RUN_COLUMNS if prm.long_run_streams else [])
    head = "  ".join(f"{h:>10}" for _, h, _ in columns)
    settings = ", ".join(f"{k}={v}" for k, v in asdict(prm).items())
    lines = [f"knee study ({100 * CONFIDENCE:.0f} % intervals): {settings}", head]
    for row in result["rows"]:
        lines.append("  ".join(f"{fmt.format(row[k]):>10}" for k, _, fmt in columns))
    lines.append("miss< : share of runs whose interval lies under the true ratio; miss> : over it; "
                 "s fit: the fit's median stream spread; rival ok: share of runs whose headline rival is the "
                 "contiguous engine with the highest true knee (a third one screened: --screened-knee)")
    if prm.long_run_streams:
        lines.append(f"lr@true: pooled attainment of long runs ({prm.long_run_streams} streams each) at the true "
                     "sustained rates, +-se its Monte Carlo error, z its distance from the target in errors; lr@rps: "
                     "the median over runs of a long run's attainment at the reported rate; met: the share of runs "
                     "where it met the target; strad: the share whose interval's ends straddle the target")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="synthetic runs per true ratio")
    ap.add_argument("--json", action="store_true", help='print {"rows": [...]} on stdout instead of a table')
    ap.add_argument("--seed", type=int, default=0, help="the study's seed (each run draws from its own)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (the machine has 2 busy cores)")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="true ratios paged / static-oracle")
    ap.add_argument("--k-static", type=float, default=d.k_static_rps, help="static-oracle's true knee, req/s")
    ap.add_argument("--slope", type=float, default=d.slope_b, help="b: logit attainment's fall per unit of log rate")
    ap.add_argument("--spread", type=float, default=d.spread_s, help="s: sd of a stream's shift in log load (paged's)")
    ap.add_argument("--spreads", default=None,
                    help="several spreads, comma-separated (e.g. 0.04,0.1,0.2,0.35,0.5): a row for each, instead of "
                         "--spread")
    ap.add_argument("--spread-ratio", type=float, default=d.spread_ratio, help="static-oracle's spread over paged's")
    ap.add_argument("--pairing", choices=("on", "off", "both"), default="on",
                    help="on: the decision's n-th turn of each engine reads the same stream (the bench's); off: "
                         "every point a stream of its own; both: a row for each")
    ap.add_argument("--explained", type=float, default=d.explained,
                    help="the share of a stream's shift its offered token load explains (known to the fit)")
    ap.add_argument("--residual-rho", default=str(d.residual_rho),
                    help="the correlation between two engines' leftover shifts on one stream (comma-separated: a "
                         "row for each)")
    ap.add_argument("--fit-rho", default="0",
                    help="the residual correlation the fit is told, comma-separated for a row each (the bench tells "
                         "it the twins' lower bound; 0: each engine fitted alone)")
    ap.add_argument("--load-sd", type=float, default=d.load_sd, help="sd of a point's log offered token load")
    ap.add_argument("--slope-ratio", type=float, default=d.slope_ratio,
                    help="static-oracle's true slope over paged's (the twin's: about 0.07, b 1.8 against 25)")
    ap.add_argument("--drift-sd", type=float, default=d.drift_sd,
                    help="the machine's drift: sd of the shift in log load each visit of an engine draws (0: none)")
    ap.add_argument("--prior-width", default=f"{d.prior_below},{d.prior_above}",
                    help="the prior's widths in log s, toward narrower and toward wider (stream_priors.SpreadPrior)")
    ap.add_argument("--prior-factors", default="none",
                    help="the fit's spread prior: none (the half-t), or comma-separated factors the twin's prior is "
                         "off by (1: centred on the truth; 0.5,1,2: a row each)")
    ap.add_argument("--judged", default=str(d.judged),
                    help="judged requests a point takes (comma-separated: a row for each)")
    ap.add_argument("--spread-exponent", type=float, default=d.spread_exponent,
                    help="a stream's shift (and its load's spread) scale as (judged / --spread-judged-ref) to minus "
                         "this (0: a point's length does not matter; the twin: about 0.4)")
    ap.add_argument("--spread-judged-ref", type=int, default=d.spread_judged_ref,
                    help="the judged requests at which --spread and --load-sd hold")
    ap.add_argument("--early-judged", type=int, default=d.early_judged, help="a clear miss stops at this many")
    ap.add_argument("--burst-mean", type=float, default=d.burst_mean, 
                    help="mean burst length (requests sharing a fate)")
    ap.add_argument("--warmup-s", type=float, default=d.warmup_s, help="a point's warm-up, s")
    ap.add_argument("--drain-s", type=float, default=d.drain_s, help="a point's drain, s")
    ap.add_argument("--switch-s", type=float, default=d.switch_s, 
                    help="a server restart when the turn changes engine, s")
    ap.add_argument("--search-s", type=float, default=d.search_s, help="each engine's search time, s")
    ap.add_argument("--decision-s", type=float, default=d.decision_s, help="the decision phase's time, s")
    ap.add_argument("--calibration-sd", type=float, default=d.calibration_sd,
                    help="sd of log calibrated rate around 1.6 x the true knee")
    ap.add_argument("--decide-confidence", type=float, default=d.decide_confidence,
                    help="the central interval whose excluding 1.0 counts as decided (the bench: the 90 %% one)")
    ap.add_argument("--screened-knee", type=float, default=d.screened_knee,
                    help="the screened third engine's true knee over static-oracle's (the rival check)")
    ap.add_argument("--long-run", type=int, default=d.long_run_streams,
                    help="the long-run check: streams in each long simulated run at the true and the reported rates "
                         "(0: not run)")
    ap.add_argument("--placer", choices=("fit", "paired"), default=d.placer,
                    help="what places the decision's turns and reads its stop: fit, the joint fit (the bench's, "
                         "seconds a turn); paired, kneepaired's estimates (milliseconds a turn; the joint fit made "
                         "once on the final points, so both estimators read the same points)")
    ap.add_argument("--partial", default=None, help="a file the rows so far are written to every 5 runs")
    ap.add_argument("--stop", choices=("rule", "time", "decided"), default="rule",
                    help="rule: placement.done stops the decision; time: it runs until its time is spent (no "
                         "optional stopping: tells the interval's calibration from the stop rule's looks); "
                         "decided: the former stop, decided and precise (optional stopping, for comparison)")
    return ap


def params_of(a: argparse.Namespace) -> list[Params]:
    """One Params per (spread, pairing, prior, fit rho, judged) cell the flags ask for."""
    one = one_params(a)
    spreads = [float(x) for x in a.spreads.split(",")] if a.spreads else [a.spread]
    pairings = {"on": [True], "off": [False], "both": [True, False]}[a.pairing]
    factors = [None if x.strip() == "none" else float(x) for x in a.prior_factors.split(",")]
    rhos = [float(x) for x in a.fit_rho.split(",")]
    judged = [int(x) for x in a.judged.split(",")]
    residual = [float(x) for x in a.residual_rho.split(",")]
    return [replace(one, spread_s=s, paired=p, prior_factor=f, fit_rho=r, judged=n, residual_rho=q) for s in spreads
            for p in pairings for f in factors for r in rhos for n in judged for q in residual]


def one_params(a: argparse.Namespace) -> Params:
    return Params(k_static_rps=a.k_static, slope_b=a.slope, spread_s=a.spread, slope_ratio=a.slope_ratio,
                  spread_ratio=a.spread_ratio, explained=a.explained,
                  residual_rho=float(a.residual_rho.split(",")[0]), load_sd=a.load_sd,
                  judged=int(a.judged.split(",")[0]), spread_exponent=a.spread_exponent,
                  spread_judged_ref=a.spread_judged_ref, early_judged=a.early_judged, burst_mean=a.burst_mean,
                  warmup_s=a.warmup_s,
                  drain_s=a.drain_s, switch_s=a.switch_s, search_s=a.search_s, decision_s=a.decision_s,
                  calibration_sd=a.calibration_sd, stop=a.stop, screened_knee=a.screened_knee, drift_sd=a.drift_sd,
                  prior_below=float(a.prior_width.split(",")[0]), prior_above=float(a.prior_width.split(",")[1]),
                  decide_confidence=a.decide_confidence, long_run_streams=a.long_run,
                  placer=a.placer)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    prms = params_of(a)
    ratios = tuple(float(x) for x in a.ratios.split(","))
    result = study(prms, ratios, a.runs, a.seed, a.jobs, progress_to(a.partial, ratios))
    print(json.dumps(result) if a.json else table(result, prms[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
