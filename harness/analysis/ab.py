"""The A/B gate's figures and verdicts (`fragbench ab`): BASE's build against NEW's, decided as the field's gates
decide (Firecracker's A/B runs, Chromium's Pinpoint, asv): many short replicated pairs, a FAIL only where a
regression is both significant and past an effect floor and fresh pairs confirm it, a PASS on non-inferiority.

The unit is the pair. Per engine, both builds' servers run side by side (harness/run/ab_runs.py); pair k is one
fresh stream (its own key), sent at one fixed rate well under both builds' knees to one build and then the other,
the order alternating (AB, BA, AB, ...). Each build judges about 30 requests of it at steady state.

- `tpot_p50_s`, the carrying figure: a pair's log ratio is the median, over the requests both builds completed, of
  log(NEW's TPOT / BASE's) for that request: a request's own size cancels, and a step 20 % slower is 1.2x.
- `slo_misses`: the requests a build judged and missed (the SLO's rule; a failed or unfinished request misses),
  paired: NEW missing a request BASE met is evidence of a regression (an exact one-sided binomial test on the
  discordant requests, McNemar's), never a dropped pair.
- `instructions`: each engine's step at fixed batch shapes counted in instructions under callgrind
  (harness/run/ab_instructions.py): no load moves it, so it is compared as it is, without statistics.
- `ttft_p50_s`, `output_tokens_per_s` (pairs, as TPOT) and `knee` (a short knee search of each build) are
  reported beside them, never gated: a capacity collapse shows as NEW missing the SLO at a rate BASE sustains, and
  `history` keeps the slow drifts.

The rule on the pairs' log ratios y_k (`decide`): a least-squares fit y_k = mu + gamma o_k, o_k = +1 for AB and -1
for BA (what the second run of a pair meets on this machine: a warm cache, the first's leftovers), equal weights,
t with k - 2 degrees of freedom.
- FAIL: one-sided p < ALPHA (0.01) against mu = 0, the estimate exp(mu) past 1 + threshold, and then CONFIRM_PAIRS
  fresh pairs confirm it: all pairs together still meet both, and the fresh pairs alone are worse than no change
  at one-sided p < 0.05 (a Firecracker-style retry: the first sighting is the hypothesis, the fresh pairs the
  test).
- PASS: the upper one-sided 95 % bound of exp(mu) under 1 + threshold, from at least `min_pairs` pairs
  (non-inferiority: an improvement passes).
- INCONCLUSIVE otherwise: more pairs while time remains.
An engine FAILs where any of its gated figures does, PASSes where all do; the gate FAILs where an engine or the
memory gate does (a crash of NEW's build included), PASSes where every engine does, else is INCONCLUSIVE.
benchmarks/ab_study.py measures the rule's false FAIL rate and its power (docs/method.md, Nightly)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
from scipy import stats

from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeFit, fit

SIDES = ("base", "new")
ALPHA = 0.01  # a FAIL's one-sided significance against no change
PASS_CONFIDENCE = 0.95  # a PASS's one-sided bound
CONFIRM_PAIRS = 4  # fresh pairs a FAIL's first sighting must be confirmed by
CONFIRM_ALPHA = 0.05  # their own one-sided significance
MIN_LOOK_PAIRS = 6  # the first look: t with 4 degrees of freedom after the order term
MIN_PAIR_REQUESTS = 10  # requests both builds completed that make a pair's latency ratio
SLO_FLOOR = 0.05  # NEW's net share of a pair's requests missed where BASE met them, past which misses may FAIL
GATED = ("tpot_p50_s", "slo_misses", "instructions")  # the figures that decide; every other is reported


def side_name(engine: str, side: str) -> str:
    """The name a build's server goes by (a target's name: letters, digits, '.', '_', '-')."""
    return f"{engine}.{side}"


def side_order(pair: int) -> tuple[str, ...]:
    """AB, BA, AB, ...: the builds' order alternates every pair."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


def overall(verdicts: list[str]) -> str:
    if "FAIL" in verdicts:
        return "FAIL"
    return "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts or not verdicts else "PASS"


# -- one pair


@dataclass(frozen=True)
class Pair:
    """One fresh stream both builds of an engine were sent at `rate_rps`, in `order`; each side's judged requests
    (stream_index, status, met, ttft_s, tpot_s, output_tokens)."""

    engine: str
    number: int
    rate_rps: float
    key: str
    order: tuple[str, ...]
    base: pd.DataFrame
    new: pd.DataFrame

    @property
    def order_sign(self) -> int:
        return 1 if self.order[0] == "base" else -1

    def both(self) -> pd.DataFrame:
        """The requests both builds judged, matched by their place in the stream."""
        return self.base.merge(self.new, on="stream_index", suffixes=("_base", "_new"))

    def json(self) -> dict:
        return {"engine": self.engine, "pair": self.number, "rate_rps": self.rate_rps, "key": self.key,
                "order": "".join("A" if s == "base" else "B" for s in self.order), "judged_base": len(self.base),
                "judged_new": len(self.new), "tpot_log_ratio": log_ratio(self, "tpot_s"),
                "ttft_log_ratio": log_ratio(self, "ttft_s"), "discordant": list(discordant(self))}


def log_ratio(pair: Pair, column: str) -> float | None:
    """The median over the requests both builds completed of log(NEW's value / BASE's): None under
    MIN_PAIR_REQUESTS such requests."""
    both = pair.both()
    if both.empty:
        return None
    ok = (both.status_base == "ok") & (both.status_new == "ok")
    b = pd.to_numeric(both.loc[ok, f"{column}_base"], errors="coerce").to_numpy(dtype=float)
    n = pd.to_numeric(both.loc[ok, f"{column}_new"], errors="coerce").to_numpy(dtype=float)
    keep = np.isfinite(b) & np.isfinite(n) & (b > 0) & (n > 0)
    if keep.sum() < MIN_PAIR_REQUESTS:
        return None
    return float(np.median(np.log(n[keep] / b[keep])))


def tokens_log_ratio(pair: Pair) -> float | None:
    """log(NEW's output tokens / BASE's) over the requests both judged: a failed request gives its build none."""
    both = pair.both()
    tokens = [float(pd.to_numeric(both[f"output_tokens_{s}"], errors="coerce").fillna(0)
                    .where(both[f"status_{s}"] == "ok", 0).sum()) for s in SIDES]
    return math.log(tokens[1] / tokens[0]) if len(both) >= MIN_PAIR_REQUESTS and min(tokens) > 0 else None


def discordant(pair: Pair) -> tuple[int, int, int]:
    """(requests BASE met and NEW missed, requests NEW met and BASE missed, requests both judged)."""
    both = pair.both()
    if both.empty:
        return 0, 0, 0
    b, n = both.met_base.astype(bool), both.met_new.astype(bool)
    return int((b & ~n).sum()), int((n & ~b).sum()), len(both)


# -- the rule


@dataclass(frozen=True)
class Fit:
    """mu (the log ratio, NEW over BASE, worse positive), its standard error and degrees of freedom."""

    mu: float
    se: float
    df: int

    def p_worse(self) -> float:
        """One-sided p against mu = 0 toward worse."""
        if self.se <= 0:
            return 0.0 if self.mu > 0 else 1.0
        return float(stats.t.sf(self.mu / self.se, self.df))

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


def confirms(fresh: np.ndarray) -> bool:
    """Fresh pairs replicate a sighted regression: by themselves worse than no change at one-sided p < CONFIRM_ALPHA
    (t with n - 1 degrees of freedom; AB and BA alternate within them, so the order cancels in their mean)."""
    if len(fresh) < 2 or fresh.std(ddof=1) == 0:
        return bool(len(fresh) and fresh.mean() > 0)
    t = fresh.mean() / (fresh.std(ddof=1) / math.sqrt(len(fresh)))
    return float(stats.t.sf(t, len(fresh) - 1)) < CONFIRM_ALPHA


def failing(f: Fit, threshold: float) -> bool:
    """Significant against no change, and an estimate past the effect floor."""
    return f.p_worse() < ALPHA and f.mu > math.log(1 + threshold)


def passing(f: Fit, threshold: float) -> bool:
    """Non-inferior: the upper one-sided 95 % bound under 1 + threshold."""
    return f.upper() < math.log(1 + threshold)


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
        """The two-sided 90 % interval (its upper end is the PASS bound)."""
        return (math.exp(self.fit.lower()), math.exp(self.fit.upper())) if self.fit else None


def decide(y: list[float], order: list[int], threshold: float, min_pairs: int,
           sighted_at: int | None = None) -> Decision:
    """The rule (module docstring) on the pairs so far; `sighted_at` carries a first sighting of a FAIL from an
    earlier look (the pairs after it are its confirmation)."""
    k = len(y)
    f = fit_pairs(np.array(y), np.array(order))
    if f is None:
        return Decision("INCONCLUSIVE", k, None, None, f"{k} pair(s): fewer than {MIN_LOOK_PAIRS} of both orders")
    if failing(f, threshold):
        if sighted_at is None:
            return Decision("INCONCLUSIVE", k, f, k, f"a regression sighted at {k} pairs (p = {f.p_worse():.2g}): "
                                                     f"{CONFIRM_PAIRS} fresh pairs to confirm it")
        fresh = np.array(y[sighted_at:])
        if len(fresh) < CONFIRM_PAIRS:
            why = f"confirming: {len(fresh)} of {CONFIRM_PAIRS} fresh pairs"
            return Decision("INCONCLUSIVE", k, f, sighted_at, why)
        if confirms(fresh):
            why = (f"p = {f.p_worse():.2g} over {k} pairs; {len(fresh)} fresh pairs confirmed it (their own ratio "
                   f"{math.exp(fresh.mean()):.3f})")
            return Decision("FAIL", k, f, sighted_at, why)
        return Decision("INCONCLUSIVE", k, f, None, "a sighted regression the fresh pairs did not confirm")
    if passing(f, threshold) and k >= min_pairs:
        return Decision("PASS", k, f, None, f"upper 95 % bound {math.exp(f.upper()):.3f} < {1 + threshold:g}")
    return Decision("INCONCLUSIVE", k, f, None, f"{k} pairs: neither a confirmed regression nor non-inferior")


# the SLO misses: McNemar's exact test on the discordant requests, pooled over pairs


@dataclass(frozen=True)
class Misses:
    new_only: int  # requests BASE met and NEW missed
    base_only: int
    judged: int  # requests both judged

    @property
    def net_share(self) -> float:
        return (self.new_only - self.base_only) / self.judged if self.judged else 0.0

    def p_worse(self) -> float:
        n = self.new_only + self.base_only
        return float(stats.binomtest(self.new_only, n, 0.5, alternative="greater").pvalue) if n else 1.0

    def failing(self) -> bool:
        return self.p_worse() < ALPHA and self.net_share > SLO_FLOOR


def misses_of(pairs: list[Pair]) -> Misses:
    counts = np.array([discordant(p) for p in pairs] or [(0, 0, 0)])
    return Misses(*(int(c) for c in counts.sum(axis=0)))


def decide_misses(pairs: list[Pair], sighted_at: int | None) -> Decision:
    """The same sighting and confirmation as `decide`, on the discordant requests."""
    m, k = misses_of(pairs), len(pairs)
    why = f"{m.new_only} requests missed by NEW alone, {m.base_only} by BASE alone, of {m.judged}"
    if not m.failing() or k < MIN_LOOK_PAIRS:  # the same first look as the latency's
        return Decision("PASS" if m.net_share <= SLO_FLOOR else "INCONCLUSIVE", k, None, None, why)
    if sighted_at is None:
        return Decision("INCONCLUSIVE", k, None, k, why + f" (p = {m.p_worse():.2g}): fresh pairs to confirm it")
    fresh = misses_of(pairs[sighted_at:])
    if k - sighted_at < CONFIRM_PAIRS:
        return Decision("INCONCLUSIVE", k, None, sighted_at, why + "; confirming")
    if fresh.new_only > fresh.base_only:
        return Decision("FAIL", k, None, sighted_at, why + f" (p = {m.p_worse():.2g}), confirmed by fresh pairs")
    return Decision("INCONCLUSIVE", k, None, None, why + "; the fresh pairs did not confirm it")


# -- an engine's figures


@dataclass(frozen=True)
class ABFigure:
    engine: str
    figure: str
    ratio: float | None  # NEW / BASE
    ci: tuple[float, float] | None  # its 90 % interval where it has one
    verdict: str  # PASS, FAIL, INCONCLUSIVE; "reported" for a figure that does not gate
    why: str = ""
    base: float | None = None
    new: float | None = None
    pairs: int = 0

    @property
    def gated(self) -> bool:
        return self.figure in GATED

    def json(self) -> dict:
        return {"engine": self.engine, "figure": self.figure, "verdict": self.verdict, "gated": self.gated,
                "base": self.base, "new": self.new, "ratio": None if self.ratio is None else round(self.ratio, 4),
                "ci": [round(x, 4) for x in self.ci] if self.ci else None, "pairs": self.pairs, "why": self.why}


def decision_figure(engine: str, name: str, d: Decision, verdict: str | None = None) -> ABFigure:
    return ABFigure(engine, name, d.ratio, d.ci, verdict or d.verdict, d.why, pairs=d.pairs)


@dataclass
class EngineGate:
    """One engine's pairs and where its decision stands; `sighted` carries a FAIL's first sighting per figure."""

    engine: str
    threshold: float
    min_pairs: int
    pairs: list[Pair] = field(default_factory=list)
    sighted: dict[str, int | None] = field(default_factory=lambda: {"tpot_p50_s": None, "slo_misses": None})
    instructions: ABFigure | None = None
    crashed: str | None = None  # NEW's server died during a pair: what its log said

    def add(self, pair: Pair) -> None:
        self.pairs.append(pair)
        for name, d in self.decisions().items():
            self.sighted[name] = d.sighted_at

    def series(self, column: str) -> tuple[list[float], list[int]]:
        kept = [(r, p.order_sign) for p in self.pairs if (r := log_ratio(p, column)) is not None]
        return [r for r, _ in kept], [o for _, o in kept]

    def decisions(self) -> dict[str, Decision]:
        y, order = self.series("tpot_s")
        return {"tpot_p50_s": decide(y, order, self.threshold, self.min_pairs, self.sighted["tpot_p50_s"]),
                "slo_misses": decide_misses(self.pairs, self.sighted["slo_misses"])}

    def verdict(self) -> str:
        if self.crashed:
            return "FAIL"
        d = self.decisions()
        verdicts = [d["tpot_p50_s"].verdict, d["slo_misses"].verdict]
        if self.instructions is not None:
            verdicts.append(self.instructions.verdict)
        return overall(verdicts)

    def settled(self) -> bool:
        """No more pairs would change it: a confirmed FAIL, a crash, or a PASS of every figure measured so far."""
        return self.crashed is not None or self.verdict() != "INCONCLUSIVE"

    def figures(self) -> list[ABFigure]:
        d = self.decisions()
        out = [decision_figure(self.engine, "tpot_p50_s", d["tpot_p50_s"]),
               decision_figure(self.engine, "slo_misses", d["slo_misses"])]
        if self.crashed:
            out.append(ABFigure(self.engine, "crash", None, None, "FAIL", f"NEW's server died: {self.crashed}"))
        if self.instructions is not None:
            out.append(self.instructions)
        y, order = self.series("ttft_s")
        out.append(reported(self.engine, "ttft_p50_s", y, order, self.threshold))
        tokens = [(r, p.order_sign) for p in self.pairs if (r := tokens_log_ratio(p)) is not None]
        out.append(reported(self.engine, "output_tokens_per_s", [r for r, _ in tokens], [o for _, o in tokens],
                            self.threshold))
        return out


def reported(engine: str, name: str, y: list[float], order: list[int], threshold: float) -> ABFigure:
    """A figure measured on the pairs and reported with its 90 % interval, never gated."""
    f = fit_pairs(np.array(y), np.array(order))
    if f is None:
        return ABFigure(engine, name, None, None, "reported", f"{len(y)} pair(s): no interval", pairs=len(y))
    return ABFigure(engine, name, math.exp(f.mu), (math.exp(f.lower()), math.exp(f.upper())), "reported",
                    f"{len(y)} pairs, not gated", pairs=len(y))


def instructions_figure(engine: str, base: float | None, new: float | None, threshold: float,
                        why: str = "", ratio: float | None = None) -> ABFigure:
    """Instructions of the engine's fixed step shapes, NEW / BASE (`ratio`, where given: the shapes' geometric
    mean, harness/analysis/ab_instr.instr_ratio; else the totals'): counted, not sampled, so compared as it is (an
    A/A read within 0.22 % at every shape): FAIL past 1 + threshold, else PASS."""
    if not base or not new:
        return ABFigure(engine, "instructions", None, None, "INCONCLUSIVE", why or "not counted", base, new)
    ratio = ratio if ratio is not None else new / base
    return ABFigure(engine, "instructions", ratio, None, "FAIL" if ratio > 1 + threshold else "PASS",
                    why or "callgrind's count of the step at fixed batch shapes", base, new)


# -- the knee, reported


def turn_keyed(points: list[Judged], turn: int) -> list[Judged]:
    """A turn's points with their stream keys made the turn's own: turns draw from different seeds, so one key in
    two turns names two different streams."""
    return [replace(p, key=f"t{turn}:{p.key}") for p in points]


def knees_fit(engine: str, turns: list[dict[str, list[Judged]]], target: float) -> KneeFit | None:
    """The knee fit of every search turn's points of the engine's two builds (per turn, side name -> points): each
    build fitted as an engine of its own (harness/analysis/kneefit.py), the two independent."""
    points = {side_name(engine, s): [] for s in SIDES}
    for k, per_side in enumerate(turns):
        for name in points:
            points[name] += turn_keyed(per_side.get(name, []), k)
    return fit(points, target)


def knee_figure(engine: str, turns: list[dict[str, list[Judged]]], target: float) -> ABFigure:
    """NEW's knee over BASE's, reported (never gated: a night's search cannot tell 10 %)."""
    knees = knees_fit(engine, turns, target)
    b, n = side_name(engine, "base"), side_name(engine, "new")
    if knees is None or b not in knees.estimates or n not in knees.estimates:
        return ABFigure(engine, "knee", None, None, "reported", "no knee measured on one side")
    ratio, ci = knees.ratio(n, b)
    eb, en = knees.estimates[b], knees.estimates[n]
    why = "two independent fits, not gated" + ("" if eb.bracketed and en.bracketed else "; a knee not bracketed")
    return ABFigure(engine, "knee", ratio, tuple(ci) if ci else None, "reported", why, round(eb.rps, 4),
                    round(en.rps, 4))
