"""The headline ratio from the pairs (issue 86): each engine's long-run sustained rate read off a population-
averaged dose-response curve, and the ratio's interval from the streams themselves, resampled jointly for both
engines (docs/method.md, "The paired ratio").

Each engine's curve is the share of all its requests meeting the SLO against log offered rate, every stream pooled
(no stream effect in the model: it is averaged over, as a user running the engine sees it),

    P(met | r) = sigmoid(logit(t) - b * (log r - log R)),

fitted by maximum likelihood on the points' judged requests, b bounded in SLOPE_BOUNDS (a rate every request met
under one none did leaves the steepness unbounded; the bound keeps such a point informing). R, where the curve
crosses the target t, is the long-run sustained rate (kneefit.DEFINITION) itself; no stream spread enters it.

The interval. Requests of one stream share its effect and its bursts, and the decision gives both engines the
same stream on their n-th turns: a stream (a point's key) is one cluster, holding both engines' points on it.
The variance of log(R_a / R_b) is the delete-one-stream jackknife's (each stream left out of both engines at
once, both refitted), so a stream that moved both engines alike moves the ratio little, and what the pairs share
cancels without a spread or a correlation being learned; the interval is log ratio +- t(G - 1) x that standard
error over G streams, the small-sample reference of a cluster-robust variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from harness.analysis.knee import CONFIDENCE, Judged, knee_points
from harness.analysis.kneefit import EDGE

METHOD = "paired streams: population-averaged logistic per engine, delete-one-stream jackknife"
SLOPE_BOUNDS = (0.5, 200.0)  # b: kneefit.SLOPES' reach (2-200) and below it, for a flat engine's curve
START_CELLS = (41, 13)  # the coarse grid (log R, log b) a fit starts from, before its optimizer


@dataclass(frozen=True)
class PairedRatio:
    """a's long-run sustained rate over b's, its interval, and what it rests on."""

    ratio: float
    ci: tuple[float, float]
    rates_rps: dict[str, float]  # each engine's long-run sustained rate from its pooled curve
    slopes: dict[str, float]  # each engine's fitted b
    streams: int  # clusters the jackknife left out one by one (distinct keys among both engines' points)
    paired_streams: int  # keys both engines judged
    se_log: float  # the jackknife's standard error of log ratio

    def to_json(self) -> dict:
        return {"method": METHOD, "ratio": round(self.ratio, 4), "ci": [round(c, 4) for c in self.ci],
                "rates_rps": {e: round(r, 4) for e, r in self.rates_rps.items()},
                "slopes": {e: round(b, 3) for e, b in self.slopes.items()}, "streams": self.streams,
                "paired_streams": self.paired_streams, "se_log": round(self.se_log, 4)}


def _arrays(points: list[Judged]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kept = [p for p in points if len(p.met)]
    return (np.log([p.offered_rps for p in kept]), np.array([float(p.met.sum()) for p in kept]),
            np.array([float(len(p.met)) for p in kept]))


def _nll(theta: np.ndarray, x: np.ndarray, met: np.ndarray, n: np.ndarray, logit_t: float
         ) -> tuple[float, np.ndarray]:
    """The negative log likelihood at (log R, log b) and its gradient."""
    c, b = theta[0], math.exp(theta[1])
    eta = logit_t - b * (x - c)
    value = float(np.sum(met * np.logaddexp(0.0, -eta) + (n - met) * np.logaddexp(0.0, eta)))
    resid = n / (1.0 + np.exp(-eta)) - met  # d nll / d eta
    return value, np.array([float(np.sum(resid) * b), float(np.sum(resid * (c - x)) * b)])


def curve_fit(points: list[Judged], target: float) -> tuple[float, float] | None:
    """(log R, b) of one engine's pooled curve (module docstring); None without a judged request. log R is kept
    within EDGE of the rates measured (past them it is a bound, as the fit's knee grid keeps it)."""
    x, met, n = _arrays(points)
    if not len(x):
        return None
    logit_t = math.log(target / (1 - target))
    c_bounds = (float(x.min()) - math.log(EDGE), float(x.max()) + math.log(EDGE))
    b_bounds = (math.log(SLOPE_BOUNDS[0]), math.log(SLOPE_BOUNDS[1]))
    cs, bs = np.linspace(*c_bounds, START_CELLS[0]), np.linspace(*b_bounds, START_CELLS[1])
    eta = logit_t - np.exp(bs)[None, :, None] * (x[None, None, :] - cs[:, None, None])
    grid = (met * np.logaddexp(0.0, -eta) + (n - met) * np.logaddexp(0.0, eta)).sum(axis=2)
    i, j = np.unravel_index(int(np.argmin(grid)), grid.shape)
    res = optimize.minimize(_nll, np.array([cs[i], bs[j]]), args=(x, met, n, logit_t), jac=True,
                            method="L-BFGS-B", bounds=[c_bounds, b_bounds])
    best = res.x if res.fun <= grid[i, j] else np.array([cs[i], bs[j]])
    return float(best[0]), float(math.exp(best[1]))


def paired_ratio(points: dict[str, list[Judged]], a: str, b: str, target: float,
                 confidence: float = CONFIDENCE) -> PairedRatio | None:
    """a's long-run sustained rate over b's with its `confidence` interval (module docstring), on the points a knee
    rests on (knee.knee_points); None where either engine has no judged request or fewer than two streams leave
    nothing to resample."""
    pts = {e: knee_points(points.get(e, [])) for e in (a, b)}
    full = {e: curve_fit(pts[e], target) for e in (a, b)}
    if any(f is None for f in full.values()):
        return None
    keys = sorted({p.key for e in (a, b) for p in pts[e]})
    if len(keys) < 3:
        return None
    theta = full[a][0] - full[b][0]
    left_out = []
    for k in keys:
        c = {}
        for e in (a, b):
            kept = [p for p in pts[e] if p.key != k]
            fitted = full[e] if len(kept) == len(pts[e]) else curve_fit(kept, target)
            c[e] = None if fitted is None else fitted[0]
        if None not in c.values():
            left_out.append(c[a] - c[b])
    g = len(left_out)
    jack = np.array(left_out)
    se = math.sqrt((g - 1) / g * float(np.sum((jack - jack.mean()) ** 2))) if g > 1 else math.inf
    half = float(stats.t.ppf((1 + confidence) / 2, max(g - 1, 1))) * se
    lo, hi = (math.exp(theta - half), math.exp(theta + half)) if math.isfinite(half) else (0.0, math.inf)
    paired = len({p.key for p in pts[a]} & {p.key for p in pts[b]})
    return PairedRatio(math.exp(theta), (lo, hi), {e: math.exp(full[e][0]) for e in (a, b)},
                       {e: full[e][1] for e in (a, b)}, g, paired, se)
