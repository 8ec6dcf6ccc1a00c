"""Two engines fitted jointly on the streams they share (issue 79, part 2): their stream effects correlated.

The model. kneefit.py's model for each engine, with one change: on a stream k, engine e's leftover shift in log
load is

    u_e,k = s_e * (sqrt(rho) * w_k + sqrt(1 - rho) * e_e,k)

where w_k (one draw per stream, shared by both engines) and e_e,k (one per engine and stream) are Student-t of
kneefit.TAIL_DF degrees of freedom and unit scale, all independent: each engine's u has the scale and shape of
kneefit's at rho = 0 (where this is kneefit's model exactly) and nearly so above it, and the two engines' u on one
stream correlate rho. A stream only one engine judged has the same form, its partner's term absent.

The fit. The independent fits' draws (kneefit.fit: knee, slope, spread and gain per engine, drawn side by side)
are the proposal; each draw pair's importance weight is the joint likelihood over the independent one, stream by
stream: for each stream, the average over w (a grid of W_NODES values, t-weighted) of the product of each
engine's points' likelihoods with e integrated out (kneefit.marginal at scale s sqrt(1 - rho), shifted by
s sqrt(rho) w), over the product of their kneefit likelihoods. The priors are the same in both, so they cancel.
A ratio of the two engines' knees is read from the weighted draws (`KneeFit.ratio`); their effective number
(Kish) is reported beside it.

Where rho comes from. The twins' streams (harness/sim/spread_prior.py offers both headline engines' twins the
same fresh streams, each at its own knee's multiple): `twin_correlation` reads the marginal likelihood of rho
(the independent fits' draws averaged, every parameter integrated, not held at a point) on RHO_GRID, takes its
flat-prior posterior and gives its median and its 5 % quantile. The run's joint fit uses the 5 % quantile: a
conservative lower bound, so that the ratio's interval narrows by no more than what the twin shows the pairing
earns (where the twins show no shared residual, it is 0 and the fit is the independent one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from scipy.special import logsumexp

from harness.analysis.knee import Judged, knee_points
from harness.analysis.kneefit import (
    CELLS_PER_SPREAD,
    FINE_STEP,
    REACH,
    TAIL_DF,
    JointWeights,
    KneeFit,
    _Data,
    binomial_log,
    fit,
    knee_grid,
    marginal,
    read_at,
    softmax,
)
from harness.analysis.stream_priors import SpreadPrior

W_NODES = np.linspace(-REACH, REACH, 81)  # w's grid, in its own unit scale (a fifth of a scale apart)
W_LOG = np.log((1 + W_NODES ** 2 / TAIL_DF) ** (-(TAIL_DF + 1) / 2))
W_LOG = W_LOG - logsumexp(W_LOG)  # w's t density on its grid, summing to 1
RHO_GRID = np.round(np.linspace(0.0, 0.9, 10), 2)  # the correlations the twin's marginal likelihood is read at
LOWER_Q = 0.05  # the quantile of rho's posterior the run uses: a one-sided 95 % lower bound
TWIN_DRAWS = 500  # draws of the twin's fits its correlation is read from (more: seconds more on 2 cores, no change)
SOURCE = "twin"


@dataclass(frozen=True)
class Correlation:
    """The residual correlation of two engines' stream effects, as their twins' streams show it."""

    engines: tuple[str, str]
    estimate: float  # the posterior median of rho (flat prior on RHO_GRID)
    lower: float  # its LOWER_Q quantile: what the run's joint fit uses
    streams: int  # streams both twins judged
    source: str = SOURCE

    def to_json(self) -> dict:
        return {"engines": list(self.engines), "estimate": round(self.estimate, 3), "lower": round(self.lower, 3),
                "used": round(self.lower, 3), "rule": f"the {LOWER_Q:.0%} quantile of rho's posterior",
                "streams": self.streams, "source": self.source}


@dataclass(frozen=True)
class _Engine:
    """One engine's part of the pair: its points, their streams, and its draws (optionally a subset)."""

    data: _Data
    keys: tuple[str, ...]  # its streams, in order
    stream_of_row: np.ndarray  # each point's stream, an index into `keys`
    base_d: np.ndarray  # points x draws: log knee (its cell's value) - log rate - g x
    slopes: np.ndarray
    spreads: np.ndarray

    def memo_key(self, target: float) -> tuple:
        arrays = (self.data.log_rate, self.data.load, self.data.met, self.data.judged, self.stream_of_row,
                  self.base_d, self.slopes, self.spreads)
        return (self.keys, target, *(a.tobytes() for a in arrays))


def _engine(kf: KneeFit, e: str, points: list[Judged], take: np.ndarray) -> _Engine:
    data = _Data.of(points)
    log_knee = knee_grid(points)[kf.cells[e][take]]
    base_d = log_knee[None, :] - data.log_rate[:, None] - kf.gains[e][take][None, :] * data.load[:, None]
    keys = tuple(sorted({p.key for p in points}))
    rows = np.array([keys.index(p.key) for p in points])
    return _Engine(data, keys, rows, base_d, kf.slopes[e][take], kf.spreads[e][take])


_MEMO: dict[tuple, object] = {}  # the last few engines' terms: a decision turn adds one point to one engine, and
MEMO_SIZE = 16  # the fit after it finds the other's points and draws as they were


def _memo(key: tuple, make):
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = make()
    return _MEMO[key]


@dataclass(frozen=True)
class _Prep:
    """What does not depend on rho: the fine grid of d, each slope's binomial term on it, each draw's own fit."""

    y0: float
    liks: dict[float, tuple[np.ndarray, np.ndarray]]  # per slope: exp(log likelihood - top) and top
    onehot: np.ndarray  # streams x points
    alone: np.ndarray  # streams x draws: the points' log likelihood on each stream under the engine's own fit


def _prep(eng: _Engine, target: float) -> _Prep:
    reach = 2 * REACH * float(eng.spreads.max()) + 4 * FINE_STEP * CELLS_PER_SPREAD  # u's reach at any rho
    y0 = float(eng.base_d.min()) - reach
    y = y0 + FINE_STEP * np.arange(math.ceil((float(eng.base_d.max()) + reach - y0) / FINE_STEP) + 1)
    onehot = np.zeros((len(eng.keys), len(eng.stream_of_row)))
    onehot[eng.stream_of_row, np.arange(len(eng.stream_of_row))] = 1.0
    liks, alone = {}, np.zeros((len(eng.keys), eng.base_d.shape[1]))
    for b, s, j in _groups(eng):
        if b not in liks:
            f = binomial_log(eng.data, b, y, target)
            top = f.max(axis=1, keepdims=True)
            liks[b] = (np.exp(f - top), top)
        alone[:, j] = onehot @ _read(eng.data, *liks[b], y0, s, eng.base_d[:, j], b, target)
    return _Prep(y0, liks, onehot, alone)


def _groups(eng: _Engine):
    """(slope, spread, the draws that have them) for each pair of values the draws take."""
    for b in np.unique(eng.slopes):
        for s in np.unique(eng.spreads[eng.slopes == b]):
            yield float(b), float(s), np.flatnonzero((eng.slopes == b) & (eng.spreads == s))


def _stream_terms(eng: _Engine, rho: float, target: float) -> tuple[np.ndarray, np.ndarray]:
    """Per stream of the engine and draw: the log likelihood of its points on it under the joint model at each w
    (streams x draws x W_NODES) and under its own fit (streams x draws)."""
    key = eng.memo_key(target)
    prep = _memo(key, lambda: _prep(eng, target))
    return _memo((*key, rho), lambda: _joint_terms(eng, prep, rho, target)), prep.alone


def _joint_terms(eng: _Engine, prep: _Prep, rho: float, target: float) -> np.ndarray:
    joint = np.zeros((len(eng.keys), eng.base_d.shape[1], len(W_NODES)))
    for b, s, j in _groups(eng):
        shifted = eng.base_d[:, j, None] - math.sqrt(rho) * s * W_NODES[None, None, :]
        left = _read(eng.data, *prep.liks[b], prep.y0, math.sqrt(1 - rho) * s, shifted, b, target)
        joint[:, j, :] = np.einsum("kr,rjn->kjn", prep.onehot, left)
    return joint


def _read(data: _Data, lik: np.ndarray, top: np.ndarray, y0: float, scale: float, d: np.ndarray, slope: float,
          target: float) -> np.ndarray:
    """Each point's log likelihood at d (points x ...) with a leftover of this scale integrated out."""
    if scale <= 0:
        return binomial_log(data, slope, d.reshape(len(d), -1), target, rows=True).reshape(d.shape)
    log_l, start, step = marginal(lik, top, y0, scale, (float(d.min()), float(d.max())))
    return read_at(log_l, start, step, d)


def pair_log_weights(kf: KneeFit, points: Mapping[str, list[Judged]], a: str, b: str, rho: float, target: float,
                     take: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Each draw pair's log importance weight (joint over independent; unnormalized) at correlation rho, and how
    many streams both engines judged. `points`: the points each fit rests on (knee.knee_points); `take`: the
    draws to weigh (all of them by default)."""
    shared = len({p.key for p in points[a]} & {p.key for p in points[b]})
    take = np.arange(len(kf.cells[a])) if take is None else take
    if rho <= 0:
        return np.zeros(len(take)), shared
    ea, eb = _engine(kf, a, points[a], take), _engine(kf, b, points[b], take)
    keys = sorted(set(ea.keys) | set(eb.keys))
    joint = np.zeros((len(keys), len(take), len(W_NODES)))
    alone = np.zeros((len(keys), len(take)))
    for eng in (ea, eb):  # each engine's streams placed among the pair's
        j, al = _stream_terms(eng, rho, target)
        at = [keys.index(k) for k in eng.keys]
        joint[at] += j
        alone[at] += al
    per_stream = logsumexp(W_LOG[None, None, :] + joint, axis=2) - alone
    return per_stream.sum(axis=0), shared


def joint_fit(points: dict[str, list[Judged]], target: float, correlations: Mapping[tuple[str, str], float],
              priors: Mapping[str, SpreadPrior] | None = None, spreads: np.ndarray | None = None) -> KneeFit | None:
    """kneefit.fit, then each pair in `correlations` (rho > 0) reweighted to its joint fit: their ratio is read
    from the weighted draws. A fit with its spreads held (`spreads`) has no stream effect to correlate."""
    kf = fit(points, target, priors=priors) if spreads is None else fit(points, target, spreads, priors=priors)
    if kf is None or spreads is not None:
        return kf
    pts = {e: knee_points(p) for e, p in points.items() if p}
    joint = {}
    for (a, b), rho in correlations.items():
        if a in kf.estimates and b in kf.estimates and rho > 0:
            log_w, shared = pair_log_weights(kf, pts, a, b, rho, target)
            joint[(a, b)] = JointWeights(rho, softmax(log_w), shared)
    return replace(kf, joint=joint) if joint else kf


def twin_correlation(kf: KneeFit | None, points: dict[str, list[Judged]], a: str, b: str, target: float,
                     seed: int = 0) -> Correlation | None:
    """rho from two twins' points on shared streams (one point a stream each) and their independent fit `kf`
    (kneefit.fit on those points: the one the twins' priors are read from): its marginal likelihood on RHO_GRID
    from the fits' draws (TWIN_DRAWS of them), the posterior under a flat prior there, its median and its LOWER_Q
    quantile. None when the two share no stream or either fit is missing."""
    if kf is None or a not in kf.estimates or b not in kf.estimates:
        return None
    pts = {e: knee_points(points[e]) for e in (a, b)}
    take = np.random.default_rng(seed).choice(len(kf.cells[a]), size=min(TWIN_DRAWS, len(kf.cells[a])),
                                              replace=False)
    log_ml, shared = [], 0
    for rho in RHO_GRID:
        log_w, shared = pair_log_weights(kf, pts, a, b, float(rho), target, take)
        log_ml.append(logsumexp(log_w) - math.log(len(log_w)))
    if not shared:
        return None
    cdf = np.cumsum(softmax(np.array(log_ml)))
    median = float(RHO_GRID[np.searchsorted(cdf, 0.5)])
    lower = float(RHO_GRID[np.searchsorted(cdf, LOWER_Q)])
    return Correlation((a, b), median, lower, shared)
