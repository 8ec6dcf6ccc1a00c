"""u, a stream's own effect in the knee fit (kneefit.py's model), and the long-run sustained rate it implies.

u's distribution. A Student-t of TAIL_DF degrees of freedom and scale s, cut at REACH scales: the fit's likelihood
is convolved with it on a grid (`kernel`, kneefit.marginal), and the long-run average below sums over it on the
same grid, or reads its distribution function cut where the kernel cuts it (`cut_cdf`).

The long-run crossing (docs/method.md, "The sustained rate"; kneefit's docstring). At z = log r - log knee, the
share of all requests meeting the SLO, every stream at that rate pooled, is the fitted curve averaged over u and
over x as the engine's points offered it (`long_run_attainment`); `long_run_offsets` solves, per draw of (b, s, g),
for the z where that share is the target. kneefit.sustained_draws moves each draw's knee by it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.special import expit, stdtr

TAIL_DF = 4  # u's Student-t degrees of freedom (Lange, Little and Taylor 1989's robust default)
REACH = 8.0  # u's density is cut at this many scales (t4 keeps 0.4 % of its mass beyond 6, 0.1 % beyond 8)
# the long-run average over u (`long_run_attainment`): over u's own nodes (kernel, a LONG_RUN_STEP-th of s apart)
# where the curve is wider than u's density (s b <= SHARP: u's sd under the logistic's, pi / sqrt(3) / b), else over
# the logistic's nodes (LOGISTIC_STEP apart out to LOGISTIC_REACH) with u's distribution function exact
LONG_RUN_STEP = 0.4  # 41 nodes; against a direct integral within 1e-4 in attainment (tests/test_kneefit.py)
SHARP = math.pi / math.sqrt(3) / math.sqrt(TAIL_DF / (TAIL_DF - 2))
LOGISTIC_STEP = 0.5
LOGISTIC_REACH = 20.0  # the logistic's mass beyond: 2e-9
HALVINGS = 8  # the long-run crossing's bracket (a few units of log rate) halved first, then SOLVE_STEPS Illinois
SOLVE_STEPS = 8  # steps (superlinear: under 1e-12 in log rate left against 60 halvings)


@lru_cache(maxsize=256)
def kernel(scale: float, step: float, df: float) -> np.ndarray:
    """u's density on a grid of `step`, cut at REACH scales, summing to 1 (an average over u): the Student-t's
    shape, its constant left to the normalization."""
    half = max(1, math.ceil(REACH * scale / step))
    z = np.arange(-half, half + 1) * step / scale
    k = (1 + z * z / df) ** (-(df + 1) / 2)
    return k / k.sum()


def student_cdf(t: np.ndarray) -> np.ndarray:
    """u's distribution function in its unit scale (a Student-t of TAIL_DF degrees of freedom; closed at 4)."""
    return 0.5 + t * (t * t + 6) / (2 * (t * t + 4) ** 1.5) if TAIL_DF == 4 else stdtr(TAIL_DF, t)


def cut_cdf(t: np.ndarray) -> np.ndarray:
    """u's distribution function cut at REACH scales, as the fit's kernel cuts it."""
    lo, hi = student_cdf(np.array(-REACH)), student_cdf(np.array(REACH))
    return (student_cdf(np.clip(t, -REACH, REACH)) - lo) / (hi - lo)


def long_run_attainment(z: np.ndarray, slope: np.ndarray, spread: np.ndarray, gain: np.ndarray,
                        loads: np.ndarray, weights: np.ndarray, target: float) -> np.ndarray:
    """The long-run share of requests meeting the SLO at log r - log knee = z, per (z, b, s, g) given side by side
    (arrays of one length): the curve averaged over u (a t of scale s) and over x (`loads`, `weights` summing to
    1). p = P(u + e / b < c) for e logistic: the narrower of u and e / b is summed on nodes, the other is exact."""
    c = math.log(target / (1 - target)) / slope[:, None] - z[:, None] - gain[:, None] * loads[None, :]
    wide = spread * slope <= SHARP
    p = np.empty_like(c)
    if wide.any():  # the curve is wider than u: u on its nodes, the logistic exact
        unit = kernel(1.0, LONG_RUN_STEP, TAIL_DF)
        u = spread[wide, None, None] * ((np.arange(len(unit)) - len(unit) // 2) * LONG_RUN_STEP)
        p[wide] = expit(slope[wide, None, None] * (c[wide][..., None] - u)) @ unit
    if not wide.all():  # u is wider: the logistic on its nodes, u's distribution function exact
        e = np.arange(-LOGISTIC_REACH, LOGISTIC_REACH + 1e-9, LOGISTIC_STEP)
        w = expit(e) * expit(-e)
        t = (c[~wide][..., None] - e / slope[~wide, None, None]) / spread[~wide, None, None]
        p[~wide] = cut_cdf(t) @ (w / w.sum())
    return p @ weights


def long_run_offsets(slopes: np.ndarray, spreads: np.ndarray, gains: np.ndarray, loads: np.ndarray,
                     weights: np.ndarray, target: float) -> np.ndarray:
    """Per draw (b, s, g side by side), z = log sustained rate - log knee: where the long-run attainment is the
    target, once per distinct (b, s, g): a bracket where the attainment is near 1 and near 0, halved HALVINGS
    times, then regula falsi with the Illinois step (the kept end's value halved when it is kept twice). At most 0
    for a target over a half where x is 0: averaging a curve that is concave there over a spread lowers it."""
    combos, back = np.unique(np.stack([slopes, spreads, gains], axis=1), axis=0, return_inverse=True)
    b, s, g = combos.T

    def gap(z: np.ndarray) -> np.ndarray:
        return long_run_attainment(z, b, s, g, loads, weights, target) - target

    half = (abs(math.log(target / (1 - target))) + 40) / b + 2 * REACH * s + g * float(np.max(np.abs(loads)))
    lo, hi = -half, half
    for _ in range(HALVINGS):  # first narrowed by halving: a secant across the curve's flat tails creeps
        mid = (lo + hi) / 2
        met = gap(mid) >= 0
        lo, hi = np.where(met, mid, lo), np.where(met, hi, mid)
    f_lo, f_hi, kept = gap(lo), gap(hi), np.zeros(len(b))
    best, f_best = lo, f_lo
    for _ in range(SOLVE_STEPS):
        apart = f_lo - f_hi
        z = np.where(apart > 0, hi + f_hi * (hi - lo) / np.where(apart > 0, apart, 1.0), (lo + hi) / 2)
        f_z = gap(z)
        best, f_best = np.where(np.abs(f_z) < np.abs(f_best), z, best), np.minimum(np.abs(f_z), np.abs(f_best))
        up = f_z > 0  # z on the met side: it replaces lo
        lo, f_lo = np.where(up, z, lo), np.where(up, f_z, f_lo)
        hi, f_hi = np.where(up, hi, z), np.where(up, f_hi, f_z)
        f_hi = np.where(up & (kept == 1), f_hi / 2, f_hi)
        f_lo = np.where(~up & (kept == -1), f_lo / 2, f_lo)
        kept = np.where(up, 1, -1)
    return best[back.ravel()]
