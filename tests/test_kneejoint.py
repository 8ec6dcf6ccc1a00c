"""The joint fit of two engines on shared streams (harness/analysis/kneejoint.py): its weights against a
brute-force integral, the independent fit at rho = 0, the narrowing it earns where streams are shared, and the
twins' correlation read back from streams drawn with a known one."""

import math

import numpy as np
import pytest
from scipy import stats

from harness.analysis import kneefit
from harness.analysis.knee import Judged, knee_points
from harness.analysis.kneejoint import joint_fit, pair_log_weights, twin_correlation

A, B = "paged", "static-oracle"


def synth(rng, streams, rho, spreads=(0.2, 0.3), knees=(2.0, 1.0), slopes=(25.0, 8.0), n=30,
          multiples=(0.7, 0.85, 1.0, 1.15, 1.4)) -> dict[str, list[Judged]]:
    """Each stream judged once by each engine at its own knee's multiple; the two engines' shifts on one stream
    correlated rho, as the joint fit's model draws them."""
    pts = {A: [], B: []}
    for k in range(streams):
        w = rng.standard_t(4)
        for i, e in enumerate(pts):
            u = spreads[i] * (math.sqrt(rho) * w + math.sqrt(1 - rho) * rng.standard_t(4))
            r = knees[i] * multiples[k % len(multiples)] * math.exp(rng.normal(0, 0.05))
            p = 1 / (1 + math.exp(-(math.log(9) - slopes[i] * (math.log(r) + u - math.log(knees[i])))))
            pts[e].append(Judged(r, f"p{k}", (rng.random(n) < p).astype(float), np.arange(n)))
    return pts


def test_at_rho_0_the_joint_fit_is_the_independent_one():
    pts = synth(np.random.default_rng(3), 8, 0.8)
    alone, joint = kneefit.fit(pts, 0.9), joint_fit(pts, 0.9, {(A, B): 0.0})
    assert joint.joint == {} and joint.ratio(A, B) == alone.ratio(A, B)


def test_a_draws_weight_is_the_joint_integral_over_the_independent_one():
    """One stream, one point an engine: the weight of a few draws against a dense direct sum of the model itself
    in its own variables (w shared, each engine's leftover summed given w), not the fit's binned convolution."""
    pts = synth(np.random.default_rng(5), 6, 0.5)
    one = {e: knee_points(p)[:1] for e, p in pts.items()}  # the first stream alone
    kf, rho = kneefit.fit(one, 0.9), 0.6
    take = np.arange(5)
    got, shared = pair_log_weights(kf, one, A, B, rho, 0.9, take)
    assert shared == 1
    z = np.linspace(-60, 60, 6001)  # a t4 keeps 1e-6 of its mass beyond 60
    tz = stats.t(kneefit.TAIL_DF).pdf(z)
    tz = tz / tz.sum()

    def lik(e, j, shift, scale):  # the point's likelihood with its leftover of this scale summed out, per shift
        p, data = one[e][0], kneefit._Data.of(one[e])
        d0 = kneefit.knee_grid(one[e])[kf.cells[e][j]] - math.log(p.offered_rps) - kf.gains[e][j] * p.log_load
        eta = math.log(9) + kf.slopes[e][j] * (d0 - shift[:, None] - scale * z[None, :])
        log_f = -data.met[0] * np.logaddexp(0, -eta) - (data.judged[0] - data.met[0]) * np.logaddexp(0, eta)
        return np.exp(log_f) @ tz

    w = z[::3]
    tw = tz[::3] / tz[::3].sum()
    for j in take:
        sa, sb = kf.spreads[A][j], kf.spreads[B][j]
        joint = tw @ (lik(A, j, math.sqrt(rho) * sa * w, math.sqrt(1 - rho) * sa)
                      * lik(B, j, math.sqrt(rho) * sb * w, math.sqrt(1 - rho) * sb))
        alone = lik(A, j, np.zeros(1), sa)[0] * lik(B, j, np.zeros(1), sb)[0]
        assert got[j] == pytest.approx(math.log(joint / alone), abs=0.05), (j, got)


def test_shared_streams_narrow_the_ratio_and_keep_its_estimate():
    pts = synth(np.random.default_rng(7), 10, 0.8)
    alone, joint = kneefit.fit(pts, 0.9), joint_fit(pts, 0.9, {(A, B): 0.8})
    (_, (lo0, hi0)), (r1, (lo1, hi1)) = alone.ratio(A, B), joint.ratio(A, B)
    assert hi1 / lo1 < 0.9 * (hi0 / lo0)  # 2.26 -> 1.81 when written
    assert lo0 <= r1 <= hi0
    assert joint.joint[(A, B)].effective_draws > 200 and joint.joint[(A, B)].paired_streams == 10


def test_the_twins_correlation_is_read_back_and_its_lower_bound_is_used():
    strong_pts, none_pts = synth(np.random.default_rng(1), 40, 0.8), synth(np.random.default_rng(2), 40, 0.0)
    strong = twin_correlation(kneefit.fit(strong_pts, 0.9), strong_pts, A, B, 0.9)
    none = twin_correlation(kneefit.fit(none_pts, 0.9), none_pts, A, B, 0.9)
    assert strong.estimate >= 0.6 and 0.3 <= strong.lower <= strong.estimate and strong.streams == 40
    assert none.lower == 0.0 and none.estimate <= 0.4
    assert strong.to_json()["used"] == strong.to_json()["lower"]
