"""The knee search: for one engine, offered rates placed so that the rate it sustains at the SLO lies between
two measured points; intervals for that rate and for the ratio of two engines' rates; the constraint that
bound an engine there.

The vLLM paper reads each system's knee off a latency-against-rate sweep; a fixed grid shared by every
engine resolves it only for the engines whose knee happens to fall inside. Here each engine gets its own
rates, on the grid of workloads/streams.py (so that two engines offered one rate judge the same requests):
a bracket first (from its calibrated saturation rate, stepping by `step`, then its square, its cube... until
one rate meets the SLO and a higher one misses it), then bisection (geometric, on the grid) until the bracket
is narrower than `tolerance`, at most `max_points` points. Noise can make a higher rate pass after a lower one
failed; the bracket is always the lowest failing rate and the highest passing rate below it, which is what
`capacity.sustained_rate` reads.

Intervals (`Judged`, `replicate_knees`): a point's judged requests are not independent draws: requests that
arrive in one episode of queueing (a burst of long prompts fills the memory, the queue behind it misses its
TTFT) share a fate. Each engine's design effect (`design_effect`) is the long-run variance of its met/missed
series over the binomial one: 1 + 2 x the sum of its autocorrelations (every point's series centred on its
own attainment, in arrival order) up to the lag after which `QUIET_LAGS` in a row are insignificant (under
2 sqrt(log10 n / n), the Politis-White rule), at least 1; a point of n judged requests then weighs as n / d
independent ones. Each replicate draws every point's attainment from its Jeffreys posterior at that size,
Beta(met / d + 1/2, missed / d + 1/2); points of two engines that judged the same stream (the same offered
rate, the same requests) draw with one uniform (paired, by quantile). A point cannot show a correlation
longer than itself: on a bursty workload the design effect is a lower bound.

Replications (`replicate_knees`): the variation between two runs of one commit is mostly not inside one
stream. Whether an engine near its knee tips into preemption depends on the stream's bursts and on what the
machine did that minute, and a binomial draw inside one realization sees neither. So the bracket ends of the
headline's engines are measured again on independent realizations of their rates (workloads/streams.key_of's
replications), in rounds that visit the two engines alternately, and each replicate also resamples the rounds
(a hierarchical bootstrap, Kalibera and Jones 2013: resample at each level the variance arises at): the same
rounds for every engine (one round's points of both engines were measured minutes apart, under one machine),
each rate's attainment the effective-size-weighted mean of its points in the rounds drawn (a rate none of whose
rounds was drawn keeps all of its points). The share of the ratio interval's log-width that resampling the
rounds adds is the run-to-run share (`run_to_run_share`).

Each replicate's attainments are made non-increasing in the rate (pool adjacent violators, weighted by judged
requests: attainment cannot rise with the load, so a dip under a higher rate is noise), then every engine's
bracket re-read (its highest rate meeting the target below the lowest that misses it) and the knee drawn
log-uniformly inside it: attainment falls with the rate, so the knee lies in the bracket, and nothing
measured says where (interpolation, which gives the point estimate, assumes a straight line between two
points far apart). An engine's interval is the central 90 % of its replicates, a ratio's the central 90 % of
the replicates' ratios (the joint distribution, not two intervals combined at their ends). A replicate in
which every rate met the SLO puts the knee within one search step (x step) past the highest rate measured.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
from scipy.special import betaincinv  # the Beta quantile (stats.beta.ppf's, without scipy.stats' 2 s import)

from harness.analysis.capacity import SLO
from workloads.streams import STEPS_PER_OCTAVE, grid_index, grid_rate, replication_of

CONFIDENCE = 0.9
REPLICATES = 2000
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
            out.append(Judged(p.offered_rps, p.key, p.met[half:], p.index[half:], p.use))
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
                                                          np.concatenate([p.index for p in mine]), use))
    return out


def replications(points: list[Judged], rates: list[float]) -> int:
    """How many independent realizations each of `rates` was judged on, at the least (0 without rates)."""
    counts = [len({p.replication for p in points if p.offered_rps == r}) for r in rates]
    return min(counts) if counts else 0


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


def replicate_attainments(points: dict[str, list[Judged]], replicates: int = REPLICATES,
                          seed: int = 0) -> dict[str, np.ndarray]:
    """Per engine, a (replicates x points) array of attainments drawn from each point's posterior at its
    effective size; one uniform per stream, shared by every engine that judged it."""
    keys = sorted({p.key for pts in points.values() for p in pts})
    # one generator per stream, seeded by its name: a stream's draws do not depend on which others the run holds
    uniforms = {key: named_rng(seed, key).random(replicates) for key in keys}
    out = {}
    for engine, pts in points.items():
        d = design_effect(pts)
        cols = [betaincinv(p.met.sum() / d + 0.5, (len(p.met) - p.met.sum()) / d + 0.5, uniforms[p.key])
                if len(p.met) else np.zeros(replicates) for p in pts]
        out[engine] = np.column_stack(cols) if cols else np.zeros((replicates, 0))
    return out


def named_rng(seed: int, name: str) -> np.random.Generator:
    """A generator of its own for one stream or engine (its draws the same whatever else is drawn beside it)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of one row (pool adjacent violators): attainment cannot
    rise with the offered rate, so a lower rate that dips under a higher one is noise, pooled with it."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


def monotone(att: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Every row of `att` (rates ascending) made non-increasing; rows already so are left as they are."""
    out = att.copy()
    rising = (np.diff(att, axis=1) > 0).any(axis=1) if att.shape[1] > 1 else np.zeros(len(att), dtype=bool)
    for i in np.flatnonzero(rising):
        out[i] = decreasing(att[i], weights)
    return out


def crossings(rates: np.ndarray, att: np.ndarray, target: float, step: float,
              rng: np.random.Generator) -> np.ndarray:
    """The knee in every row of `att` (rates ascending): between the row's highest rate meeting the target
    below its first failing one and that failing rate, drawn log-uniformly (monotone attainment puts the knee
    in that bracket, and nothing measured says where inside it). A row in which every rate met the target
    puts it within one search step (x step) past the highest; one in which none did, between the lowest
    rate and where a line from an ideal server (every request met at rate 0) would cross the target."""
    fails = att < target
    first = np.where(fails.any(axis=1), fails.argmax(axis=1), -1)
    below = rates[0] * (1 - target) / np.maximum(1 - att[:, 0], 1e-9)
    lo = np.where(first > 0, rates[np.maximum(first - 1, 0)], np.where(first == 0, below, rates[-1]))
    hi = np.where(first >= 0, rates[np.maximum(first, 0)], rates[-1] * step)
    return lo * (hi / lo) ** rng.random(len(att))


def round_weights(points: dict[str, list[Judged]], replicates: int, rng: np.random.Generator,
                  resample: bool = True) -> dict[int, np.ndarray]:
    """Per round (replication), how many times each replicate draws it: one multinomial draw of the rounds per
    replicate, shared by every engine (the rounds' pairing); all ones when the rounds are not resampled."""
    rounds = sorted({p.replication for pts in points.values() for p in pts})
    if not resample or len(rounds) < 2:
        return {r: np.ones(replicates) for r in rounds}
    counts = rng.multinomial(len(rounds), [1 / len(rounds)] * len(rounds), size=replicates)
    return {r: counts[:, i].astype(float) for i, r in enumerate(rounds)}


def pooled_draws(pts: list[Judged], att: np.ndarray, weights: dict[int, np.ndarray], d: float) -> tuple:
    """(rates ascending, replicates x rates attainments, judged per rate): each rate's attainment the mean of its
    points' draws weighted by effective size and by how often the replicate drew each point's round; a rate none
    of whose rounds was drawn keeps all its points."""
    rates = sorted({p.offered_rps for p in pts})
    group = np.array([[p.offered_rps == r for r in rates] for p in pts], dtype=float)  # points x rates
    size = np.array([max(len(p.met), 1) / d for p in pts])
    w = np.column_stack([weights[p.replication] for p in pts]) * size  # replicates x points
    none = (w @ group) == 0  # replicates x rates: no round of this rate drawn
    w = np.where(none @ group.T > 0, size, w)
    return (np.array(rates), (w * att) @ group / (w @ group),
            np.array([sum(len(p.met) for p in pts if p.offered_rps == r) for r in rates], dtype=float))


def replicate_knees(points: dict[str, list[Judged]], slo: SLO, step: float, replicates: int = REPLICATES,
                    seed: int = 0, resample_rounds: bool = True) -> dict[str, np.ndarray]:
    """Per engine, its knee in each joint replicate, on the points a knee rests on (`knee_points`; a point over
    its knee misses the target in every replicate), the rounds resampled (`round_weights`) unless told not to;
    engines without such points are left out."""
    points = {e: knee_points(p) for e, p in points.items()}
    points = {e: p for e, p in points.items() if p}
    reps = replicate_attainments(points, replicates, seed)
    weights = round_weights(points, replicates, np.random.default_rng(seed + 2), resample_rounds)
    out = {}
    for engine, att in reps.items():
        pts = points[engine]
        over = np.array([p.use == "over_knee" for p in pts])
        att = np.where(over, np.minimum(att, slo.attainment - 1e-9), att)
        rates, att, judged = pooled_draws(pts, att, weights, design_effect(pts))
        out[engine] = crossings(rates, monotone(att, judged), slo.attainment, step, named_rng(seed + 1, engine))
    return out


def central(values: np.ndarray, confidence: float = CONFIDENCE) -> list[float]:
    lo, hi = np.quantile(values, [(1 - confidence) / 2, (1 + confidence) / 2])
    return [round(float(lo), 4), round(float(hi), 4)]


def ratio_replicates(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a / np.maximum(b, 1e-12)


def ratio_interval(a: list[float], b: list[float]) -> list[float] | None:
    """Bounds on a / b from two intervals at their ends: for figures that have no joint replicates (the
    twin's); the measured ratios use `ratio_replicates`."""
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
    running = "n/a" if knee["running"] is None else f"{knee['running']:.2g}"
    return "compute", f"KV {usage} allocated with no OOM or preemption, step {step} with {running} running on average"


def knee_point(points: list[dict], slo: SLO) -> dict:
    """The lowest rate that missed the SLO (where the binding constraint shows), else the highest measured;
    among the points a knee rests on (one over its knee by its second half), where there are any."""
    usable = [{**p, "slo_attainment": p["halves"][1]} if p.get("knee_use") == "over_knee" else p
              for p in points if p.get("knee_use", "steady") != "unsteady"]
    _, hi = bracket_of(usable or points, slo)
    return next((p for p in points if p["offered_rps"] == hi), max(points, key=lambda p: p["offered_rps"]))


def knee_block(block: dict, slo: SLO, interval: list[float] | None) -> dict:
    """A capacity block with the sustained rate's interval (from `replicate_knees`) and the constraint that
    bound it at the knee."""
    points = block["points"]
    at = knee_point(points, slo)
    knee = {"kv_usage": at.get("kv_usage"), "waiting_for_memory_share": at.get("waiting_for_memory_share"),
            "running": at.get("mean_running"), "step_s": at.get("step_s"), "oom_total": at.get("oom_total", 0),
            "preemptions": at.get("preemptions", 0), "offered_rps": at["offered_rps"], "crashes": at.get("crashes", 0)}
    bound, evidence = binding_constraint(knee, at.get("failed", 0), at.get("missed", 0))
    return {**block, "sustained_rps_ci": interval, "bound": bound,
            "bound_evidence": evidence, "knee": knee}
