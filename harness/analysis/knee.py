"""The knee search: for one engine, offered rates placed so that the rate it sustains at the SLO lies between
two measured points, a confidence interval for that rate, and the constraint that bound it there.

The vLLM paper reads each system's knee off a latency-against-rate sweep; a fixed grid shared by every
engine resolves it only for the engines whose knee happens to fall inside. Here each engine gets its own
rates: a bracket first (from its calibrated saturation rate, stepping by `step`, then its square, its cube...
until one rate meets the SLO and a higher one misses it), then bisection (geometric) until the bracket is
narrower than `tolerance`, at most `max_points` points. Noise can make a higher rate pass after a lower one
failed; the bracket is always the lowest failing rate and the highest passing rate below it, which is what
`capacity.sustained_rate` reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from harness.analysis.capacity import SLO, sustained_rate

CONFIDENCE = 0.9
REPLICATES = 2000


@dataclass
class KneeSearch:
    """The next rate to measure, given what was measured; None when the knee is resolved or the points spent."""

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
        return lo is not None and hi is not None and hi <= lo * (1 + self.tolerance)

    def next_rate(self) -> float | None:
        if not self.measured:
            return round(self.start_rps, 4)
        if len(self.measured) >= self.max_points or self.resolved():
            return None
        lo, hi = self.bracket()
        # each step out of a one-sided bracket is larger than the last (step, step^2, ...): a calibration far
        # off (a naive engine that crashed while being calibrated) is still bracketed within a few points
        steps = self.step ** len(self.measured)
        if hi is None:
            return round(lo * steps, 4)
        if lo is None:
            rate = hi / steps
            return round(rate, 4) if rate >= self.min_rps else None
        return round(math.sqrt(lo * hi), 4)


def bootstrap_rates(points: list[dict], slo: SLO, replicates: int = REPLICATES, seed: int = 0) -> np.ndarray:
    """The sustained rate re-read from resampled points: each point's requests drawn again with replacement
    (its attainment then Binomial(n, met/n) / n), the crossing interpolated again per replicate."""
    rng = np.random.default_rng(seed)
    n = np.array([max(int(p.get("requests") or 0), 0) for p in points])
    att = np.array([p["slo_attainment"] or 0.0 for p in points])
    draws = rng.binomial(n, att, size=(replicates, len(points))) / np.maximum(n, 1)
    draws[:, n == 0] = 0.0
    out = np.empty(replicates)
    for i, row in enumerate(draws):
        out[i] = sustained_rate([{"offered_rps": p["offered_rps"], "slo_attainment": a}
                                 for p, a in zip(points, row, strict=True)], slo)[0]
    return out


def bracket_of(points: list[dict], slo: SLO) -> tuple[float | None, float | None]:
    search = KneeSearch(0.0, slo.attainment)
    for p in points:
        search.record(p["offered_rps"], p["slo_attainment"])
    return search.bracket()


Z = {0.9: 1.645, 0.95: 1.96}


def inconclusive(point: dict, target: float, confidence: float = CONFIDENCE) -> bool:
    """Whether the point's attainment cannot be told from the target: its Wilson interval holds it."""
    n = int(point.get("requests") or 0)
    if n == 0:
        return True
    p, z = point["slo_attainment"] or 0.0, Z[confidence]
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n) <= target <= (centre + half) / (1 + z * z / n)


def sustained_interval(points: list[dict], slo: SLO, tolerance: float | None = None,
                       confidence: float = CONFIDENCE) -> list[float]:
    """[lo, hi]: the bootstrap's central `confidence` interval, widened to the bracket the search measured
    (the knee lies between the highest passing and the lowest failing rate; interpolation between them is
    an assumption the interval does not make). A bracket end whose attainment cannot be told from the
    target bounds nothing: the interval then reaches the next measured rate past it, or one search step
    (1 + tolerance) past it where none was measured (interpolation cannot reach beyond the measured rates,
    so the bootstrap alone would stop at that end)."""
    reps = bootstrap_rates(points, slo)
    lo, hi = np.quantile(reps, [(1 - confidence) / 2, (1 + confidence) / 2])
    b_lo, b_hi = bracket_of(points, slo)
    rates = sorted(p["offered_rps"] for p in points)
    step = 1 + (tolerance or 0.0)
    at = {p["offered_rps"]: p for p in points}
    if b_lo is not None:
        if inconclusive(at[b_lo], slo.attainment, confidence):
            b_lo = max((r for r in rates if r < b_lo), default=b_lo / step)
        lo = min(lo, b_lo)
    if b_hi is not None:
        if inconclusive(at[b_hi], slo.attainment, confidence):
            b_hi = min((r for r in rates if r > b_hi), default=b_hi * step)
        hi = max(hi, b_hi)
    return [round(float(lo), 4), round(float(hi), 4)]


def ratio_interval(a: list[float], b: list[float]) -> list[float] | None:
    """Bounds on a / b from the two intervals (every value of one against every value of the other)."""
    if b[0] <= 0:
        return None
    return [round(a[0] / b[1], 3), round(a[1] / b[0], 3)]


KV_USAGE_NEAR_FULL = 0.85  # mean KV usage at or above this: memory is what is left to give
WAITING_FOR_MEMORY = 0.2  # share of the knee's samples with requests held back by memory alone


def binding_constraint(knee: dict, failed: int, missed: int) -> tuple[str, str]:
    """memory, compute or failures at the knee point (the lowest rate that missed the SLO), and the evidence.
    `failed`: requests that errored or met a crash there (OOM rejections are memory's); `missed`: all that
    missed the SLO."""
    if knee["crashes"] or (missed and failed >= missed / 2):
        return "failures", f"crashes {knee['crashes']}, {failed} of {missed} SLO misses were failed requests"
    memory = []
    if knee["oom_total"]:
        memory.append(f"{knee['oom_total']} OOMs")
    if knee["preemptions"]:
        memory.append(f"{knee['preemptions']} preemptions")
    if (knee["kv_usage"] or 0) >= KV_USAGE_NEAR_FULL:
        memory.append(f"KV {100 * knee['kv_usage']:.0f} % allocated")
    if (knee["waiting_for_memory_share"] or 0) >= WAITING_FOR_MEMORY:
        memory.append(f"requests waited for memory in {100 * knee['waiting_for_memory_share']:.0f} % of samples")
    if memory:
        return "memory", ", ".join(memory)
    usage = "n/a" if knee["kv_usage"] is None else f"{100 * knee['kv_usage']:.0f} %"
    step = "n/a" if knee["step_s"] is None else f"{1000 * knee['step_s']:.0f} ms"
    return "compute", f"KV {usage} allocated with no OOM or preemption, step {step} with {knee['running']} running"


def knee_point(points: list[dict], slo: SLO) -> dict:
    """The lowest rate that missed the SLO (where the binding constraint shows), else the highest measured."""
    _, hi = bracket_of(points, slo)
    return next((p for p in points if p["offered_rps"] == hi), max(points, key=lambda p: p["offered_rps"]))


def knee_block(block: dict, slo: SLO, tolerance: float | None = None) -> dict:
    """A capacity block with the sustained rate's interval and the constraint that bound it at the knee."""
    points = block["points"]
    at = knee_point(points, slo)
    knee = {"kv_usage": at.get("kv_usage"), "waiting_for_memory_share": at.get("waiting_for_memory_share"),
            "running": at.get("mean_running"), "step_s": at.get("step_s"), "oom_total": at.get("oom_total", 0),
            "preemptions": at.get("preemptions", 0), "offered_rps": at["offered_rps"], "crashes": at.get("crashes", 0)}
    bound, evidence = binding_constraint(knee, at.get("failed", 0), at.get("missed", 0))
    return {**block, "sustained_rps_ci": sustained_interval(points, slo, tolerance), "bound": bound,
            "bound_evidence": evidence, "knee": knee}
