"""The paired ratio (harness/analysis/kneepaired.py): the long-run crossing recovered, the shared stream effect
cancelling in the interval, a point every request of which met or missed still informing."""

import math

import numpy as np

from harness.analysis.knee import Judged
from harness.analysis.kneepaired import curve_fit, paired_ratio

A, B = "paged", "static-oracle"
LOGIT = math.log(9)


def synth(rng, streams, shared_sd, knees=(3.0, 2.0), slopes=(25.0, 8.0), n=50, paired=True,
          multiples=(0.8, 1.25, 0.9, 1.1)) -> dict[str, list[Judged]]:
    """Each stream judged once by each engine at a multiple of its own knee; the stream shifts both engines' log
    load by one shared normal draw of sd `shared_sd` (paired: one key for both; else a key each)."""
    pts = {A: [], B: []}
    for k in range(streams):
        u = rng.normal(0.0, shared_sd)
        for i, e in enumerate(pts):
            r = knees[i] * multiples[k % len(multiples)]
            p = 1 / (1 + math.exp(-(LOGIT - slopes[i] * (math.log(r) + u - math.log(knees[i])))))
            key = f"p{k}" if paired else f"{e}{k}"
            pts[e].append(Judged(r, key, (rng.random(n) < p).astype(float), np.arange(n)))
    return pts


def test_without_a_stream_effect_the_crossing_is_the_curves():
    pts = synth(np.random.default_rng(1), 40, 0.0, n=200)
    out = paired_ratio(pts, A, B, 0.9)
    assert abs(out.rates_rps[A] / 3.0 - 1) < 0.05 and abs(out.rates_rps[B] / 2.0 - 1) < 0.05
    assert out.ci[0] <= 1.5 <= out.ci[1] and out.ci[0] < out.ratio < out.ci[1]
    assert out.streams == 40 and out.paired_streams == 40


def test_the_pairs_cancel_what_both_engines_share():
    """One data set, its keys shared or not: the estimate is the same (the keys do not enter the curves), and the
    interval read off the pairs is much narrower, as the shared shift moves both engines' crossings alike."""
    pts = synth(np.random.default_rng(2), 16, 0.15, slopes=(25.0, 25.0))
    apart = {e: [Judged(p.offered_rps, f"{e}{p.key}", p.met, p.index) for p in ps] for e, ps in pts.items()}
    paired, alone = paired_ratio(pts, A, B, 0.9), paired_ratio(apart, A, B, 0.9)
    assert math.isclose(paired.ratio, alone.ratio)
    assert paired.streams == 16 and alone.streams == 32 and alone.paired_streams == 0
    assert math.log(paired.ci[1] / paired.ci[0]) < 0.6 * math.log(alone.ci[1] / alone.ci[0])


def test_a_point_all_met_or_all_missed_still_informs():
    """Every request met at 2 req/s and none at 3: the crossing lies between them, the slope finite (Firth's
    penalty); a third point at 100 % at 2.6 moves it up, past 2.6, and one at 0 % at 2.2 down, under 2.2."""
    met, missed = np.ones(40), np.zeros(40)
    two = [Judged(2.0, "a", met, np.arange(40)), Judged(3.0, "b", missed, np.arange(40))]
    log_r, b = curve_fit(two, 0.9)
    assert 2.0 < math.exp(log_r) < 3.0 and 0 < b < 200
    up, _ = curve_fit([*two, Judged(2.6, "c", met, np.arange(40))], 0.9)
    down, _ = curve_fit([*two, Judged(2.2, "c", missed, np.arange(40))], 0.9)
    assert 2.6 < math.exp(up) < 3.0 and 2.0 < math.exp(down) < 2.2


def test_nothing_to_resample_gives_no_ratio():
    pts = synth(np.random.default_rng(3), 2, 0.1)
    assert paired_ratio(pts, A, B, 0.9) is None
    assert paired_ratio({A: pts[A]}, A, B, 0.9) is None


def test_the_interval_is_the_same_on_the_same_points():
    pts = synth(np.random.default_rng(4), 10, 0.1)
    assert paired_ratio(pts, A, B, 0.9) == paired_ratio(pts, A, B, 0.9)
