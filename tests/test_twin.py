"""The simulator twin: the engines' step rows, the fitted step model, and the twin of a bench sweep."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.scheduled.steps import StepRecorder
from engines.sequence import SamplingParams
from harness.sim.stepfit import MIN_ROWS, TERMS, StepModelError, fit, load
from harness.sim.twin import client_rows, needed_budget
from tests.conftest import run_cli
from workloads.generate import TraceRequest

TRUE = {"fixed_s": 2e-3, "per_decode_s": 4e-4, "per_prefill_s": 1e-3, "per_token_s": 5e-5,
        "per_context_token_s": 1e-6}


def synthetic_steps(n: int, seed: int = 0, noise_s: float = 1e-4, truth: dict = TRUE) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    decodes = rng.integers(0, 16, n)
    prefills = rng.integers(0, 3, n) * (rng.random(n) < 0.3)
    tokens = decodes + prefills * rng.integers(16, 600, n)
    context = decodes * rng.integers(50, 900, n) + tokens
    rows = pd.DataFrame({"decodes": decodes, "prefills": prefills, "tokens": tokens, "context_tokens": context})
    rows["duration_s"] = sum(v * (1 if col is None else rows[col]) for (_, col), v in
                             zip(TERMS.items(), truth.values(), strict=True)) + rng.normal(0, noise_s, n)
    return rows


def test_the_fit_recovers_known_step_costs():
    model = fit(synthetic_steps(2000), "synthetic")
    for term, value in TRUE.items():
        assert model.coefficients[term] == pytest.approx(value, rel=0.1), term
    assert model.fit_r2 > 0.95 and model.rows == 2000


def test_a_term_the_rows_make_negative_is_dropped_not_negative():
    """Steps that get cheaper with more prefills (noise, a cache): least squares alone would say -1 ms."""
    model = fit(synthetic_steps(2000, truth={**TRUE, "per_prefill_s": -1e-3}), "synthetic")
    assert model.coefficients["per_prefill_s"] == 0.0
    assert all(v >= 0 for v in model.coefficients.values())


def test_too_few_rows_and_bad_models_are_refused(tmp_path):
    with pytest.raises(StepModelError, match="too few"):
        fit(synthetic_steps(MIN_ROWS - 1), "synthetic")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"step_model": {"coefficients": {**TRUE, "per_token_s": -1.0}}}))
    with pytest.raises(StepModelError, match="negative"):
        load(str(bad))
    bad.write_text('{"coefficients": {"fixed_s": NaN}}')
    with pytest.raises(StepModelError, match="no per_decode_s|not a finite"):
        load(str(bad))
    with pytest.raises(StepModelError, match="no step rows"):
        load(str(tmp_path))


def test_the_engine_records_one_row_per_step(tiny_model, tmp_path):
    engine = make_engine(EngineSpec("paged", str(tiny_model), 4 << 20, max_seq_len=512))
    path = tmp_path / "steps.csv"
    engine.step_recorder = StepRecorder(path)
    prompts = [[5 + i] * (10 + 7 * i) for i in range(4)]
    generate(engine, prompts, SamplingParams(6))
    engine.close()
    rows = pd.read_csv(path)
    assert len(rows) == engine.steps
    assert (rows.duration_s > 0).all()
    # every prompt prefilled once, then one token a step for each sample: 4 x 6 tokens sampled in all
    assert rows.prefills.sum() == 4 and (rows.tokens - rows.decodes).sum() == sum(map(len, prompts))
    assert rows.decodes.sum() + rows.prefills.sum() == 4 * 6
    assert (rows.context_tokens >= rows.tokens).all()


def test_the_client_view_of_simulated_requests():
    """A whole answer shows no first token, a slow reader reads at its own pace, a cancel is left out, and
    a request still running at the cut is cut off with what it showed."""
    reqs = [TraceRequest("r0", 0.0, "c", [1] * 8, 10, stream=False),
            TraceRequest("r1", 0.0, "c", [1] * 8, 10, read_delay_s=0.05),
            TraceRequest("r2", 0.0, "c", [1] * 8, 3, cancel_after_tokens=3),
            TraceRequest("r3", 5.0, "c", [1] * 8, 10)]
    frame = pd.DataFrame({"status": ["ok", "ok", "ok", "ok"], "arrival_s": [0.0, 0.0, 0.0, 5.0],
                          "output_tokens": [10, 10, 3, 10], "ttft_s": [0.1] * 4, "tpot_s": [0.01] * 4,
                          "e2e_s": [0.19, 0.19, 0.12, 0.19]})
    rows = client_rows(frame, reqs, cut_s=5.15)
    assert np.isnan(rows.ttft_s[0]) and rows.e2e_s[0] == pytest.approx(0.19)
    assert rows.tpot_s[1] == pytest.approx(0.05) and rows.e2e_s[1] == pytest.approx(0.1 + 9 * 0.05)
    assert rows.status.tolist() == ["ok", "ok", "cancelled", "error"]
    assert rows.e2e_s[3] == pytest.approx(0.15) and rows.ttft_s[3] == pytest.approx(0.1)


def test_the_budget_an_engine_needs_is_read_off_its_curve():
    curve = [{"kv_budget_bytes": b, "sustained_rps": r} for b, r in ((4, 0.0), (8, 1.0), (16, 3.0))]
    assert needed_budget(curve, 2.0) == pytest.approx(np.exp((np.log(8) + np.log(16)) / 2))
    assert needed_budget(curve, 0.0) == 4 and needed_budget(curve, 5.0) is None


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_a_sweep_records_steps_and_simulates_its_twin(swept):
    run_dir, report = swept
    steps = pd.read_parquet(run_dir / "steps.parquet")
    assert set(steps.engine) == {"static-oracle", "paged"}
    assert {0, 1} <= set(steps.point) and (steps.duration_s > 0).all()
    summary = json.loads((run_dir / "summary.json").read_text())
    for engine in ("static-oracle", "paged"):
        twin = summary["twin"][engine]
        assert len(twin["points"]) == 2 and twin["sustained_rps"] >= 0
        assert set(twin["error"]) >= {"sustained_rps", "mean_running", "ttft_p50_s", "tpot_p50_s",
                                      "token_states_share"}
        assert twin["step_model"]["rows"] > MIN_ROWS and twin["step_model"]["fit_r2"] is not None
        assert len(twin["budget_curve"]) == 9
        # the twin replays the measured requests: the same ones are judged at each point
        for t, m in zip(twin["points"], summary["capacity"][engine]["points"], strict=True):
            assert abs(t["requests"] - m["requests"]) <= max(2, 0.2 * m["requests"])
    assert 'id="twin"' in report.read_text() and "Point by point" in report.read_text()


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_simulate_fits_a_step_model_from_a_run(swept, tmp_path):
    run_dir, _ = swept
    args = ("simulate", "--model", "tiny-llama", "--gpu-mem", "1GiB", "--workload", "mixed-churn", "--policy",
            "paged", "--requests", "50", "--max-seq-len", "2048")
    r = run_cli(*args, "--step-model", str(run_dir), "--step-engine", "paged", "--json")
    assert r.returncode == 0, r.stderr
    sm = json.loads(r.stdout)["step_model"]
    assert set(sm["coefficients"]) == set(TERMS) and isinstance(sm["fit_r2"], float) and sm["rows"] > MIN_ROWS
    saved = tmp_path / "model.json"
    saved.write_text(r.stdout)
    again = run_cli(*args, "--step-model", str(saved), "--json")
    assert json.loads(again.stdout)["step_model"]["coefficients"] == sm["coefficients"]
    for bad in (str(tmp_path), str(tmp_path / "nope.json")):
        r = run_cli(*args, "--step-model", bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli(*args, "--step-model", str(run_dir), "--step-engine", "hf")
    assert r.returncode == 2 and "no step rows of engine hf" in r.stderr
