"""Replications (issue 48): independent realizations of a rate's stream, pooled per rate, and intervals that
resample them so that two runs of one commit agree within their intervals."""

from __future__ import annotations

import numpy as np
import pytest

from harness.analysis.capacity import SLO
from harness.analysis.headline import headline
from harness.analysis.knee import Judged, central, pooled, replicate_knees, replications, round_weights
from workloads.spec import load_spec
from workloads.streams import Streams, key_of, replication_of


def point(rate: float, met: list[int] | np.ndarray, replication: int = 0) -> Judged:
    met = np.asarray(met, dtype=float)
    return Judged(rate, key_of(rate, replication), met, np.arange(len(met)))


def test_a_replication_is_a_stream_of_its_own_that_names_its_replication():
    streams = Streams(load_spec("mixed-churn"), 0)
    first, again = key_of(2.0), key_of(2.0, 1)
    assert first == "g16" and again == "g16r1" and replication_of(again) == 1 and replication_of(first) == 0
    ids = {streams.item(first, i).request_id for i in range(20)}
    assert not ids & {streams.item(again, i).request_id for i in range(20)}  # no request judged twice
    prompts = [[streams.item(key, i).prompt_ids for i in range(5)] for key in (first, again)]
    assert prompts[0] != prompts[1]


def test_a_rates_replications_are_pooled_into_one_verdict_and_counted():
    pts = [point(2.0, [1, 1, 0, 0]), point(2.0, [1, 1, 1, 1], 1), point(1.5, [1, 1, 1, 1]),
           point(1.5, [1, 1, 1, 1], 1), point(1.5, [1, 1, 1, 1], 2)]
    rows = pooled(pts)
    assert [p.offered_rps for p in rows] == [1.5, 2.0]
    assert rows[1].attainment == pytest.approx(6 / 8) and len(rows[0].met) == 12
    assert replications(pts, [1.5, 2.0]) == 2 and replications(pts, [1.5]) == 3 and replications(pts, []) == 0


def test_every_engine_draws_the_same_rounds_in_a_replicate():
    pts = {"a": [point(1.0, [1] * 5, r) for r in range(3)], "b": [point(2.0, [1] * 5, r) for r in range(3)]}
    w = round_weights(pts, 500, np.random.default_rng(0))
    assert sorted(w) == [0, 1, 2] and np.all(sum(w.values()) == 3)  # three rounds drawn in each replicate
    assert any(np.any(w[r] == 0) for r in w)  # some replicates leave a round out
    kept = round_weights(pts, 10, np.random.default_rng(0), resample=False)
    assert all(np.all(v == 1) for v in kept.values())


def run_of(rng, engines: dict[str, float], sd: float, rounds: int = 3, n: int = 60) -> dict[str, list[Judged]]:
    """One simulated bench run: each round a realization whose knee is the engine's times exp(N(0, sd)) (what a
    stream's bursts and the machine's minute do), its attainment 1 - 0.1 (rate / knee)^6 (0.9 at the knee); the
    search (round 0) measures four rates, later rounds the two bracket ends again, n judged requests a point."""
    out = {}
    for engine, knee in engines.items():
        lo, hi = knee * 0.93, knee * 1.07
        pts = []
        for r in range(rounds):
            k = knee * np.exp(rng.normal(0, sd))
            for rate in ([knee * 0.75, lo, hi, knee * 1.3] if r == 0 else [lo, hi]):
                att = min(1.0, max(0.0, 1 - 0.1 * (rate / k) ** 6))
                pts.append(point(round(rate, 6), (rng.random(n) < att).astype(int), r))
        out[engine] = pts
    return out


def test_intervals_that_resample_the_rounds_hold_across_two_runs_where_one_realizations_do_not():
    """The first test of any figure: two runs of one commit (A/A). With knees that move between realizations by
    15 % (sd of the log), intervals that resample the rounds overlap between two independent runs in at least
    90 % of 30 pairs (a 90 % interval of one quantity does so far more often than that); intervals of one
    realization's sampling alone overlap less often. The share of the ratio's width that resampling adds is larger
    where realizations differ than where they do not (sd 0: binomial sampling alone)."""
    slo, rng = SLO(), np.random.default_rng(7)
    overlap = {True: 0, False: 0}
    shares: dict[float, list[float]] = {0.15: [], 0.0: []}
    for _ in range(30):
        a, b = (run_of(rng, {"paged": 3.0, "static-oracle": 2.0}, 0.15) for _ in range(2))
        for resample in (True, False):
            ci = [central(replicate_knees(r, slo, 1.15, 1000, resample_rounds=resample)["paged"]) for r in (a, b)]
            overlap[resample] += ci[0][0] <= ci[1][1] and ci[1][0] <= ci[0][1]
        shares[0.15].append(headline(a, slo, 1.15, 1.5, replicates=1000).run_to_run_share)
        calm = run_of(rng, {"paged": 3.0, "static-oracle": 2.0}, 0.0)
        shares[0.0].append(headline(calm, slo, 1.15, 1.5, replicates=1000).run_to_run_share)
    assert overlap[True] >= 27 and overlap[True] > overlap[False], overlap
    assert np.median(shares[0.15]) > np.median(shares[0.0]), {k: np.median(v) for k, v in shares.items()}
