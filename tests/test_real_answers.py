"""Only real answers count (issue 88): a 200 whose body the client cannot read as the OpenAI API's (not JSON, no
choices, an error object, no token where tokens were asked) is a failed request with its reason, and a load whose
every request failed exits 1 in one line. The server is a real one on loopback answering garbage."""

from __future__ import annotations

import itertools
import json
from http.server import BaseHTTPRequestHandler

import pandas as pd
import pytest

from tests.conftest import run_cli
from tests.helpers import serving

# (a whole answer's body, a stream's body, the reason its row gives): whole answers take them one after another,
# and so do streams, each kind counted apart
GARBAGE = [
    (b"<html>It works!</html>", b"data: <html>It works!</html>\n\n", "not JSON"),
    (b'{"id": "x", "object": "text_completion"}', b'data: {"id": "x"}\n\n', "no choices"),
    (b'{"error": {"message": "overloaded"}}', b'data: {"error": {"message": "overloaded"}}\n\n', "overloaded"),
    (b'{"choices": [{"text": "", "finish_reason": "length"}]}', b'data: {"choices": []}\n\ndata: [DONE]\n\n',
     "200 but no token"),
]


class GarbageServer(BaseHTTPRequestHandler):
    """Up (its /health answers 200), and every completion a 200 whose body is not the API's answer."""

    turns = {True: itertools.count(), False: itertools.count()}  # streamed or not

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        asked = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        stream = bool(asked.get("stream"))
        whole, streamed, _ = GARBAGE[next(self.turns[stream]) % len(GARBAGE)]
        body = streamed if stream else whole
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if asked.get("stream") else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def garbage_url():
    with serving(GarbageServer) as url:
        yield url


# half the requests streamed, half whole answers, 24 of them at once: every garbage reaches both kinds
SPEC = """name: both-kinds
num_requests: 24
arrival: {process: poisson, rate: 1000.0}
classes:
  - {name: streamed, weight: 1, prompt: {dist: uniform, low: 8, high: 16}, output: {dist: uniform, low: 4, high: 8}}
  - {name: whole, weight: 1, stream: 0, prompt: {dist: uniform, low: 8, high: 16},
     output: {dist: uniform, low: 4, high: 8}}
"""


def test_a_load_answered_with_garbage_fails_every_request_with_its_reason(garbage_url, tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    r = run_cli("load", "--target", garbage_url, "--workload", str(tmp_path / "spec.yaml"), "--duration", "1",
                "--out", str(tmp_path / "out"))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"fragbench: error: {garbage_url}: all ") and "requests failed" in lines[0], lines
    rows = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    assert len(rows) == 24 and set(rows.status) == {"error"}, rows.status.value_counts()
    assert rows.error.str.len().gt(0).all() and (rows.output_tokens == 0).all()
    for stream, kind in ((True, "stream"), (False, "answer")):  # every garbage named in the rows it failed
        mine = rows[rows.stream == stream].sort_values("sent_s").error.tolist()
        assert len(mine) >= len(GARBAGE), (kind, mine)
        for _, _, reason in GARBAGE:
            reason = f"no token in the {kind}" if reason.endswith("no token") else reason
            assert any(reason in error for error in mine), (kind, reason, mine)
