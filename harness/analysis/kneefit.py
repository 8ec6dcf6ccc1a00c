"""The knee from every point: SLO attainment against log offered load fitted with a monotone dose-response model,
and the knee read where the fit crosses the target (the ED90 of bioassay at a 90 % target; Finney).

The model. A point is one stream (a request sequence, workloads/streams.py) judged at one offered rate r. Its
requests meet the SLO with probability

    p(r) = sigmoid(logit(t) - b * (log r + g * x + u - log knee))

where t is the attainment target, `knee` the engine's sustained rate (p = t there, for a stream that offers the
workload's mean token load at that rate), b the slope (how fast attainment tips as the load grows, per unit of log
rate), x the stream's own offered token load over the point's judged window (the log of the tokens its requests
asked, prompt and output, per second of the window, over what the rate would offer at the workload's mean:
`Judged.log_load`, harness/analysis/token_load.py; a stream's bursts and long requests both raise it, and it is
known from the requests alone, before any engine runs), g its gain (how much of a shift in log load a shift in x
is: 1 where a quarter more tokens loads the engine as a quarter higher rate would; fitted, flat on GAINS) and u
what is left of the stream's own effect, one draw per stream from a Student-t of scale s and
TAIL_DF degrees of freedom (heavy-tailed: one stream that met 19 % where its neighbours met all moves the knee as
a rare stream, not as a spread every stream has). Within a point, requests that arrive in one burst share a fate:
its judged and met counts are divided by the engine's design effect (knee.py `design_effect`) before they enter
the binomial likelihood. Each engine has its own knee, slope, gain and spread, fitted on its own points: how fast
attainment tips differs by engine, and so does how much one stream's attainment scatters from the next.

Pairing. The decision gives the headline's two engines the same streams (each at its own rate): their points on
one stream share x (as far as their judged windows coincide), so the part of the stream effect that the offered
token load explains (g * x) is taken out of both engines' points alike, and the ratio's interval narrows by what
that part was. What the load leaves (u) may still be shared in truth: each engine is fitted alone here, and the
headline's pair is then reweighted to a joint fit with the correlation its twins show at a lower bound
(kneejoint.py; `KneeFit.joint`, which `ratio` reads). Each engine's share of its stream variance that the load explains
(`KneeFit.explained_share`) and the correlation that the shared load alone implies between two engines' stream effects
(`KneeFit.paired_correlation`: sqrt of the two shares, a function of the fitted gains and spreads that can never
show a shared residual) are read from the same draws. In the bench's twin (benchmarks/pairing_study.py, 200
streams of mixed-churn offered to paged and static-oracle at their knees) the two engines' stream effects
correlated 0.64 [0.53, 0.74]; the offered token load explained 34 % and 42 % of them, and left a correlation of
0.11 [0.00, 0.20]; the tokens asked alone (no bursts) explained under 8 %.

The integral over u. For one point, the likelihood as a function of d = log knee - log r - g * x is the binomial
likelihood at slope b convolved with u's density of scale s: it is computed once per point and slope on a fine
grid of d (FINE_STEP, the binomial term's steepest transition spans several cells even at the steepest slope),
convolved exactly for every s (the fine grid averaged into cells a tenth of s wide, where the kernel is smooth:
no quadrature nodes to miss a sharp likelihood where b * s is large), and read off at every knee and gain.
tests/test_kneefit.py checks it against a brute-force integral.

The posterior. Flat priors on log knee (over the rates measured, widened by the search's step at both ends), on
log b (SLOPES) and on g (GAINS), and on s a half-t over SPREADS (trapezoid weights on its grid), all on a grid,
exactly; or, for an engine given a `SpreadPrior` (the bench gives the headline's two one from their twins before the
decision: harness/sim/spread_prior.py), a Student-t in log s around the twin's s, wider toward wider, on a log grid
of its own, and a normal on g around the twin's gain. Draws of (g, s) come from their joint marginal, then the knee
from its conditional given them (b summed out); a ratio of two engines' knees is read from their draws side by side.
An estimate is the posterior median, its interval the central 90 %: an interval always holds its estimate.

The sustained rate reported (docs/method.md, "The sustained rate"). `knee` above is a conditional figure: where
the median stream (u = 0, x = 0) meets the target. The figure reported is the long-run one, the field's (the vLLM
paper's sustained rate, DistServe's goodput attainment): the highest rate at which the share of all requests
meeting the SLO, every stream at that rate pooled, reaches t. Per draw, the fitted curve is averaged over u's
t (scale s) and over x as the engine's points offered it (each point's x weighted by its judged requests), and
solved for the rate where that average is t (kneelongrun.py, `long_run_offsets`): the draws of the sustained
rate are the knee's moved by it, so the interval carries every parameter's uncertainty through.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from scipy.ndimage import convolve1d
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
from harness.analysis.kneelongrun import REACH, TAIL_DF, kernel, long_run_offsets
from harness.analysis.operating import operating_key
from harness.analysis.stream_priors import SPREADS, SpreadPrior, spread_log_weights

METHOD = "dose-response fit"
SLOPES = np.geomspace(2.0, 200.0, 25)  # b: logit attainment falls by b per unit of log rate (0.9 -> 0.5 over 2.2/b)
GAINS = np.round(np.linspace(0.0, 1.5, 7), 3)  # g: a shift in x as a shift in log load (1: proportional)
# the fine grid of d, where u's density is averaged over (s = 0 reads the binomial term at each d exactly): against
# a brute-force integral of 40,001 nodes, within a tenth of a nat wherever the likelihood is within 10 nats of its
# peak (tests/test_kneefit.py), and a grid five times finer came no closer
FINE_STEP = 0.0025
CELLS_PER_SPREAD = 10  # the convolution's cells: a tenth of s wide (the kernel is smooth at that scale)
KNEE_CELLS = 161  # the log-knee grid, per engine
DRAWS = 4000
DEFINITION = ("the sustained rate: the highest offered rate at which the long-run share of all requests meeting "
              "the SLO (every stream at that rate pooled) reaches the target, as the vLLM paper's sustained request "
              "rate and DistServe's goodput define it")
EDGE = 1.6  # a knee past every rate measured lies within this factor beyond it (the search's bracketing step)
SEED = 20261204


@dataclass(frozen=True)
class KneeEstimate:
    """One engine's knee: its sustained rate, the interval, what it rests on."""

    engine: str
    rps: float
    ci: tuple[float, float]
    points: int  # points that inform the knee (knee.knee_points, unsteady ones and the fixed operating point out)
    streams: int  # independent streams among them (distinct keys): the replications the estimate rests on
    judged: int  # judged requests at the points the fit rests on
    bracketed: bool  # a rate that met the SLO below one that missed it: a knee measured, not a bound
    method: str = METHOD
    curve_rps: float | None = None  # where the fitted curve crosses the target for the median stream (u = 0, x = 0)

    def to_json(self) -> dict:
        out = {"method": self.method, "points": self.points, "streams": self.streams, "judged": self.judged,
               "rps": round(self.rps, 4), "ci": [round(self.ci[0], 4), round(self.ci[1], 4)],
               "bracketed": self.bracketed}
        if self.curve_rps is not None:
            out["definition"] = "long-run"  # rps: every stream pooled (DEFINITION), not the median stream's
            out["median_stream_rps"] = round(self.curve_rps, 4)
        return out


@dataclass(frozen=True)
class KneeFit:
    """Every engine's knee, and the draws that their ratios and stream figures are read from."""

    estimates: dict[str, KneeEstimate]
    log_knees: dict[str, np.ndarray]  # per engine, DRAWS posterior draws of the log sustained rate (long-run)
    gains: dict[str, np.ndarray]  # per engine, the draws of g (the offered token load's gain), beside its knee's
    spreads: dict[str, np.ndarray]  # per engine, the draws of s
    load_var: dict[str, float]  # per engine, the variance of its points' x (log offered token load)
    priors: dict[str, SpreadPrior] = field(default_factory=dict)  # the engines fitted under an informative prior
    slopes: dict[str, np.ndarray] = field(default_factory=dict)  # per engine, the draws of b beside its knee's
    cells: dict[str, np.ndarray] = field(default_factory=dict)  # per engine, each draw's cell on its knee grid
    # per engine pair (a, b) fitted jointly (kneejoint.py), each draw pair's normalized importance weight and the
    # correlation it rests on: a ratio of a and b is read from the weighted draws
    joint: dict[tuple[str, str], JointWeights] = field(default_factory=dict)
    # per engine, the draws of log knee (the median stream's crossing), beside the sustained rate's
    curve_knees: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def spread_s(self) -> dict[str, float]:
        """Per engine, the posterior median of s, its leftover stream spread in log load."""
        return {e: float(np.median(s)) for e, s in self.spreads.items()}

    def ratio(self, a: str, b: str) -> tuple[float, tuple[float, float]]:
        """a's knee over b's: the posterior median and central interval of the draws' ratios."""
        draws = np.exp(self.log_knees[a] - self.log_knees[b])
        w = self.joint.get((a, b)) or self.joint.get((b, a))
        if w is None:
            lo, hi = central(draws, CONFIDENCE)
            return float(np.median(draws)), (lo, hi)
        mid, lo, hi = weighted_quantiles(draws, w.weights, (0.5, (1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2))
        return mid, (round(lo, 4), round(hi, 4))

    def gain(self, engine: str) -> tuple[float, tuple[float, float]]:
        """The offered token load's gain g: its posterior median and central interval."""
        g = self.gains[engine]
        lo, hi = central(g, CONFIDENCE)
        return float(np.median(g)), (lo, hi)

    def stream_variance(self, engine: str, var_x: float) -> tuple[np.ndarray, np.ndarray]:
        """Per draw, the engine's stream-to-stream variance in log load that a load of variance var_x shows
        (g^2 var_x), and the whole of it (that plus u's variance)."""
        shown = self.gains[engine] ** 2 * var_x
        return shown, shown + u_variance(self.spreads[engine])

    def explained_share(self, engine: str) -> float:
        """The share of the engine's stream-to-stream variance in log load that its streams' offered token load
        explains (the posterior median)."""
        shown, whole = self.stream_variance(engine, self.load_var[engine])
        return float(np.median(shown / np.maximum(whole, 1e-12)))

    def paired_correlation(self, a: str, b: str) -> float:
        """The correlation between two engines' stream effects on one stream that the offered token load alone
        implies: the load is the same for both (correlated 1), what it leaves is taken as independent, so per draw
        it is sqrt(each engine's explained share), the shares as `explained_share` reads them (each engine's own
        load variance); the posterior median. A function of the fitted gains and spreads: it can never show a
        residual the two engines share (benchmarks/pairing_study.py measures that one, on the model's scale)."""
        shares = []
        for e in (a, b):
            shown, whole = self.stream_variance(e, self.load_var[e])
            shares.append(shown / np.maximum(whole, 1e-12))
        return float(np.median(np.sqrt(shares[0] * shares[1])))


@dataclass(frozen=True)
class JointWeights:
    """Two engines' draws reweighted to their joint fit (kneejoint.py): one weight per draw pair, summing to 1."""

    rho: float  # the residual correlation of their stream effects the joint fit assumed
    weights: np.ndarray
    paired_streams: int  # streams both engines' knees rest on: the only ones the correlation couples

    @property
    def effective_draws(self) -> float:
        """Kish's effective sample size of the weighted draws (DRAWS when every weight is equal)."""
        return float(1.0 / np.sum(self.weights ** 2))


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """Quantiles of weighted draws: each value's weight centred on its place in the sorted cumulative sum."""
    order = np.argsort(values)
    v, cw = values[order], np.cumsum(weights[order])
    at = (cw - weights[order] / 2) / cw[-1]
    return [float(np.interp(q, at, v)) for q in qs]


def u_variance(scale: np.ndarray) -> np.ndarray:
    """The variance of a Student-t of TAIL_DF degrees of freedom and this scale."""
    return scale ** 2 * TAIL_DF / (TAIL_DF - 2)


@dataclass(frozen=True)
class _Data:
    """An engine's points as the likelihood reads them: log rates, log offered token loads and effective counts."""

    log_rate: np.ndarray
    load: np.ndarray
    met: np.ndarray
    judged: np.ndarray

    @classmethod
    def of(cls, points: list[Judged]) -> _Data:
        d = design_effect(points)
        return cls(np.log([p.offered_rps for p in points]), np.array([p.log_load for p in points]),
                   np.array([p.met.sum() / d for p in points]), np.array([len(p.met) / d for p in points]))


def binomial_log(data: _Data, slope: float, d: np.ndarray, target: float, rows: bool = False) -> np.ndarray:
    """log P(met | judged) at every point (rows) for each d (columns: one grid for all points, or with `rows` a
    row of its own per point), at slope b and u = 0."""
    eta = math.log(target / (1 - target)) + slope * (d if rows else d[None, :])
    return -data.met[:, None] * np.logaddexp(0.0, -eta) - (data.judged - data.met)[:, None] * np.logaddexp(0.0, eta)


def marginal(lik: np.ndarray, top: np.ndarray, y0: float, scale: float,
             reads: tuple[float, float]) -> tuple[np.ndarray, float, float]:
    """log of the binomial likelihood (rows of `lik`, exp(log likelihood - top) on the fine grid from y0) averaged
    over u of this scale, where it is read (d in `reads`): the fine grid averaged into cells a
    CELLS_PER_SPREAD-th of the scale wide and convolved with u's density there. Returns the log likelihood, where
    its grid starts and its step."""
    per = max(1, int(scale / CELLS_PER_SPREAD / FINE_STEP))
    reach = REACH * scale + 2 * per * FINE_STEP
    first = max(0, int((reads[0] - reach - y0) / FINE_STEP))
    cells = (min(lik.shape[1], math.ceil((reads[1] + reach - y0) / FINE_STEP) + 1) - first) // per
    binned = lik[:, first:first + cells * per].reshape(len(lik), cells, per).mean(axis=2)
    step = per * FINE_STEP
    avg = convolve1d(binned, kernel(scale, step, TAIL_DF), axis=1, mode="constant")
    return np.log(np.maximum(avg, 1e-300)) + top, y0 + (first + (per - 1) / 2) * FINE_STEP, step


def read_at(log_l: np.ndarray, y0: float, step: float, d: np.ndarray) -> np.ndarray:
    """log_l (points x grid) read at d (points x ...), linearly between grid cells."""
    pos = np.clip((d - y0) / step, 0, log_l.shape[1] - 1.000001)
    i = pos.astype(int)
    frac = pos - i
    rows = np.arange(len(log_l)).reshape((-1,) + (1,) * (d.ndim - 1))
    return (1 - frac) * log_l[rows, i] + frac * log_l[rows, i + 1]


def log_likelihood(data: _Data, log_knees: np.ndarray, target: float, spreads: np.ndarray = SPREADS,
                   gains: np.ndarray = GAINS) -> np.ndarray:
    """log P(points | knee, b, s, g) on the grid: (knees x SLOPES x spreads x gains), u integrated out per point."""
    # d at every point, knee and gain: points x knees x gains
    d = log_knees[None, :, None] - data.log_rate[:, None, None] - gains[None, None, :] * data.load[:, None, None]
    pad = REACH * float(np.max(spreads)) + 4 * FINE_STEP * CELLS_PER_SPREAD
    y0 = float(d.min()) - pad
    reads = (float(d.min()), float(d.max()))  # where the likelihood is read: its grids cover this and u's reach
    y = y0 + FINE_STEP * np.arange(math.ceil((reads[1] + pad - y0) / FINE_STEP) + 1)
    out = np.empty((len(log_knees), len(SLOPES), len(spreads), len(gains)))
    for bi, b in enumerate(SLOPES):
        if np.any(spreads > 0):
            f = binomial_log(data, b, y, target)
            top = f.max(axis=1, keepdims=True)  # each point's peak: the rest is a share of it (one exp per slope)
            lik = np.exp(f - top)
        for si, s in enumerate(spreads):
            if s == 0:  # no integral: the binomial term itself, at each d exactly
                flat = binomial_log(data, b, d.reshape(len(d), -1), target, rows=True)
                out[:, bi, si, :] = flat.reshape(d.shape).sum(axis=0)
                continue
            log_l, start, step = marginal(lik, top, y0, float(s), reads)
            out[:, bi, si, :] = read_at(log_l, start, step, d).sum(axis=0)
    return out


def knee_grid(points: list[Judged]) -> np.ndarray:
    rates = [p.offered_rps for p in points]
    return np.linspace(math.log(min(rates) / EDGE), math.log(max(rates) * EDGE), KNEE_CELLS)


def bracketed(points: list[Judged], target: float) -> bool:
    """A rate (its replications pooled) that met the target below one that missed it, among `points`, the points a
    knee rests on (knee.knee_points: already halved where a point was over its knee, so not halved again here):
    the knee measured, not a bound past (every rate met) or under (none did) the rates measured."""
    search = KneeSearch(0.0, target, measured=[(p.offered_rps, p.attainment) for p in pooled(points)])
    lo, hi = search.bracket()
    return lo is not None and hi is not None


@dataclass(frozen=True)
class _Draws:
    """One engine's posterior draws."""

    log_knees: np.ndarray
    gains: np.ndarray
    spreads: np.ndarray
    slopes: np.ndarray
    cells: np.ndarray  # each draw's cell on the knee grid (its log knee is the cell's value, jittered within it)


def engine_draws(points: list[Judged], target: float, spreads: np.ndarray, rng: np.random.Generator,
                 prior: SpreadPrior | None = None) -> _Draws:
    """(g, s) from their joint marginal (knee and b summed out), then the knee given them (b summed out). An
    engine whose points carry no offered token load (a run recorded before it was read) has no gain to fit: g is 0.
    Under a `prior` s is read on the prior's own grid (unless `spreads` is not the default: s held, as the
    within-runs fit holds it at 0) and weighted by it, and g by its gain prior."""
    data = _Data.of(points)
    gains = GAINS if np.any(data.load != 0) else np.zeros(1)
    grid = knee_grid(points)
    if prior is not None and spreads is SPREADS:
        spreads, s_w = prior.spreads(), prior.spread_log_weights(prior.spreads())
    else:
        s_w = spread_log_weights(spreads)
    g_w = prior.gain_log_weights(gains) if prior is not None else np.zeros(len(gains))
    ll = log_likelihood(data, grid, target, spreads, gains) + s_w[None, None, :, None] + g_w[None, None, None, :]
    given = logsumexp(ll, axis=1)  # knee x s x g
    pick = rng.choice(len(spreads) * len(gains), size=DRAWS, p=softmax(logsumexp(given, axis=0).ravel()))
    s_i, g_i = np.divmod(pick, len(gains))
    knees, cells = draw_knees(given[:, s_i, g_i], grid, rng)
    b_log = ll[cells, :, s_i, g_i]  # draws x SLOPES: b given the drawn knee's cell, s and g
    b_i = (np.cumsum(softmax_rows(b_log), axis=1) < rng.random(DRAWS)[:, None]).sum(axis=1)
    return _Draws(knees, gains[g_i], spreads[s_i], SLOPES[np.minimum(b_i, len(SLOPES) - 1)], cells)


def sustained_draws(points: list[Judged], draws: _Draws, target: float) -> np.ndarray:
    """The draws of the log sustained rate (the long-run crossing: module docstring), x as the points offered it,
    each point weighted by its judged requests."""
    judged = np.array([len(p.met) for p in points], dtype=float)
    weights = judged / judged.sum() if judged.sum() > 0 else np.full(len(points), 1 / len(points))
    loads = np.array([p.log_load for p in points])
    return draws.log_knees + long_run_offsets(draws.slopes, draws.spreads, draws.gains, loads, weights, target)


def fit(points: dict[str, list[Judged]], target: float, spreads: np.ndarray = SPREADS,
        seed: int = SEED, priors: Mapping[str, SpreadPrior] | None = None) -> KneeFit | None:
    """Every engine's knee from its own fit on the points a knee rests on; None when no engine has any. `priors`:
    per engine, an informative prior on its spread and gain (`SpreadPrior`); an engine without one keeps the
    half-t on s and the flat prior on g."""
    pts = {e: knee_points(p) for e, p in points.items() if p}
    pts = {e: p for e, p in pts.items() if p}
    if not pts:
        return None
    priors = {e: p for e, p in (priors or {}).items() if e in pts}
    draws = {e: engine_draws(p, target, spreads, named_rng(seed, e), priors.get(e)) for e, p in pts.items()}
    sustained = {e: sustained_draws(pts[e], draws[e], target) for e in pts}
    estimates = {e: estimate(e, pts[e], sustained[e], target, draws[e].log_knees) for e in pts}
    return KneeFit(estimates, sustained,
                   {e: d.gains for e, d in draws.items()}, {e: d.spreads for e, d in draws.items()},
                   {e: float(np.var([p.log_load for p in pts[e]])) for e in pts}, priors,
                   {e: d.slopes for e, d in draws.items()}, {e: d.cells for e, d in draws.items()},
                   curve_knees={e: d.log_knees for e, d in draws.items()})


def softmax(log_w: np.ndarray) -> np.ndarray:
    w = np.exp(log_w - log_w.max())
    return w / w.sum()


def softmax_rows(log_w: np.ndarray) -> np.ndarray:
    w = np.exp(log_w - log_w.max(axis=1, keepdims=True))
    return w / w.sum(axis=1, keepdims=True)


def draw_knees(cond: np.ndarray, grid: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One log knee per column of `cond` (knees x draws: the log posterior given that draw's shared parameters)
    from its conditional on the grid, spread uniformly inside its cell; and each draw's cell."""
    draws = cond.shape[1]
    cdf = np.cumsum(np.exp(cond - cond.max(axis=0)), axis=0)
    at = (cdf < rng.random(draws) * cdf[-1]).sum(axis=0)
    width = grid[1] - grid[0]
    cells = np.minimum(at, len(grid) - 1)
    return grid[cells] + width * (rng.random(draws) - 0.5), cells


def informs(point: Judged) -> bool:
    """A point that tells where the knee lies: not the fixed operating point (its rate's operating stream), which
    is placed at half the knee by design (analysis/operating.py) and met by every run."""
    return point.key != operating_key(point.offered_rps)


def estimate(engine: str, points: list[Judged], log_rates: np.ndarray, target: float,
             curve_knees: np.ndarray | None = None) -> KneeEstimate:
    """An engine's sustained rate from its draws (`log_rates`), and the median stream's knee beside it."""
    lo, hi = central(np.exp(log_rates), CONFIDENCE)
    curve = None if curve_knees is None else float(np.exp(np.median(curve_knees)))
    return KneeEstimate(engine, float(np.exp(np.median(log_rates))), (lo, hi), sum(map(informs, points)),
                        len({p.key for p in points}), int(sum(len(p.met) for p in points)), bracketed(points, target),
                        curve_rps=curve)
