"""Where the decision places its points, and when it stops (an up-and-down design around the fitted knee).

Once an engine's knee is bracketed (knee.KneeSearch: a rate that met the SLO below one that missed it), each
further point goes near the knee as the fit now estimates it (kneefit.py), alternating sides: one above, the
next below, `spread` apart in log rate, so that the points straddle the crossing where they tell most about it
(a point far from the knee says little about where the curve crosses the target) and still see the slope. Each
point is a fresh stream (the decision's paired stream of its turn, workloads/streams.paired_key) with a fixed
number of judged requests, so that every point weighs alike and the stream-to-stream spread is sampled as often
as the rate is.

A turn stays where the points leave the crossing in doubt: never more than a grid step below the lowest rate
that met the target, nor above the highest that missed it (`reach`). Below every rate that met, a point meets
too and tells nothing of the crossing; it also takes longest (its judged requests arrive slowest). A fit whose
slope came out shallow has a wide interval, and half its half-width can reach far past the points: in a
fresh-clone run static-oracle's search bracketed its knee between 2.83 and 7.34 req/s, and the decision's first
turn went to 0.229 req/s (100 % met; its 35 judged requests took the decision's whole 237 s).

Nor does a turn go under the bracket's met end (the highest rate that met under the lowest that missed above a
rate that met) by more than half the way from it to the knee: its floor (`floor_rps`)
is the geometric middle of that rate and the knee estimate, or that rate itself where the estimate lies under it.
Under it the points already say "met"; a turn there is a replicate of what is known, not a look at the crossing.
In a fresh-clone run of be5c217 static-oracle met 77 % at 1.61 req/s and 83-87 % at 1.76 (its misses
fragmentation OOMs at every load), its search stepped down to 0.386 req/s to meet, and the decision's first turn
went to 0.386 again, a quarter of its knee, where every request met.

The stop: the headline precise (hi / lo at most the precision asked), each of its two engines resting on at least
`MIN_POINTS` points; else when the time is spent. Whether it is decided does not enter the stop: a rule that
stops as soon as the interval excludes 1.0 looks again after every point and stops on the first look that does,
so at a true ratio of 1.0 it decides far more often than a 90 % interval should (optional stopping: in the
simulation study, benchmarks/knee_study.py, 13-30 % of such runs decided under a stop on "decided and precise",
7.5 % under a stop on precision alone; the intervals' coverage fell from 0.93 to 0.68-0.83). An interval as narrow
as asked that still holds 1.0 is an answer too: no measurable difference at that precision.
"""

from __future__ import annotations

import math

from harness.analysis.knee import Judged, knee_points, pooled
from harness.analysis.kneefit import KneeEstimate
from workloads.streams import STEPS_PER_OCTAVE, grid_index, grid_rate, snap

# points that inform a headline knee (the operating point does not: kneefit.informs) before the decision may stop:
# the bracket's two ends and four placed around the knee, two on each side, so that the slope is seen from both
# sides twice (each engine's fit has four unknowns, its knee, slope, stream spread and the offered token load's
# gain: fewer points than about twice that leave the spread and gain to their priors, which the interval then shows)
MIN_POINTS = 6
GRID_STEP = math.log(2) / STEPS_PER_OCTAVE  # one grid step in log rate: the finest two points can differ


def spread(estimate: KneeEstimate) -> float:
    """Half of the interval's log half-width, at least one grid step: the points close in as the knee does."""
    half = math.log(estimate.ci[1] / estimate.ci[0]) / 2 if estimate.ci[0] > 0 else GRID_STEP
    return max(GRID_STEP, half / 2)


def reach(points: list[Judged], target: float) -> tuple[float | None, float | None, float | None]:
    """(lowest rate that met, highest that missed, the bracket's met end: the highest rate that met under the
    lowest that missed above the lowest that met) among the points a knee rests on, each rate's replications
    pooled; None where no rate met (or none missed, or none missed above one that met)."""
    rows = pooled(knee_points(points))
    met = [p.offered_rps for p in rows if len(p.met) and p.attainment >= target]
    missed = [p.offered_rps for p in rows if not len(p.met) or p.attainment < target]
    above = [r for r in missed if met and r > min(met)]
    met_end = max((r for r in met if r < min(above)), default=None) if above else None
    return min(met, default=None), max(missed, default=None), met_end


def floor_rps(estimate: KneeEstimate, met_end: float | None) -> float | None:
    """The lowest rate a turn may take (module docstring): halfway in log rate from the bracket's met end to the
    knee estimate, that met end where the estimate lies under it; None without a met end."""
    if met_end is None:
        return None
    return snap(math.sqrt(met_end * estimate.rps)) if estimate.rps > met_end else met_end


def clamped(rate: float, lowest_met: float | None, highest_missed: float | None) -> float:
    """`rate`, kept within a grid step of where the points leave the crossing in doubt (module docstring)."""
    if lowest_met is not None:
        rate = max(rate, grid_rate(grid_index(lowest_met) - 1))
    if highest_missed is not None:
        rate = min(rate, grid_rate(grid_index(highest_missed) + 1))
    return rate


def next_rate(estimate: KneeEstimate, turn: int, lowest_met: float | None = None,
              highest_missed: float | None = None, met_end: float | None = None) -> float:
    """The grid rate of an engine's `turn`-th placed point: above the knee on even turns, below on odd ones,
    within a grid step of the lowest rate that met and the highest that missed, and at or above its floor
    (`reach` gives the three rates; `floor_rps`)."""
    side = 1 if turn % 2 == 0 else -1
    rate = snap(estimate.rps * math.exp(side * spread(estimate)))
    if rate == snap(estimate.rps):  # the grid rounded it onto the knee's own rate: one step to its side
        rate = grid_rate(round(STEPS_PER_OCTAVE * math.log2(rate)) + side)
    floor = floor_rps(estimate, met_end)
    return clamped(rate if floor is None else max(rate, floor), lowest_met, highest_missed)


def done(precise: bool, points: dict[str, int]) -> bool:
    """The decision's stop: precise, and each headline engine on at least MIN_POINTS points."""
    return precise and min(points.values(), default=0) >= MIN_POINTS
