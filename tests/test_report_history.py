"""The report says what it found and stays readable at any length; nightly runs get a history."""

import json
import subprocess

import pandas as pd
import pytest

from harness.analysis.records import RunRecord
from harness.analysis.summary import finalize
from harness.analysis.summary_records import EngineFigures, Summary
from harness.run.synthetic import write_run
from harness.views.report import render
from harness.views.verdict import diagnosis, verdict_sentences
from tests.conftest import run_cli
from tests.helpers import scaled
from tests.test_bench import chromium

FAST = {"token_states": 0.9, "running": 15, "ttft_s": 0.2}
SLOW = {"token_states": 0.2, "running": 3, "ttft_s": 4.0}


def test_the_verdict_names_this_runs_engines_and_numbers_and_turns_with_the_outcome(tmp_path):
    first = finalize(write_run(tmp_path / "a", {"paged": FAST, "static-max": SLOW}, duration_s=30, ooms=10))
    second = finalize(write_run(tmp_path / "b", {"paged": SLOW, "static-max": FAST}, duration_s=30, ooms=10))
    meta = RunRecord.of({"config": {"kv_budget": "32MiB"}})
    events = pd.read_parquet(tmp_path / "a" / "events.parquet")
    a, b = (verdict_sentences(Summary.model_validate(s), events, meta) for s in (first, second))
    assert "paged served the most" in a[0] and "x the best contiguous engine (static-max)" in a[0]
    assert "static-max served the most" in b[0]
    # each sentence found by what it says: a warning (a median TTFT over the SLO) may stand before them
    def said(sentences, words):
        return next(s for s in sentences if words in s)

    assert "WARNING: static-max" in a[1] and "median TTFT" in a[1]  # SLOW's 4 s against the 2 s limit
    held_a = said(a, "mean over the churn: ").split("mean over the churn: ")[1]
    assert held_a.startswith("paged") and said(b, "mean over the churn: ").split("mean over the churn: ")[1] \
        .startswith("static-max")
    assert f"{100 * first.engines['paged'].token_states_share:.1f} %" in said(a, "Where the memory went")
    assert "static-max: 5 capacity and 5 fragmentation OOMs" in said(a, "Failures:")
    assert any("static-max, diagnosis" in s for s in a)


def test_a_crash_no_oom_explains_gets_no_oom_runbook():
    """A target's server killed outright (fragbench ab's knee turn over a NEW that crashed): crashes counted, no OOM
    figures at all; the OOM runbook says nothing (it compared the two missing counts and raised TypeError)."""
    assert diagnosis(EngineFigures(crashes=1), pd.DataFrame()) is None
    assert "fragmentation" in diagnosis(EngineFigures(crashes=1, oom_fragmentation=3, oom_capacity=1), pd.DataFrame())


def test_a_run_with_5000_oom_events_gets_a_summary_and_20_rows(tmp_path):
    run = write_run(tmp_path / "long", {"static-max": SLOW, "paged": FAST}, duration_s=120, ooms=5000)
    finalize(run)
    html = render(run, tmp_path / "long.html").read_text()
    oom = html[html.index('id="oom-events"'):html.index('id="memory-map"')]
    assert "By engine and cause" in oom and oom.count("<td>static-max</td><td>fragmentation</td><td>2500</td>") == 1
    assert "The first 20 of 5000" in oom and "The other 4980 events" in oom
    first20 = oom[oom.index("The first 20"):]
    assert first20.count("<tr>") == 21  # a header and 20 events
    assert "{" not in oom.split("<script")[0].replace("{}", "")  # no JSON in the cells


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    for i, (name, shape) in enumerate((("r1", FAST), ("r2", SLOW))):
        finalize(write_run(folder / name, {"paged": shape, "static-max": SLOW}, duration_s=20,
                           started=f"2026-11-2{i}T03:00:00+00:00", git_sha=f"{i:040d}"))
    bad = write_run(folder / "r3", {"paged": FAST}, duration_s=5)
    (bad / "summary.json").write_text("{not json")
    return folder


def test_history_draws_the_readable_runs_and_names_the_skipped_one(results, tmp_path):
    out = tmp_path / "history.html"
    r = run_cli("history", str(results), "--out", str(out))
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert "mixed-churn at 32MiB: 2 runs" in html and "Skipped: r3 (unreadable" in html
    assert "2026-11-20T03:00:00" in html and "2026-11-21T03:00:00" in html
    assert "No change point in 2 runs" in html  # two runs are too few for a change point


def series_run(folder, i: int, paged_rps: float, static_rps: float):
    """A run whose summary holds a capacity block per engine and a headline, as a sweep's does."""
    run = folder / f"r{i:02d}"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "started": f"2026-11-{i + 1:02d}T03:00:00+00:00",
                                              "git_sha": f"{i:040d}", "status": "complete",
                                              "config": {"workload": "mixed-churn", "kv_budget": "16MiB"}}))
    cap = {e: {"sustained_rps": v, "sustained_rps_ci": [0.9 * v, 1.1 * v]}
           for e, v in (("paged", paged_rps), ("static-oracle", static_rps))}
    (run / "summary.json").write_text(json.dumps({
        "run_id": run.name, "status": "complete", "engines": {e: {} for e in cap}, "capacity": cap,
        "headline": {"engine": "paged", "against": "static-oracle", "ratio": paged_rps / static_rps,
                     "ratio_ci": [0.9 * paged_rps / static_rps, 1.1 * paged_rps / static_rps]}}))


def test_history_finds_the_one_change_after_the_fifth_run_and_calls_it_a_regression(tmp_path):
    """Eight runs with noise of about 2 %; paged slows by a third from the sixth on, static-oracle does not: Otava's
    E-divisive with its t-test at p < 0.001 finds one change in paged's rate, at the sixth run (index 5), and one
    in the ratio, and none in static-oracle's."""
    noise = [1.00, 1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.00]
    for i, n in enumerate(noise):
        series_run(tmp_path / "results", i, (3.0 if i < 5 else 2.0) * n, 2.4 * noise[-1 - i])
    r = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html"), "--json")
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    by = {(c["engine"], c["figure"]): c for c in found["change_points"]}
    assert set(by) == {("paged", "sustained_rps"), ("paged/static-oracle", "headline_ratio")}
    paged = by[("paged", "sustained_rps")]
    assert paged["index"] == 5 and paged["run_id"] == "r05" and paged["worse"] and paged["confirmed"]
    assert paged["mean_before"] == pytest.approx(3.0 * sum(noise[:5]) / 5)
    text = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html"))
    assert "paged sustained_rps: REGRESSION at run r05 (#6)" in text.stdout
    assert "REGRESSION" in (tmp_path / "h.html").read_text()


def test_history_of_one_steady_series_finds_no_change_point(tmp_path):
    for i, n in enumerate([1.00, 1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.00]):
        series_run(tmp_path / "results", i, 3.0 * n, 2.4 * n)
    r = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["change_points"] == []


def test_a_grid_step_inside_the_runs_intervals_is_no_measurable_difference(tmp_path):
    """Two short runs offered paged 2.278 req/s and six offered 2.181 (the search's grid rate, met in full: the rate is
    the point itself). Identical values in each segment give the t-test p = 0, but the runs' own intervals overlap:
    the step is listed apart as no measurable difference, never a regression."""
    for i, rate in enumerate([2.278] * 2 + [2.181] * 6):
        series_run(tmp_path / "results", i, rate, 1.5)
    r = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html"), "--json")
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["change_points"] == []
    assert [(c["engine"], c["index"], c["measurable"]) for c in found["within_intervals"]] == [
        ("paged", 2, False), ("paged/static-oracle", 2, False)]
    text = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html")).stdout
    assert "0 change points" in text and "no measurable difference at run r02" in text and "REGRESSION" not in text


def test_history_of_nothing_readable_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_cli("history", str(tmp_path / "empty"), "--out", str(tmp_path / "h.html"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs it with apt)")
def test_history_page_draws_in_headless_chromium(tmp_path):
    """The page of a series with one change point (paged a third slower from the sixth run) draws its charts and
    names the regression in the browser, not only in the HTML's text."""
    for i, n in enumerate([1.00, 1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.00]):
        series_run(tmp_path / "results", i, (3.0 if i < 5 else 2.0) * n, 2.4 * n)
    out = tmp_path / "history.html"
    assert run_cli("history", str(tmp_path / "results"), "--out", str(out)).returncode == 0
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path}",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=15000",
           "--dump-dom", out.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120)).stdout
    assert dom.count('class="main-svg"') >= 1 and json.dumps("REGRESSION")[1:-1] in dom
