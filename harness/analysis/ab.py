"""The A/B gate's figures and verdicts (`fragbench ab`): BASE's build against NEW's, measured in one run.

Each engine's two builds are served side by side and benched as two engines of one run (`paged.base`,
`paged.new`), turn after turn, each turn a fresh stream (its own seed) that both builds are given, the builds'
order reversed every turn and every engine (ABBA). The figures, per engine, each NEW / BASE with its 90 % interval:
- `knee`: the sustained rate at the SLO, from one joint fit of every turn's points (harness/analysis/kneefit.py:
  the two builds as two engines, each turn's stream keys kept apart), the ratio read from the fit's draws;
- `ttft_p50_s`, `tpot_p50_s`, `output_tokens_per_s`: at a rate both builds sustain with margin (`margin_rate`:
  the operating table's rule, analysis/operating.rule_rate, on the lower end of the two builds' pooled knee
  intervals so far: half of it, on the grid), measured after each turn's search as a fixed rate on the turn's
  stream, both builds the same requests (ABBA too); a turn's pair counts where both judged it at steady state
  within the SLO. Each turn's ratio has its interval from the two points' block-bootstrap intervals (log scale,
  taken as independent: wider than a paired interval would be), the turns pooled by inverse variance.
A figure FAILs when its interval lies wholly on the worse side of 1 +- threshold, PASSes when it lies inside
1 +- threshold, and is INCONCLUSIVE otherwise (or where it could not be measured); the gate FAILs if any figure
(or the memory gate) fails, else is INCONCLUSIVE if any figure is, else PASSes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeFit, fit
from harness.analysis.operating import below_knee, rule_rate
from harness.analysis.summary_records import CapacityBlock, CapacityPoint

Z90 = 1.6449  # the standard normal's 95th percentile: a central 90 % interval is +- Z90 standard errors
# figure -> whether higher is better
FIGURES = {"knee": True, "ttft_p50_s": False, "tpot_p50_s": False, "output_tokens_per_s": True}
SIDES = ("base", "new")


def side_name(engine: str, side: str) -> str:
    """The name a build's server is benched under (a target's name: letters, digits, '.', '_', '-')."""
    return f"{engine}.{side}"


def verdict_of(ci: tuple[float, float] | None, threshold: float, higher_better: bool) -> str:
    """The contract's rule on NEW / BASE's interval; `threshold` a share (0.10 for 10 %)."""
    if ci is None:
        return "INCONCLUSIVE"
    lo, hi = ci
    worse = hi < 1 - threshold if higher_better else lo > 1 + threshold
    if worse:
        return "FAIL"
    return "PASS" if 1 - threshold <= lo and hi <= 1 + threshold else "INCONCLUSIVE"


def overall(verdicts: list[str]) -> str:
    if "FAIL" in verdicts:
        return "FAIL"
    return "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts or not verdicts else "PASS"


@dataclass(frozen=True)
class ABFigure:
    engine: str
    figure: str
    base: float | None
    new: float | None
    ratio: float | None  # NEW / BASE
    ci: tuple[float, float] | None  # its 90 % interval
    verdict: str
    why: str = ""

    def json(self) -> dict:
        return {"engine": self.engine, "figure": self.figure, "verdict": self.verdict, "base": self.base,
                "new": self.new, "ratio": self.ratio, "ci": list(self.ci) if self.ci else None, "why": self.why}


def figure(engine: str, name: str, base: float | None, new: float | None, ratio: float | None,
           ci: tuple[float, float] | None, threshold: float, why: str = "") -> ABFigure:
    rounded = tuple(round(x, 4) for x in ci) if ci else None
    return ABFigure(engine, name, base, new, None if ratio is None else round(ratio, 4), rounded,
                    verdict_of(ci, threshold, FIGURES[name]), why)


def turn_keyed(points: list[Judged], turn: int) -> list[Judged]:
    """A turn's points with their stream keys made the turn's own: turns draw from different seeds, so one key in
    two turns names two different streams."""
    return [replace(p, key=f"t{turn}:{p.key}") for p in points]


def pooled_fit(engine: str, turns: list[dict[str, list[Judged]]], target: float) -> KneeFit | None:
    """One fit of every turn's points of the engine's two builds (`turns`: per turn, side name -> points)."""
    points = {side_name(engine, s): [] for s in SIDES}
    for k, per_side in enumerate(turns):
        for name in points:
            points[name] += turn_keyed(per_side.get(name, []), k)
    return fit(points, target)


def margin_rate(engine: str, turns: list[dict[str, list[Judged]]], target: float) -> float | None:
    """The rate both builds sustain with margin: the operating table's rule on the lower of their knee intervals'
    lower ends (None where a build has no knee yet, or the rate is too low to judge its requests in a minute)."""
    knees = pooled_fit(engine, turns, target)
    names = [side_name(engine, s) for s in SIDES]
    if knees is None or any(n not in knees.estimates for n in names):
        return None
    return rule_rate([min(knees.estimates[n].ci[0] for n in names)])


def knee_figure(engine: str, turns: list[dict[str, list[Judged]]], target: float, threshold: float) -> ABFigure:
    """NEW's knee over BASE's from one fit of every turn's points."""
    knees = pooled_fit(engine, turns, target)
    b, n = side_name(engine, "base"), side_name(engine, "new")
    if knees is None or b not in knees.estimates or n not in knees.estimates:
        return figure(engine, "knee", None, None, None, None, threshold, "no knee measured on one side")
    ratio, ci = knees.ratio(n, b)
    eb, en = knees.estimates[b], knees.estimates[n]
    why = "" if eb.bracketed and en.bracketed else "a knee not bracketed: a bound"
    return figure(engine, "knee", round(eb.rps, 4), round(en.rps, 4), ratio, ci if not why else None, threshold, why)


@dataclass(frozen=True)
class TurnRatio:
    """One turn's NEW / BASE of a figure at its operating point, in log scale with its standard error."""

    base: float
    new: float
    log_ratio: float
    se: float


def turn_ratio(base, new, name: str) -> TurnRatio | None:
    """A figure's ratio at one turn's shared point, its standard error from the two points' 90 % intervals."""
    b, n = base.figure(name), new.figure(name)
    b_ci, n_ci = base.figure(f"{name}_ci"), new.figure(f"{name}_ci")
    if not b or not n or not b_ci or not n_ci or min(*b_ci, *n_ci) <= 0:
        return None
    half = [math.log(ci[1] / ci[0]) / 2 / Z90 for ci in (b_ci, n_ci)]
    return TurnRatio(b, n, math.log(n / b), math.hypot(*half))


def pooled(ratios: list[TurnRatio]) -> tuple[float, float, float, tuple[float, float]]:
    """Inverse-variance pooled (base, new, ratio, 90 % interval) over turns (geometric means of the values)."""
    weights = [1 / max(r.se, 1e-6) ** 2 for r in ratios]
    total = sum(weights)
    log_ratio = sum(w * r.log_ratio for w, r in zip(weights, ratios, strict=True)) / total
    se = 1 / math.sqrt(total)
    geo = [math.exp(sum(math.log(getattr(r, side)) for r in ratios) / len(ratios)) for side in SIDES]
    return geo[0], geo[1], math.exp(log_ratio), (math.exp(log_ratio - Z90 * se), math.exp(log_ratio + Z90 * se))


def fixed_pair(engine: str, blocks: dict[str, CapacityBlock]) -> tuple[CapacityPoint, CapacityPoint] | None:
    """A fixed-rate turn's pair: the highest-rate stream both builds judged at steady state within the SLO."""
    b, n = blocks.get(side_name(engine, "base")), blocks.get(side_name(engine, "new"))
    if b is None or n is None:
        return None
    mine = {p.key: p for p in b.points if p.key and below_knee(p, b.slo.attainment)}
    theirs = {p.key: p for p in n.points if p.key and below_knee(p, n.slo.attainment)}
    keys = sorted(set(mine) & set(theirs), key=lambda k: -mine[k].offered_rps)
    return (mine[keys[0]], theirs[keys[0]]) if keys else None


def operating_figures(engine: str, turns: list[dict[str, CapacityBlock]], threshold: float) -> list[ABFigure]:
    """TTFT, TPOT and output tokens/s at each fixed-rate turn's pair, NEW / BASE, turns pooled."""
    shared = [pair for pair in (fixed_pair(engine, blocks) for blocks in turns) if pair is not None]
    out = []
    for name in ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s"):
        ratios = [r for r in (turn_ratio(b, n, name) for b, n in shared) if r is not None]
        if not ratios:
            out.append(figure(engine, name, None, None, None, None, threshold,
                              "no rate both builds sustained with margin was measured in any turn"))
            continue
        base, new, ratio, ci = pooled(ratios)
        out.append(figure(engine, name, round(base, 6), round(new, 6), ratio, ci, threshold,
                          f"{len(ratios)} turn(s), at " + ", ".join(sorted({f"{b.offered_rps:.3g}" for b, _ in shared}))
                          + " req/s"))
    return out
