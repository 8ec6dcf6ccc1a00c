"""The answer first (issue 81): bench ends with a per-engine table read from the typed summary; a run's
per-request and per-engine tables export as CSV or JSON with their units in the column names; check opens with its
verdict; report and history say each phase as they go."""

import argparse
import json

import pandas as pd

from harness.analysis.engine_rows import engine_rows
from harness.analysis.summary import finalize
from harness.analysis.summary_records import Summary
from harness.run.synthetic import write_run
from harness.views.engine_table import WIDTH, engine_table
from tests.conftest import run_cli

FAST = {"token_states": 0.9, "running": 15, "ttft_s": 0.2}
SLOW = {"token_states": 0.2, "running": 3, "ttft_s": 4.0}
UNITS = ("_s", "_rps", "_per_s", "_requests", "_share")  # every figure's column ends in its unit (or counts requests)


def swept_summary() -> Summary:
    """A summary as a sweep writes it: capacity blocks (one within its rates, one a lower bound) beside figures."""
    slo = {"ttft_s": 2.0, "tpot_s": 0.25, "attainment": 0.9}
    return Summary.model_validate({
        "engines": {
            "paged": {"requests_per_s": 3.36, "output_tokens_per_s": 403.6, "ttft_p50_s": 0.847, "ttft_p90_s": 1.52,
                      "tpot_p50_s": 0.018, "tpot_p90_s": 0.031, "oom_capacity": 0, "oom_fragmentation": 0,
                      "requests_unfinished": 5},
            "static-max": {"requests_per_s": 0.8, "output_tokens_per_s": 92.5, "ttft_p50_s": 0.038,
                           "ttft_p90_s": 0.2, "tpot_p50_s": 0.008, "tpot_p90_s": 0.012, "oom_capacity": 125,
                           "oom_fragmentation": 3, "requests_oom": 40, "requests_crashed": 2, "requests_rejected": 1},
        },
        "capacity": {
            "static-max": {"sustained_rps": 0.89, "sustained_where": "beyond", "slo": slo, "bound": "compute"},
            "paged": {"sustained_rps": 3.2, "sustained_rps_ci": [2.32, 4.06], "slo": slo, "bound": "memory"},
        }})


def test_the_table_gives_each_engines_rate_interval_failures_and_latency_with_units():
    text = engine_table(swept_summary())
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    head = " ".join(lines[:2])
    for unit in ("req/s", "[90 % interval]", "TTFT ms", "TPOT ms", "p50 / p90", "tok/s", "cap. / frag."):
        assert unit in head, unit
    paged = next(line for line in lines if line.startswith("paged"))
    static = next(line for line in lines if line.startswith("static-max"))
    assert lines.index(paged) < lines.index(static)  # highest sustained rate first
    assert "3.20 [2.32, 4.06]" in paged and "memory" in paged and "847 / 1520" in paged and "18 / 31" in paged
    assert "403.6" in paged and "0 / 5" in paged  # none failed, five unfinished at the end
    assert ">= 0.89" in static  # every rate met the SLO: a lower bound, not an interval
    assert "125 / 3" in static and "43 / 0" in static  # OOMs by cause; failed: 40 OOM'd + 1 rejected + 2 crashed
    flat = " ".join(text.split())  # the note is wrapped at WIDTH: its sentence read across lines
    assert ("sustained: the highest offered rate at which the long-run share of all requests (every stream at that "
            "rate pooled) within TTFT <= 2 s and TPOT <= 0.25 s reaches 90 %") in flat  # the run's SLO, long-run


def test_a_knee_past_the_rates_measured_is_shown_as_its_bound_and_the_fit_only_as_its_extrapolation():
    """A fitted engine that met the SLO at every rate (or at none) has a bound, not a figure: the table and the
    page lead with the rate measured (knee.bound_of), never the fit's figure past it as if it were the bound."""
    from harness.views.capacity_section import rate_words  # views read here only for this one sentence

    summary = swept_summary()
    beyond = summary.capacity["static-max"].model_copy(update={
        "sustained_rps": 3.28, "sustained_rps_ci": [2.1, 5.0], "sustained_where": "beyond",
        "sustained_bound": {"where": "beyond", "rps": 2.0, "attainment": 0.95}})
    below = summary.capacity["static-max"].model_copy(update={
        "sustained_rps": 0.41, "sustained_rps_ci": [0.2, 0.8], "sustained_where": "below",
        "sustained_bound": {"where": "below", "rps": 0.5, "highest_attainment": 0.84, "highest_at_rps": 0.5}})
    for block, cell, words in ((beyond, ">= 2.00", "at least 2.00 req/s (every rate measured met the SLO)"),
                               (below, "< 0.50", "under 0.50 req/s (a bound")):
        s = summary.model_copy(update={"capacity": {**summary.capacity, "static-max": block}})
        row = next(r for r in engine_rows(s) if r.engine == "static-max")
        assert row.sustained_lo_rps is None and row.sustained_hi_rps is None
        static = next(line for line in engine_table(s).splitlines() if line.startswith("static-max"))
        assert cell in static and "3.28" not in static and "0.41" not in static
        said = rate_words(block, " req/s")
        assert said.startswith(words) and "the fit, past the rates measured, reads" in said


def test_finalize_writes_engines_csv_beside_the_summary_with_units_in_its_header(tmp_path):
    run = write_run(tmp_path / "a", {"paged": FAST, "static-max": SLOW}, duration_s=20, ooms=6)
    summary = finalize(run)
    table = pd.read_csv(run / "engines.csv")
    assert list(table.engine) == [r.engine for r in engine_rows(summary)]
    figures = [c for c in table.columns if c not in ("run_status", "engine", "sustained_where", "bound")]
    assert all(c.endswith(UNITS) or c.startswith("oom_") for c in figures), figures
    assert {"sustained_rps", "ttft_p50_s", "ttft_p90_s", "tpot_p90_s", "output_tokens_per_s"} <= set(table.columns)
    static = table.set_index("engine").loc["static-max"]
    assert static.oom_capacity == 3 and static.oom_fragmentation == 3
    assert static.ttft_p90_s == summary.engines["static-max"].ttft_p90_s > summary.engines["static-max"].ttft_p50_s


def test_report_exports_the_per_request_and_per_engine_tables_as_csv_and_json(tmp_path):
    run = write_run(tmp_path / "a", {"paged": FAST, "static-max": SLOW}, duration_s=20, ooms=6)
    r = run_cli("report", str(run), "--format", "csv", "--out", str(tmp_path / "csv"))
    assert r.returncode == 0, r.stderr
    requests = pd.read_csv(tmp_path / "csv" / "requests.csv")
    engines = pd.read_csv(tmp_path / "csv" / "engines.csv")
    assert {"ttft_s", "tpot_s", "e2e_s", "arrival_s", "prompt_tokens", "output_tokens"} <= set(requests.columns)
    assert len(requests) == len(pd.read_parquet(run / "requests.parquet")) == 200
    assert {"sustained_rps", "served_rps", "ttft_p50_s", "tpot_p50_s", "failed_requests"} <= set(engines.columns)
    assert sorted(engines.engine) == ["paged", "static-max"]
    r = run_cli("report", str(run), "--format", "json", "--out", str(tmp_path / "json"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "json" / "engines.json").read_text())
    assert {row["engine"] for row in rows} == {"paged", "static-max"}
    assert len(json.loads((tmp_path / "json" / "requests.json").read_text())) == 200
    r = run_cli("report", str(run), "--format", "text")
    assert r.returncode == 0, r.stderr
    assert "TTFT ms" in r.stdout and "static-max" in r.stdout
    assert "s: summarizing the journals" in r.stderr  # a line per phase


def test_bench_prints_the_table_under_its_decision_line(tmp_path, monkeypatch, capsys):
    """The verb's own handler, its bench replaced by a recorded (synthetic) run: what it prints after the run."""
    import harness.cli.bench as cli
    import harness.run.bench as bench

    run = write_run(tmp_path / "results" / "r", {"paged": FAST, "static-max": SLOW}, duration_s=20, ooms=6)

    class Recorded:
        def __init__(self, cfg):
            self.dir, self.failure = run, None

        def run(self):
            finalize(run)
            return run

    monkeypatch.setattr(cli, "config", lambda args: argparse.Namespace(
        run_id="r", engines=["paged", "static-max"], kv_budgets=[], targets={}, compare_alloc_confs=[], sweep=False,
        rates=None, duration_s=20, grace_s=4))  # what bench's estimate of its duration reads
    monkeypatch.setattr(bench, "Bench", Recorded)
    assert cli.run(argparse.Namespace(reports=str(tmp_path / "reports"))) == 0
    out = capsys.readouterr().out
    assert out.index("TTFT ms") < out.index("results:")
    assert "static-max" in out and "3 / 3" in out  # its OOMs by cause
    assert (run / "engines.csv").is_file() and (tmp_path / "reports" / "r.html").is_file()


def test_report_of_a_run_whose_json_is_broken_says_which_file_in_one_line(tmp_path):
    run = write_run(tmp_path / "a", {"paged": FAST}, duration_s=5)
    (run / "run.json").write_text("{cut off")
    r = run_cli("report", str(run), "--format", "csv")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "run.json is not JSON" in r.stderr and "Traceback" not in r.stderr


def test_check_opens_with_its_verdict_and_prints_no_python_reprs():
    from harness.views.check_report import check_text

    result = {"target": "http://127.0.0.1:8000", "metrics_found": "vllm", "questions": [
        {"id": 1, "question": "KV bytes per token?", "status": "PASS", "answer": 131072, "evidence": "2 x 32 x 8"},
        {"id": 2, "question": "KV budget?", "status": "WARN", "answer": {"plan_tokens": None, "server_tokens": 4096},
         "evidence": "the server's"},
        {"id": 9, "question": "Sustained rate?", "status": "FAIL",
         "answer": {"sustained_rps": 2.125, "sustained_rps_ci": [1.5, 2.75]}, "evidence": "knee search"},
        {"id": 5, "question": "Free memory?", "status": "UNKNOWN", "answer": None, "evidence": "no NVML"}]}
    lines = check_text(result).splitlines()
    assert lines[0] == ("check: FAIL (1 FAIL, 1 WARN, 1 UNKNOWN, 1 PASS) for http://127.0.0.1:8000, metrics: vllm; "
                        "exit 1: a question FAILed")
    text = "\n".join(lines)
    assert "answer: plan_tokens unknown, server_tokens 4,096" in text
    assert "answer: sustained_rps 2.125, sustained_rps_ci [1.5, 2.75]" in text and "answer: 131,072" in text
    answers = [line for line in lines if line.lstrip().startswith("answer:")]
    assert len(answers) == 4 and not any(c in line for line in answers for c in ("{", "None", "'"))


def test_history_says_each_phase_on_stderr_and_keeps_stdout_for_its_answer(tmp_path):
    finalize(write_run(tmp_path / "results" / "r1", {"paged": FAST}, duration_s=5))
    r = run_cli("history", str(tmp_path / "results"), "--out", str(tmp_path / "h.html"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["runs"][0]["run_id"] == "r1"  # stdout is the JSON alone
    phases = r.stderr.strip().splitlines()
    assert phases[0].startswith("fragbench history: at ") and "1 runs read (0 skipped); finding change points" in \
        phases[0] and "drawing the page" in phases[1]
