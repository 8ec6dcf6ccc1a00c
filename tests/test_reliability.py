"""Nothing leaks, nothing is lost, no input kills anything (short forms; `make stress` runs the long ones)."""

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.run.servers import start_server
from harness.run.storm import cancel_storm
from tests.conftest import run_cli
from tests.helpers import scaled


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def drained(url: str, timeout_s: float = 10) -> dict:
    """/stats once the server holds nothing, or at `timeout_s` (scaled to the machine: a slow one frees later)."""
    deadline = time.time() + scaled(timeout_s)
    while True:
        _, stats = get(f"{url}/stats")
        if (stats["allocated_bytes"] == 0 and stats["running"] == 0) or time.time() > deadline:
            return stats
        time.sleep(0.2)


@pytest.mark.parametrize("engine", ["paged", "static", "hf"])
def test_cancel_storm_leaves_nothing_behind(engine, servers):
    # a short context, so that even static reservations fit several at once; the session's server of that engine
    srv = servers(engine, "32MiB", "--max-seq-len", "256")
    _, before = get(f"{srv.url}/stats")
    result = asyncio.run(cancel_storm(srv.url, requests=200, concurrency=32, seed=1))
    stats = drained(srv.url)
    assert result.sent == 200 and result.status_5xx == 0 and not result.errors and result.oom == 0
    assert 60 < result.cancelled < 140 and result.cancelled + result.completed == 200
    assert stats["allocated_bytes"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["threads"] == before["threads"]  # no thread left behind
    assert stats["asyncio_tasks"] <= before["asyncio_tasks"] + 1  # only the /stats handler itself
    assert stats["abort_release_p99_steps"] <= 2


BODY = st.dictionaries(
    st.sampled_from(["prompt", "max_tokens", "n", "stream", "temperature", "top_p", "seed", "ignore_eos", "model",
                     "stream_options", "logprobs", "x"]),
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.text(max_size=20),
              st.lists(st.integers(-5, 5000), max_size=20), st.lists(st.text(max_size=5), max_size=3),
              st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)),
    max_size=8,
)


@pytest.fixture(scope="module")
def fuzz_server(servers):
    return servers("paged", "32MiB", "--max-seq-len", "256")  # the session's (tests/conftest.py)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(BODY, st.binary(max_size=64).map(lambda b: {"raw": b})))
def test_fuzzed_bodies_never_get_a_5xx(fuzz_server, body):
    if "raw" in body:
        data = body["raw"]
    else:
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
            body["max_tokens"] = 64  # keep valid requests short; validity is not what is fuzzed here
        data = json.dumps(body).encode()
    status, answer = post(f"{fuzz_server.url}/v1/completions", data)
    assert status < 500, answer
    if status >= 400:
        assert answer["error"]["message"]


def test_after_fuzzing_the_server_is_up_and_memory_is_back(fuzz_server):
    assert fuzz_server.alive()
    stats = drained(fuzz_server.url)
    assert stats["allocated_bytes"] == 0


def test_api_key_is_required_when_set(tiny_model, tmp_path):
    with start_server("paged", str(tiny_model), "16MiB", tmp_path / "s.log", extra=["--api-key", "s3cret"]) as srv:
        assert srv.url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2, "temperature": 0}).encode()
        status, err = post(f"{srv.url}/v1/completions", body)
        assert status == 401 and err["error"]["param"] == "authorization"
        assert get(f"{srv.url}/stats")[0] == 401
        ok, _ = post(f"{srv.url}/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert ok == 200
        # nothing in a request names a file: a path-like model is only echoed back
        ok, out = post(f"{srv.url}/v1/completions", json.dumps({"prompt": [5], "max_tokens": 1, "temperature": 0,
                                                                "model": "../../etc/passwd"}).encode(),
                       {"Authorization": "Bearer s3cret"})
        assert ok == 200 and "root:" not in json.dumps(out)


def test_report_escapes_strings_from_results(tmp_path):
    from harness.views.report import render

    run = tmp_path / "run"
    (run / "engines" / "paged").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "<b>x</b>", "status": "complete",
                                              "config": {"workload": "<img src=x onerror=alert(1)>",
                                                         "engines": ["paged"]}}))
    evil = "<script>alert(1)</script>"
    row = {"engine": "paged", "request_id": evil, "class": evil, "arrival_s": 0, "sent_s": 0, "first_token_s": 0.1,
           "end_s": 1.0, "prompt_tokens": 5, "output_tokens_target": 4, "output_tokens": 4, "n": 1, "stream": True,
           "status": "ok", "error": evil, "ttft_s": 0.1, "tpot_s": 0.2, "e2e_s": 1.0, "inter_token_s": "[0.2]"}
    (run / "engines" / "paged" / "requests.jsonl").write_text(json.dumps(row) + "\n")
    (run / "samples.jsonl").write_text("")
    (run / "events.jsonl").write_text(json.dumps({"engine": "paged", "t_s": 0.5, "kind": "oom", "cause": evil,
                                                  "detail": evil, "requested_bytes": 1}) + "\n")
    html = render(run, tmp_path / "r.html").read_text()
    assert evil not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def start_s(tiny_model, log: Path) -> float:
    """Seconds a paged server takes to start here, now (what the bench's restart takes): measured, not assumed."""
    began = time.monotonic()
    start_server("paged", str(tiny_model), "16MiB", log, threads=2).stop()  # the bench's --threads default
    return time.monotonic() - began


KILL_AFTER_S = 4
MEASURED_AFTER_S = 10  # seconds of the schedule left once the server is back: chat-short's 4 req/s, ~40 requests


def test_sigkilled_engine_is_restarted_and_its_requests_are_crashed(tiny_model, tmp_path):
    # The load's schedule runs on while the server is down: it must outlast the restart, whose time is the machine's
    # (a fixed 20 s schedule left 19 s after the kill, and on a busy machine no request came after the restart; a
    # bench's set-up of paged, its start and idle probes, took 8.5 s at a load average of 3 and 85 s at 11). So the
    # schedule is the kill, three times the start measured just now, and MEASURED_AFTER_S of requests after.
    restart_s = start_s(tiny_model, tmp_path / "measured.log")
    duration = KILL_AFTER_S + 3 * restart_s + MEASURED_AFTER_S
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--duration", f"{duration:.0f}", "--grace",
                "5", "--kv-budget", "16MiB", "--workload", "chat-short", "--kill-after", str(KILL_AFTER_S), "--out",
                str(tmp_path), "--reports", str(tmp_path), "--run-id", "chaos", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    events = pd.read_parquet(tmp_path / "chaos" / "events.parquet")
    requests = pd.read_parquet(tmp_path / "chaos" / "requests.parquet")
    assert list(events[events.kind.isin(["crash", "restart"])].kind) == ["crash", "restart"]
    back = events[events.kind == "restart"].iloc[0]
    assert (requests.status == "crashed").any()
    after = requests[requests.sent_s > back.t_s + 0.5]
    seen = (f"a start took {restart_s:.1f} s, the schedule {duration:.0f} s, the restart {back.detail} at "
            f"{back.t_s:.1f} s; the requests after it: {after.status.value_counts().to_dict()}")
    print(seen)
    assert (after.status == "ok").any(), seen  # the rest of the run is measured
    journal = sum(1 for _ in open(tmp_path / "chaos" / "engines" / "paged" / "requests.jsonl"))
    assert len(requests) == journal  # no row lost
    summary = json.loads((tmp_path / "chaos" / "summary.json").read_text())
    assert summary["engines"]["paged"]["crashes"] == 1
    # the supervisor exports the restart where it runs, as node_exporter's textfile collector reads it
    exported = (tmp_path / "chaos" / "metrics" / "supervisor.prom").read_text()
    assert 'fragbench:engine_restarts_total{engine="paged"} 1.0' in exported
