"""Steady state inside one point of a sweep: where its warm-up ends, whether what follows is stationary, and
the binomial intervals the search and the report use.

- Warm-up (`warmup_s`): one p90 E2E latency of the point's own finished requests, at least `MIN_WARMUP_S`.
  The requests the engine held when the point began were admitted under the previous load (or none); by
  Little's law the engine's population turns over in about one sojourn time, and nine in ten of them have
  left after one p90 E2E latency. (MSER-5 on the 10 Hz running + waiting series was tried first: on the bursty
  arrivals of the churn presets its truncation followed bursts, not the transient, and cut half of a
  stationary window.)
- Halves (`halves`): the judged requests split in two by arrival; each half's SLO attainment with its Wilson
  90 % interval, and each half's mean queue (running + waiting requests) with a batch-means 90 % interval (10
  batches). The queue's halves are reported; they do not decide whether a point counts.
- What a knee makes of a point (`knee_use`), judged on the question asked, SLO attainment against the target:
  a point whose halves' attainments lie on one side of the target (both pass, or both miss) or whose halves'
  intervals overlap is `steady`, used as it is, whatever its queue did (a paged engine's running count moves
  with preemption: that is how it serves, not a transient). One whose attainment fell while its queue grew
  (the second half's interval wholly under the target, its mean queue above the first half's) is `over_knee`:
  its queue grew without bound inside the point, so at steady state it would miss by more still (a miss, not
  an uncertain attainment). Only a point whose halves fall on two sides of the target with disjoint intervals
  and no growing queue is `unsteady`: no knee rests on it, and the decision phase extends it at the same rate
  until it settles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z90 = 1.645  # two-sided 90 %
MIN_WARMUP_S = 1.0
BATCHES = 10  # batch means of a half's samples


def wilson(met: float, n: int, z: float = Z90) -> tuple[float, float]:
    """The Wilson score interval of `met` successes in `n` trials ((0, 1) with none)."""
    if n <= 0:
        return 0.0, 1.0
    p = met / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def fewest_to_pass(target: float, z: float = Z90) -> int:
    """The fewest judged requests at which a point every one of whose requests met the SLO is told from the
    target: Wilson's lower bound n / (n + z^2) reaches it at n = z^2 t / (1 - t) (25 at t = 0.9)."""
    return math.ceil(z * z * target / (1 - target)) if target < 1 else 10**6


def warmup_s(e2e_s: list[float] | np.ndarray) -> float:
    """Seconds from a point's start that its judging skips: one p90 E2E latency of its finished requests."""
    e2e = np.asarray([x for x in e2e_s if x is not None and np.isfinite(x)], dtype=float)
    return round(max(MIN_WARMUP_S, float(np.percentile(e2e, 90)) if len(e2e) else 0.0), 3)


def batch_mean_interval(values: np.ndarray, batches: int = BATCHES, z: float = Z90) -> tuple[float, float] | None:
    """The mean of a correlated series with a batch-means interval (None with too few values)."""
    n = len(values) // batches
    if n < 1:
        return None
    means = np.asarray(values[: n * batches], dtype=float).reshape(batches, n).mean(axis=1)
    half = z * float(means.std(ddof=1)) / math.sqrt(batches)
    centre = float(np.mean(values))
    return centre - half, centre + half


def overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is None or b is None or (a[0] <= b[1] and b[0] <= a[1])


@dataclass(frozen=True)
class Halves:
    attainment: tuple[float | None, float | None]
    attainment_ci: tuple[tuple[float, float] | None, tuple[float, float] | None]
    running: tuple[float | None, float | None]
    running_ci: tuple[tuple[float, float] | None, tuple[float, float] | None]

    @property
    def agree(self) -> bool:
        """The halves' attainment intervals overlap."""
        return overlap(*self.attainment_ci)

    def one_side(self, target: float) -> bool:
        """Both halves pass, or both miss: the point answers the question whatever its halves' difference."""
        a1, a2 = self.attainment
        return a1 is not None and a2 is not None and (a1 >= target) == (a2 >= target)

    def to_json(self) -> dict:
        def r(x):
            return None if x is None else round(float(x), 4)

        return {"halves": [r(a) for a in self.attainment],
                "halves_ci": [None if c is None else [r(c[0]), r(c[1])] for c in self.attainment_ci],
                "running_halves": [r(m) for m in self.running],
                "running_halves_ci": [None if c is None else [r(c[0]), r(c[1])] for c in self.running_ci],
                "attainment_halves_agree": self.agree}


def halves(met: np.ndarray, running_first: np.ndarray, running_second: np.ndarray) -> Halves:
    """`met`: the judged requests' verdicts in arrival order (1 met, 0 missed); the queue (running + waiting)
    sampled while each half's requests arrived."""
    half = len(met) // 2
    parts = (met[:half], met[half:])
    att = tuple(float(p.mean()) if len(p) else None for p in parts)
    att_ci = tuple(wilson(float(p.sum()), len(p)) if len(p) else None for p in parts)
    runs = (running_first, running_second)
    return Halves(att, att_ci, tuple(float(np.mean(r)) if len(r) else None for r in runs),
                  tuple(batch_mean_interval(r) for r in runs))


def knee_use(h: Halves, target: float) -> str:
    """`steady`, `over_knee` or `unsteady` (the module's docstring says why)."""
    (a1, a2), (_, ci2), (q1, q2) = h.attainment, h.attainment_ci, h.running
    collapsed = a1 is not None and a2 is not None and a2 < a1 and ci2 is not None and ci2[1] < target
    growing = q1 is not None and q2 is not None and q2 > q1
    if collapsed and growing:
        return "over_knee"
    return "steady" if h.agree or h.one_side(target) else "unsteady"
