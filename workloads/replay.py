"""The Locust user that replays a trace open-loop: each request leaves at its arrival time in its own
greenlet (a late one is counted late, not shifted), streams over SSE, reads slowly or cancels as the
trace says, and reports exact client timestamps for every token.

It speaks HTTP through geventhttpclient (what Locust's FastHttpUser wraps) directly and reports each
request to Locust's request event itself: Locust's requests-based HttpUser cost tens of milliseconds of
client-side TTFT error under load, and FastHttpSession's per-request wrapping still cost about a tenth of the
requests a loaded client completes (benchmarks/loadgen_error.py measures both clocks)."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import gevent
from gevent.pool import Pool
from geventhttpclient import HTTPClient
from geventhttpclient.url import URL
from locust import User, task

from workloads.generate import TraceRequest
from workloads.outcome import UNFINISHED, Outcome, PointTags
from workloads.schedule import ScheduleReader
from workloads.sse import arrivals, events


@dataclass
class ReplayPlan:
    requests: list[TraceRequest]
    t0: float  # wall-clock origin of arrival times (time.time())
    duration_s: float
    on_outcome: Callable[[Outcome], None]
    closed_concurrency: int | None = None
    model: str | None = None
    grace_s: float = 30.0  # how long requests still in flight at the deadline may finish
    api_key: str | None = None
    api: str = "completions"  # or "chat": /v1/chat/completions, the prompt as one user message
    schedule: ScheduleReader | None = None  # segments decided while it runs (bench): `requests` is then unused
    on_first_token: Callable[[Outcome], None] | None = None  # told when a stream's first token arrives


# Chat content is text: a prompt's ids become one common English word each, a token each in Llama-family
# tokenizers (the server's usage gives the true count, template included).
WORDS = ("the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "as", "with")


def prompt_text(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def request_seed(request_id: str) -> int:
    """A request's sampling seed: its number in a trace (r000123), else a stable hash of its id (a stream's)."""
    digits = request_id[1:]
    return int(digits) if request_id.startswith("r") and digits.isdigit() else zlib.crc32(request_id.encode())


def request_body(plan: ReplayPlan, req: TraceRequest) -> dict:
    body = {"max_tokens": req.max_tokens, "n": req.n, "stream": req.stream, "temperature": req.temperature,
            "ignore_eos": True, "seed": request_seed(req.request_id)}
    if plan.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(req.prompt_ids)}]
    else:
        body["prompt"] = req.prompt_ids
    if plan.model:
        body["model"] = plan.model
    return body


class NotAnAnswer(ValueError):
    """A 200 whose body is not the API's answer (not JSON, no choices, an error object, no token where tokens were
    asked): the request failed, this its reason. Counted as answered, garbage would pass for a fast server."""


def answer_of(data: bytes, whole: bool) -> dict:  # the parse edge: a body, or one streamed event's data
    """The API's answer (or stream chunk) as json.loads gives it, or NotAnAnswer saying why it is not one. A whole
    answer has at least one choice; a chunk may have none (vLLM's closing usage chunk)."""
    try:
        payload = json.loads(data)
    except ValueError:
        raise NotAnAnswer(f"200 but not the API's answer: not JSON: {data[:80]!r}") from None
    if not isinstance(payload, dict):
        raise NotAnAnswer(f"200 but not the API's answer: not a JSON object: {data[:80]!r}")
    if "error" in payload:  # the server failed this request, after its 200 (mid-stream) or in it
        raise NotAnAnswer(str(payload["error"]))
    choices = payload.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices) or (whole and not choices):
        raise NotAnAnswer(f"200 but not the API's answer: no choices in {data[:80]!r}")
    return payload


def tokens_asked(req: TraceRequest, out: Outcome, text: bool = False) -> None:
    """A request that asked for tokens and got none, nor an OOM (an answer the run measures), nor text (a server
    that counts none), was not answered."""
    if req.max_tokens > 0 and not out.output_tokens and out.finish_reason != "oom" and not text:
        raise NotAnAnswer(f"200 but no token in the {'stream' if req.stream else 'answer'} "
                          f"({req.max_tokens} asked)")


def chunk_tokens(choice: dict) -> int:  # the parse edge: a streamed chunk's choice, as json.loads gave it
    """Tokens one streamed chunk carries: its token ids (fragbench, vLLM), else one if it carries text."""
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return len(choice.get("token_ids") or []) or (1 if text else 0)


def now(plan: ReplayPlan) -> float:
    return time.time() - plan.t0


class ReplayUser(User):
    """One per load-generator process; it dispatches its share of the trace."""

    host = "http://127.0.0.1"

    def on_start(self) -> None:
        # connections in flight: the trace bounds them, not the client; a queued request may wait long for
        # its first byte, and the plan's deadline ends it anyway
        url = URL(self.host)
        self.http = HTTPClient.from_url(url, concurrency=100_000, network_timeout=3600.0, connection_timeout=10.0)
        self.base_path = url.path.rstrip("/")

    @task
    def replay(self) -> None:
        plan: ReplayPlan = self.environment.replay_plan
        if plan.schedule is not None:
            return self.replay_schedule(plan)
        runner = self.environment.runner
        index, count = getattr(runner, "worker_index", 0), getattr(self.environment, "replay_workers", 1)
        mine = [r for i, r in enumerate(plan.requests) if i % count == index]
        pool = Pool(plan.closed_concurrency) if plan.closed_concurrency else Pool()
        for req in mine:
            if plan.closed_concurrency:
                pool.wait_available()
            else:
                delay = req.arrival_s - now(plan)
                if delay > 0:
                    gevent.sleep(delay)
            if now(plan) >= plan.duration_s:
                break
            pool.spawn(self.send, plan, req)
        pool.join(timeout=max(0.0, plan.duration_s - now(plan)) + plan.grace_s)
        pool.kill()
        self.environment.replay_done = True
        self.stop(force=True)

    def replay_schedule(self, plan: ReplayPlan) -> None:
        """The segments as the schedule gives them, each request tagged with its point, rate and stream place;
        once the schedule stops, what is in flight has the grace period to finish."""
        pool = Pool()
        for req, seg, index in plan.schedule.dispatch(lambda: now(plan)):
            pool.spawn(self.send, plan, req, PointTags(seg.point, seg.rate_rps, seg.key, index))
        pool.join(timeout=plan.grace_s)
        pool.kill()
        self.environment.replay_done = True
        self.stop(force=True)

    def send(self, plan: ReplayPlan, req: TraceRequest, tags: PointTags | None = None) -> None:
        sent = now(plan)
        late = 0.0 if plan.closed_concurrency else max(0.0, sent - req.arrival_s)
        due = sent if plan.closed_concurrency else req.arrival_s
        out = Outcome(req, sent, late, due_s=due, tags=tags)
        body = request_body(plan, req)
        path = f"{self.base_path}/v1/{'chat/completions' if plan.api == 'chat' else 'completions'}"
        headers = {"Content-Type": "application/json"}
        if plan.api_key:
            headers["Authorization"] = f"Bearer {plan.api_key}"
        resp, error = None, None
        try:
            resp = self.http.request("POST", path, body=json.dumps(body).encode(), headers=headers)
            out.http_status = resp.status_code
            if resp.status_code != 200:
                out.status, out.error = "rejected", resp.read().decode(errors="replace")[:200]
            elif req.stream:
                self._read_stream(plan, req, resp, out)
            else:
                self._read_whole(req, resp, out)
        except gevent.GreenletExit:
            out.status, out.error = "error", UNFINISHED
            raise
        except NotAnAnswer as e:  # a failed request, its reason in its row (and a failure in Locust's statistics)
            out.status, out.error = "error", str(e)[:200]
            error = e
        except Exception as e:  # a dead server: connection refused or reset; a body that is not JSON
            out.status, out.error = "error", f"{type(e).__name__}: {e}"[:200]
            error = e
        finally:
            if resp is not None:
                resp.release()  # back to the pool when read to its end; closed otherwise (a cancel, an error)
            out.end_s = now(plan)
            plan.on_outcome(out)
            # Locust's own statistics and web UI see every request, as they would from its HTTP users
            self.environment.events.request.fire(request_type="POST", name=req.cls, context={},
                                                 response_time=(out.end_s - sent) * 1e3, response_length=0,
                                                 exception=error, response=None, url=path)

    def _read_stream(self, plan: ReplayPlan, req: TraceRequest, resp, out: Outcome) -> None:
        cancel_at = req.cancel_after_s
        for stamp, data in events(resp):
            if data == b"[DONE]":
                for _ in arrivals(resp):  # the body's end, so that the connection can serve the next request
                    pass
                break
            t = stamp - plan.t0  # when the bytes arrived, whatever parsing came before
            choice = answer_of(data, whole=False)["choices"]  # not the API's: NotAnAnswer, recorded by send
            if not choice:
                continue
            tokens = chunk_tokens(choice[0])
            if tokens:
                if out.first_token_s is None and plan.on_first_token is not None:
                    out.first_token_s = t
                    plan.on_first_token(out)
                out.first_token_s = out.first_token_s if out.first_token_s is not None else t
                out.token_times_s.append(t)
                out.output_tokens += tokens
            if choice[0].get("finish_reason"):
                out.finish_reason = choice[0]["finish_reason"]
            if req.read_delay_s:
                gevent.sleep(req.read_delay_s)
            if (req.cancel_after_tokens is not None and out.output_tokens >= req.cancel_after_tokens) or (
                cancel_at is not None and t - out.sent_s >= cancel_at
            ):
                out.status = "cancelled"
                resp.release()  # the client goes away, closing the connection: the server must free the KV now
                return
        tokens_asked(req, out)
        out.status = "oom" if out.finish_reason == "oom" else "ok"

    def _read_whole(self, req: TraceRequest, resp, out: Outcome) -> None:
        data = answer_of(resp.read(), whole=True)
        choices = data["choices"]
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        out.output_tokens = sum(len(c.get("token_ids") or []) for c in choices) or usage.get("completion_tokens") or 0
        out.finish_reason = choices[0].get("finish_reason")
        tokens_asked(req, out, text=any(c.get("text") or (c.get("message") or {}).get("content") for c in choices))
        out.status = "oom" if out.finish_reason == "oom" else "ok"
