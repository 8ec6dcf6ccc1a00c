"""The A/B gate's rule (`fragbench ab`, harness/analysis/ab.py): a gated figure's per-pair values, worse positive,
to PASS, FAIL or INCONCLUSIVE after every pair; the pairs and their figures are ab.py's, this reads numbers alone.

The rule on a figure's pair values y_k (the TPOT log ratio; the miss and error shares' differences), `sequential`:
a least-squares fit y_k = mu + gamma o_k, o_k = +1 for AB and -1 for BA (what the second run of a pair meets on
this machine: a warm cache, the first's leftovers), equal weights, t with k - 2 degrees of freedom; a group
sequential test, its looks planned and its errors spent over them (Bonferroni), for FAIL as for PASS.
- FAIL at every look from MIN_LOOK_PAIRS to the last PASS look (`fail_looks` looks): mu past the floor at one-sided
  p < ALPHA / fail_looks (the floor log(1 + threshold) for TPOT, 0 for the shares): the floor tested on all pairs,
  not the estimate read against it, so a night's chance of a FAIL at the floor itself is at most ALPHA whatever
  pair it ends at, and less under it.
- PASS at one of PASS_LOOKS looks (min_pairs, then every PASS_LOOK_EVERY pairs): the upper one-sided bound of mu
  under the margin (log(1 + threshold); ERROR_MARGIN for the errors; for the misses their median's bound, under
  MISS_MARGIN), each look at 1 - 0.05 / PASS_LOOKS (a night's false PASS at most 5 %). Non-inferiority: an
  improvement passes. A FAIL is looked at first: a look that FAILs never PASSes.
- INCONCLUSIVE otherwise: more pairs while time remains and a look is left (`last_look`).
benchmarks/ab_study.py measures the rule's false FAIL rate and its power (docs/method.md, Nightly)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats

from harness.analysis.gate_verdict import GateVerdict

ALPHA = 0.01  # a night's chance of a FAIL at the floor itself, spent equally over the FAIL looks
PASS_CONFIDENCE = 0.95  # a night's PASS: one-sided, its error shared over PASS_LOOKS looks
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


def last_look(min_pairs: int) -> int:
    """The night's last planned look, its last PASS look: past it no pair changes the verdict."""
    return max(MIN_LOOK_PAIRS, min_pairs + PASS_LOOK_EVERY * (PASS_LOOKS - 1))


def fail_looks(min_pairs: int) -> int:
    """FAIL's looks: every pair from MIN_LOOK_PAIRS to the last look."""
    return last_look(min_pairs) - MIN_LOOK_PAIRS + 1


def fail_alpha(min_pairs: int) -> float:
    """A FAIL look's one-sided level: ALPHA spent equally over the fail_looks looks (Bonferroni: the night's chance
    of a FAIL at the floor at most ALPHA, whatever the looks' correlation and wherever the night ends)."""
    return ALPHA / fail_looks(min_pairs)


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
    why: str = ""
    final: bool = False  # no look is left: more pairs would not change it

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


def sign_p(y: list[float]) -> float:
    """The sign test's one-sided p that NEW is worse: of the pairs that differ, as many worse or more by chance
    (each pair either way with chance 1/2 where the builds do not differ). Exact whatever a block's requests share
    (a hiccup that makes a block miss together is one pair of many) and whatever the values' distribution."""
    worse, better = sum(v > 0 for v in y), sum(v < 0 for v in y)
    return float(stats.binom.sf(worse - 1, worse + better, 0.5)) if worse else 1.0


def sequential(y: list[float], order: list[int], floor: float, margin: float, min_pairs: int, unit,
               signs: bool = False, median: bool = False) -> Decision:
    """The rule (module docstring) on a figure's per-pair values y (worse positive): FAIL at a look where mu lies
    past `floor` at one-sided p < fail_alpha (`signs`: the pairs' sign test, sign_p, against no change); else
    PASS at a PASS look where the mean's upper bound (`median`: the median's, median_upper) lies under
    `margin`."""
    k, last = len(y), last_look(min_pairs)
    f = fit_pairs(np.array(y), np.array(order))
    if f is None:
        why = f"{k} pair(s): fewer than {MIN_LOOK_PAIRS} of both orders"
        return Decision(GateVerdict.INCONCLUSIVE, k, None, why)
    if k > last:
        return Decision(GateVerdict.INCONCLUSIVE, k, f, f"{k} pairs: past the last planned look ({last})", True)
    p, level = sign_p(y) if signs else f.p_worse(floor), fail_alpha(min_pairs)
    if p < level:
        why = (f"past the floor {unit(floor)} at one-sided p = {p:.2g} < {level:.2g} ({ALPHA:g} over "
               f"{fail_looks(min_pairs)} looks), {k} pairs")
        return Decision(GateVerdict.FAIL, k, f, why, True)
    upper = median_upper(y, pass_confidence()) if median else f.upper(pass_confidence())
    if pass_look(k, min_pairs) and upper < margin:
        bound = f"upper {pass_confidence():.2%} bound {unit(upper)} under {unit(margin)}"
        return Decision(GateVerdict.PASS, k, f, bound, True)
    return Decision(GateVerdict.INCONCLUSIVE, k, f, f"{k} pairs: neither past the floor nor non-inferior"
                    + ("" if pass_look(k, min_pairs) else " at a PASS look"), k == last)


def decide(y: list[float], order: list[int], threshold: float, min_pairs: int) -> Decision:
    """The latency rule on the pairs' log ratios: floor and margin both log(1 + threshold)."""
    floor = math.log(1 + threshold)
    return sequential(y, order, floor, floor, min_pairs, lambda v: f"x{math.exp(v):.3f}")


def decide_misses(shares: list[float], order: list[int], min_pairs: int, errors: bool = False) -> Decision:
    """The rule on the pairs' differences of block shares (NEW's minus BASE's): FAIL where the sign test finds NEW
    worse (sign_p: a block's share of 30 requests takes few values, and a mean's t on them is no test: pairs alike
    but in their order gave a standard error of 0); PASS, for the SLO misses (a failed request a miss), where the
    median rise is bounded under MISS_MARGIN (a block that hiccups, its requests missing together, moves a median
    by one place), for the errors (requests that failed) where the mean rise is bounded under ERROR_MARGIN (no
    hiccup fails a request: a NEW that fails 3 % more of them cannot PASS but by chance)."""
    margin, what = (ERROR_MARGIN, "failed") if errors else (MISS_MARGIN, "missed")
    d = sequential(shares, order, 0.0, margin, min_pairs, lambda v: f"{100 * v:+.1f} pp", True, not errors)
    return replace(d, fit=None, why=f"{d.why}; NEW's share {what} minus BASE's, mean "
                   f"{100 * float(np.mean(shares)) if shares else 0.0:+.1f} pp over {len(shares)} pairs")
