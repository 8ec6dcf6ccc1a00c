"""The knee from every point: SLO attainment against log offered rate fitted with a monotone dose-response model,
and the knee read where the fit crosses the target (the ED90 of bioassay at a 90 % target; Finney).

The model. A point is one stream (an independent realization of its rate: workloads/streams.key_of) judged at
one offered rate r. Its requests meet the SLO with probability

    p(r) = sigmoid(logit(t) - b * (log r + u - log knee))

where t is the attainment target, `knee` the engine's sustained rate (p = t there), b the slope (how fast
attainment tips as the load grows, per unit of log rate) and u the stream's own effect: a stream that asks for a
quarter more tokens than its neighbour loads the engine as a quarter higher rate would, so u is a shift in log
load, u ~ Normal(0, s^2), one draw per stream (a per-stream random effect). Within a point, requests that arrive
in one burst share a fate: its judged and met counts are divided by the engine's design effect (knee.py
`design_effect`) before they enter the binomial likelihood. Each engine has its own knee, slope and spread, fitted
on its own points: how fast attainment tips differs by engine (a paged engine's falls steeply once preemption
starts, a contiguous one's fragmentation OOMs miss a share of requests at every load), and so does how much one
stream's attainment scatters from the next (an engine that OOMs on a stream's long prompts scatters more). A
fresh-clone run showed both: a slope shared by static-oracle and paged moved paged's knee by static-oracle's curve,
and a spread shared with the screened engines (static-max: 60 % met at 1.61 req/s, 71 % at 2.59) widened the
headline's interval from [2.33, 3.37] to [2.10, 3.69].

The posterior. Flat priors on log knee (over the rates measured, widened by the search's step at both ends: a
knee past every rate measured is a bound the step limits, as it always was), on log b (SLOPES) and on s
(SPREADS); u integrated out by Gauss-Hermite quadrature, the posterior computed on a grid, exactly. Draws of
s come from its marginal, then the knee from its conditional given s (b summed out); a ratio of two engines'
knees is read from their draws side by side. An estimate is the posterior median, its
interval the central 90 %: the knee and a ratio of knees read the same way, so an interval always holds its
estimate. Its width comes from where the variance arises: the binomial draw inside each stream, and the
stream-to-stream spread s, which a run estimates from how far its points scatter around the curve (a run's
points are its streams: two realizations of one rate disagreeing is what makes s large).

Points of two engines that judged one stream share its u in truth; the fits treat them as independent, which
can only widen a ratio's interval (pairing cancels the shared part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

from harness.analysis.knee import (
    CONFIDENCE,
    Judged,
    KneeSearch,
    central,
    design_effect,
    knee_points,
    named_rng,
    pooled,
)

METHOD = "dose-response fit"
SLOPES = np.geomspace(2.0, 200.0, 25)  # b: logit attainment falls by b per unit of log rate (0.9 -> 0.5 over 2.2/b)
# s: sd of a stream's shift in log load. Up to 0.5: two fresh-clone runs' paged met 100 % and 19 % of requests on two
# streams of one rate (8 req/s), and its marginal still rose at 0.3, where the grid first ended
SPREADS = np.array([0.0, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5])
KNEE_CELLS = 161  # the log-knee grid, per engine
DRAWS = 4000
EDGE = 1.6  # a knee past every rate measured lies within this factor beyond it (the search's bracketing step)
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(9)  # probabilists' Hermite: E[f(Z)], Z ~ N(0, 1)
_LOG_W = np.log(_WEIGHTS / _WEIGHTS.sum())
SEED = 20261204


@dataclass(frozen=True)
class KneeEstimate:
    """One engine's knee: its sustained rate, the interval, what it rests on."""

    engine: str
    rps: float
    ci: tuple[float, float]
    points: int  # points the fit rests on (knee.knee_points: unsteady points left out)
    streams: int  # independent streams among them (distinct keys): the replications the estimate rests on
    judged: int  # judged requests at those points
    bracketed: bool  # a rate that met the SLO below one that missed it: a knee measured, not a bound
    method: str = METHOD

    def to_json(self) -> dict:
        return {"method": self.method, "points": self.points, "streams": self.streams, "judged": self.judged,
                "rps": round(self.rps, 4), "ci": [round(self.ci[0], 4), round(self.ci[1], 4)],
                "bracketed": self.bracketed}


@dataclass(frozen=True)
class KneeFit:
    """Every engine's knee, and the draws that their ratios are read from."""

    estimates: dict[str, KneeEstimate]
    log_knees: dict[str, np.ndarray]  # per engine, DRAWS posterior draws of log knee
    spread_s: dict[str, float]  # per engine, the posterior median of s, its stream-to-stream spread in log load

    def ratio(self, a: str, b: str) -> tuple[float, tuple[float, float]]:
        """a's knee over b's: the posterior median and central interval of the draws' ratios (the engines' fits
        are independent: their streams are)."""
        draws = np.exp(self.log_knees[a] - self.log_knees[b])
        lo, hi = central(draws, CONFIDENCE)
        return float(np.median(draws)), (lo, hi)


@dataclass(frozen=True)
class _Data:
    """An engine's points as the likelihood reads them: log rates and effective counts."""

    log_rate: np.ndarray
    met: np.ndarray
    judged: np.ndarray

    @classmethod
    def of(cls, points: list[Judged]) -> _Data:
        d = design_effect(points)
        return cls(np.log([p.offered_rps for p in points]), np.array([p.met.sum() / d for p in points]),
                   np.array([len(p.met) / d for p in points]))


def log_likelihood(data: _Data, log_knees: np.ndarray, target: float, spreads: np.ndarray = SPREADS) -> np.ndarray:
    """log P(points | knee, b, s) on the grid: (knees x SLOPES x spreads), u integrated out per point."""
    lt = math.log(target / (1 - target))
    # eta: knees x slopes x spreads x nodes x points
    shift = data.log_rate[None, None, None, None, :] + spreads[None, None, :, None, None] * _NODES[None, None, None, :,
                                                                                                    None]
    eta = lt - SLOPES[None, :, None, None, None] * (shift - log_knees[:, None, None, None, None])
    log_p, log_q = -np.logaddexp(0.0, -eta), -np.logaddexp(0.0, eta)
    per_node = data.met * log_p + (data.judged - data.met) * log_q + _LOG_W[None, None, None, :, None]
    return logsumexp(per_node, axis=3).sum(axis=-1)


def knee_grid(points: list[Judged]) -> np.ndarray:
    rates = [p.offered_rps for p in points]
    return np.linspace(math.log(min(rates) / EDGE), math.log(max(rates) * EDGE), KNEE_CELLS)


def bracketed(points: list[Judged], target: float) -> bool:
    """A rate (its replications pooled) that met the target below one that missed it, among the points a knee
    rests on: the knee measured, not a bound past (every rate met) or under (none did) the rates measured."""
    search = KneeSearch(0.0, target, measured=[(p.offered_rps, p.attainment) for p in pooled(knee_points(points))])
    lo, hi = search.bracket()
    return lo is not None and hi is not None


def fit(points: dict[str, list[Judged]], target: float, spreads: np.ndarray = SPREADS,
        seed: int = SEED) -> KneeFit | None:
    """Every engine's knee from its own fit on the points a knee rests on; None when no engine has any."""
    pts = {e: knee_points(p) for e, p in points.items() if p}
    pts = {e: p for e, p in pts.items() if p}
    if not pts:
        return None
    log_knees, spread = {}, {}
    for e, p in pts.items():
        grid = knee_grid(p)
        ll = log_likelihood(_Data.of(p), grid, target, spreads)  # knee x b x s
        rng = named_rng(seed, e)
        # s from its marginal (knee and b summed out), then the knee given s (b summed out)
        s_i = rng.choice(len(spreads), size=DRAWS, p=softmax(logsumexp(ll, axis=(0, 1))))
        log_knees[e] = draw_knees(logsumexp(ll, axis=1)[:, s_i], grid, rng)
        spread[e] = float(np.median(spreads[s_i]))
    estimates = {e: estimate(e, pts[e], log_knees[e], target) for e in pts}
    return KneeFit(estimates, log_knees, spread)


def softmax(log_w: np.ndarray) -> np.ndarray:
    w = np.exp(log_w - log_w.max())
    return w / w.sum()


def draw_knees(cond: np.ndarray, grid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One log knee per column of `cond` (knees x draws: the log posterior given that draw's shared parameters)
    from its conditional on the grid, spread uniformly inside its cell."""
    draws = cond.shape[1]
    cdf = np.cumsum(np.exp(cond - cond.max(axis=0)), axis=0)
    at = (cdf < rng.random(draws) * cdf[-1]).sum(axis=0)
    width = grid[1] - grid[0]
    return grid[np.minimum(at, len(grid) - 1)] + width * (rng.random(draws) - 0.5)


def estimate(engine: str, points: list[Judged], log_knees: np.ndarray, target: float) -> KneeEstimate:
    lo, hi = central(np.exp(log_knees), CONFIDENCE)
    return KneeEstimate(engine, float(np.exp(np.median(log_knees))), (lo, hi), len(points),
                        len({p.key for p in points}), int(sum(len(p.met) for p in points)), bracketed(points, target))
