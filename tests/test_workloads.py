"""Workload specs, deterministic traces, real-trace replay, and the Locust load generator."""

import re
import time
import urllib.request

import pandas as pd
import pytest

from tests.conftest import run_cli
from tests.helpers import scaled
from workloads.generate import trace
from workloads.spec import load_spec, preset_names


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    paths = [tmp_path / f"{n}.jsonl" for n in "abc"]
    for path, seed in zip(paths, ("7", "7", "8"), strict=True):
        r = run_cli("workload", "trace", "mixed-churn", "--seed", seed, "--out", str(path))
        assert r.returncode == 0, r.stderr
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c
    first = pd.read_json(paths[0], lines=True)
    expected = {"arrival_s", "class", "prompt_ids", "max_tokens", "n", "stream", "cancel_after_tokens", "read_delay_s"}
    assert expected <= set(first.columns)


def test_azure_conv_show_matches_the_scaled_trace():
    r = run_cli("workload", "show", "azure-conv")
    assert r.returncode == 0, r.stderr
    # the trace: input p50 1,020, p90 2,735, p99 4,142; scaled from 8k to 2k context: x0.25
    prompt = re.search(r"prompt\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", r.stdout).groups()
    mean, p50, p90, p99 = map(int, prompt)
    assert abs(mean - 1155 / 4) < 5 and abs(p50 - 1020 / 4) < 5 and abs(p90 - 2735 / 4) < 5
    assert abs(p99 - 4142 / 4) < 10
    assert "5.53 req/s" in r.stdout and "CC BY 4.0" in r.stdout


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_fits_the_context(name):
    t = trace(load_spec(name), seed=1, max_seq_len=512)
    assert t.requests
    assert all(len(r.prompt_ids) + r.max_tokens <= 512 for r in t.requests[:500])
    assert all(3 <= i < 4096 for r in t.requests[:50] for i in r.prompt_ids)


def test_mooncake_equal_hash_ids_become_equal_prefixes():
    t = trace(load_spec("mooncake-prefix"), seed=0, max_seq_len=2048)
    block = round(512 * 2048 / 32768)
    # every Mooncake request starts with hash id 0, the shared system prompt
    first_blocks = {tuple(r.prompt_ids[:block]) for r in t.requests[:200] if len(r.prompt_ids) >= block}
    assert len(first_blocks) == 1


def test_shared_system_prompt_shares_prefixes():
    t = trace(load_spec("shared-system-prompt"), seed=0)
    heads = [tuple(r.prompt_ids[:256]) for r in t.requests]
    top_two = pd.Series(heads).value_counts().iloc[:2].sum()
    assert top_two / len(heads) > 0.8


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("name: x\nnum_requests: 3\nbogus: 1\narrival: {process: poisson, rate: 1}\n"
         "classes: [{name: a, weight: 1, prompt: {dist: fixed, value: 4}, output: {dist: fixed, value: 4}}]", "bogus"),
        ("name: x\narrival: {process: poisson, rate: -2}\n"
         "classes: [{name: a, weight: 1, prompt: {dist: fixed, value: 4}, output: {dist: fixed, value: 4}}]",
         "arrival.rate"),
        ("name: x\narrival: {process: trace}\ntrace: {path: /no/such/trace.csv}\n", "trace file not found"),
    ],
)
def test_bad_specs_exit_2_naming_the_problem(tmp_path, spec, needle):
    path = tmp_path / "w.yaml"
    path.write_text(spec)
    r = run_cli("workload", "show", str(path))
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_spec_file_exits_2():
    r = run_cli("workload", "show", "/no/such/spec.yaml")
    assert r.returncode == 2 and "not found" in r.stderr


def test_load_cancel_storm_counts_match_the_servers_aborts(tiny_model, tmp_path):
    from harness.run.servers import start_server

    with start_server("paged", str(tiny_model), "32MiB", tmp_path / "server.log") as srv:
        out = tmp_path / "load"
        r = run_cli("load", "--target", srv.url, "--workload", "cancel-storm", "--duration", "8",
                    "--out", str(out))
        assert r.returncode == 0, r.stderr
        df = pd.read_parquet(out / "requests.parquet")
        cancelled = int((df.status == "cancelled").sum())
        # the engine books an abort when its step notices the closed stream, which can come after the client has
        # written its row: read until every request is booked (aborted or finished) and the counts stand still
        # for a second, within 15 s on the developers' quiet machine (scaled: a busy one's steps come later)
        counts, deadline = None, time.time() + scaled(15)
        while time.time() < deadline:
            metrics = urllib.request.urlopen(f"{srv.url}/metrics").read().decode()
            now = {reason: float(n) for reason, n in
                   re.findall(r'request_success_total\{finished_reason="(\w+)"\} (\S+)', metrics)}
            if now == counts and sum(now.values()) >= len(df):
                break
            counts = now
            time.sleep(1.0)
    assert {"ok", "cancelled"} <= set(df.status)
    aborts = counts.get("abort", 0.0)
    finished = sum(n for reason, n in counts.items() if reason != "abort")
    ok = df[df.status == "ok"]
    # every request the client sent is booked once by the server, as aborted or finished
    assert aborts + finished == len(df)
    # a cancel the server meets only after it has finished the request is a finished request there (a loaded suite
    # showed 33 aborts beside 34 cancelled rows, standing for 15 s; the nearest cancel came 9 tokens before the
    # request's end): every cancelled row is an abort or one of those, and nothing is lost
    assert aborts <= cancelled and finished - len(ok) == cancelled - aborts
    assert (ok.output_tokens == ok.output_tokens_target).all()
    assert ok.ttft_s.notna().all() and (ok.ttft_s > 0).all()


class FakeSocket:
    """Hands out one chunk per recv, as a socket does when the bytes arrive."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def recv(self, n):
        return self.chunks.pop(0) if self.chunks else b""


class FakeResponse:
    block_size = 4096

    def __init__(self, chunks, complete_after):
        self._sock, self._body_buffer = FakeSocket(chunks), bytearray()
        self.complete_after, self.reads, self.message_complete = complete_after, 0, False

    def feed(self, data):
        self._body_buffer += data
        self.reads += 1
        self.message_complete = self.reads >= self.complete_after


def test_sse_events_carry_the_time_their_bytes_arrived_and_split_across_reads():
    from workloads.sse import events

    raw = FakeResponse([b'data: {"a": 1}\n\ndata: {"a"', b': 2}\n\ndata: [DONE]\n\n'], complete_after=2)
    got = list(events(raw))
    assert [d for _, d in got] == [b'{"a": 1}', b'{"a": 2}', b"[DONE]"]
    assert got[0][0] <= got[1][0] == got[2][0]  # the second read's events share its arrival time


def test_sse_a_stream_cut_before_its_end_is_an_error():
    from workloads.sse import events

    raw = FakeResponse([b'data: {"a": 1}\n\n'], complete_after=99)
    with pytest.raises(ConnectionError, match="mid-stream"):
        list(events(raw))
