"""The knee study (benchmarks/knee_study.py) on a few short runs: its --json keeps the issue's contract, its figures
are shares and widths that make sense, a clearly faster engine is decided in most runs, and its synthetic points
carry the burst correlation real runs show (a design effect over 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.analysis.knee import Judged, design_effect
from tests.helpers import benchmark_module

CONTRACT = {"true_ratio", "runs", "coverage", "median_hi_lo", "decided_share"}


@pytest.fixture(scope="module")
def knee_study():
    return benchmark_module("knee_study")


def test_json_rows_keep_the_contract_and_a_clear_ratio_is_decided(knee_study, capsys):
    # a short decision phase keeps it fast; at a true ratio of 1.7 the search's brackets and a few turns decide
    assert knee_study.main(["--runs", "3", "--ratios", "1.0,1.7", "--json", "--decision-s", "240", "--seed", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["true_ratio"] for r in rows] == [1.0, 1.7]
    for row in rows:
        assert CONTRACT <= set(row)
        assert row["runs"] == 3
        assert 0.0 <= row["coverage"] <= 1.0 and 0.0 <= row["decided_share"] <= 1.0
        assert row["median_hi_lo"] >= 1.0
        assert row["precise_stop_share"] + row["time_spent_share"] == pytest.approx(1.0)
        assert row["rival_best_share"] == 1.0  # hf screened at 0.7 x static-oracle's knee: never the rival
    assert rows[1]["decided_share"] >= 2 / 3
    assert 1.3 < rows[1]["median_ratio"] < 2.2


def test_points_judge_their_requests_in_bursts_that_share_a_fate(knee_study):
    rng = np.random.default_rng(0)
    points = [Judged(1.0, f"g0r{i}", knee_study.bursty_verdicts(rng, 0.5, 200, 1.5), np.arange(200))
              for i in range(10)]
    assert 1.5 < design_effect(points) < 2.6  # geometric bursts of mean 1.5: 2 x 1.5 - 1 = 2


def test_a_clear_miss_stops_early_and_a_pass_does_not(knee_study):
    assert knee_study.clear_miss_at(np.zeros(50), 10, 1.0) == 10
    assert knee_study.clear_miss_at(np.ones(50), 10, 1.0) is None


def test_help_states_every_default(knee_study):
    ap = knee_study.parser()
    flags = [a for a in ap._actions if a.dest != "help"]
    assert ap.format_help().count("(default:") == len(flags)


def test_spreads_and_pairing_give_a_row_each_and_paired_turns_read_one_stream(knee_study, capsys):
    assert knee_study.main(["--runs", "1", "--ratios", "1.3", "--json", "--decision-s", "90", "--search-s", "60",
                            "--spreads", "0.1,0.5", "--pairing", "both", "--seed", "4"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["spread"], r["paired"]) for r in rows] == [(0.1, True), (0.1, False), (0.5, True), (0.5, False)]
    prm = knee_study.Params(spread_s=0.3, decision_s=90, search_s=60)
    run = knee_study.Run(prm, np.random.default_rng(1), {"paged": [], "static-oracle": []})
    engines = {e: knee_study.Engine(e, k, 25.0, 0.3) for e, k in (("paged", 3.0), ("static-oracle", 2.0))}
    searches = {e: knee_study.search(run, engines[e]) for e in engines}
    knee_study.decide(run, engines, searches)
    decided = {e: [p for p in run.points[e] if p.key.startswith("p")] for e in engines}
    shared = {p.key: p.log_load for p in decided["paged"]}
    both = [p for p in decided["static-oracle"] if p.key in shared]
    assert both and all(p.log_load == shared[p.key] for p in both)  # one stream: one offered token load
    searched = [p.key for e in engines for p in run.points[e] if not p.key.startswith("p")]
    assert len(searched) == len(set(searched))  # a search point's stream is its own


def test_the_rival_check_names_the_contiguous_engine_with_the_highest_true_knee(knee_study):
    """Issue 79: a third contiguous engine screened by one point under static-oracle's interval is never the
    headline's rival where its true knee lies well under static-oracle's (the one rule, analysis/ruled_out.py),
    and is where its knee lies above."""
    from dataclasses import replace

    from harness.analysis.kneefit import fit

    prm = knee_study.Params()
    run = knee_study.Run(prm, np.random.default_rng(2), {"static-oracle": []})
    static = knee_study.Engine("static-oracle", 2.0, 25.0, 0.08)
    knee_study.search(run, static)
    pts = list(run.points["static-oracle"])
    kf = fit(run.points, 0.9)
    lower = replace(prm, screened_knee=0.7)
    assert [knee_study.rival_check(lower, np.random.default_rng(i), static, pts, pts, kf) for i in range(6)] == \
        ["static-oracle"] * 6
    assert knee_study.rival_check(replace(prm, screened_knee=2.0), np.random.default_rng(0), static, pts, pts,
                                  kf) == "hf"


def test_the_prior_off_by_a_factor_and_drift_between_visits_give_a_row_each(knee_study, capsys):
    assert knee_study.main(["--runs", "1", "--ratios", "1.3", "--json", "--decision-s", "90", "--search-s", "60",
                            "--prior-factors", "none,0.5,2", "--drift-sd", "0.1", "--slope-ratio", "0.07",
                            "--seed", "5"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["prior_factor"] for r in rows] == [None, 0.5, 2.0]
    assert all(r["drift_sd"] == 0.1 and r["slope_ratio"] == 0.07 for r in rows)
    prm = knee_study.Params(spread_s=0.2, prior_factor=2.0)
    engines = {e: knee_study.Engine(e, 2.0, 25.0, 0.2) for e in ("paged", "static-oracle")}
    priors = knee_study.twin_priors(prm, engines)
    truth = knee_study.T4_SCALE_OF_NORMAL * 0.2 * np.sqrt(1 - prm.explained)
    assert priors["paged"].centre == pytest.approx(2 * truth)  # the twin off by x2, and blind to the drift
    assert knee_study.twin_priors(knee_study.Params(), engines) is None


def test_drift_is_one_draw_per_visit_of_an_engine(knee_study):
    run = knee_study.Run(knee_study.Params(drift_sd=0.1), np.random.default_rng(2), {"paged": [], "static-oracle": []})
    first = run.drift("paged")
    assert run.drift("paged") == first and first != 0.0
    run.visit["paged"] = 1
    assert run.drift("paged") != first
    still = knee_study.Run(knee_study.Params(), np.random.default_rng(2), {"paged": []})
    assert still.drift("paged") == 0.0


def test_the_truth_is_the_long_run_rate_and_a_long_run_there_meets_the_target(knee_study, capsys):
    """Issue 86: an engine's true sustained rate is where a long run, every stream pooled, meets the target: a
    long simulated run there meets it within three Monte Carlo errors (a steep curve and a flat one, a spread and
    a drift), where one at the median stream's knee (the old figure) misses by far more on the steep curve. The
    study's --long-run rows carry the check."""
    prm = knee_study.Params(spread_s=0.2, drift_sd=0.05)
    rng = np.random.default_rng(7)
    for slope in (25.0, 1.8):
        engine = knee_study.engine_of("paged", 3.0, slope, 0.2, prm)
        share, se = knee_study.long_run(prm, rng, engine, 3.0, 6000)
        assert abs(share - 0.9) <= 3 * se and se < 0.005, (slope, share, se)
        assert engine.knee_rps > 3.0
    steep = knee_study.engine_of("paged", 3.0, 25.0, 0.2, prm)
    assert knee_study.long_run(prm, rng, steep, steep.knee_rps, 6000)[0] < 0.75
    assert knee_study.main(["--runs", "1", "--ratios", "1.5", "--json", "--decision-s", "90", "--search-s", "60",
                            "--long-run", "1000", "--seed", "6"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert abs(row["long_run_true"] - 0.9) <= 3 * row["long_run_true_se"]
    assert 0.0 <= row["long_run_straddle_paged"] <= 1.0 and 0.0 < row["long_run_at_rps_paged"] <= 1.0


def test_the_paired_ratio_is_read_beside_the_fit_and_can_place_the_turns(knee_study, capsys):
    """Each row carries the paired estimator's columns (kneepaired.py, each slope setting) on the same runs' points;
    `--placer paired` places the turns with it, and a clearly faster engine still comes out above 1."""
    assert knee_study.main(["--runs", "2", "--ratios", "2.5", "--json", "--decision-s", "240", "--seed", "5",
                            "--placer", "paired"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    for tag in knee_study.PAIRED_SLOPES:
        assert 0.0 <= row[f"{tag}_coverage"] <= 1.0 and row[f"{tag}_median_hi_lo"] >= 1.0
        assert row[f"{tag}_median_ratio"] > 1.2
    assert row["runs"] == 2 and row["median_ratio"] > 1.2
