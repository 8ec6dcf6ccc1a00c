"""`fragbench rules`: every family's file passes `promtool check rules`, and `promtool test rules` shows each
alert firing on the series the seeds describe, within its window plus its hold, and silent on their look-alikes
(a paged pool at 60, 80 or 95 % live tokens is not fragmentation; capacity OOMs are not fragmentation OOMs)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.monitoring.families import ALERTS, CAPACITY, FAILURES, FRAGMENTATION, PREEMPTIONS, RESERVED, rules_for
from harness.monitoring.rules import Thresholds
from tests.conftest import run_cli

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (apt-get install prometheus)")

# per family: alert -> {instance: series}; "fires" must fire at each of EVALS (the default window plus hold, and
# 15 minutes), every other instance must stay silent at each
EVALS = ("7m", "15m")
MINUTES = "x20"  # each series holds its value for 20 one-minute samples


def fragbench_cases() -> dict[str, dict[str, dict[str, str]]]:
    def kv(largest_free: float, tokens: float) -> dict[str, str]:
        """A KV of 100 B: its largest free extent and its live tokens' bytes; the rest is held by no token."""
        return {"fragbench:kv_largest_free_bytes": f"{largest_free}{MINUTES}",
                "fragbench:kv_capacity_bytes": f"100{MINUTES}", "fragbench:kv_token_states_bytes": f"{tokens}{MINUTES}"}

    def paged(live_share: int) -> dict[str, str]:
        """A block pool at this share of live tokens: its free blocks are all usable, and 2 % of the KV sits in
        partly filled last blocks (a paged server measured 1.1 % at 74.7 % live tokens)."""
        return kv(largest_free=100 - live_share - 2, tokens=live_share)

    def reserved(allocated: str) -> dict[str, str]:
        return {'fragbench:memory_reserved_bytes{source="cuda"}': "1e9+1e8x20",
                'fragbench:memory_allocated_bytes{source="cuda"}': allocated,
                'fragbench:request_success_total{finished_reason="length"}': "0+60x20"}

    def ooms(cause: str, finished_per_min: int) -> dict[str, str]:
        return {f'fragbench:oom_total{{cause="{cause}"}}': "0+2x20",
                'fragbench:request_success_total{finished_reason="length"}': f"0+{finished_per_min}x20"}

    def full(waiting: int, live: int) -> dict[str, str]:
        return {"fragbench:kv_cache_usage_perc": "0.98x20", "fragbench:num_requests_waiting": f"{waiting}x20",
                "fragbench:kv_live_tokens": f"{live}x20", "fragbench:kv_capacity_tokens": "1000x20"}

    return {
        # a contiguous KV holding 40 % in reservations and holes, 8 % usable, against paged pools and a
        # contiguous one whose reservations leave most of it free
        FRAGMENTATION: {"fires": kv(largest_free=8, tokens=52), "paged-60": paged(60), "paged-80": paged(80),
                        "paged-95": paged(95), "plenty-free": kv(largest_free=60, tokens=5)},
        RESERVED: {"fires": reserved("5e8-1e6x20"), "load-rising": reserved("5e8+1e8x20")},
        FAILURES: {"fires": ooms("fragmentation", 60), "capacity-ooms": ooms("capacity", 60),
                   "no-churn": ooms("fragmentation", 0)},
        PREEMPTIONS: {"fires": {"fragbench:num_preemptions_total": "0+60x20"},
                      "few": {"fragbench:num_preemptions_total": "0+6x20"}},
        CAPACITY: {"fires": full(waiting=3, live=950), "fragmented": full(waiting=3, live=100),
                   "no-queue": full(waiting=0, live=950)},
    }


def vllm_cases() -> dict[str, dict[str, dict[str, str]]]:
    labels = '{model_name="m",engine="0"}'
    return {
        PREEMPTIONS: {"fires": {f"vllm:num_preemptions_total{labels}": "0+60x20"},
                      "few": {f"vllm:num_preemptions_total{labels}": "0+6x20"}},
        CAPACITY: {"fires": {f"vllm:kv_cache_usage_perc{labels}": "0.99x20",
                             f"vllm:num_requests_waiting{labels}": "4x20"},
                   "no-queue": {f"vllm:kv_cache_usage_perc{labels}": "0.99x20",
                                f"vllm:num_requests_waiting{labels}": "0x20"},
                   "half-full": {f"vllm:kv_cache_usage_perc{labels}": "0.5x20",
                                 f"vllm:num_requests_waiting{labels}": "4x20"}},
    }


def sglang_cases() -> dict[str, dict[str, dict[str, str]]]:
    labels = '{model_name="m"}'
    return {
        PREEMPTIONS: {"fires": {f"sglang:num_retracted_requests_total{labels}": "0+60x20"},
                      "few": {f"sglang:num_retracted_requests_total{labels}": "0+6x20"}},
        CAPACITY: {"fires": {f"sglang:token_usage{labels}": "0.97x20", f"sglang:num_queue_reqs{labels}": "2x20"},
                   "no-queue": {f"sglang:token_usage{labels}": "0.97x20", f"sglang:num_queue_reqs{labels}": "0x20"}},
    }


CASES = {"fragbench": fragbench_cases, "vllm": vllm_cases, "sglang": sglang_cases}


def with_labels(series: str, instance: str) -> str:
    name, _, rest = series.partition("{")
    inner = rest.rstrip("}")
    return f'{name}{{instance="{instance}",job="fragbench"{"," + inner if inner else ""}}}'


def own_labels(series: str) -> dict[str, str]:
    """The labels a series carries besides instance and job (the alert keeps those of its expression's left side,
    which each case lists first)."""
    if "{" not in series:
        return {}
    pairs = series[series.index("{") + 1:-1].replace('"', "").split(",")
    return dict(p.split("=") for p in pairs)


def unit_tests(family: str, rules_file: str) -> dict:
    """promtool's test file: one test per alert, its instances' series together; only `fires` fires."""
    ruleset = rules_for(family, Thresholds())
    alerts = {a.alert: a for a in ruleset.alerts}
    tests = []
    for name, instances in CASES[family]().items():
        series = [{"series": with_labels(s, inst), "values": v} for inst, by_name in instances.items()
                  for s, v in by_name.items()]
        expected = expected_alert(alerts[name], "fires", own_labels(next(iter(instances["fires"]))))
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": at, "alertname": name, "exp_alerts": [expected]} for at in EVALS]})
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def expected_alert(alert, instance: str, own: dict[str, str]) -> dict:
    labels = {"severity": "warning", "instance": instance, "job": "fragbench", **own,
              **({"cause": alert.cause} if alert.cause else {})}
    summary = alert.summary.replace("{{ $labels.instance }}", instance)
    return {"exp_labels": labels, "exp_annotations": {"summary": summary, "runbook": alert.runbook}}


def write_rules(family: str, out: Path, *flags: str) -> Path:
    r = run_cli("rules", "--family", family, "--out", str(out), *flags, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


@needs_promtool
@pytest.mark.parametrize("family", ["fragbench", "vllm", "sglang"])
def test_every_family_passes_promtool_and_each_alert_fires_only_where_it_should(family, tmp_path):
    rules = write_rules(family, tmp_path / f"{family}.yml")
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(unit_tests(family, rules.name), sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    written = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert written == set(CASES[family]())  # every rule the file holds has a case that fires and one that does not
    assert all(len(instances) >= 2 for instances in CASES[family]().values())


@needs_promtool
def test_a_contiguous_kv_that_starts_fragmenting_fires_within_the_window_plus_the_hold(tmp_path):
    """Healthy for 15 minutes (most of it free), then 40 % held by reservations and holes with 8 % usable: silent
    at 15m, firing by 15m + the window (5m) + the hold (2m)."""
    rules = write_rules("fragbench", tmp_path / "fragbench.yml")
    alert = next(a for a in rules_for("fragbench", Thresholds()).alerts if a.alert == FRAGMENTATION)
    series = {"fragbench:kv_capacity_bytes": "100x40", "fragbench:kv_largest_free_bytes": "60x15 8x25",
              "fragbench:kv_token_states_bytes": "30x15 52x25"}
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": with_labels(s, "turns"), "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": "15m", "alertname": FRAGMENTATION, "exp_alerts": []},
                            {"eval_time": "22m", "alertname": FRAGMENTATION,
                             "exp_alerts": [expected_alert(alert, "turns", {})]}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_fragmentation_kind_carries_its_cause():
    alerts = {a.alert: a for a in rules_for("fragbench", Thresholds()).alerts}
    assert {n for n, a in alerts.items() if a.cause == "fragmentation"} == {FRAGMENTATION, FAILURES}
    assert "cause: fragmentation" in rules_for("fragbench", Thresholds()).to_yaml()


def test_a_family_without_a_signal_says_so_instead_of_faking_the_rule():
    for family in ("vllm", "sglang"):
        ruleset = rules_for(family, Thresholds())
        names = {a.alert for a in ruleset.alerts} | {o.alert for o in ruleset.omitted}
        assert names == set(ALERTS)
        text = ruleset.to_yaml()
        for omitted in ruleset.omitted:
            assert f"#   {omitted.alert}: " in text and omitted.alert not in yaml.safe_load(text).__repr__()
    assert not rules_for("fragbench", Thresholds()).omitted


def test_the_envelope_comes_from_a_check_report(tmp_path):
    report = tmp_path / "check.json"
    report.write_text(json.dumps({"target": "http://127.0.0.1:8000", "envelope": {
        "live_tokens": 1234, "until": "the first preemption", "t_s": 4.2}}))
    text = write_rules("fragbench", tmp_path / "r.yml", "--from-check", str(report)).read_text()
    assert "fragbench:kv_live_tokens / 1234" in text and "the first preemption" in text


@pytest.mark.parametrize("flags, says", [
    (["--family", "tgi"], "invalid choice: 'tgi'"),
    (["--family", "vllm", "--window", "5 minutes"], "not a Prometheus duration"),
    (["--family", "vllm", "--free-below", "2"], "must be in (0, 1]"),
    (["--family", "fragbench", "--from-check", "nowhere.json"], "--from-check nowhere.json"),
    (["--family", "fragbench", "--from-check", "x.json", "--envelope-tokens", "5"], "not allowed with"),
])
def test_bad_input_exits_2_with_one_line(flags, says):
    r = run_cli("rules", *flags, timeout=60)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_check_report_without_an_envelope_is_refused(tmp_path):
    report = tmp_path / "check.json"
    report.write_text(json.dumps({"target": "http://127.0.0.1:8000", "questions": []}))
    r = run_cli("rules", "--family", "fragbench", "--from-check", str(report), timeout=60)
    assert r.returncode == 2 and "holds no envelope" in r.stderr


def test_the_envelope_is_the_most_live_tokens_before_the_first_oom_or_preemption():
    from harness.monitoring.envelope import envelope

    def row(t_s, live, ooms=0.0, preemptions=0.0):
        return {"t_s": t_s, "preemptions": preemptions,
                "raw": {"fragbench:kv_live_tokens": live, "fragbench:oom_total": ooms}}

    rows = [row(0.1, 50), row(0.2, 400), row(0.3, 300), row(0.4, 900, ooms=1), row(0.5, 1000, ooms=1)]
    assert envelope("fragbench", rows) == {"live_tokens": 400, "until": "the first OOM, at t=0.4 s"}
    rows = [row(0.1, 50, preemptions=2), row(0.2, 700, preemptions=2), row(0.3, 800, preemptions=3)]
    assert envelope("fragbench", rows)["until"].startswith("the first preemption")
    assert envelope("fragbench", [row(0.1, 5), row(0.2, 9)])["until"].startswith("the end of the churn")
    assert envelope("vllm", rows) is None  # vLLM exports no live-token count
