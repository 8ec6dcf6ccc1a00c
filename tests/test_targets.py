"""Servers fragbench did not start, benched as one more engine: their metrics, their refusals, their rows."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from engines.peers.vllm import vllm_python
from engines.procs import free_port
from engines.procs import metric_values as parse
from harness.run.servers import start_server
from harness.run.telemetry import FAMILIES, detect
from harness.views.history import read_runs
from tests.conftest import run_cli
from tests.helpers import serving

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


@pytest.mark.parametrize("name, expected", [
    ("vllm", {"kv_cache_usage_perc", "running", "waiting", "preempted_total", "prefix_cache_hit_tokens"}),
    ("sglang", {"kv_cache_usage_perc", "running", "waiting"}),
    ("tgi", {"running", "waiting"}),
])
def test_each_family_reads_its_own_names_and_leaves_the_rest_unknown(name, expected):
    metrics = parse((FIXTURES / f"{name}.txt").read_text())
    family = detect(metrics)
    assert family is not None and family.name == name
    row = family.row(metrics)
    assert {k for k, v in row.items() if v is not None} >= expected
    assert row.get("token_states_bytes") is None  # no family but fragbench's exports live-token bytes
    if name == "sglang":
        assert row["kv_cache_usage_perc"] == pytest.approx(0.28) and row["running"] == 12
    if name == "tgi":
        assert "kv_cache_usage_perc" not in row and row["waiting"] == 2


def test_an_unknown_page_has_no_family():
    assert detect(parse("# TYPE foo gauge\nfoo 1\n")) is None
    assert {f.name for f in FAMILIES} == {"fragbench", "vllm", "sglang", "tgi"}


class Fake(BaseHTTPRequestHandler):
    """/v1/models is HTML (not an OpenAI server); under /ok it is a model list, and every /metrics page there
    knows no family."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.endswith("/metrics"):
            body = b"# TYPE foo gauge\nfoo 1\n"
        elif self.path == "/ok/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        else:
            body = b"<html>hello</html>"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_url():
    with serving(Fake) as url:
        yield url


def bench(*args: str, timeout: float = 600):
    return run_cli("bench", "--engines", "", *args, "--out", "/nonexistent-never-written", timeout=timeout)


def test_bad_targets_exit_2_with_one_line_before_any_load(tiny_model, fake_url):
    closed = f"http://127.0.0.1:{free_port()}"
    cases = {
        "does not answer": ("--target", f"t={closed}"),
        "not an OpenAI": ("--target", f"t={fake_url}"),
        "none of the metric families": ("--target", f"t={fake_url}/ok"),
        "two targets named": ("--target", f"t={fake_url}/ok", "--target", f"t={fake_url}/ok"),
        "not an http:// or https:// URL": ("--target", "t=ftp://127.0.0.1:1"),
        "NAME=URL": ("--target", "no-url"),
    }
    for words, args in cases.items():
        r = bench(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (words, r.stderr)
        assert words in r.stderr, (words, r.stderr)
    r = run_cli("bench", "--engines", "paged", "--target", f"paged={fake_url}/ok", "--model", str(tiny_model))
    assert r.returncode == 2 and "one of --engines" in r.stderr
    assert not Path("/nonexistent-never-written").exists()


@pytest.mark.slow  # a bench sweep of two engines, one a --target: make test-all
def test_a_target_is_one_more_engine_of_the_run(tiny_model, tmp_path):
    """The contract: a separately started static-oracle beside the in-house paged, one report with both."""
    with start_server("static-oracle", str(tiny_model), "16MiB", tmp_path / "s.log") as srv:
        r = run_cli("bench", "--engines", "paged", "--target", f"mine={srv.url}", "--model", str(tiny_model),
                    "--kv-budget", "16MiB", "--workload", "mixed-churn", "--sweep", "--rates", "1,3",
                    "--point-duration", "4", "--grace", "3", "--out", str(tmp_path), "--reports", str(tmp_path),
                    "--run-id", "t", timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        assert srv.proc.poll() is None  # fragbench never stops a target
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    mine = summary["engines"]["mine"]
    assert mine["source"] == "target" and summary["engines"]["paged"]["source"] == "fragbench"
    assert mine["requests_ok"] > 0 and len(summary["capacity"]["mine"]["points"]) == 2
    # fragbench's own metrics export live-token bytes and capacity, not the reservation split: unknown
    assert mine["token_states_share"] is not None and mine["reservation_share"] is None
    assert mine["allocated_share"] is not None and mine["oom_total"] is None
    meta = json.loads((tmp_path / "t" / "run.json").read_text())
    assert meta["targets"]["mine"]["family"] == "fragbench"
    assert 0 < meta["targets"]["mine"]["network_rtt_s"] < 5  # the network's round trip, measured before the run
    assert "paged" in summary["twin"] and "mine" not in summary["twin"]  # a twin needs the engine's own steps
    html = (tmp_path / "t.html").read_text()
    assert "a server fragbench did not start" in html and "mine" in html
    runs, _ = read_runs(tmp_path)
    assert set(runs[0].engines) == {"paged", f"mine (target, {meta['targets']['mine']['model']})"}


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (make vllm)")
def test_a_vllm_target_reads_vllms_metrics(tiny_model, tmp_path):
    with start_server("vllm", str(tiny_model), "64MiB", tmp_path / "v.log", timeout_s=900) as srv:
        r = run_cli("bench", "--engines", "", "--target", f"v={srv.url}", "--model", str(tiny_model),
                    "--workload", "mixed-churn", "--sweep", "--rates", "1", "--point-duration", "6", "--grace", "3",
                    "--out", str(tmp_path), "--reports", str(tmp_path), "--run-id", "v", timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    v = summary["engines"]["v"]
    assert json.loads((tmp_path / "v" / "run.json").read_text())["targets"]["v"]["family"] == "vllm"
    assert v["allocated_share"] is not None and v["preemptions"] is not None
    assert v["token_states_share"] is None and v["reservation_share"] is None


def test_a_target_that_stops_answering_is_down_until_it_answers_again(tmp_path):
    """Recorded with its times, never restarted: the run goes on."""
    import time

    from harness.run.bench import Bench, BenchConfig, EngineRun
    from harness.units import KvBudget

    bench = Bench(BenchConfig(engines=[], model="m", kv_budget=KvBudget.parse("16MiB"), out_dir=tmp_path,
                              workload="mixed-churn", duration_s=1, run_id="w"))
    answers = iter([True, False, False, True])
    server = type("Gone", (), {"alive": lambda self: next(answers), "proc": None})()
    run = EngineRun("mine", time.time(), 0, server=server)
    for _ in range(4):
        run.checked_s = -1e9  # ask at once rather than every 2 s
        bench.servers.watch(run)
    events = [json.loads(x) for x in (tmp_path / "w" / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["crash", "restart"]
    assert "never restarts" in events[0]["detail"] and "answers again" in events[1]["detail"]
    assert json.loads((tmp_path / "w" / "engines" / "mine" / "down.json").read_text())[0][1] >= events[0]["t_s"]


class FakeVllm(BaseHTTPRequestHandler):
    """An OpenAI model list and vLLM's metrics page (the fixture's), on loopback."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/metrics":
            body = (FIXTURES / "vllm.txt").read_bytes()
        elif self.path in ("/v1/models", "/health"):
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_opened_target_records_the_networks_round_trip():
    from harness.run.targets import Target, open_targets

    with serving(FakeVllm) as url:
        target = open_targets([f"t={url}"], [], [])["t"]
    described = target.describe()
    assert described.family == "vllm" and 0 < described.network_rtt_s < 5
    assert json.loads(json.dumps(described.written()))["network_rtt_s"] == described.network_rtt_s  # run.json's
    assert Target.restore("t", described, None).network_rtt_s == described.network_rtt_s


def test_a_target_on_another_machine_is_accepted(monkeypatch):
    """Any http(s) host is a target (a server in a cluster); checked here without a packet sent: the calls that
    would reach it are replaced."""
    from harness.run import targets

    reached = []
    monkeypatch.setattr(targets, "model_id", lambda url, key: reached.append(url) or "m")
    monkeypatch.setattr(targets.Telemetry, "of", classmethod(lambda cls, url: reached.append(url) or None))
    monkeypatch.setattr(targets, "round_trip_s", lambda url, headers: reached.append(url) or 0.012)
    for url in ("http://10.0.0.5:8000", "https://llm.example.internal", "http://[fd00::5]:8000"):
        targets.check_url(url, "--target")  # no refusal
    opened = targets.open_targets(["far=http://10.0.0.5:8000"], [], [])["far"]
    assert opened.url == "http://10.0.0.5:8000" and opened.network_rtt_s == 0.012
    assert reached == ["http://10.0.0.5:8000", "http://10.0.0.5:8000/metrics", "http://10.0.0.5:8000"]
    with pytest.raises(targets.TargetRefused, match="not an http"):
        targets.check_url("ftp://10.0.0.5", "--target")
    with pytest.raises(targets.TargetRefused, match="no valid port"):
        targets.check_url("http://10.0.0.5:99999", "--target")
