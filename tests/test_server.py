"""The OpenAI-compatible server: cancellation frees memory, streaming equals non-streaming, bad input is 4xx."""

import asyncio
import json
import re

import aiohttp
import pytest

from tests.helpers import scaled

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["paged", "static", "hf"])
def server(request, servers):
    return servers(request.param)  # the session's server of that engine (tests/conftest.py)


async def stream_tokens(session, url, body, cut_after=None):
    tokens = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            if cut_after is not None and len(tokens) >= cut_after:
                resp.close()  # the client goes away mid-stream
                return tokens
    return tokens


async def storm(url, prompts):
    async with aiohttp.ClientSession() as session:
        jobs = [
            # a cut stream asks for 240 tokens and reads 5: an engine that finished it (finished_reason "length",
            # not "abort") before the disconnect was seen would have to outrun a slow client ten times as far as
            # with 24, which a loaded 2-core machine once did
            stream_tokens(session, url, {"prompt": p, "max_tokens": 240 if i % 2 else 24, **GREEDY},
                          cut_after=5 if i % 2 else None)
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*jobs)


def get_json(url):
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return await r.json()
    return asyncio.run(go())


def get_text(url):
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return await r.text()
    return asyncio.run(go())


def post(url, data, headers=None):
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers or {}) as r:
            return r.status, await r.json()
    return asyncio.run(go())


def test_cancelled_streams_free_their_kv(server):
    before = abort_count(server.url)
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(5 + i % 40)] for i in range(64)]
    results = asyncio.run(storm(server.url, prompts))
    assert all(len(t) == 24 for t in results[::2])
    assert all(len(t) >= 5 for t in results[1::2])
    stats = wait_drained(server.url)
    assert stats["allocated_bytes"] == 0 and stats["running"] == 0
    assert abort_count(server.url) - before == 32


def wait_drained(url, timeout_s=2.0):
    """/stats once the server holds nothing, or at `timeout_s` scaled to the machine (the aborts reach the engine
    at its next step: later on a slow or busy machine)."""
    import time

    deadline = time.monotonic() + scaled(timeout_s)
    while True:
        stats = get_json(f"{url}/stats")
        if (stats["allocated_bytes"] == 0 and stats["running"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def abort_count(url):
    text = get_text(f"{url}/metrics")
    m = re.search(r'fragbench:request_success_total\{finished_reason="abort"\} (\S+)', text)
    return float(m.group(1))


def test_streaming_and_whole_responses_carry_the_same_tokens(server):
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 12, **GREEDY}
    status, whole = post(f"{server.url}/v1/completions", json.dumps(body))
    assert status == 200
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}

    async def go():
        async with aiohttp.ClientSession() as s:
            return await stream_tokens(s, server.url, body)
    assert asyncio.run(go()) == whole["choices"][0]["token_ids"]


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": 5, "max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": "four"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": list(range(3, 2100)), "max_tokens": 1}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1, 2, 99999], "max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1, 2, -1], "max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "n": 17}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": "x" * (2**20 + 10), "max_tokens": 4}).encode(), 413, None),
    # Python's JSON reader takes NaN and Infinity literals: each must be refused, naming its field
    *[(json.dumps({"prompt": "hi", "max_tokens": 4, field: float(value)}).encode(), 400, field)
      for field in ("temperature", "top_p", "max_tokens", "n", "seed") for value in ("nan", "inf", "-inf")],
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(server, body, status, param):
    got, err = post(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    assert got == status
    assert err["error"]["param"] == param and err["error"]["message"]
    ok, resp = post(f"{server.url}/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 2, **GREEDY}))
    assert ok == 200 and len(resp["choices"][0]["token_ids"]) == 2


def test_the_oom_snapshot_is_absent_outside_the_cuda_memory_mode(server):
    async def go():
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/memory_snapshot") as r:
            return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 404 and body["error"]["param"] == "memory_snapshot"
    assert get_json(f"{server.url}/stats")["oom_snapshot"] is False


METRICS_CONTRACT = ("fragbench:time_to_first_token_seconds", "fragbench:e2e_request_latency_seconds",
                    "fragbench:request_prompt_tokens", "fragbench:request_generation_tokens")


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """Each contract histogram's (_count, _sum) on a /metrics page."""
    def value(series: str) -> float:
        return float(re.search(rf"^{series} (\S+)", text, re.M).group(1))

    return {name: (value(f"{name}_count"), value(f"{name}_sum")) for name in METRICS_CONTRACT}


def test_every_engines_metrics_carry_the_monitoring_contract(server):
    """The session's server has served other tests' requests: what this request added is the difference of the
    histograms before and after it (the server observes a request before it answers it, and this worker's tests
    use it one at a time). 4 prompt tokens and 4 generated (ignore_eos): one observation each, those sums."""
    before = get_text(f"{server.url}/metrics")
    for name in METRICS_CONTRACT:
        assert f"# TYPE {name} histogram" in before, name
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, **GREEDY}
    assert post(f"{server.url}/v1/completions", json.dumps(body))[0] == 200
    text = get_text(f"{server.url}/metrics")
    was, now = histogram_totals(before), histogram_totals(text)
    added = {name: (now[name][0] - was[name][0], now[name][1] - was[name][1]) for name in METRICS_CONTRACT}
    for name in METRICS_CONTRACT:
        assert added[name][0] == 1, (name, added[name])
    assert added["fragbench:request_prompt_tokens"][1] == 4 and added["fragbench:request_generation_tokens"][1] == 4
    for name in ("fragbench:time_to_first_token_seconds", "fragbench:e2e_request_latency_seconds"):
        assert added[name][1] > 0, (name, added[name])  # a served request takes some time
    assert re.search(r"^fragbench:kv_live_tokens \S+", text, re.M)
    assert re.search(r'^fragbench:kv_failed_allocation_bytes_total\{cause="fragmentation"\} \S+', text, re.M)
