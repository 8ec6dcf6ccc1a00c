"""Where the decision places its points, and when it stops (an up-and-down design around the fitted knee).

Once an engine's knee is bracketed (knee.KneeSearch: a rate that met the SLO below one that missed it), each
further point goes near the knee as the fit now estimates it (kneefit.py), alternating sides: one above, the
next below, `spread` apart in log rate, so that the points straddle the crossing where they tell most about it
(a point far from the knee says little about where the curve crosses the target) and still see the slope. Each
point is a fresh stream (a new realization of its rate) with a fixed number of judged requests, so that every
point weighs alike and the stream-to-stream spread is sampled as often as the rate is.

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

from harness.analysis.kneefit import KneeEstimate
from workloads.streams import STEPS_PER_OCTAVE, grid_rate, snap

# points a headline knee rests on before the decision may stop: the fit has three unknowns that the two engines
# share (slope, stream spread) or hold alone (the knee), and a stream spread estimated from fewer than about twice
# as many points as unknowns is a guess (the bracket's two ends plus four placed around the knee)
MIN_POINTS = 6
GRID_STEP = math.log(2) / STEPS_PER_OCTAVE  # one grid step in log rate: the finest two points can differ


def spread(estimate: KneeEstimate) -> float:
    """Half of the interval's log half-width, at least one grid step: the points close in as the knee does."""
    half = math.log(estimate.ci[1] / estimate.ci[0]) / 2 if estimate.ci[0] > 0 else GRID_STEP
    return max(GRID_STEP, half / 2)


def next_rate(estimate: KneeEstimate, turn: int) -> float:
    """The grid rate of an engine's `turn`-th placed point: above the knee on even turns, below on odd ones."""
    side = 1 if turn % 2 == 0 else -1
    rate = snap(estimate.rps * math.exp(side * spread(estimate)))
    if rate == snap(estimate.rps):  # the grid rounded it onto the knee's own rate: one step to its side
        rate = grid_rate(round(STEPS_PER_OCTAVE * math.log2(rate)) + side)
    return rate


def done(precise: bool, points: dict[str, int]) -> bool:
    """The decision's stop: precise, and each headline engine on at least MIN_POINTS points."""
    return precise and min(points.values(), default=0) >= MIN_POINTS
