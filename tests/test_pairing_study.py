"""The pairing study (benchmarks/pairing_study.py): its model fits recover a known correlation of stream effects
from counts alone, and one engine offered the same streams twice, under two names, is paired exactly (the study
gives both engines the same requests, not two draws of the workload)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import expit

from harness.analysis.capacity import SLO
from harness.sim.stepfit import FittedStepModel
from harness.sim.twin import TwinEngine
from tests.helpers import benchmark_module

CONFIG = {"policy": "paged", "placement": "best-fit", "block_size": 16, "preflight": True, "prefix_caching": False,
          "max_num_seqs": 64, "max_num_batched_tokens": 2048, "on_oom": "reject", "kv_budget_bytes": 16 << 20,
          "kv_bytes_per_token": 4096, "max_seq_len": 2048, "row_pad_bytes": 0}
# paged's step model as a recorded run fitted it (tiny-llama, 16MiB, mixed-churn, this 2-core machine): its twin's
# knee lay at 5.6 req/s
STEPS = FittedStepModel({"fixed_s": 0.00142, "per_decode_s": 0.00056, "per_prefill_s": 0.0, "per_token_s": 8.14e-5,
                         "per_context_token_s": 4.74e-7}, None, 0, "test")


@pytest.fixture(scope="module")
def study():
    return benchmark_module("pairing_study")


def synthetic(rng: np.random.Generator, rho: float, b: float = 25.0, s: float = 0.1, streams: int = 200):
    """Counts from the fit's own model: two engines' stream effects correlated by rho, 25 judged a point."""
    z = np.log(np.array([0.85, 1.0, 1.15]))
    u1 = rng.normal(0.0, 1.0, streams)
    u2 = rho * u1 + math.sqrt(1 - rho * rho) * rng.normal(0.0, 1.0, streams)
    n = np.full((streams, 3), 25.0)
    met = [rng.binomial(25, expit(math.log(9) - b * (z[None] + s * u[:, None]))).astype(float) for u in (u1, u2)]
    return z, n, met


@pytest.mark.parametrize("rho", [0.0, 0.7])
def test_the_model_recovers_slope_spread_and_correlation(study, rho):
    z, n, (m1, m2) = synthetic(np.random.default_rng(7), rho)
    fits = (study.fit_marginal(m1, n, z), study.fit_marginal(m2, n, z))
    for f in fits:
        assert 17 < f.b < 35 and 0.06 < f.s < 0.14
    assert abs(study.model_rho(fits, ((m1, n), (m2, n)), (z, z)) - rho) < 0.2


def test_one_engine_under_two_names_is_paired_exactly(study):
    twin = TwinEngine("paged", CONFIG, STEPS, False)
    knee = 6.4  # past the knee: streams miss some of their requests, and not all alike
    data = study.simulate(study.Study({"paged": twin, "static-oracle": twin}, {"paged": knee, "static-oracle": knee},
                                      SLO(), 16 << 20, "mixed-churn", 0, 2048), streams=12, judged=15, jobs=1)
    a, b = data["paged"], data["static-oracle"]
    assert (a.n == 15).all()
    assert np.array_equal(a.met, b.met) and np.array_equal(a.x_window, b.x_window)
    # the streams differ from one another: their demand, their bursts, and what they meet
    assert a.x_window.std() > 0.05 and a.x_load.std() > 0.05 and a.met[:, -1].std() > 0
    out = study.figures(data)
    assert set(out["engines"]) == {"paged", "static-oracle"}
    assert out["pair"]["rho_effect"]["rho"] == pytest.approx(1.0)
    assert out["pair"]["rho_at_knee"]["ci90"][0] == pytest.approx(1.0)


def test_with_the_load_covariate_the_model_scale_correlation_is_what_the_load_leaves(study):
    """Two engines whose stream shifts are g x + u with the load x shared and u independent: without the covariate
    their effects correlate through x; with it the residual correlation on the model's scale is near 0, and each
    engine's gain is found."""
    rng = np.random.default_rng(11)
    streams, b, g = 240, 25.0, 1.0
    z = np.log(np.array([0.85, 1.0, 1.15]))
    x = rng.normal(0.0, 0.12, streams)
    n = np.full((streams, 3), 25.0)
    def counts() -> np.ndarray:
        u = 0.06 * rng.normal(0, 1, streams)
        return rng.binomial(25, expit(math.log(9) - b * (z[None] + g * x[:, None] + u[:, None]))).astype(float)

    met = [counts(), counts()]
    plain = tuple(study.fit_marginal(m, n, z) for m in met)
    loaded = tuple(study.fit_marginal(m, n, z, x) for m in met)
    for f in loaded:
        assert 0.6 < f.g < 1.4 and f.s < plain[0].s
    assert study.model_rho(plain, ((met[0], n), (met[1], n)), (z, z)) > 0.5
    assert abs(study.model_rho(loaded, ((met[0], n), (met[1], n)), (z, z), (x, x))) < 0.3
