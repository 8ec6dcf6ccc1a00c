"""Bad input never takes anything down: a hostile body gets a 4xx, one request's failure is its own, an
engine-wide failure ends every open request at once and the process exits, no child outlives its parent,
and no budget breaks a policy."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pandas as pd
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.kv import GrowthKV, PagedKV, StaticKV
from engines.memory.arena import Arena
from engines.peers.vllm import vllm_python
from engines.procs import free_port
from harness.run.servers import start_server
from tests.conftest import ROOT, run_cli
from tests.helpers import scaled
from tests.test_reliability import drained, get

GREEDY = {"temperature": 0, "ignore_eos": True}
NORMAL = {"prompt": [5, 6, 7, 8], "max_tokens": 6, **GREEDY}


def complete(url: str, body: bytes) -> tuple[int, dict]:
    """The answer's status and JSON; a streamed answer (a body that asked stream: true) read as SSE: every
    event JSON, the stream ended by [DONE], as {"events": [...]}."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
                return r.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    data = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", raw[-200:]
    return 200, {"events": [json.loads(d) for d in data[:-1]]}


# -- the whole request schema, fuzzed against a live server of each engine
FIELDS = ["prompt", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "seed", "ignore_eos",
          "model"]
SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e-320]),
    st.text(max_size=12), st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3),
)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=3), max_leaves=12)


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'


@st.composite
def hostile(draw) -> bytes:
    """A normal body with some fields replaced by any JSON value, or a body malformed as a whole."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "duplicate", "deep", "raw", "huge"]))
    if kind == "deep":
        return nested(draw(st.integers(50, 200_000)))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "huge":
        return b'{"prompt": "' + b"a" * (2**20 + draw(st.integers(1, 1000))) + b'", "max_tokens": 2}'
    body = dict(NORMAL)
    for key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body[key] = draw(JSON)
    text = json.dumps(body)  # NaN and Infinity go out as the literals Python's reader accepts
    if kind == "duplicate":  # the same key twice: the last one is the one that counts
        key = draw(st.sampled_from(FIELDS))
        text = text[:-1] + f', "{key}": {json.dumps(draw(JSON))}}}'
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module", params=["paged", "static", "hf", "hf-cb"])
def live(request, servers):
    # the session's server of that engine, the one test_reliability's cancel storms use (tests/conftest.py): a short
    # max-seq-len bounds what a fuzzed request can cost, and a hostile body must not harm a server others use
    srv = servers(request.param, "32MiB", "--max-seq-len", "256")
    status, first = complete(srv.url, json.dumps(NORMAL).encode())
    assert status == 200
    srv.expected = first["choices"][0]["token_ids"]
    return srv


# make stress runs many more (FRAGBENCH_FUZZ_EXAMPLES)
@settings(max_examples=int(os.environ.get("FRAGBENCH_FUZZ_EXAMPLES", "10")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(body=hostile())
def test_hostile_bodies_get_a_4xx_and_normal_requests_their_tokens(live, body):
    status, answer = complete(live.url, body)
    assert status < 500, answer
    if status >= 400:
        assert answer["error"]["message"] and answer["error"]["code"] == status
    status, normal = complete(live.url, json.dumps(NORMAL).encode())
    assert status == 200 and normal["choices"][0]["token_ids"] == live.expected


def test_after_the_fuzzing_nothing_is_allocated_and_the_engine_is_up(live):
    assert live.alive() and get(f"{live.url}/health")[0] == 200
    assert drained(live.url)["allocated_bytes"] == 0


# -- one sequence's failure is its request's alone
@pytest.fixture
def poisoned_server(tiny_model, monkeypatch):
    """An in-process paged server whose sampler raises for the request with seed 666 only."""
    from transformers import AutoTokenizer

    import engines.scheduled.engine
    from engines.api.server import CompletionServer, serve
    from engines.factory import EngineSpec, make_engine

    real = engines.scheduled.engine.sample

    def sample(logits, params, generator, greedy=None):
        if params.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator, greedy)

    monkeypatch.setattr(engines.scheduled.engine, "sample", sample)
    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * 2**20, max_seq_len=256))
    server = CompletionServer(engine, AutoTokenizer.from_pretrained(tiny_model), "tiny")
    bound = threading.Event()
    port = free_port()
    threading.Thread(target=lambda: asyncio.run(serve(server, "127.0.0.1", port, lambda p: bound.set())),
                     daemon=True).start()
    assert bound.wait(30)
    return f"http://127.0.0.1:{port}"


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[int], list[dict]]:
    tokens, errors = [], []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                tokens += event["choices"][0]["token_ids"]
    return tokens, errors


def test_an_error_in_one_sequence_fails_that_request_alone(poisoned_server):
    url = poisoned_server

    async def go():
        async with aiohttp.ClientSession() as s:
            jobs = [stream(s, url, {"prompt": [5 + i, 6, 7], "max_tokens": 40, "seed": i, **GREEDY}) for i in range(4)]
            jobs.append(stream(s, url, {"prompt": [9, 9, 9], "max_tokens": 40, "seed": 666, **GREEDY}))
            return await asyncio.gather(*jobs)

    results = asyncio.run(go())
    for tokens, errors in results[:4]:
        assert len(tokens) == 40 and not errors
    tokens, errors = results[4]
    assert errors and "probability tensor" in errors[0]["message"]
    status, whole = complete(url, json.dumps({"prompt": [1, 2], "max_tokens": 3, "seed": 666, **GREEDY}).encode())
    assert status == 500 and "probability tensor" in whole["error"]["message"]
    assert get(f"{url}/health")[0] == 200
    stats = drained(url)
    assert stats["allocated_bytes"] == 0 and stats["finished_total"]["error"] == 2


# -- an engine-wide failure: every open request ends, /health is 503, the process exits non-zero
def test_an_engine_wide_error_ends_every_request_and_the_process(tiny_model, tmp_path):
    srv = start_server("paged", str(tiny_model), "16MiB", tmp_path / "s.log", extra=["--fail-at-step", "30"])
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                jobs = [stream(s, srv.url, {"prompt": [5 + i, 6], "max_tokens": 200, **GREEDY}) for i in range(6)]
                return await asyncio.gather(*jobs)

        started = time.monotonic()
        results = asyncio.run(go())
        ended = time.monotonic()
        health = get(f"{srv.url}/health")[0] if srv.alive() else 503
        for tokens, errors in results:
            assert len(tokens) < 200 and errors and "injected engine error" in errors[0]["message"]
        # nobody waits on the dead engine: its 30 steps and the failure, on this machine (scaled), not a client's
        # timeout (aiohttp's, 300 s)
        assert ended - started < scaled(30)
        assert health == 503
        assert srv.proc.wait(scaled(10)) == 71
    finally:
        srv.stop()


def test_bench_restarts_an_engine_that_failed_and_records_the_crash(tiny_model, tmp_path):
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--duration", "8", "--grace", "5",
                "--kv-budget", "16MiB", "--workload", "chat-short", "--engine-args", "paged=--fail-at-step 150",
                "--out", str(tmp_path), "--reports", str(tmp_path), "--run-id", "failing", timeout=600)
    # the idle integrity probes take about 370 steps, so the first server dies during them and the restarted one
    # serves the churn until its own step 150: on a busy machine its restart can outlast the churn, every request
    # then fails, and the run rightly exits 1 saying it measured nothing; the restart is what is tested
    assert r.returncode == 0 or (r.returncode == 1 and "the run measured nothing" in r.stderr), r.stderr[-2000:]
    events = pd.read_parquet(tmp_path / "failing" / "events.parquet")
    assert {"crash", "restart"} <= set(events.kind)
    assert "71" in events[events.kind == "crash"].detail.iloc[0]
    assert json.loads((tmp_path / "failing" / "summary.json").read_text())["engines"]["paged"]["crashes"] >= 1


# -- no child process outlives its parent
def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def all_gone(procs: list[psutil.Process], timeout_s: float = 15) -> list[psutil.Process]:
    """Those of `procs` still running after `timeout_s` (scaled to the machine: a busy one stops them later)."""
    _, alive = psutil.wait_procs(procs, timeout=scaled(timeout_s))
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_to_bench_mid_run_leaves_no_child(tiny_model, tmp_path):
    bench = subprocess.Popen([sys.executable, "-m", "harness.cli", "bench", "--engines", "paged", "--model",
                              str(tiny_model), "--duration", "60", "--kv-budget", "16MiB", "--workload", "chat-short",
                              "--out", str(tmp_path), "--reports", str(tmp_path), "--run-id", "term"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + scaled(120)  # the server's start and the probes before the churn: the machine's
        while time.time() < deadline and not (tmp_path / "term" / "engines" / "paged" / "loadgen.log").exists():
            time.sleep(0.5)
        time.sleep(3)
        children = descendants(bench.pid)
        assert len(children) >= 2  # the engine server and the load generator
        bench.send_signal(signal.SIGTERM)
        bench.wait(scaled(60))
        assert not all_gone(children)
    finally:
        bench.kill()


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (make vllm)")
def test_sigterm_to_serve_vllm_leaves_no_vllm_process(tiny_model, tmp_path):
    srv = start_server("vllm", str(tiny_model), "64MiB", tmp_path / "vllm.log", extra=["--max-seq-len", "512"],
                       timeout_s=900)
    children = descendants(srv.proc.pid)
    assert children  # the api_server, and its EngineCore
    os.kill(srv.proc.pid, signal.SIGTERM)  # the serve process alone, as systemd or a script would
    srv.proc.wait(60)
    assert not all_gone(children, 60)


def test_a_spawned_child_dies_with_a_sigkilled_parent(tmp_path):
    code = ("import sys, time; from engines.procs import spawn; "
            "p = spawn([sys.executable, '-c', 'import time; time.sleep(120)']); print(p.pid, flush=True); "
            "time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert not all_gone([child], 10)


# -- no budget breaks a policy
@settings(max_examples=300, deadline=None)
@given(budget=st.integers(512, 2**30), placement=st.sampled_from(["best-fit", "buddy"]),
       block_size=st.sampled_from([1, 16, 32]))
def test_every_policy_starts_within_any_budget(budget, placement, block_size):
    kvb, max_seq_len = 8192, 256
    block_bytes = block_size * kvb
    policies = [lambda a: PagedKV(a, kvb, max_seq_len, block_size), lambda a: GrowthKV(a, kvb, max_seq_len),
                *[lambda a, r=r: StaticKV(a, kvb, max_seq_len, r) for r in ("max", "pow2", "oracle")]]
    for make in policies:
        arena = Arena(budget, placement, backing_device=None)
        fits_a_block = arena.rounded(block_bytes) <= arena.stats().largest_free_bytes
        try:
            kv = make(arena)
        except ValueError as e:  # a budget under one block is said so, in a sentence
            assert not fits_a_block and "holds no block" in str(e)
            continue
        mem = arena.stats()
        assert mem.allocated_bytes <= budget
        assert kv.stats().kv_capacity_bytes <= budget
        if isinstance(kv, PagedKV):
            assert len(kv.pool.blocks) >= 1
            # the largest pool that fits: one more block would not
            assert arena.rounded((len(kv.pool.blocks) + 1) * block_bytes) > budget or placement == "buddy"


def test_a_budget_off_the_allocator_granule_starts_and_serves(tiny_model, tmp_path):
    with start_server("paged", str(tiny_model), "33MB", tmp_path / "s.log") as srv:
        status, out = complete(srv.url, json.dumps({"prompt": "hello", "max_tokens": 3, **GREEDY}).encode())
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 3
        assert get(f"{srv.url}/stats")[1]["kv_capacity_bytes"] <= 33_000_000


def test_simulate_on_a_small_budget_prints_its_result():
    r = run_cli("simulate", "--model", "tiny-llama", "--gpu-mem", "64MiB", "--workload", "mixed-churn", "--policy",
                "static-oracle,paged", "--requests", "200", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["policies"]) == {"static-oracle", "paged"} and "Traceback" not in r.stderr
