"""Saturation throughput beside the headline (harness/analysis/saturation.py, harness/run/saturation_runs.py):
the paired interval on known inputs, the rules, and two real engines serving tiny sets into summary.json."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from harness.analysis.saturation import paired_ratio, repeats_by_rule, set_order, set_size


def test_the_paired_ratio_is_the_geometric_mean_with_a_t_interval_over_the_log_ratios():
    ours, theirs = [200.0, 220.0, 180.0, 210.0], [100.0, 100.0, 100.0, 100.0]
    d = [math.log(2.0), math.log(2.2), math.log(1.8), math.log(2.1)]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    half = stats.t.ppf(0.95, 3) * sd / 2
    ratio, ci = paired_ratio(ours, theirs, 0.9)
    assert ratio == pytest.approx(math.exp(mean), abs=1e-4)
    assert ci == pytest.approx([math.exp(mean - half), math.exp(mean + half)], abs=1e-4)


def test_equal_pairs_give_a_point_interval_and_one_pair_none():
    assert paired_ratio([3.0, 6.0], [1.5, 3.0]) == (2.0, [2.0, 2.0])
    assert paired_ratio([3.0], [1.5]) == (2.0, None)
    assert paired_ratio([0.0], [1.0]) is None


def test_the_rules():
    assert set_order(3, "a", "b") == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert repeats_by_rule(120) == 0 and 2 <= repeats_by_rule(830) <= 6 and repeats_by_rule(1e5) == 6
    assert set_size([2.0, 0.5]) == 10 and set_size([0.0]) == 8 and set_size([100.0]) == 256


def test_two_engines_serve_tiny_sets_into_summary_json(tiny_model, tmp_path):
    """Two real engines, two pairs of 4-request sets (ABBA), then finalize: summary.json's record, the
    console's line and the report's section read it."""
    from harness.analysis.saturation import saturation_words
    from harness.analysis.summary import finalize
    from harness.run.config import BenchConfig
    from harness.run.console import Console
    from harness.run.record import RunWriter
    from harness.run.saturation_runs import SaturationRuns
    from harness.run.supervisor import Supervisor
    from harness.units import KvBudget
    from harness.views.saturation_section import saturation_section

    cfg = BenchConfig(engines=["paged", "static-oracle"], workload="mixed-churn", model=str(tiny_model),
                      kv_budget=KvBudget.parse("32MiB"), out_dir=tmp_path, duration_s=10.0, max_seq_len=512)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = RunWriter.start(cfg, run_dir)
    SaturationRuns(cfg, run_dir, Supervisor(cfg, {}, record), Console(None)).run(
        "paged", "static-oracle", {}, repeats=2, requests=4)
    summary = finalize(run_dir)
    b = summary.saturation_throughput
    assert b is not None and b.pairs == 2 and b.requests == 4 and len(b.sets) == 4
    assert [s.engine for s in b.sets] == ["paged", "static-oracle", "static-oracle", "paged"]
    assert all(s.completed == 4 and s.output_tokens_per_s > 0 for s in b.sets)
    assert b.ratio > 0 and b.ratio_ci[0] <= b.ratio <= b.ratio_ci[1]
    assert "saturation_throughput" in (run_dir / "summary.json").read_text()
    assert "paged/static-oracle" in saturation_words(b) and "Saturation throughput" in saturation_section(summary)
