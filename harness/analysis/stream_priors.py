"""The priors of the knee fit's stream spread s and load gain g (harness/analysis/kneefit.py): the weakly
informative half-t every engine has by default, and the informative one (`SpreadPrior`) an engine takes from its
twin (harness/sim/spread_prior.py). Kept apart from the fit: the twin's side, the bench and the study build priors
without the likelihood."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

# s: the scale of a stream's leftover shift in log load, a flat density on [0, 1]: fresh-clone runs fitted 0.04 to
# 0.5 per engine (one paged run met 100 % and 19 % of requests on two streams of one rate), and a prior that ends
# where fits sit cuts their intervals short
SPREADS = np.round(np.linspace(0.0, 1.0, 21), 3)
# s's prior: a half-t of 4 degrees of freedom and scale 0.25 (Gelman 2006's weakly informative prior for a scale: its
# scale the size of effect one expects, a quarter in log load, the most adjacent streams' token load differs; half its
# mass under 0.19, 1.6 % over 1, where the grid ends)
SPREAD_PRIOR_DF, SPREAD_PRIOR_SCALE = 4, 0.25
# an informative prior on s from the engine's twin (`SpreadPrior`): a Student-t of PRIOR_DF degrees of freedom in log s
# around what the twin's streams showed, PRIOR_BELOW wide toward narrower (a twin's streams carry every source of
# spread the model has but the machine's: a run shows at least about as much) and PRIOR_ABOVE toward wider (the
# machine adds spread the twin has not, drift between visits among it, and the twin's rates are ~22 % off): a run
# whose points scatter twice as far as the twin's still widens its interval (benchmarks/knee_study.py --prior-factors)
PRIOR_DF, PRIOR_BELOW, PRIOR_ABOVE = 4, 0.3, 0.6
PRIOR_GRID = 15  # s's grid under such a prior: log-spaced from PRIOR_REACH_BELOW scales under its centre to ...
PRIOR_REACH_BELOW, PRIOR_REACH_ABOVE = 3.0, 4.0  # ... PRIOR_REACH_ABOVE over it (within SPREADS' range)
PRIOR_GAIN_SD = 0.35  # g's prior around the twin's gain: normal, this wide (its grid's step is 0.25)


@dataclass(frozen=True)
class SpreadPrior:
    """One engine's informative prior on its stream spread s (and on its load gain g), where something outside the
    run's points has seen the engine's streams (harness/sim/spread_prior.py: its twin offered hundreds of fresh
    streams in virtual time and fitted by this model). s: a Student-t of PRIOR_DF degrees of freedom in log s,
    centred on `centre`, `below` wide under it and `above` wide over it (a tail toward wider: a run that shows more
    spread than the twin still widens); g: a normal of `gain_sd` around `gain` (flat where `gain` is None)."""

    centre: float
    below: float = PRIOR_BELOW
    above: float = PRIOR_ABOVE
    gain: float | None = None
    gain_sd: float = PRIOR_GAIN_SD

    def spreads(self) -> np.ndarray:
        """s's grid under this prior: log-spaced around its centre, within SPREADS' range (its ends excluded: s = 0
        has no density in log s)."""
        lo = math.log(max(self.centre, 1e-3)) - PRIOR_REACH_BELOW * self.below
        hi = math.log(max(self.centre, 1e-3)) + PRIOR_REACH_ABOVE * self.above
        grid = np.exp(np.linspace(lo, hi, PRIOR_GRID))
        return np.unique(np.round(np.clip(grid, 0.005, float(SPREADS[-1])), 4))

    def spread_log_weights(self, spreads: np.ndarray) -> np.ndarray:
        """The prior's mass at each grid value of s: its density in log s times each value's trapezoid width in
        log s (a single value: all of the mass)."""
        if len(spreads) == 1:
            return np.zeros(1)
        ls = np.log(np.maximum(spreads, 1e-9))
        gaps = np.diff(ls)
        w = np.concatenate([[gaps[0] / 2], (gaps[:-1] + gaps[1:]) / 2, [gaps[-1] / 2]])
        z = (ls - math.log(max(self.centre, 1e-3))) / np.where(ls < math.log(max(self.centre, 1e-3)),
                                                                self.below, self.above)
        w = w * (1 + z * z / PRIOR_DF) ** (-(PRIOR_DF + 1) / 2)
        w = np.where(spreads > 0, w, 0.0)
        return np.log(np.maximum(w / w.sum(), 1e-300))

    def gain_log_weights(self, gains: np.ndarray) -> np.ndarray:
        if self.gain is None or len(gains) == 1:
            return np.zeros(len(gains))
        w = -0.5 * ((gains - self.gain) / self.gain_sd) ** 2
        return w - logsumexp(w)

    def scaled(self, factor: float) -> SpreadPrior:
        """The same prior with its centres (s and g) times `factor`: a twin off by that much."""
        return SpreadPrior(self.centre * factor, self.below, self.above,
                           None if self.gain is None else self.gain * factor, self.gain_sd)

    def to_json(self) -> dict:
        return {"centre": round(self.centre, 4), "below": self.below, "above": self.above, "df": PRIOR_DF,
                "gain": None if self.gain is None else round(self.gain, 4), "gain_sd": self.gain_sd}

    @classmethod
    def of(cls, d: Mapping) -> SpreadPrior:
        return cls(float(d["centre"]), float(d.get("below", PRIOR_BELOW)), float(d.get("above", PRIOR_ABOVE)),
                   None if d.get("gain") is None else float(d["gain"]), float(d.get("gain_sd", PRIOR_GAIN_SD)))


def spread_log_weights(spreads: np.ndarray) -> np.ndarray:
    """The prior density of s on its grid: a half-t (SPREAD_PRIOR_DF degrees of freedom, scale SPREAD_PRIOR_SCALE)
    times each grid value's trapezoid width (a single value: all of the mass)."""
    if len(spreads) == 1:
        return np.zeros(1)
    gaps = np.diff(spreads)
    w = np.concatenate([[gaps[0] / 2], (gaps[:-1] + gaps[1:]) / 2, [gaps[-1] / 2]])
    z = spreads / SPREAD_PRIOR_SCALE
    w = w * (1 + z * z / SPREAD_PRIOR_DF) ** (-(SPREAD_PRIOR_DF + 1) / 2)  # the half-t's shape
    return np.log(w / w.sum())
