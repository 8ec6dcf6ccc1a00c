"""The measurement's design, derived from what the user asks (a precision for the headline ratio, a total
time) by rules the report prints, not tuned so that a figure comes out: how many requests a point judges,
when it stops, how long a decision turn may take, how the time is shared.

- A point judges `min_judged` requests: `POINT_LENGTH` times the fewest at which a point every one of whose
  requests met the SLO can be told from the target (Wilson: z^2 t / (1 - t), 25 at t = 0.9), times the
  workload's index of dispersion D (the variance over the mean of its arrival counts in windows that hold that
  many arrivals on average: 1 for Poisson arrivals, more for bursty ones, workloads/streams.dispersion). A bursty
  stream's requests arrive in bunches that share a fate, so a point holds D times as many to hold its bursts.
- The number is fixed (`max_judged` is `min_judged`: the knee is fitted from every point), save that a point
  whose Wilson 90 % interval at the effective size (judged requests over the engine's design effect,
  harness/analysis/knee.py) lies wholly under the target stops as soon as it has `early_judged` judged requests
  (a clear miss needs no more), and that no point runs past its time bound: its engine's share in a search, a
  share of the time left in the decision (harness/run/search.py's TURN_SHARE). A point cut short judges fewer
  requests, and its interval says so.
- Each engine's search brackets its knee (a rate that met below one that missed) and stops; with
  `--knee-tolerance` it bisects the bracket until hi / lo <= 1 + tolerance.
- Who is searched: the paged reference first, then the contiguous engine likeliest to be its rival
  (harness/run/search.likely_rival). Every other engine is screened: one point at the grid rate at or under the
  rival's lower interval end; a clear miss there rules it out (its knee a bound under the rival's interval) and
  ends its search; otherwise it is searched as the others are.
- Time: the whole budget (`--time`) counts from the bench's start. Before each engine's search, what is left
  (less the set-up every engine still to come will spend, as measured on those done) is shared equally between
  the searches still to run (this one, and later engines that are not screened) and `DECISION_SHARES` shares
  for the decision; a share caps a search, and what a search or a screen leaves unused goes on to the ones after
  it and to the decision, which gets all that is left. The decision measures the headline's two engines in
  alternating visits (ABBA), turn n of each on the same paired stream, until the ratio's interval is as narrow
  as asked on enough points (harness/analysis/placement.done: whether it is decided does not enter the stop),
  or the next turn does not fit in the time left.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from harness.analysis.placement import MIN_POINTS
from harness.analysis.steady import Z90, fewest_to_pass

EARLY_JUDGED = 10  # a point clearly under the target may stop with this many judged requests
GUARD_S = (1.0, 10.0)  # a point's tail guard, one median E2E latency clamped to this range
# the decision's shares of a search's cap: the headline's two engines are the only ones searched in full, and the
# decision measures both of them again, so it is reserved as much as their two searches (it gets every second
# the searches and screens leave besides)
DECISION_SHARES = 2
# a point's length, in multiples of the fewest judged requests that tell a point from the target (times D). A
# stream's shift narrows as a longer window averages more of its arrivals' load (the twin's streams: the fitted
# spread falls as judged^-0.34 to judged^-0.78, benchmarks/pairing_study.py at 25 and 100 judged), and the knee study
# with each search's time held at 75 s found 3 x narrower (hi/lo 1.71 -> 1.56 at s = 0.2). On the bench it was not:
# the searches bracket by points, so at 3 x they ran to their caps (about 190 s each), the decision began at 390-620
# s instead of 280-320 s and had 3-5 visits instead of 8-10, and four fresh-clone runs gave hi/lo 1.47-2.05 (median
# 1.80) against 1x's five 1.47-1.94 (1.55). 1 x stays (issue 79 part 6; docs/performance.md, "Point length").
POINT_LENGTH = 1
# a decision turn's judged arrivals take at most this share of the time left: one ABBA round (two turns of each
# engine) would fit in the time left after it were every turn that long, so that no one turn takes the time of
# the turns that pair it (a fresh-clone run's first turn, at 0.229 req/s, took the decision's whole 237 s)
TURN_SHARE = 1 / 4


@dataclass(frozen=True)
class Design:
    time_s: float
    precision: float  # the headline ratio's interval asked: hi / lo at most this
    target: float  # the SLO attainment
    min_judged: int
    max_judged: int
    tolerance: float | None  # bisect each bracket until hi / lo <= 1 + this; None: bracket, then stop
    min_judged_s: float = 0.0  # --point-duration: seconds of judged arrivals a point takes at least
    step: float = 1.6  # the bracketing factor
    max_points: int = 8
    early_judged: int = EARLY_JUDGED
    dispersion: float = 1.0  # the workload's index of dispersion of arrivals (1: Poisson), as measured
    # a screen's point: 1 x the fewest (x D) whatever POINT_LENGTH is. A screen asks one question, whether the
    # engine clearly misses at the rival's lower end, and is not fitted into the headline: a longer point buys it
    # nothing (at 3 x two screens judged 154-156 requests at 2.1 req/s, 160 s of a fresh-clone run's decision)
    screen_judged: int = 0  # Design.of sets it

    @classmethod
    def of(cls, time_s: float, precision: float, target: float, point_requests: int | None = None,
           point_s: float | None = None, tolerance: float | None = None, max_points: int = 8,
           dispersion: float = 1.0) -> Design:
        fewest = fewest_judged(target, dispersion)
        n, screen = point_requests or POINT_LENGTH * fewest, point_requests or fewest
        return cls(time_s, precision, target, n, n, tolerance, point_s or 0.0, max_points=max_points,
                   early_judged=min(EARLY_JUDGED, n), dispersion=round(dispersion, 3), screen_judged=screen)

    def to_json(self) -> dict:
        return {**asdict(self), "rules": self.rules()}

    def rules(self) -> list[str]:
        z = Z90
        fewest = fewest_to_pass(self.target)
        bursts = (f" x the workload's index of dispersion {self.dispersion:g} (its arrival counts' variance over "
                  f"their mean in windows of {fewest} arrivals; 1 is Poisson), so that a point holds its bursts"
                  if self.dispersion > 1 and self.min_judged > fewest else "")
        ruled = self.min_judged == POINT_LENGTH * fewest_judged(self.target, self.dispersion)
        why = (f"{POINT_LENGTH} x: a longer point narrows its stream's shift, but its searches then run to their "
               "caps and leave the decision fewer turns (docs/performance.md, \"Point length\"); " if ruled else "")
        how = (f" ({POINT_LENGTH} x the fewest at which a point that met the SLO for every request is told from the "
               f"{100 * self.target:.0f} % target: z^2 t / (1 - t), z = {z}{bursts})" if ruled
               else " (--point-requests)")
        return [
            f"a point judges at least {self.min_judged} requests{how}"
            + (f" and {self.min_judged_s:g} s of arrivals" if self.min_judged_s else ""),
            f"every point judges {self.min_judged} (a fixed number: the knee is fitted from every point); {why}one "
            f"whose Wilson 90 % interval lies under the target stops at {self.early_judged}",
            ("each engine's search brackets its knee and stops" if self.tolerance is None else
             f"each engine's bracket is bisected until hi / lo <= {1 + self.tolerance:.3f} (--knee-tolerance)"),
            f"the {self.time_s:g} s budget is shared equally, before each engine's search, between the searches "
            f"still to run (the paged engine, its likely rival, and any engine a screen did not rule out) and "
            f"{DECISION_SHARES} shares for the decision, less the set-up of every engine still to come; a share caps "
            "a search, and what it leaves goes on; no point runs past its engine's share",
            "every engine other than the paged one and its likely rival (measured second) is screened: one point "
            f"({self.screen_judged} judged requests at most: a screen asks one question and is not fitted into the "
            "headline) at the grid rate at or under the rival's lower interval end; a clear miss there (its Wilson "
            "interval under the target) rules it out, its knee a bound under the rival's, and ends its search",
            "the decision measures the headline's two engines in alternating visits (ABBA), turn n of each on the "
            "same paired stream (one request sequence, each engine at its own rate), each turn placed around the "
            "engine's fitted knee, alternately above and below it, never more than a grid step below the lowest "
            f"rate that met nor above the highest that missed, its judged arrivals at most {100 * TURN_SHARE:g} % of "
            f"the time left; it stops once the ratio's interval is at most {self.precision:g} wide (hi / lo) on at "
            f"least {MIN_POINTS} points per engine, or when the next turn does not fit in the "
            "time left (whether it is decided does not stop it: stopping on the first look that excludes 1.0 would "
            "decide too often where there is no difference)",
        ]


def fewest_judged(target: float, dispersion: float) -> int:
    """The fewest judged requests that tell a point from the target, times the workload's index of dispersion: a
    screen's point, and POINT_LENGTH times it every other point."""
    return math.ceil(fewest_to_pass(target) * max(1.0, dispersion))


def share_s(left_s: float, engines_left: int, setup_s: float, decision: bool = True,
            setups_after: int | None = None) -> float:
    """An engine's search time: what is left, less the set-up of the engines after it (`setups_after`, by default
    the searches after it), over the searches left (this one included) and `DECISION_SHARES` for the decision
    (where there is a headline to decide)."""
    after = engines_left - 1 if setups_after is None else setups_after
    return max(0.0, (left_s - setup_s * after) / (engines_left + DECISION_SHARES * int(decision)))


def guard_s(e2e_median_s: float | None) -> float:
    lo, hi = GUARD_S
    return min(hi, max(lo, e2e_median_s or lo))
