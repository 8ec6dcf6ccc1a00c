"""Each engine's stream-spread prior from its twin (issue 79): before the decision, the engine's twin (twin.py: its
own policy and scheduler on its measured step times) is offered fresh streams of the run's workload at its own
knee's multiples, each judged as a decision turn is (the warm-up rule, then the turn's judged requests, their
offered token load read as the bench reads it), and the knee fit's own model (harness/analysis/kneefit.py) is
fitted to them: the spread s and load gain g it finds are on the fit's scale, for this workload, budget and engine.
The run's knee fit then takes them as an informative prior (stream_priors.SpreadPrior: centred there, a tail toward
wider, since the machine adds spread the twin has not and the twin's absolute rates are ~22 % off).

Why: with about ten points an engine, learning s (and the slope and the gain) from the run's points alone is
about 45 % of the headline interval's width (issue 79); the twin sees hundreds of streams in virtual time."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from harness.analysis.capacity import SLO
from harness.analysis.knee import Judged, KneeSearch
from harness.analysis.kneefit import fit
from harness.analysis.kneejoint import Correlation, twin_correlation
from harness.analysis.stream_priors import SpreadPrior
from harness.analysis.token_load import mean_tokens_asked
from harness.sim.simulator import pool_map
from harness.sim.twin import TwinEngine, stream_verdicts
from workloads.streams import key_of

KNEE_JUDGED = 100  # judged requests a rate of the twin's own knee search
KNEE_RATES = 6  # rates that search measures at most
STREAMS = 40  # fresh streams offered to each engine's twin (a 2-core machine simulates them in seconds)
MULTIPLES = (0.7, 0.85, 1.0, 1.15, 1.4)  # the rates they are offered at, as multiples of the twin's own knee
KEY = "spread-prior"  # the twin's streams' keys: KEY<i>, read by no point of the run
MAX_SENT = 2000  # requests one stream may send at most (an overloaded twin's warm-up grows)
FLOOR = 0.03  # the least centre: the machine adds some spread to any twin's (fresh-clone runs fitted 0.04 to 0.5)
SOURCE = "twin"


@dataclass(frozen=True)
class PriorJob:
    """One fresh stream offered to one engine's twin at one rate, judged as a decision turn."""

    twin: TwinEngine
    key: str
    rate_rps: float
    judged: int
    slo: SLO
    budget_bytes: int
    workload: str
    seed: int
    max_seq_len: int
    mean_tokens: float | None


def twin_point(job: PriorJob) -> Judged:
    """The stream from its first request at the job's rate: past the warm-up rule (one p90 E2E latency of its
    finished requests), its first `judged` verdicts in arrival order, and its offered token load over their window
    (the tokens the window's requests asked per second of it, over the rate's at the workload's mean: as
    analysis/token_load.py reads a measured point's)."""
    reqs, verdict = stream_verdicts(job.twin, job.workload, job.seed, job.max_seq_len, job.key, job.rate_rps,
                                    job.budget_bytes, job.slo, job.judged, MAX_SENT)
    mine = verdict.iloc[: job.judged]
    met = mine.to_numpy(dtype=float)
    load = 0.0
    if len(mine) > 1 and job.mean_tokens:
        first, last = int(mine.index.min()), int(mine.index.max())
        window_s = reqs[last].arrival_s - reqs[first].arrival_s
        asked = sum(len(r.prompt_ids) + r.max_tokens * r.n for r in reqs[first:last + 1])
        if window_s > 0 and asked > 0:
            load = math.log(asked / window_s / (job.rate_rps * job.mean_tokens))
    return Judged(job.rate_rps, job.key, met, np.arange(len(met)), log_load=load)


@dataclass(frozen=True)
class TwinPrior:
    """One engine's prior and what it rests on."""

    prior: SpreadPrior
    twin_knee_rps: float
    points: int
    spread_ci: tuple[float, float]
    gain_ci: tuple[float, float]

    def to_json(self) -> dict:
        return {**self.prior.to_json(), "twin_knee_rps": round(self.twin_knee_rps, 4), "points": self.points,
                "spread_ci": [round(x, 4) for x in self.spread_ci], "gain_ci": [round(x, 4) for x in self.gain_ci]}


def twin_knee(twin: TwinEngine, start_rps: float, slo: SLO, budget_bytes: int, workload: str, seed: int,
              max_seq_len: int, mean_tokens: float | None = None) -> float:
    """The rate the twin sustains at the run's budget: a knee search of its own from the measured knee (knee.py's
    KneeSearch, the bench's step, KNEE_JUDGED requests a rate on the stream of the rate's own key), so that its
    streams are offered around its own knee, not the machine's (the twin's rates are ~22 % off). Cheaper than
    twin.curve_point's (400 judged a rate, bisected to a grid step): a knee within the search's tolerance is close
    enough to centre the streams' rates on."""
    search = KneeSearch(max(start_rps, 0.05), slo.attainment, max_points=KNEE_RATES)
    while (rate := search.next_rate()) is not None:
        point = twin_point(PriorJob(twin, key_of(rate), rate, KNEE_JUDGED, slo, budget_bytes, workload, seed,
                                    max_seq_len, mean_tokens))
        search.record(rate, point.attainment)
    lo, hi = search.bracket()
    if lo is not None and hi is not None:
        return math.sqrt(lo * hi)
    return lo or hi or start_rps


@dataclass(frozen=True)
class TwinPriors:
    """The headline engines' priors and, where both have twins, their stream effects' residual correlation on the
    streams both twins judged (kneejoint.twin_correlation: stream i is offered to each twin at the same multiple
    of its own knee)."""

    engines: dict[str, TwinPrior]
    correlation: Correlation | None


def twin_priors(twins: dict[str, TwinEngine], knees_rps: dict[str, float], slo: SLO, budget_bytes: int,
                workload: str, seed: int, max_seq_len: int, judged: int, streams: int = STREAMS,
                n_jobs: int | None = None) -> TwinPriors:
    """Per engine with a twin and a measured knee: its twin's knee, `streams` fresh streams at its multiples, and
    the knee fit's s and g on them (posterior medians, the half-t prior on s: the twin's points decide); and for
    two such engines, the correlation of what the load leaves of their effects on one stream."""
    engines = [e for e in twins if knees_rps.get(e)]
    n = n_jobs or os.cpu_count() or 1
    mean = mean_tokens_asked(workload, seed, max_seq_len)
    knees = dict(zip(engines, pool_map(_knee, [(twins[e], knees_rps[e], slo, budget_bytes, workload, seed,
                                                 max_seq_len, mean) for e in engines], n), strict=True))
    jobs = [PriorJob(twins[e], f"{KEY}{i}", knees[e] * MULTIPLES[i % len(MULTIPLES)], judged, slo, budget_bytes,
                     workload, seed, max_seq_len, mean) for e in engines for i in range(streams)]
    results = iter(pool_map(twin_point, jobs, n))
    seen = {e: [p for p in (next(results) for _ in range(streams)) if len(p.met)] for e in engines}
    # one fit of every twin (each engine fitted alone on its own draws): the priors and the correlation read it
    kf = fit(seen, slo.attainment)
    out = {}
    for e in engines:
        if kf is None or e not in kf.estimates:
            continue
        s, g = kf.spreads[e], kf.gains[e]
        prior = SpreadPrior(max(float(np.median(s)), FLOOR), gain=float(np.median(g)))
        out[e] = TwinPrior(prior, knees[e], len(seen[e]), tuple(float(x) for x in np.quantile(s, [0.05, 0.95])),
                           tuple(float(x) for x in np.quantile(g, [0.05, 0.95])))
    pair = [e for e in engines if seen.get(e)]
    corr = twin_correlation(kf, seen, pair[0], pair[1], slo.attainment, seed) if len(pair) == 2 else None
    return TwinPriors(out, corr)


def _knee(args: tuple) -> float:
    return twin_knee(*args)


def prior_block(priors: TwinPriors, seconds: float, streams: int, judged: int) -> dict:
    """run.json's and summary.json's `spread_prior`: where it came from, per engine its values, and the residual
    correlation the joint fit of the two uses (None: no pair of twins, and the engines are fitted alone)."""
    return {"source": SOURCE, "streams": streams, "judged": judged, "multiples": list(MULTIPLES),
            "seconds": round(seconds, 1), "engines": {e: p.to_json() for e, p in priors.engines.items()},
            "correlation": priors.correlation.to_json() if priors.correlation else None}


def timed_priors(*args, **kwargs) -> tuple[TwinPriors, float]:
    """twin_priors and the seconds it took."""
    t0 = time.time()
    out = twin_priors(*args, **kwargs)
    return out, time.time() - t0
