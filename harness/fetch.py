"""The harness's one HTTP client for short requests to a server (/health, /stats, /metrics, /v1/models, a probe):
urllib, so that the bench, its sampler and `check` need no event loop. The load itself goes through the load
generator (harness/run/loadgen.py), not through here.

Two outcomes callers tell apart: the server answered with an error status (`HTTPError`: it is up), or nothing
answered (another `OSError`: refused, reset, timed out).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPResponse

HTTPError = urllib.error.HTTPError  # an answer with a 4xx or 5xx status


# `body`: the JSON posted as the caller built it (the wire's edge: serialized here, nothing reads it back)
def _request(url: str, body: dict | None, headers: dict[str, str] | None) -> urllib.request.Request:
    data = json.dumps(body).encode() if body is not None else None
    sent = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    return urllib.request.Request(url, data, sent)


def bearer(api_key: str | None) -> dict[str, str]:
    """The Authorization header an OpenAI-compatible server with a key wants (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> bytes:
    """The body of a GET. Raises HTTPError on an error status and OSError when nothing answers."""
    with urllib.request.urlopen(_request(url, None, headers), timeout=timeout_s) as r:
        return r.read()


# `body`: a completion request as check's probe builds it (harness/check), posted as JSON: the wire's edge
@contextmanager
def stream(url: str, body: dict, headers: dict[str, str] | None = None,
           timeout_s: float = 300.0) -> Iterator[HTTPResponse]:
    """A POST whose answer is read as it comes (iterate it for lines: server-sent events)."""
    with urllib.request.urlopen(_request(url, body, headers), timeout=timeout_s) as r:
        yield r


def json_or_none(url: str, timeout_s: float = 5.0) -> dict | None:
    """A JSON body, or None when the server is gone or answers with an error or garbage."""
    try:
        return json.loads(request(url, timeout_s=timeout_s))
    except (OSError, ValueError):
        return None


def text_or_none(url: str, timeout_s: float = 5.0) -> str | None:
    """A text body (a metrics page), or None when the server is gone or answers with an error."""
    try:
        return request(url, timeout_s=timeout_s).decode(errors="replace")
    except OSError:
        return None


def answers(url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> bool:
    """Whether anything answers at url: an error status counts (the server is up, it said no)."""
    try:
        request(url, headers=headers, timeout_s=timeout_s)
        return True
    except HTTPError:
        return True
    except OSError:
        return False


def ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether url answers 200 (a /health)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


SERVER_PATHS = ("/health", "/v1/models")  # what an OpenAI-compatible server answers without a body (vLLM, SGLang, TGI)


def server_answers(base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> bool:
    """Whether a server answers at base_url: any of SERVER_PATHS, an error status included (it is up, it said no).
    Every verb that sends load (load, bench, check) asks this first."""
    return any(answers(f"{base_url}{path}", headers, timeout_s) for path in SERVER_PATHS)


def round_trip_s(base_url: str, headers: dict[str, str] | None = None, tries: int = 5,
                 timeout_s: float = 5.0) -> float | None:
    """The median seconds of `tries` GETs of the first of SERVER_PATHS that answers: the network's round trip and
    the server's least work, for telling a remote target's latency from its serving; None where none answers."""
    for path in SERVER_PATHS:
        times = []
        for _ in range(tries):
            began = time.perf_counter()
            if not answers(f"{base_url}{path}", headers, timeout_s):
                break
            times.append(time.perf_counter() - began)
        if times:
            return statistics.median(times)
    return None


__all__ = ["HTTPError", "answers", "bearer", "json_or_none", "ok", "request", "round_trip_s", "server_answers",
           "stream", "text_or_none"]
