"""Capacity at an SLO: the sustained-rate rule, the simulator's sweep against the vLLM paper, bench's sweep."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from harness.analysis.capacity import SLO, request_metrics, sustained_rate, sweep_rates
from tests.conftest import ROOT, run_cli
from tests.helpers import scaled

POINT_FIELDS = {"offered_rps", "achieved_rps", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "normalized_latency_s_per_token", "mean_running", "token_states_share", "oom_total",
                "oom_fragmentation", "crashes",
                # the operating-point gate's figures and intervals (analysis/operating.py)
                "output_tokens_per_s", "ttft_p50_s_ci", "tpot_p50_s_ci", "output_tokens_per_s_ci", "kv_usage_ci"}


def pts(*pairs):
    return [{"offered_rps": r, "slo_attainment": a} for r, a in pairs]


def test_sustained_rate_interpolates_the_crossing():
    rate, where = sustained_rate(pts((1, 1.0), (2, 0.95), (4, 0.45)), SLO())
    assert where == "within" and rate == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.45) * 2)


def test_sustained_rate_says_when_the_knee_lies_beyond_or_below_the_rates():
    assert sustained_rate(pts((1, 1.0), (2, 0.99)), SLO()) == (2, "beyond")
    rate, where = sustained_rate(pts((1, 0.5), (2, 0.1)), SLO())
    assert where == "below" and rate == pytest.approx(0.2)  # from an ideal server at rate 0


def test_sweep_rates_straddle_every_calibration():
    rates = sweep_rates([2.0, 8.0], 5)
    assert len(rates) == 5 and rates[0] < 2.0 and rates[-1] > 8.0 and rates == sorted(rates)


def test_request_metrics_count_failures_as_misses_and_leave_cancellations_out():
    req = pd.DataFrame([
        {"status": "ok", "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.1, "output_tokens": 100},
        {"status": "ok", "ttft_s": 5.0, "tpot_s": 0.01, "e2e_s": 6.0, "output_tokens": 100},  # TTFT over the SLO
        {"status": "oom", "ttft_s": None, "tpot_s": None, "e2e_s": 0.1, "output_tokens": 0},
        {"status": "cancelled", "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.3, "output_tokens": 5},
    ])
    m = request_metrics(req, 10.0, SLO())
    assert m["requests"] == 3 and m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["achieved_rps"] == pytest.approx(0.2) and m["goodput_rps"] == pytest.approx(0.1)
    assert m["normalized_latency_s_per_token"] == pytest.approx((0.011 + 0.06) / 2)


def test_simulated_sweep_reproduces_the_papers_ratios():
    r = run_cli("simulate", "--model", "llama-2-13b", "--gpu", "a100-40gb", "--workload", "paper", "--policy",
                "static-max,static-oracle,paged", "--sweep", "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    cap = json.loads(r.stdout)["capacity"]
    paged = cap["paged"]["sustained_rps"]
    assert 2.7 <= paged / cap["static-max"]["sustained_rps"] <= 8.0
    assert 1.7 <= paged / cap["static-oracle"]["sustained_rps"] <= 2.7
    assert POINT_FIELDS <= set(cap["paged"]["points"][0])


def test_a_sweep_in_parallel_gives_the_same_json_as_in_series():
    args = ["simulate", "--model", "tiny-llama", "--gpu-mem", "64MiB", "--workload", "mixed-churn", "--policy",
            "static-oracle,paged", "--requests", "150", "--sweep", "--points", "3", "--json"]
    one, two = (run_cli(*args, "--jobs", jobs) for jobs in ("1", "2"))
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    for out in (a, b):
        for result in out["policies"].values():
            result.pop("wall_s")
    assert a == b and a["capacity"]


@pytest.mark.parametrize("flags, says", [
    (["--rates", "0,-1"], "--rates"),
    (["--rates", ""], "--rates"),
    (["--sweep", "--point-duration", "2", "--warmup", "3"], "warm-up"),
    (["--sweep", "--slo-ttft", "0"], "--slo-ttft"),
    (["--sweep", "--slo-tpot", "nan"], "--slo-tpot"),
])
def test_a_sweep_that_cannot_be_run_exits_2_with_one_line(flags, says, tiny_model, tmp_path):
    r = run_cli("bench", "--model", str(tiny_model), "--out", str(tmp_path), *flags)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_bench_sweep_writes_the_capacity_block_and_tags_its_rows(swept):
    run_dir, report = swept
    cap = json.loads((run_dir / "summary.json").read_text())["capacity"]
    assert set(cap) == {"static-oracle", "paged"}
    for c in cap.values():
        assert [p["offered_rps"] for p in c["points"]] == [0.5, 4.0]
        assert POINT_FIELDS <= set(c["points"][0]) and c["sustained_where"] in ("within", "beyond", "below")
        assert c["slo"] == {"ttft_s": 2.0, "tpot_s": 0.25, "attainment": 0.9}
        most = max(c["points"], key=lambda p: p["judged"])  # 4 req/s: a score of requests and many samples
        for fig in ("ttft_p50_s", "kv_usage"):
            assert most[f"{fig}_ci"][0] <= most[fig] <= most[f"{fig}_ci"][1], (fig, most)
    requests = pd.read_parquet(run_dir / "requests.parquet")
    assert set(requests.offered_rps.unique()) == {0.5, 4.0}
    html = report.read_text()
    assert 'id="capacity"' in html and "Sustained request rate within the SLO" in html


def resting(points: list[dict]) -> int:
    """The judged requests a knee rests on, read by hand from summary.json's points."""
    kept = [p["judged"] - p["judged"] // 2 if p["knee_use"] == "over_knee" else p["judged"]
            for p in points if p["knee_use"] != "unsteady"]
    return sum(kept) if kept else sum(p["judged"] for p in points)


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_every_point_says_what_it_judged_at_steady_state_and_no_request_is_judged_twice(swept):
    run_dir, report = swept
    summary = json.loads((run_dir / "summary.json").read_text())
    requests = pd.read_parquet(run_dir / "requests.parquet")
    for engine, c in summary["capacity"].items():
        for p in c["points"]:
            assert p["judged"] >= 1 and p["warmup_s"] >= 1.0 and isinstance(p["steady"], bool)
            assert len(p["halves"]) == 2 and all(h is None or 0 <= h <= 1 for h in p["halves"])
        assert c["judged_total"] == sum(p["judged"] for p in c["points"]) == c["distinct_requests"]
        # the two rates judged different requests: each drew its own stream, and only past its warm-up
        mine = requests[requests.engine == engine]
        assert set(mine.stream_key.dropna()) == {"g-16", "g32"}
        assert mine.request_id.is_unique
    # one rate, one stream: both engines were sent the same requests at 0.5 req/s
    at = requests[requests.offered_rps == 0.5]
    ids = [set(at[at.engine == e].request_id) for e in ("static-oracle", "paged")]
    assert len(ids[0] & ids[1]) >= 0.8 * min(map(len, ids))
    h = summary["headline"]
    assert {"engine", "against", "ratio", "ratio_ci", "method", "decided", "judged"} <= set(h)
    assert h["engine"] == "paged" and h["against"] == "static-oracle" and isinstance(h["decided"], bool)
    # the requests its knees rest on (harness/analysis/knee.knee_points): every point's, but an unsteady point's
    # (none where all are) and the first half of one over its knee; all of judged_total where both points settled
    assert h["judged"] == {e: resting(summary["capacity"][e]["points"]) for e in ("paged", "static-oracle")}
    assert "the request rate of static-oracle" in report.read_text()  # the headline's answer, in one line


def test_a_bench_killed_during_a_sweep_reports_the_points_it_finished(tiny_model, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "bench", "--engines", "paged", "--model",
                             str(tiny_model), "--rates", "0.5,1", "--point-duration", "6", "--grace", "2",
                             "--kv-budget", "32MiB", "--out", str(tmp_path), "--reports", str(tmp_path),
                             "--run-id", "killed"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    meta = tmp_path / "killed" / "run.json"
    deadline = time.time() + scaled(300)  # the first point done: after the server's start, the machine's
    while time.time() < deadline:
        points = json.loads(meta.read_text()).get("sweep", {}).get("points", {}).get("paged", []) \
            if meta.exists() else []
        if len(points) >= 2:  # the first point is done, the second has started
            break
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    r = run_cli("report", str(tmp_path / "killed"), "--out", str(tmp_path / "killed.html"))
    assert r.returncode == 0, r.stderr
    cap = json.loads((tmp_path / "killed" / "summary.json").read_text())["capacity"]["paged"]
    first = cap["points"][0]
    assert first["offered_rps"] == 0.5 and first["achieved_rps"] > 0


def test_a_request_cut_off_by_the_window_is_judged_on_what_it_showed():
    from workloads.outcome import UNFINISHED

    def row(status, ttft, tpot, waited, stream=True, target=100):
        return {"status": status, "error": UNFINISHED if status == "error" else None, "ttft_s": ttft, "tpot_s": tpot,
                "e2e_s": waited, "output_tokens": 0, "output_tokens_target": target, "stream": stream}

    req = pd.DataFrame([
        row("ok", 0.1, 0.03, 3.0),
        row("error", 0.02, 0.03, 6.0),  # streaming within both limits when the window closed: meets
        row("error", None, None, 3.0),  # no first token after 3 s: misses
        row("error", None, None, 0.5),  # sent half a second before the end: left out
        row("error", None, None, 5.0, stream=False),  # a whole answer allowed 26.75 s: left out
    ])
    m = request_metrics(req, 10.0, SLO())
    assert m["requests"] == 3 and m["slo_attainment"] == pytest.approx(2 / 3)
    assert m["goodput_rps"] == pytest.approx(0.1)  # goodput counts completed requests only


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_every_capacity_block_has_its_interval_and_the_constraint_that_bound_it(swept):
    run_dir, report = swept
    summary = json.loads((run_dir / "summary.json").read_text())
    for c in summary["capacity"].values():
        lo, hi = c["sustained_rps_ci"]
        assert lo <= c["sustained_rps"] <= hi and c["bound"] in ("memory", "compute", "failures")
        knee = {"kv_usage", "waiting_for_memory_share", "running", "step_s", "oom_total", "preemptions"}
        assert knee <= set(c["knee_point"])
        assert {"method", "points", "streams", "judged", "rps", "ci"} <= set(c["knee"])  # issue 58's contract
        assert c["knee"]["rps"] == round(c["sustained_rps"], 4) and c["replications"] == c["knee"]["streams"]
        assert c["role"] in ("headline", "rival", "screened") and set(c["operating_point"]) == {"offered_rps", "keys"}
        assert "load_independent_misses" in c  # issue 79: beside the knee (None where no rate that low was measured)
    h = summary["headline"]
    ruling = summary["capacity"][h["against"]]["ruling"]  # issue 79: the rival is never one the run ruled out
    assert not ruling["ruled_out"] and ruling["words"].startswith(f"{h['against']}: not ruled out")
    assert h["stop"] in ("precise", "time spent") and isinstance(h["precise"], bool)
    assert summary["capacity"][h["engine"]]["role"] == "headline" and summary["capacity"][h["against"]]["role"] == \
        "rival"
    assert "What bound each engine at its knee" in report.read_text()
