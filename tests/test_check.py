"""fragbench check against our own servers (and vLLM when installed): answers from measured behaviour."""

import json

import pytest

from engines.peers.vllm import vllm_python
from engines.procs import free_port
from harness.run.servers import start_server
from tests.conftest import run_cli
from tests.helpers import scaled


def check(url: str, model: str, *extra: str) -> tuple[int, dict]:
    """Every question but the ninth (a knee search), unless --capacity-time is given."""
    capacity = () if "--capacity-time" in extra else ("--capacity-time", "0")
    r = run_cli("check", "--target", url, "--model", model, "--gpu-mem", "40GiB", "--duration", "8", "--json",
                *capacity, *extra, timeout=600)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def by_id(result: dict) -> dict[int, dict]:
    return {q["id"]: q for q in result["questions"]}


@pytest.mark.parametrize("engine, layout", [("static", "contiguous"), ("paged", "blocks")])
def test_check_infers_the_layout_and_prompt_release(engine, layout, tiny_model, tmp_path, servers):
    # the ninth question once, on one server; 20 s on the developers' quiet machine, scaled to this one: 12 measured
    # no point when the other worker's benches held the cores (the search's calibration windows took its time)
    capacity = ("--capacity-time", f"{scaled(20):.0f}") if engine == "paged" else ()
    srv = servers(engine)  # the session's server of that engine (tests/conftest.py)
    code, result = check(srv.url, str(tiny_model), "--report", str(tmp_path / "check.html"), *capacity)
    q = by_id(result)
    assert sorted(q) == list(range(1, 11))
    tenth = q[10]  # KV integrity: the probes sent into the churn against their idle answers
    assert tenth["status"] == "PASS" and tenth["answer"]["probes"] > 0, tenth["evidence"]
    assert tenth["answer"]["diverged"] == 0 and tenth["answer"]["max_abs_logprob_diff"] <= 1e-3
    if engine == "paged":  # the sustained rate with its interval, from bench's knee search
        ninth = q[9]
        assert ninth["status"] == "PASS", ninth["evidence"]
        lo, hi = ninth["answer"]["sustained_rps_ci"]
        assert 0 <= lo <= ninth["answer"]["sustained_rps"] <= hi and ninth["answer"]["sustained_rps"] > 0
        assert ninth["answer"]["bound"] in ("memory", "compute", "failures")
        assert "knee search" in ninth["evidence"] and "90 % interval" in ninth["evidence"]
    else:
        assert q[9]["status"] == "UNKNOWN"  # --capacity-time 0
    assert result["metrics_found"] == "fragbench"
    assert q[3]["answer"] == layout, q[3]["evidence"]
    assert q[6]["status"] == "PASS", q[6]["evidence"]
    assert q[1]["answer"] == 4096  # tiny-llama as built: float32
    assert all(x["status"] in ("PASS", "WARN", "FAIL", "UNKNOWN") and x["evidence"] for x in q.values())
    assert code == (1 if any(x["status"] == "FAIL" for x in q.values()) else 0)
    assert (tmp_path / "check.html").is_file()


def test_closed_port_exits_2_with_one_line(tiny_model):
    r = run_cli("check", "--target", f"http://127.0.0.1:{free_port()}", "--model", str(tiny_model))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (make vllm)")
def test_check_sees_blocks_in_vllm_usage_alone(tiny_model, tmp_path):
    with start_server("vllm", str(tiny_model), "64MiB", tmp_path / "v.log", timeout_s=900) as srv:
        _, result = check(srv.url, str(tiny_model), "--metrics-url", f"{srv.url}/metrics")
    assert result["metrics_found"] == "vllm"
    assert by_id(result)[3]["answer"] == "blocks", by_id(result)[3]["evidence"]


def test_a_release_read_before_the_last_token_is_not_growth():
    """The server frees a contiguous reservation as it sends the last token; a loaded client reads that token
    after the sampler saw usage fall. One whole reservation at admission, flat, then the release: contiguous."""
    from harness.check import classify_layout
    from harness.check.measures import LayoutProbe

    times = [0.1 * i for i in range(1, 41)]
    rows = [{"t_s": t, "usage": 0.25} for t in times[:-1]] + [{"t_s": times[-1] - 0.01, "usage": 0.0}]
    rows.sort(key=lambda r: r["t_s"])
    layout, evidence = classify_layout(LayoutProbe(0.0, rows, times, None), 8192)
    assert layout == "contiguous", evidence


def test_check_speaks_chat_to_a_server(tiny_model, servers):
    """--api chat: the probe and the churn go to /v1/chat/completions, and the answers are the same kind."""
    code, result = check(servers("paged").url, str(tiny_model), "--api", "chat")
    q = by_id(result)
    assert q[3]["answer"] == "blocks", q[3]["evidence"]
    assert q[6]["status"] == "PASS", q[6]["evidence"]



def test_the_questions_are_records_each_with_the_function_that_answers_it():
    from harness.check import QUESTIONS

    assert [q.id for q in QUESTIONS] == list(range(1, 11))
    assert all(q.text.endswith("?") and callable(q.answer) for q in QUESTIONS)


def test_a_probe_too_short_to_judge_is_followed_by_a_longer_one(monkeypatch):
    """A loaded server answered /metrics twice while the first probe's tokens streamed: the layout is asked
    again with a longer answer, and the evidence gives both probes."""
    import harness.check as check_module
    from harness.check import Found, layout
    from harness.check.measures import LayoutProbe

    times = [0.01 * i for i in range(1, 97)]
    starved = LayoutProbe(0.0, [{"t_s": 0.0, "usage": 0.0}, {"t_s": 0.5, "usage": 0.01}], times, None)
    # a block of 16 tokens taken every 16th token: 16 / 8192 of the capacity at a time
    rows = [{"t_s": t, "usage": 16 * (1 + i // 16) / 8192} for i, t in enumerate(times)]
    asked = []

    def probe(target, metrics, model_name, max_tokens, api):
        asked.append(max_tokens)
        return starved if len(asked) == 1 else LayoutProbe(0.0, rows, times, None)

    monkeypatch.setattr(check_module, "probe", probe)
    cfg = type("Cfg", (), {"target": "http://127.0.0.1:1", "max_seq_len": 2048, "api": "completions"})()
    session = type("S", (), {"cfg": cfg, "metrics": None, "model_name": None, "family": "fragbench",
                             "found": {2: Found("PASS", {"server_tokens": 8192}, "")}})()
    found = layout(session)
    assert asked == [96, 384] and found.answer == "blocks" and found.status == "PASS", found.evidence
    assert found.evidence.startswith("only 1 metric samples") and "then a longer probe" in found.evidence
