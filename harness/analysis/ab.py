"""The A/B gate's figures and verdicts (`fragbench ab`): BASE's build against NEW's, measured in one run.

Each engine's two builds are served side by side. Each turn benches every engine of one build as one bench run
(the engines under their own names, in a results folder of that build: OUT/base, OUT/new), then the other build's,
both on the turn's fresh stream (its own seed), the builds' order reversed every turn (ABBA). The figures, per
engine, each NEW / BASE with its 90 % interval:
- `knee`: the sustained rate at the SLO, from one joint fit of every turn's points (harness/analysis/kneefit.py:
  the two builds as two engines, each turn's stream keys kept apart), the ratio read from the fit's draws;
- `ttft_p50_s`, `tpot_p50_s`, `output_tokens_per_s`: at a rate both builds sustain with margin (`margin_rate`:
  the operating table's rule, analysis/operating.rule_rate, on the lower end of the two builds' pooled knee
  intervals so far: half of it, on the grid), measured after each turn's search as a fixed rate on the turn's
  stream, both builds the same requests (ABBA too); a turn's pair counts where both judged it at steady state
  within the SLO. Each turn's ratio is taken over the requests both builds were sent, paired by their index in
  the stream, its interval from a block bootstrap that resamples the same requests on both sides (what a
  request's size does to its latency cancels); the turns pooled by inverse variance.
A figure FAILs when its interval lies wholly on the worse side of 1 +- threshold, PASSes when it lies inside
1 +- threshold, and is INCONCLUSIVE otherwise (or where it could not be measured); the gate FAILs if any figure
(or the memory gate) fails, else is INCONCLUSIVE if any figure is, else PASSes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from harness.analysis.knee import Judged, named_rng
from harness.analysis.kneefit import KneeFit, fit
from harness.analysis.operating import SEED, below_knee, block_indices, rule_rate
from harness.analysis.summary_records import CapacityPoint

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
class FixedSide:
    """One build's fixed-rate point of a turn and its requests after the point's warm-up (every status)."""

    point: CapacityPoint
    requests: pd.DataFrame


def point_requests(requests: pd.DataFrame, point: CapacityPoint) -> pd.DataFrame:
    """The point's requests (its stream at its rate) that arrived after its warm-up."""
    rows = requests[(requests.stream_key == point.key)
                    & np.isclose(pd.to_numeric(requests.offered_rps, errors="coerce"), point.offered_rps)]
    arrival = pd.to_numeric(rows.arrival_s, errors="coerce")
    return rows[arrival >= arrival.min() + (point.warmup_s or 0.0)] if len(rows) else rows


@dataclass(frozen=True)
class TurnRatio:
    """One turn's NEW / BASE of a figure at its operating point, in log scale with its standard error."""

    base: float
    new: float
    log_ratio: float
    se: float


# figure -> (request column, statistic over requests, whether a request must have completed on both sides):
# latency is compared where both builds completed the request, tokens over every request (a failure gives none)
PAIRED = {"ttft_p50_s": ("ttft_s", np.median, True), "tpot_p50_s": ("tpot_s", np.median, True),
          "output_tokens_per_s": ("output_tokens", np.sum, False)}
MIN_PAIRS = 10  # fewer requests both builds judged give no interval worth the name
MIN_TURNS = 2  # AB and BA: the least that tells a build from the machine's drift during a turn


def paired(base: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """The requests both builds were sent (one stream: the same index is the same request), in BASE's arrival
    order, with `ok` and the figures' columns suffixed `_base` and `_new`."""
    cols = ["stream_index", "arrival_s", "status", *(c for c, _, _ in PAIRED.values())]
    b, n = (frame[cols].assign(ok=frame.status == "ok") for frame in (base, new))
    return b.merge(n, on="stream_index", suffixes=("_base", "_new")).sort_values("arrival_s_base", kind="stable")


def turn_ratio(pairs: pd.DataFrame, name: str, rng: np.random.Generator) -> TurnRatio | None:
    """A figure's NEW / BASE over one turn's paired requests, its standard error from a block bootstrap that
    resamples requests (neighbours in arrival order together, as operating.point_intervals does) on both sides
    at once: the same requests, so what they share cancels."""
    column, statistic, both_ok = PAIRED[name]
    rows = pairs[pairs.ok_base & pairs.ok_new] if both_ok else pairs
    b, n = (pd.to_numeric(rows[f"{column}_{s}"], errors="coerce").to_numpy(dtype=float) for s in SIDES)
    if not both_ok:
        b, n = np.where(rows.ok_base, np.nan_to_num(b), 0.0), np.where(rows.ok_new, np.nan_to_num(n), 0.0)
    keep = np.isfinite(b) & np.isfinite(n) & ((b > 0) & (n > 0) if both_ok else True)
    b, n = b[keep], n[keep]
    if len(b) < MIN_PAIRS:
        return None
    base, new = float(statistic(b)), float(statistic(n))
    if base <= 0 or new <= 0:
        return None
    draws = block_indices(len(b), rng)
    logs = np.log(np.maximum(statistic(n[draws], axis=1), 1e-12) / np.maximum(statistic(b[draws], axis=1), 1e-12))
    lo, hi = np.quantile(logs, [0.05, 0.95])
    return TurnRatio(base, new, math.log(new / base), float(hi - lo) / 2 / Z90)


def pooled(ratios: list[TurnRatio]) -> tuple[float, float, float, tuple[float, float]]:
    """(base, new, ratio, 90 % interval) pooled over turns by random effects (DerSimonian-Laird): a turn's
    interval covers its requests, not the machine of its moment, so where the turns disagree by more than their
    own intervals allow, the spread between them (tau^2) is added to each turn's variance. One AB turn read a
    machine busy during B's run as a 3.9x TPOT (A/A): the BA turn after it widens the pooled interval instead of
    averaging it away. The values are the turns' geometric means."""
    y = np.array([r.log_ratio for r in ratios])
    var = np.array([max(r.se, 1e-6) ** 2 for r in ratios])
    w = 1 / var
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    c = float(w.sum() - (w ** 2).sum() / w.sum())
    tau2 = max(0.0, (q - (len(y) - 1)) / c) if c > 0 else 0.0
    w = 1 / (var + tau2)
    log_ratio, se = float((w * y).sum() / w.sum()), float(1 / math.sqrt(w.sum()))
    geo = [math.exp(sum(math.log(getattr(r, side)) for r in ratios) / len(ratios)) for side in SIDES]
    return geo[0], geo[1], math.exp(log_ratio), (math.exp(log_ratio - Z90 * se), math.exp(log_ratio + Z90 * se))


def operating_figures(engine: str, turns: list[dict[str, FixedSide]], threshold: float,
                      attainment: float) -> list[ABFigure]:
    """TTFT, TPOT and output tokens/s at each fixed-rate turn's pair, NEW / BASE over the same requests, turns
    pooled."""
    shared = []
    for sides in turns:
        b, n = sides.get(side_name(engine, "base")), sides.get(side_name(engine, "new"))
        if b and n and b.point.key == n.point.key and all(below_knee(s.point, attainment) for s in (b, n)):
            shared.append((b, n))
    pairs = [paired(b.requests, n.requests) for b, n in shared]  # once a turn, read by every figure
    out = []
    for name in PAIRED:
        ratios = [r for k, turn in enumerate(pairs)
                  if (r := turn_ratio(turn, name, named_rng(SEED, f"{engine}:{name}:{k}"))) is not None]
        if not ratios:
            out.append(figure(engine, name, None, None, None, None, threshold,
                              "no rate both builds sustained with margin was measured in any turn"))
            continue
        base, new, ratio, ci = pooled(ratios)
        rates = ", ".join(sorted({f"{b.point.offered_rps:.3g}" for b, _ in shared}))
        why = f"{len(ratios)} turn(s), the same requests on both sides, at {rates} req/s"
        if len(ratios) < MIN_TURNS:  # AB alone: a machine that drifted during the turn reads as B's doing
            ci, why = None, why + "; one order only (AB), no interval"
        out.append(figure(engine, name, round(base, 6), round(new, 6), ratio, ci, threshold, why))
    return out
