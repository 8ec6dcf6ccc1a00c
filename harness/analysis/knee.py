"""The knee search and what a knee rests on: for one engine, offered rates placed so that the rate it
sustains at the SLO lies between two measured points (the bracket); which points a knee may rest on; how many
judged requests weigh as one independent one; the constraint that bound an engine at its knee. The knee itself,
with its interval, is fitted from every point (harness/analysis/kneefit.py).

Each engine gets its own rates, on the grid of workloads/streams.py (so that two engines offered one rate judge
the same requests): a bracket first (from its calibrated saturation rate, stepping by `step`, then its square,
its cube... until one rate meets the SLO and a higher one misses it), then, where a tolerance is asked,
bisection (geometric, on the grid) until the bracket is narrower than it, at most `max_points` points. Noise can
make a higher rate pass after a lower one failed; the bracket is always the lowest failing rate and the highest
passing rate below it.

A point's judged requests are not independent draws: requests that arrive in one episode of queueing (a burst
of long prompts fills the memory, the queue behind it misses its TTFT) share a fate. Each engine's design effect
(`design_effect`) is the long-run variance of its met/missed series over the binomial one: 1 + 2 x the sum of its
autocorrelations (every point's series centred on its own attainment, in arrival order) up to the lag after
which `QUIET_LAGS` in a row are insignificant (under 2 sqrt(log10 n / n), the Politis-White rule), at least 1; a
point of n judged requests then weighs as n / d independent ones. A point cannot show a correlation longer than
itself: on a bursty workload the design effect is a lower bound.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from harness.analysis.capacity import SLO, sustained_rate
from harness.analysis.steady import wilson
from harness.analysis.summary_records import KneePoint
from workloads.streams import STEPS_PER_OCTAVE, grid_index, grid_rate, replication_of

CONFIDENCE = 0.9
QUIET_LAGS = 5  # autocorrelations in a row under the significance bound that end the sum (Politis-White)
MAX_LAG = 200


@dataclass
class KneeSearch:
    """The next rate to measure, given what was measured; None when the knee is resolved or the points spent.
    Rates are grid rates (workloads/streams.py)."""

    start_rps: float
    target: float  # the SLO attainment a rate must reach to count as sustained
    tolerance: float = 0.15  # stop once the failing rate is within (1 + tolerance) x the passing one
    step: float = 1.6  # the bracketing factor
    max_points: int = 8
    min_rps: float = 1e-3  # below this a rate has no arrivals worth a point: the search gives up
    measured: list[tuple[float, float]] = field(default_factory=list)  # (offered rps, SLO attainment)

    def record(self, rate: float, attainment: float | None) -> None:
        self.measured.append((rate, attainment or 0.0))  # no judged request: nothing met the SLO

    def bracket(self) -> tuple[float | None, float | None]:
        fails = [r for r, a in self.measured if a < self.target]
        hi = min(fails) if fails else None
        passes = [r for r, a in self.measured if a >= self.target and (hi is None or r < hi)]
        return (max(passes) if passes else None), hi

    def resolved(self) -> bool:
        lo, hi = self.bracket()
        if lo is None or hi is None:
            return False
        return hi <= lo * (1 + self.tolerance) + 1e-9 or grid_index(hi) - grid_index(lo) <= 1

    def next_rate(self) -> float | None:
        if not self.measured:
            return grid_rate(grid_index(self.start_rps))
        if len(self.measured) >= self.max_points or self.resolved():
            return None
        lo, hi = self.bracket()
        # each step out of a one-sided bracket is larger than the last (step, step^2, ...): a calibration far
        # off (a naive engine that crashed while being calibrated) is still bracketed within a few points
        steps = max(1, round(STEPS_PER_OCTAVE * math.log2(self.step) * len(self.measured)))
        if hi is None:
            return grid_rate(grid_index(lo) + steps)
        if lo is None:
            rate = grid_rate(grid_index(hi) - steps)
            return rate if rate >= self.min_rps else None
        return grid_rate((grid_index(lo) + grid_index(hi)) // 2)


def bracket_of(points: list[dict], slo: SLO) -> tuple[float | None, float | None]:
    search = KneeSearch(0.0, slo.attainment)
    for p in points:
        search.record(p["offered_rps"], p["slo_attainment"])
    return search.bracket()


@dataclass(frozen=True)
class Judged:
    """One point's judged requests, as the intervals resample them: each one's verdict (1 met the SLO, 0
    missed it) and its index in the point's stream, in arrival order; and what a knee may make of it
    (harness/analysis/steady.knee_use): `steady` (its halves' attainments on one side of the target, or their
    intervals overlapping), `over_knee` (attainment collapsed while the queue grew: a miss), or `unsteady` (halves
    on two sides of the target with disjoint intervals: no knee rests on it)."""

    offered_rps: float
    key: str  # the stream (workloads/streams.key_of): points of two engines with one key judged the same requests
    met: np.ndarray
    index: np.ndarray
    use: str = "steady"
    # the stream's offered token load over the judged window, as a log over the rate's at the workload's mean
    # (analysis/token_load.py): the same for every engine offered that stream; kneefit.py takes it out of its effect
    log_load: float = 0.0

    @property
    def attainment(self) -> float:
        return float(self.met.mean()) if len(self.met) else 0.0

    @property
    def replication(self) -> int:
        """The independent realization of its rate it judged (0: the search's; workloads/streams.key_of)."""
        return replication_of(self.key)


def knee_points(points: list[Judged]) -> list[Judged]:
    """The points a knee rests on: the steady ones as they are, one over its knee by its second half (the
    state its queue was heading to), none that is unsteady otherwise. An engine none of whose points settled
    (the time ran out first) has only those: its knee rests on them, and says so (`rests_on_unsteady`)."""
    out = []
    for p in points:
        if p.use == "over_knee":
            half = len(p.met) // 2
            out.append(Judged(p.offered_rps, p.key, p.met[half:], p.index[half:], p.use, p.log_load))
        elif p.use != "unsteady":
            out.append(p)
    return out if out else list(points)


def pooled(points: list[Judged]) -> list[Judged]:
    """One point per offered rate, its replications' verdicts together (ascending rates): what a rate's pass or
    miss is judged on once it was measured more than once."""
    out = []
    for rate in sorted({p.offered_rps for p in points}):
        mine = [p for p in points if p.offered_rps == rate]
        use = "over_knee" if all(p.use == "over_knee" for p in mine) else mine[0].use
        out.append(mine[0] if len(mine) == 1 else Judged(rate, mine[0].key, np.concatenate([p.met for p in mine]),
                                                          np.concatenate([p.index for p in mine]), use,
                                                          float(np.mean([p.log_load for p in mine]))))
    return out


def rests_on_unsteady(points: list[Judged]) -> bool:
    return bool(points) and all(p.use == "unsteady" for p in points)


def design_effect(points: list[Judged]) -> float:
    """How many judged requests weigh as one independent one, for one engine: 1 + 2 x the autocorrelations of
    its centred met/missed series summed up to where they stop being significant (at least 1)."""
    series = [p.met - p.met.mean() for p in points if len(p.met) > 1]
    n = sum(len(x) for x in series)
    var = sum(float((x * x).sum()) for x in series) / max(n, 1)
    if n < 20 or var <= 0:
        return 1.0
    bound = 2 * math.sqrt(math.log10(n) / n)
    rho = []
    for k in range(1, min(MAX_LAG, n // 4)):
        pairs = [(x[:-k] * x[k:]).sum() for x in series if len(x) > k]
        count = sum(len(x) - k for x in series if len(x) > k)
        if count < 10:
            break
        rho.append(float(sum(pairs)) / count / var)
    quiet = next((k for k in range(len(rho)) if all(abs(r) < bound for r in rho[k:k + QUIET_LAGS])), len(rho))
    return max(1.0, 1.0 + 2.0 * sum(rho[:quiet]))


def named_rng(seed: int, name: str) -> np.random.Generator:
    """A generator of its own for one stream or engine (its draws the same whatever else is drawn beside it)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def central(values: np.ndarray, confidence: float = CONFIDENCE) -> list[float]:
    lo, hi = np.quantile(values, [(1 - confidence) / 2, (1 + confidence) / 2])
    return [round(float(lo), 4), round(float(hi), 4)]


def ratio_interval(a: list[float], b: list[float]) -> list[float] | None:
    """Bounds on a / b from two intervals at their ends: for figures that have no joint replicates (the
    twin's); the measured ratios use `ratio_replicates`."""
    if b[0] <= 0:
        return None
    return [round(a[0] / b[1], 3), round(a[1] / b[0], 3)]


KV_USAGE_NEAR_FULL = 0.85  # mean KV usage at or above this: memory is what is left to give
WAITING_FOR_MEMORY = 0.2  # share of the knee's samples with requests held back by memory alone


def binding_constraint(knee: KneePoint, failed: int, missed: int) -> tuple[str, str]:
    """memory, compute or failures at the knee point (the lowest rate that missed the SLO), and the evidence.
    `failed`: requests that errored or met a crash there (OOM rejections are memory's); `missed`: all that
    missed the SLO."""
    if knee.crashes or (missed and failed >= missed / 2):
        return "failures", f"crashes {knee.crashes}, {failed} of {missed} SLO misses were failed requests"
    memory = []
    if knee.oom_total:
        memory.append(f"{knee.oom_total} OOMs")
    if knee.preemptions:
        memory.append(f"{knee.preemptions} preemptions")
    if (knee.kv_usage or 0) >= KV_USAGE_NEAR_FULL:
        memory.append(f"KV {100 * knee.kv_usage:.0f} % allocated")
    if (knee.waiting_for_memory_share or 0) >= WAITING_FOR_MEMORY:
        memory.append(f"requests waited for memory in {100 * knee.waiting_for_memory_share:.0f} % of samples")
    if memory:
        return "memory", ", ".join(memory)
    usage = "n/a" if knee.kv_usage is None else f"{100 * knee.kv_usage:.0f} %"
    step = "n/a" if knee.step_s is None else f"{1000 * knee.step_s:.0f} ms"
    running = "n/a" if knee.running is None else f"{knee.running:.2g}"
    return "compute", f"KV {usage} allocated with no OOM or preemption, step {step} with {running} running on average"


def knee_point(points: list[dict], slo: SLO) -> dict:
    """The lowest rate that missed the SLO (where the binding constraint shows), else the highest measured;
    among the points a knee rests on (one over its knee by its second half), where there are any. Of the streams
    judged at that rate (paired decision turns put several there), the one that met least: a stream that met the
    SLO shows no constraint."""
    kept = [p for p in points if p.get("knee_use", "steady") != "unsteady"] or points
    judged = [p["halves"][1] if p.get("knee_use") == "over_knee" else p["slo_attainment"] for p in kept]
    _, hi = bracket_of([{**p, "slo_attainment": a} for p, a in zip(kept, judged, strict=True)], slo)
    at = [(a or 0.0, i) for i, (p, a) in enumerate(zip(kept, judged, strict=True)) if p["offered_rps"] == hi]
    return kept[min(at)[1]] if at else max(points, key=lambda p: p["offered_rps"])


def sustained(points: list[dict], slo: SLO, estimate) -> tuple[float, str]:
    """A measured engine's sustained rate and where it lies against the rates measured, the one definition: the
    joint fit's knee (a kneefit.KneeEstimate); only where no point can carry a knee (estimate None) the rate
    interpolated between the rates measured (capacity.sustained_rate, a simulation's sweep's own rule)."""
    if estimate is None:
        return sustained_rate(points, slo)
    return estimate.rps, where_of(points, slo, estimate.bracketed)


def bound_of(points: list[Judged], target: float) -> dict:
    """An unbracketed engine's sustained rate as the bound it is (the rates measured, their replications pooled):
    `below` the lowest rate where no rate's attainment reached the target, with the highest attainment reached and
    where; else `beyond` the highest rate that met it."""
    rows = pooled(knee_points(points))
    met = [p for p in rows if len(p.met) and p.attainment >= target]
    if met:
        top = max(met, key=lambda p: p.offered_rps)
        return {"where": "beyond", "rps": top.offered_rps, "attainment": round(top.attainment, 4)}
    best = max(rows, key=lambda p: (p.attainment if len(p.met) else 0.0, -p.offered_rps))
    return {"where": "below", "rps": min(p.offered_rps for p in rows),
            "highest_attainment": round(best.attainment if len(best.met) else 0.0, 4),
            "highest_at_rps": best.offered_rps}


# `block`: the capacity block's figures summarize computed (its points and what they rest on)
def knee_block(block: dict, slo: SLO, estimate) -> dict:
    """A capacity block: its sustained rate (`sustained`, set once here), the points' figures, its knee (a
    kneefit.KneeEstimate, or None where no point can carry one: no interval) and the constraint that bound it
    at the knee point."""
    points = block["points"]
    rate, where = sustained(points, slo, estimate)
    at = knee_point(points, slo)
    knee = KneePoint(kv_usage=at.get("kv_usage"), waiting_for_memory_share=at.get("waiting_for_memory_share"),
                     running=at.get("mean_running"), step_s=at.get("step_s"), oom_total=at.get("oom_total", 0),
                     preemptions=at.get("preemptions", 0), offered_rps=at["offered_rps"],
                     crashes=at.get("crashes", 0))
    bound, evidence = binding_constraint(knee, at.get("failed", 0), at.get("missed", 0))
    figures = {k: v for k, v in block.items() if k not in ("sustained_rps", "sustained_where")}
    return {"sustained_rps": rate, "sustained_where": where, **figures,
            "sustained_rps_ci": None if estimate is None else list(estimate.ci), "bound": bound,
            "bound_evidence": evidence, "knee_point": knee.written(),
            "knee": None if estimate is None else estimate.to_json()}


# rates at most this share of the knee are light load: there a curve as steep as paged's (b = 25 per unit of log
# rate, benchmarks/knee_study.py) misses about 1 request in 500 by load (logit 2.2 + 25 x log(1 / 0.85) = 6.3)
LIGHT_LOAD = 0.85


def load_independent_misses(points: list[dict], knee_rps: float, design: float) -> dict | None:
    """The misses that lighter load does not remove: the share of the judged requests missed at rates at most
    LIGHT_LOAD x the knee (the points a knee rests on: unsteady ones out), pooled, with its Wilson 90 % interval at
    the effective size (`design`: the engine's design effect), and beside it the failed requests (errors, crashes)
    and the OOMs (fragmentation's among them) the engine recorded at those points: static-oracle's misses there
    are fragmentation OOMs, which come near every rate it sustains. An engine whose share is near the SLO's
    allowance (1 - target) has an attainment curve that barely falls at its knee: the knee is where that floor
    and the load together cross the target, and barely identified. None where no rate that low was measured."""
    light = [p for p in points if p.get("knee_use") != "unsteady" and p["offered_rps"] <= LIGHT_LOAD * knee_rps
             and p.get("judged")]
    if not light or knee_rps <= 0:
        return None
    judged = int(sum(p["judged"] for p in light))
    missed = int(sum(p.get("missed", round(p["judged"] * (1 - (p["slo_attainment"] or 0.0)))) for p in light))
    lo, hi = wilson(missed / design, judged / design)
    return {"share": round(missed / judged, 4), "share_ci": [round(lo, 4), round(hi, 4)], "judged": judged,
            "missed": missed, "failed": int(sum(p.get("failed", 0) for p in light)),
            "oom_total": int(sum(p.get("oom_total", 0) for p in light)),
            "oom_fragmentation": int(sum(p.get("oom_fragmentation", 0) for p in light)),
            "at_most_rps": round(LIGHT_LOAD * knee_rps, 4), "rates": sorted({p["offered_rps"] for p in light})}


def where_of(points: list[dict], slo: SLO, bracketed: bool) -> str:
    """Where a knee lies against the rates measured: 'within' (bracketed), 'beyond' the last (every rate met
    the SLO: a lower bound) or 'below' the first (none did)."""
    if bracketed:
        return "within"
    return "beyond" if any((p["slo_attainment"] or 0.0) >= slo.attainment for p in points) else "below"
