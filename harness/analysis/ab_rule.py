"""The A/B gate's rule (`fragbench ab`, harness/analysis/ab.py): a gated figure's per-pair values, worse positive,
to PASS, FAIL or INCONCLUSIVE after every pair; the pairs and their figures are ab.py's, this reads numbers alone.

The rule on a figure's pair values y_k (the TPOT log ratio; the miss shares' difference), `sequential`: a
least-squares fit y_k = mu + gamma o_k, o_k = +1 for AB and -1 for BA (what the second run of a pair meets on this
machine: a warm cache, the first's leftovers), equal weights, t with k - 2 degrees of freedom, looked at after every
pair from MIN_LOOK_PAIRS.
- FAIL, in two stages on disjoint pairs: sighted on all pairs so far where mu is past the floor at one-sided
  p < ALPHA (0.01; the floor log(1 + threshold) for TPOT, 0 for the misses): a test against the floor, not the
  estimate read against it; then decided on the CONFIRM_PAIRS fresh pairs after the sighting alone: their mean past
  the floor and worse than no change at one-sided p < CONFIRM_ALPHA (0.05). Not confirmed, the sighting is dropped
  and a later look may sight it again.
- PASS: at one of PASS_LOOKS looks (min_pairs, then every PASS_LOOK_EVERY pairs), the upper one-sided bound of mu
  under the margin (log(1 + threshold); ERROR_MARGIN for the errors; for the misses their median's bound, under
  MISS_MARGIN), each look at 1 - 0.05 / PASS_LOOKS (Bonferroni: a night's false PASS at most 5 %).
  Non-inferiority: an improvement passes.
- INCONCLUSIVE otherwise: more pairs while time remains.
benchmarks/ab_study.py measures the rule's false FAIL rate and its power (docs/method.md, Nightly)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats

from harness.analysis.gate_verdict import GateVerdict

ALPHA = 0.01  # a FAIL's sighting: one-sided significance past the floor
PASS_CONFIDENCE = 0.95  # a night's PASS: one-sided, its error shared over PASS_LOOKS looks
CONFIRM_PAIRS = 4  # fresh pairs a FAIL's first sighting must be confirmed by
CONFIRM_ALPHA = 0.05  # their own one-sided significance
MIN_LOOK_PAIRS = 6  # the first look: t with 4 degrees of freedom after the order term
PASS_LOOKS = 4  # the looks a night may PASS at: min_pairs, then every PASS_LOOK_EVERY pairs (their error shared)
PASS_LOOK_EVERY = 4
MISS_MARGIN = 0.05  # a PASS bounds the median rise of a block's share missed under it (one request of 30: 0.033)
ERROR_MARGIN = 0.02  # a PASS bounds the mean rise of a block's share failed under it


@dataclass(frozen=True)
class Fit:
    """mu (the log ratio, NEW over BASE, worse positive), its standard error and degrees of freedom."""

    mu: float
    se: float
    df: int

    def p_worse(self, than: float = 0.0) -> float:
        """One-sided p against mu = `than` toward worse."""
        if self.se <= 0:
            return 0.0 if self.mu > than else 1.0
        return float(stats.t.sf((self.mu - than) / self.se, self.df))

    def upper(self, confidence: float = PASS_CONFIDENCE) -> float:
        return self.mu + float(stats.t.ppf(confidence, self.df)) * self.se

    def lower(self, confidence: float = PASS_CONFIDENCE) -> float:
        return self.mu - float(stats.t.ppf(confidence, self.df)) * self.se


def fit_pairs(y: np.ndarray, order: np.ndarray) -> Fit | None:
    """Least squares of y on an intercept and the order term (+1 AB, -1 BA), equal weights; None under
    MIN_LOOK_PAIRS pairs or where the order does not vary (both orders are needed to tell a build from the
    machine's drift within a pair)."""
    y, order = np.asarray(y, dtype=float), np.asarray(order, dtype=float)
    if len(y) < MIN_LOOK_PAIRS or len(set(order.tolist())) < 2:
        return None
    x = np.column_stack([np.ones_like(y), order])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    df = len(y) - 2
    resid = y - x @ coef
    s2 = float(resid @ resid) / df
    cov = s2 * np.linalg.inv(x.T @ x)
    return Fit(float(coef[0]), math.sqrt(max(float(cov[0, 0]), 0.0)), df)


def confirms(fresh: np.ndarray, floor: float = 0.0) -> bool:
    """Fresh pairs replicate a sighted regression: by themselves worse than no change at one-sided p < CONFIRM_ALPHA
    (t with n - 1 degrees of freedom; AB and BA alternate within them, so the order cancels in their mean), and
    their mean past `floor` (docs/method.md, Nightly: the floor judged on pairs that did not sight it)."""
    fresh = np.asarray(fresh, dtype=float)
    if not len(fresh) or fresh.mean() <= floor:
        return False
    if len(fresh) < 2 or fresh.std(ddof=1) == 0:
        return True
    t = fresh.mean() / (fresh.std(ddof=1) / math.sqrt(len(fresh)))
    return float(stats.t.sf(t, len(fresh) - 1)) < CONFIRM_ALPHA


def sighted(f: Fit, floor: float) -> bool:
    """A regression sighted: past the floor at one-sided p < ALPHA (the floor tested, not the estimate read; past
    it means significant against no change too)."""
    return f.p_worse(floor) < ALPHA


def pass_look(k: int, min_pairs: int) -> bool:
    """PASS is looked at PASS_LOOKS times a night, at min_pairs and then every PASS_LOOK_EVERY pairs."""
    return k >= min_pairs and (k - min_pairs) % PASS_LOOK_EVERY == 0 and \
        (k - min_pairs) // PASS_LOOK_EVERY < PASS_LOOKS


def pass_confidence() -> float:
    """A look's one-sided confidence: 1 - PASS_CONFIDENCE's error spent equally over the PASS_LOOKS looks
    (Bonferroni: the night's chance of a false PASS at most 1 - PASS_CONFIDENCE, whatever the looks' correlation)."""
    return 1 - (1 - PASS_CONFIDENCE) / PASS_LOOKS


@dataclass(frozen=True)
class Decision:
    verdict: str
    pairs: int
    fit: Fit | None = None
    sighted_at: int | None = None  # the pair count at which a FAIL was first sighted (its confirmation follows)
    why: str = ""

    @property
    def ratio(self) -> float | None:
        return math.exp(self.fit.mu) if self.fit else None

    @property
    def ci(self) -> tuple[float, float] | None:
        """The two-sided 90 % interval."""
        return (math.exp(self.fit.lower()), math.exp(self.fit.upper())) if self.fit else None


def median_upper(y: list[float], confidence: float) -> float:
    """The one-sided distribution-free upper bound of the pairs' median (the sign test's order statistic): one
    block that hiccups moves it by one place, not by its size."""
    y = sorted(y)
    u = next((i for i in range(len(y)) if stats.binom.cdf(i, len(y), 0.5) >= confidence), None)
    return math.inf if u is None else y[u]


def sequential(y: list[float], order: list[int], floor: float, margin: float, min_pairs: int,
               sighted_at: int | None, unit, median: bool = False) -> Decision:
    """The rule (module docstring) on a figure's per-pair values y (worse positive): a FAIL sighted on all pairs
    (past `floor` at one-sided p < ALPHA), decided on the CONFIRM_PAIRS fresh pairs after the sighting alone
    (`confirms` past `floor`); a PASS at a PASS look (the mean's upper bound under `margin`; `median`: the
    median's, median_upper)."""
    k = len(y)
    f = fit_pairs(np.array(y), np.array(order))
    if f is None:
        why = f"{k} pair(s): fewer than {MIN_LOOK_PAIRS} of both orders"
        return Decision(GateVerdict.INCONCLUSIVE, k, None, None, why)
    if sighted_at is not None:
        fresh = np.array(y[sighted_at:])
        if len(fresh) < CONFIRM_PAIRS:
            return Decision(GateVerdict.INCONCLUSIVE, k, f, sighted_at,
                            f"confirming: {len(fresh)} of {CONFIRM_PAIRS} fresh pairs")
        if confirms(fresh, floor):
            why = f"sighted at {sighted_at} pairs; {len(fresh)} fresh pairs confirmed it alone ({unit(fresh.mean())})"
            return Decision(GateVerdict.FAIL, k, f, sighted_at, why)
        sighted_at = None  # not confirmed: the sighting is dropped, and a later look may sight it again
        why = f"a sighted regression the fresh pairs did not confirm ({unit(fresh.mean())})"
        return Decision(GateVerdict.INCONCLUSIVE, k, f, None, why)
    if sighted(f, floor):
        why = (f"a regression sighted at {k} pairs (p = {f.p_worse(floor):.2g} past the floor): {CONFIRM_PAIRS} fresh "
               "pairs to decide it")
        return Decision(GateVerdict.INCONCLUSIVE, k, f, k, why)
    upper = median_upper(y, pass_confidence()) if median else f.upper(pass_confidence())
    if pass_look(k, min_pairs) and upper < margin:
        bound = f"upper {pass_confidence():.2%} bound {unit(upper)} under {unit(margin)}"
        return Decision(GateVerdict.PASS, k, f, None, bound)
    return Decision(GateVerdict.INCONCLUSIVE, k, f, None, f"{k} pairs: neither a confirmed regression nor non-inferior"
                                                      + ("" if pass_look(k, min_pairs) else " at a PASS look"))


def decide(y: list[float], order: list[int], threshold: float, min_pairs: int,
           sighted_at: int | None = None) -> Decision:
    """The latency rule on the pairs' log ratios: floor and margin both log(1 + threshold); `sighted_at` carries a
    first sighting of a FAIL from an earlier look (the pairs after it are its confirmation)."""
    floor = math.log(1 + threshold)
    return sequential(y, order, floor, floor, min_pairs, sighted_at, lambda v: f"x{math.exp(v):.3f}")


def decide_misses(shares: list[float], order: list[int], min_pairs: int, sighted_at: int | None,
                  errors: bool = False) -> Decision:
    """The rule on the pairs' differences of block shares (NEW's minus BASE's): FAIL on any confirmed rise (floor 0);
    PASS, for the SLO misses (a failed request a miss), where the median rise is bounded under MISS_MARGIN (a
    block that hiccups, its requests missing together, moves a median by one place), for the errors (requests
    that failed) where the mean rise is bounded under ERROR_MARGIN (no hiccup fails a request: a NEW that fails
    3 % more of them cannot PASS but by chance)."""
    margin, what = (ERROR_MARGIN, "failed") if errors else (MISS_MARGIN, "missed")
    d = sequential(shares, order, 0.0, margin, min_pairs, sighted_at, lambda v: f"{100 * v:+.1f} pp", not errors)
    return replace(d, fit=None, why=f"{d.why}; NEW's share {what} minus BASE's, mean "
                   f"{100 * float(np.mean(shares)) if shares else 0.0:+.1f} pp over {len(shares)} pairs")
