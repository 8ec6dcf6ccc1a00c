"""The headline pair's ratio from the pairs (issue 86): each engine's long-run sustained rate read off a
population-averaged dose-response curve, and the ratio's interval from the streams themselves, resampled jointly
for both engines. Measured beside the fit in benchmarks/knee_study.py, not reported: on the bench's two shapes it
was not narrower and decided more often at a true 1.0 (docs/method.md, "The paired ratio").

Each engine's curve is the share of all its requests meeting the SLO against log offered rate, every stream pooled
(no stream effect in the model: it is averaged over, as a user running the engine sees it),

    P(met | r) = sigmoid(logit(t) - b * (log r - log R)),

fitted by maximum likelihood, every point (a stream) weighing alike, with Firth's penalty (Jeffreys' prior: a rate
every request met under one none did leaves the plain fit's slope unbounded; the penalty keeps it finite, so such
points inform), b within SLOPE_BOUNDS. R, where the curve crosses the target t, is the long-run sustained rate
(kneefit.DEFINITION) itself: no stream spread enters it. With `shared`, one b serves both engines (one shape, two
places): narrower where their curves do have one shape, a misspecified model where they do not.

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
from scipy import stats

from harness.analysis.knee import CONFIDENCE, Judged, knee_points
from harness.analysis.kneefit import EDGE

METHOD = "paired streams: population-averaged logistic per engine, delete-one-stream jackknife"
SLOPE_BOUNDS = (0.5, 200.0)  # b: kneefit.SLOPES' reach (2-200) and below it, for a flat engine's curve
# the fit's search: a coarse grid of (log R, log b), then ZOOMS finer ones of ZOOM_CELLS a side, each spanning
# the last one's best cell and its neighbours (log R to about 1e-4 over a reach of 2: exact, bounded, no optimizer)
START_CELLS = (41, 13)
ZOOMS, ZOOM_CELLS = 4, 11
SHARED_SLOPE = False  # one slope for both engines: measured beside (benchmarks/kneepaired_check.py), not the default


@dataclass(frozen=True)
class PairedRatio:
    """a's long-run sustained rate over b's, its interval, and what it rests on."""

    ratio: float
    ci: tuple[float, float]
    rates_rps: dict[str, float]  # each engine's long-run sustained rate from its pooled curve
    rates_ci: dict[str, tuple[float, float]]  # its interval, from the same jackknife (its log R alone)
    slopes: dict[str, float]  # each engine's fitted b
    streams: int  # clusters the jackknife left out one by one (distinct keys among both engines' points)
    paired_streams: int  # keys both engines judged
    se_log: float  # the jackknife's standard error of log ratio

    def to_json(self) -> dict:
        return {"method": METHOD, "ratio": round(self.ratio, 4), "ci": [round(c, 4) for c in self.ci],
                "rates_rps": {e: round(r, 4) for e, r in self.rates_rps.items()},
                "rates_ci": {e: [round(c, 4) for c in ci] for e, ci in self.rates_ci.items()},
                "slopes": {e: round(b, 3) for e, b in self.slopes.items()}, "streams": self.streams,
                "paired_streams": self.paired_streams, "se_log": round(self.se_log, 4)}


def _arrays(points: list[Judged]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log rates, met and judged counts, every point (a stream) weighing as the engine's mean judged count, its
    share its own: the long-run definition pools streams of one length, and a point cut short at a clear miss would
    otherwise weigh less than the streams that met."""
    kept = [p for p in points if len(p.met)]
    judged = np.array([float(len(p.met)) for p in kept])
    share = np.array([float(p.met.mean()) for p in kept])
    n = np.full(len(kept), judged.mean()) if len(kept) else judged
    return np.log([p.offered_rps for p in kept]), share * n, n


def _nll(theta: np.ndarray, x: np.ndarray, met: np.ndarray, n: np.ndarray, logit_t: float) -> np.ndarray:
    """The negative log likelihood at (log R, log b) (theta: 2 x any shape), less Firth's penalty (half the log
    determinant of the Fisher information in the canonical parameters, logit p = alpha - b log r: Jeffreys' prior),
    which keeps a fit finite where every request met below a rate and none above it."""
    c, b = theta[0][..., None], np.exp(theta[1])[..., None]
    eta = logit_t - b * (x - c)
    soft_pos, soft_neg = np.logaddexp(0.0, eta), np.logaddexp(0.0, -eta)
    value = np.sum(met * soft_neg + (n - met) * soft_pos, axis=-1)
    w = n * np.exp(-soft_pos - soft_neg)  # n p (1 - p)
    det = w.sum(axis=-1) * (w * x * x).sum(axis=-1) - (w * x).sum(axis=-1) ** 2
    return value - 0.5 * np.log(np.maximum(det, 1e-300))


def _fit(arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]], logit_t: float) -> list[tuple[float, float]]:
    """(log R, b) of each engine's pooled curve, one slope for all of them (a list of one: its own): each log R
    kept within EDGE of its rates measured (past them it is a bound, as the fit's knee grid keeps it)."""
    c_bounds = [(float(x.min()) - math.log(EDGE), float(x.max()) + math.log(EDGE)) for x, _, _ in arrays]
    b_bounds = (math.log(SLOPE_BOUNDS[0]), math.log(SLOPE_BOUNDS[1]))
    cs = [np.linspace(*cb, START_CELLS[0]) for cb in c_bounds]
    bs = np.linspace(*b_bounds, START_CELLS[1])
    for _ in range(ZOOMS + 1):
        grids = [_nll(np.stack(np.meshgrid(c, bs, indexing="ij")), *arr, logit_t)
                 for c, arr in zip(cs, arrays, strict=True)]
        j = int(np.argmin(sum(g.min(axis=0) for g in grids)))  # the slope, each log R at its best given it
        best = [c[int(np.argmin(g[:, j]))] for c, g in zip(cs, grids, strict=True)]
        b_best, b_step = bs[j], bs[1] - bs[0]
        cs = [np.linspace(max(cb[0], c0 - (c[1] - c[0])), min(cb[1], c0 + (c[1] - c[0])), ZOOM_CELLS)
              for c0, c, cb in zip(best, cs, c_bounds, strict=True)]
        bs = np.linspace(max(b_bounds[0], b_best - b_step), min(b_bounds[1], b_best + b_step), ZOOM_CELLS)
    return [(float(c0), float(math.exp(b_best))) for c0 in best]


def curve_fit(points: list[Judged], target: float) -> tuple[float, float] | None:
    """(log R, b) of one engine's pooled curve (module docstring); None without a judged request."""
    fitted = curves_fit({"": points}, target, False)
    return None if fitted is None else fitted[""]


def curves_fit(points: dict[str, list[Judged]], target: float, shared: bool
               ) -> dict[str, tuple[float, float]] | None:
    """Each engine's (log R, b): one slope for both where `shared`, else each its own; None where an engine has
    no judged request."""
    arrays = {e: _arrays(p) for e, p in points.items()}
    if any(not len(a[0]) for a in arrays.values()):
        return None
    logit_t = math.log(target / (1 - target))
    if shared:
        return dict(zip(arrays, _fit(list(arrays.values()), logit_t), strict=True))
    return {e: _fit([a], logit_t)[0] for e, a in arrays.items()}


def paired_ratio(points: dict[str, list[Judged]], a: str, b: str, target: float,
                 confidence: float = CONFIDENCE, shared: bool = SHARED_SLOPE) -> PairedRatio | None:
    """a's long-run sustained rate over b's with its `confidence` interval (module docstring), on the points a knee
    rests on (knee.knee_points); None where either engine has no judged request or fewer than three streams leave
    too little to resample."""
    pts = {e: knee_points(points.get(e, [])) for e in (a, b)}
    full = curves_fit(pts, target, shared)
    if full is None:
        return None
    keys = sorted({p.key for e in (a, b) for p in pts[e]})
    if len(keys) < 3:
        return None
    left_out = []  # per stream left out: (log R_a, log R_b)
    for k in keys:
        fitted = curves_fit({e: [p for p in pts[e] if p.key != k] for e in (a, b)}, target, shared)
        if fitted is not None:
            left_out.append((fitted[a][0], fitted[b][0]))
    jack = np.array(left_out).reshape(-1, 2)
    g = len(jack)
    t_q = float(stats.t.ppf((1 + confidence) / 2, max(g - 1, 1)))

    def interval(full_log: float, values: np.ndarray) -> tuple[float, tuple[float, float]]:
        se = math.sqrt((g - 1) / g * float(np.sum((values - values.mean()) ** 2))) if g > 1 else math.inf
        half = t_q * se
        return se, ((math.exp(full_log - half), math.exp(full_log + half)) if math.isfinite(half) else (0.0, math.inf))

    se, ci = interval(full[a][0] - full[b][0], jack[:, 0] - jack[:, 1])
    rates_ci = {e: interval(full[e][0], jack[:, i])[1] for i, e in enumerate((a, b))}
    paired = len({p.key for p in pts[a]} & {p.key for p in pts[b]})
    return PairedRatio(math.exp(full[a][0] - full[b][0]), ci, {e: math.exp(full[e][0]) for e in (a, b)}, rates_ci,
                       {e: full[e][1] for e in (a, b)}, g, paired, se)
