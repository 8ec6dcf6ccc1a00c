"""The A/B gate's figures and verdicts (`fragbench ab`): BASE's build against NEW's, decided as the field's gates
decide (Firecracker's A/B runs, Chromium's Pinpoint, asv): many short replicated pairs, a FAIL only where a
regression is significantly past an effect floor, a PASS on non-inferiority, both at planned looks.

The unit is the pair. Per engine, both builds' servers run side by side (harness/run/ab_runs.py); pair k is one
fresh stream (its own key), sent at one fixed rate well under both builds' knees to one build and then the other,
the order alternating (AB, BA, AB, ...). Each build judges about 30 requests of it at steady state.

- `tpot_p50_s`, the carrying figure: a pair's log ratio is the median, over the requests both builds completed, of
  log(NEW's TPOT / BASE's) for that request: a request's own size cancels, and a step 20 % slower is 1.2x.
- `slo_misses`: each build's share of its block's judged requests missed (the SLO's rule; a failed or unfinished
  request misses), a pair's figure NEW's share minus BASE's: the block is the unit (a hiccup of the machine makes a
  block's requests miss together), never its requests one by one.
- `errors`: the same, of the requests that failed (a hiccup slows requests, it does not fail them).
- `instructions`: each engine's step at fixed batch shapes counted in instructions under callgrind
  (harness/run/ab_instructions.py): no load moves it, so it is compared as it is, without statistics.
- `ttft_p50_s`, `output_tokens_per_s` (pairs, as TPOT) and `knee` (a short knee search of each build) are
  reported beside them, never gated: a capacity collapse shows as NEW missing the SLO at a rate BASE sustains, and
  `history` keeps the slow drifts.

The rule on a figure's pair values (a group sequential test: FAIL past the floor, PASS on non-inferiority, each
at planned looks with its error spent over them) is harness/analysis/ab_rule.py's.
An engine's verdict is the worst of its gated figures' (harness/analysis/gate_verdict.worst: FAIL, ERROR, INCONCLUSIVE,
PASS), a crash of NEW's build a FAIL; the gate's is the worst of its engines' and the memory gate's.
benchmarks/ab_study.py measures the rule's false FAIL rate and its power (docs/method.md, Nightly)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

# the rule's; a name imported as itself is re-exported: importers read it here, where it lived before ab_rule.py
from harness.analysis.ab_rule import ALPHA as ALPHA
from harness.analysis.ab_rule import MIN_LOOK_PAIRS as MIN_LOOK_PAIRS
from harness.analysis.ab_rule import MISS_MARGIN as MISS_MARGIN
from harness.analysis.ab_rule import PASS_LOOK_EVERY as PASS_LOOK_EVERY
from harness.analysis.ab_rule import PASS_LOOKS as PASS_LOOKS
from harness.analysis.ab_rule import Decision, decide, decide_misses, fit_pairs
from harness.analysis.ab_rule import fail_alpha as fail_alpha
from harness.analysis.ab_rule import fail_looks as fail_looks
from harness.analysis.ab_rule import pass_confidence as pass_confidence
from harness.analysis.gate_verdict import GateVerdict, passed_or_failed, worst
from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeFit, fit

SIDES = ("base", "new")
MIN_PAIR_REQUESTS = 10  # requests both builds completed that make a pair's latency ratio
SHARES = {"slo_misses": "misses", "errors": "errors"}  # the block-share figures, by the PairFigures field they read
GATED = ("tpot_p50_s", *SHARES, "instructions")  # the figures that decide; every other is reported


def side_name(engine: str, side: str) -> str:
    """The name a build's server goes by (a target's name: letters, digits, '.', '_', '-')."""
    return f"{engine}.{side}"


def side_order(pair: int) -> tuple[str, ...]:
    """AB, BA, AB, ...: the builds' order alternates every pair."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


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
                "ttft_log_ratio": log_ratio(self, "ttft_s"), "discordant": list(discordant(self)),
                "missed_share": {s: miss_share(getattr(self, s)) for s in SIDES},
                "failed_share": {s: error_share(getattr(self, s)) for s in SIDES}}


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



def miss_share(block: pd.DataFrame) -> float | None:
    """The share of a block's judged requests its build missed (the SLO's rule: a failed or unfinished request
    misses); None for a block that judged none."""
    return float(1 - block.met.astype(bool).mean()) if len(block) else None


def error_share(block: pd.DataFrame) -> float | None:
    """The share of a block's judged requests that failed; None for a block that judged none."""
    return float((block.status != "ok").mean()) if len(block) else None


def difference(pair: Pair, share) -> float | None:
    """NEW's block share minus BASE's: a pair's miss or error figure (the block its unit, its requests clustered)."""
    b, n = share(pair.base), share(pair.new)
    return None if b is None or n is None else n - b


@dataclass(frozen=True)
class PairFigures:
    """What the rule reads of one pair (None: not measured on it): the study (benchmarks/ab_study.py) feeds these
    to EngineGate directly, the gate computes them from each Pair's requests."""

    order_sign: int
    tpot: float | None
    misses: float | None
    errors: float | None = None
    ttft: float | None = None
    tokens: float | None = None


def figures_of(pair: Pair) -> PairFigures:
    return PairFigures(pair.order_sign, log_ratio(pair, "tpot_s"), difference(pair, miss_share),
                       difference(pair, error_share), log_ratio(pair, "ttft_s"), tokens_log_ratio(pair))


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
    """One engine's pairs and where its decision stands. The decisions are made once a pair, at `add` (or
    `add_figures`, the study's way in: the same code from the pair's figures on)."""

    engine: str
    threshold: float
    min_pairs: int
    pairs: list[Pair] = field(default_factory=list)
    measured: list[PairFigures] = field(default_factory=list)
    instructions: ABFigure | None = None
    crashed: str | None = None  # NEW failed in a pair (died, hung, never started): why
    decided: dict[str, Decision] | None = None

    def add(self, pair: Pair) -> None:
        self.pairs.append(pair)
        self.add_figures(figures_of(pair))

    def add_figures(self, figures: PairFigures) -> None:
        self.measured.append(figures)
        self.decided = None

    def series(self, name: str) -> tuple[list[float], list[int]]:
        """A figure's values over the pairs that measured it, and their orders."""
        kept = [(v, m.order_sign) for m in self.measured if (v := getattr(m, name)) is not None]
        return [v for v, _ in kept], [o for _, o in kept]

    def decisions(self) -> dict[str, Decision]:
        if self.decided is None:
            y, order = self.series("tpot")
            self.decided = {"tpot_p50_s": decide(y, order, self.threshold, self.min_pairs)}
            for name, attr in SHARES.items():
                self.decided[name] = decide_misses(*self.series(attr), self.min_pairs, errors=attr == "errors")
        return self.decided

    def verdict(self) -> GateVerdict:
        """The worst of its gated figures' verdicts (harness/analysis/gate_verdict.worst); a crash of NEW FAILs."""
        if self.crashed:
            return GateVerdict.FAIL
        verdicts = [d.verdict for d in self.decisions().values()]
        return worst(verdicts + ([self.instructions.verdict] if self.instructions is not None else []))

    def settled(self) -> bool:
        """No more pairs would change it: a FAIL, a crash, a PASS of every figure measured so far, or no look left
        to any figure (past the night's last planned look)."""
        return self.crashed is not None or self.verdict() != GateVerdict.INCONCLUSIVE or \
            all(d.final for d in self.decisions().values())

    def figures(self) -> list[ABFigure]:
        d = self.decisions()
        out = [decision_figure(self.engine, name, d[name]) for name in ("tpot_p50_s", *SHARES)]
        if self.crashed:
            died = f"NEW failed: {self.crashed}"
            out.append(ABFigure(self.engine, "crash", None, None, GateVerdict.FAIL, died))
        if self.instructions is not None:
            out.append(self.instructions)
        for figure, name in (("ttft_p50_s", "ttft"), ("output_tokens_per_s", "tokens")):
            out.append(reported(self.engine, figure, *self.series(name), self.threshold))
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
        return ABFigure(engine, "instructions", None, None, GateVerdict.INCONCLUSIVE, why or "not counted", base, new)
    ratio = ratio if ratio is not None else new / base
    return ABFigure(engine, "instructions", ratio, None, passed_or_failed(ratio > 1 + threshold),
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
