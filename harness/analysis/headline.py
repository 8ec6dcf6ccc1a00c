"""The headline: the rate the paged engine sustains over the best contiguous engine's, with the interval of
that ratio from the joint replicates (harness/analysis/knee.py), whether it is decided, what it rests on, and
what the decision phase of a bench measures next when it is not.

- `decided`: the ratio's 90 % interval excludes 1.0 (the direction is known) and both engines' knees are
  bracketed (a rate that met the SLO below one that missed it: a knee past every rate measured is a bound, and a
  ratio of bounds decides nothing); `precise`: its hi / lo is at most the precision asked. The decision phase
  goes on until both hold or its time is spent.
- `resolution`: how long a run would need: the interval's log-width falls as 1 / sqrt(judged requests at
  the two engines' bracket ends), so reaching the precision asked takes (width / log precision)^2 times the
  judged requests, each costing 1 / rate seconds of arrivals at its point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engines.registry import in_blocks
from harness.analysis.capacity import SLO, sustained_rate
from harness.analysis.knee import (
    REPLICATES,
    Judged,
    bracket_of,
    central,
    knee_points,
    pooled,
    ratio_replicates,
    replicate_knees,
    replications,
)

PAGED = in_blocks()  # engines that keep KV in blocks (engines/registry.py); every other one reserves contiguously

METHOD = ("90 % percentile interval of {replicates} joint replicates: each point's attainment drawn from its "
          "Jeffreys posterior at its effective size (judged requests over the engine's design effect: 1 + 2 x the "
          "significant autocorrelations of its met/missed series, Politis-White cut-off), engines that judged the "
          "same stream (one offered rate) drawing with one uniform (paired); the replications' rounds resampled "
          "with replacement, the same rounds for both engines (a hierarchical bootstrap: run-to-run variation "
          "inside the interval); in each replicate each engine's "
          "attainments made non-increasing in the rate (pool adjacent violators), its bracket re-read (its "
          "highest rate meeting the SLO target under the lowest that misses it) and its knee drawn log-uniformly "
          "inside it, and the two knees' ratio taken; widened, where it leaves the point estimate out, to reach it")


def reference_of(engines) -> str | None:
    """The paged engine the headline is about: fragbench's own where it runs, else the first paged one."""
    engines = list(engines)
    return "paged" if "paged" in engines else next((e for e in engines if e in PAGED), None)


def best_contiguous(points: dict[str, list[Judged]], slo: SLO, estimates: dict[str, float]) -> str | None:
    """The contiguous engine the paged one is measured against: the highest sustained rate among those whose
    knee is bracketed, unless one whose knee is not could still lie above it: every rate it was offered missed
    the SLO and the lowest of them is above the leader's rate (its estimate, read from 0 req/s up to its first
    point, is a guess, not a knee). Then that one, the highest reach first, so that the decision phase brackets
    it before it is ruled out. An engine that met the SLO at every rate offered reaches its last one: a lower
    bound, which leads only where it lies above every bracketed knee."""
    reach = {e: reach_of(points[e], slo, estimates[e]) for e in estimates if e not in PAGED}
    closed = [e for e in reach if bracketed(points[e], slo)]
    leader = max(closed, key=lambda e: estimates[e], default=None)
    contenders = [e for e in reach if e not in closed and (leader is None or reach[e] > estimates[leader])]
    return max(contenders, key=lambda e: reach[e]) if contenders else leader


def reach_of(points: list[Judged], slo: SLO, estimate: float) -> float:
    """The highest rate an engine's knee may be read at from its points: the lowest rate that missed where every
    one did (the knee lies anywhere under it), else its sustained rate."""
    lo, hi = bracket_of(rows_of(knee_points(points)), slo)
    return hi if lo is None and hi is not None else estimate


def rows_of(points: list[Judged]) -> list[dict]:
    """One row per offered rate, its replications pooled (knee.pooled)."""
    return [{"offered_rps": p.offered_rps, "slo_attainment": p.attainment} for p in pooled(points)]


def point_estimate(points: list[Judged], slo: SLO) -> float:
    """The sustained rate, interpolated between the points a knee rests on (knee.knee_points)."""
    return sustained_rate(rows_of(knee_points(points)), slo)[0]


def bracket_ends(points: list[Judged], slo: SLO) -> list[Judged]:
    """The knee's bracket ends among the points a knee rests on."""
    pts = pooled(knee_points(points))
    lo, hi = bracket_of(rows_of(pts), slo)
    return [p for p in pts if p.offered_rps in (lo, hi)]


def bracketed(points: list[Judged], slo: SLO) -> bool:
    """A rate that meets the SLO below one that misses it, among the points a knee rests on: the knee measured,
    not assumed past the rates measured (every one met) or under them (none did)."""
    lo, hi = bracket_of(rows_of(knee_points(points)), slo)
    return lo is not None and hi is not None


def raw_bracket_ends(points: list[Judged], slo: SLO) -> list[Judged]:
    """The bracket ends of every point, steady or not: where an unsteady point would place the knee."""
    lo, hi = bracket_of(rows_of(points), slo)
    return [p for p in pooled(points) if p.offered_rps in (lo, hi)]


@dataclass(frozen=True)
class Headline:
    engine: str
    against: str
    ratio: float
    ratio_ci: list[float]
    decided: bool
    precise: bool
    judged: dict[str, int]
    log_sd: dict[str, float]  # each engine's share of the uncertainty: sd of its log knee over the replicates
    replicates: int
    run_to_run_share: float  # of the ratio interval's log-width, what resampling the replications' rounds adds
    within_ci: list[float]  # the ratio's interval with every round kept (one realization's uncertainty alone)
    replications: dict[str, int]  # per engine: independent realizations its bracket ends were judged on (least)
    bracketed: dict[str, bool]  # per engine: its knee lies between a rate that met the SLO and one that missed it

    def to_json(self) -> dict:
        return {"engine": self.engine, "against": self.against, "ratio": round(self.ratio, 4),
                "ratio_ci": self.ratio_ci, "method": METHOD.format(replicates=f"{self.replicates:,}"),
                "decided": self.decided, "precise": self.precise, "judged": self.judged,
                "run_to_run_share": round(self.run_to_run_share, 3), "ratio_ci_within_runs": self.within_ci,
                "replications": self.replications, "bracketed": self.bracketed}


def reaching(ci: list[float], estimate: float) -> list[float]:
    """A ratio's interval that reaches its estimate, as each engine's does (summary.with_estimate): where a knee
    lies past the rates measured, the replicates' ratios can all fall on one side of the estimate, and an interval
    that leaves the estimate out would say more than the points do. Rounded outwards to 0.001."""
    return [math.floor(min(ci[0], estimate) * 1000) / 1000, math.ceil(max(ci[1], estimate) * 1000) / 1000]


def headline(points: dict[str, list[Judged]], slo: SLO, step: float, precision: float,
             replicates: int = REPLICATES, knees: dict[str, np.ndarray] | None = None) -> Headline | None:
    """The paged engine against the best contiguous one, or None when either is missing."""
    ref = reference_of(e for e, p in points.items() if knee_points(p))
    estimates = {e: point_estimate(p, slo) for e, p in points.items() if knee_points(p)}
    rival = best_contiguous(points, slo, estimates)
    if ref is None or rival is None or estimates[rival] <= 0:
        return None
    knees = knees or replicate_knees(points, slo, step, replicates)
    ratios = ratio_replicates(knees[ref], knees[rival])
    ratio = estimates[ref] / estimates[rival]
    ci = reaching(central(ratios), ratio)
    pair = {ref: points[ref], rival: points[rival]}
    within = replicate_knees(pair, slo, step, replicates, resample_rounds=False)
    within_ci = reaching(central(ratio_replicates(within[ref], within[rival])), ratio)
    closed = {e: bracketed(points[e], slo) for e in (ref, rival)}
    # decided: the interval excludes 1.0 and rests on two measured knees (a knee past every rate measured is a
    # bound, not a measurement: a ratio of bounds decides nothing)
    return Headline(ref, rival, ratio, ci,
                    not ci[0] <= 1.0 <= ci[1] and all(closed.values()), ci[1] <= ci[0] * precision,
                    {e: int(sum(len(p.met) for p in points[e])) for e in (ref, rival)},
                    {e: float(np.std(np.log(np.maximum(knees[e], 1e-9)))) for e in (ref, rival)}, len(ratios),
                    run_to_run(ci, within_ci), within_ci,
                    {e: replications(knee_points(points[e]), [p.offered_rps for p in bracket_ends(points[e], slo)])
                     for e in (ref, rival)}, closed)


def run_to_run(ci: list[float], within_ci: list[float]) -> float:
    """The share of the ratio interval's log-width that resampling the rounds adds: 1 - (log-width with every
    round kept) / (log-width with the rounds resampled), at least 0 (0 with a single round)."""
    if min(*ci, *within_ci) <= 0:
        return 0.0
    width, within = math.log(ci[1] / ci[0]), math.log(within_ci[1] / within_ci[0])
    return max(0.0, 1.0 - within / width) if width > 0 else 0.0


def time_to_resolve(h: Headline, points: dict[str, list[Judged]], slo: SLO, precision: float) -> float | None:
    """Seconds of arrivals more, at the bracket ends, for the ratio's interval to narrow to the precision."""
    ends = [p for e in (h.engine, h.against) for p in bracket_ends(points[e], slo)]
    if not ends or h.ratio_ci[0] <= 0:
        return None
    width = math.log(h.ratio_ci[1] / h.ratio_ci[0])
    factor = (width / math.log(precision)) ** 2
    return max(0.0, (factor - 1) * sum(len(p.met) / p.offered_rps for p in ends))


def resolvable(h: Headline, factor: float) -> float:
    """The smallest ratio an interval `factor` times as many judged requests would tell from 1.0: its
    half-width in log, the present log-width shrunk by sqrt(factor)."""
    width = math.log(h.ratio_ci[1] / h.ratio_ci[0]) if h.ratio_ci[0] > 0 else math.inf
    return math.exp(width / math.sqrt(max(factor, 1e-9)) / 2)
