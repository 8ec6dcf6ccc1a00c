"""The Locust user that replays a trace open-loop: each request leaves at its arrival time in its own
greenlet (a late one is counted late, not shifted), streams over SSE, reads slowly or cancels as the
trace says, and reports exact client timestamps for every token.

It is a FastHttpUser (geventhttpclient): Locust's requests-based HttpUser costs several milliseconds of
client time per event under load, which a TTFT measurement cannot afford (benchmarks/loadgen_error.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import gevent
from gevent.pool import Pool
from locust import task
from locust.contrib.fasthttp import FastHttpUser

from workloads.generate import TraceRequest
from workloads.outcome import UNFINISHED, Outcome
from workloads.sse import abandon, events


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


def now(plan: ReplayPlan) -> float:
    return time.time() - plan.t0


class ReplayUser(FastHttpUser):
    """One per load-generator process; it dispatches its share of the trace."""

    host = "http://127.0.0.1"
    concurrency = 100_000  # connections in flight: an open-loop trace bounds them, not the client
    network_timeout = 3600.0  # a queued request may wait long for its first byte; the plan's deadline rules
    connection_timeout = 10.0

    @task
    def replay(self) -> None:
        plan: ReplayPlan = self.environment.replay_plan
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

    def send(self, plan: ReplayPlan, req: TraceRequest) -> None:
        sent = now(plan)
        late = 0.0 if plan.closed_concurrency else max(0.0, sent - req.arrival_s)
        out = Outcome(req, sent, late)
        body = {"prompt": req.prompt_ids, "max_tokens": req.max_tokens, "n": req.n, "stream": req.stream,
                "temperature": req.temperature, "ignore_eos": True, "seed": int(req.request_id[1:])}
        if plan.model:
            body["model"] = plan.model
        headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
        try:
            with self.client.post("/v1/completions", json=body, stream=req.stream, headers=headers,
                                  name=req.cls, catch_response=True) as resp:
                out.http_status = resp.status_code
                if resp.status_code == 0:  # Locust's stand-in response for a connection that failed
                    out.status, out.error = "error", f"{type(resp.error).__name__}: {resp.error}"[:200]
                    resp.success()
                elif resp.status_code != 200:
                    out.status, out.error = "rejected", resp.text[:200]
                    resp.success()  # a 4xx is the server's answer, recorded in our rows
                elif req.stream:
                    self._read_stream(plan, req, resp, out)
                else:
                    self._read_whole(plan, resp, out)
        except gevent.GreenletExit:
            out.status, out.error = "error", UNFINISHED
            raise
        except Exception as e:  # a dead server: connection refused or reset
            out.status, out.error = "error", f"{type(e).__name__}: {e}"[:200]
        finally:
            out.end_s = now(plan)
            plan.on_outcome(out)

    def _read_stream(self, plan: ReplayPlan, req: TraceRequest, resp, out: Outcome) -> None:
        cancel_at = req.cancel_after_s
        for stamp, data in events(resp._response):
            if data == b"[DONE]":
                break
            t = stamp - plan.t0  # when the bytes arrived, whatever parsing came before
            payload = json.loads(data)  # not JSON: the request's error, recorded below
            if "error" in payload:  # the server failed this request mid-stream
                out.status, out.error = "error", str(payload["error"])[:200]
                resp.success()
                return
            choice = payload["choices"]
            if not choice:
                continue
            tokens = len(choice[0].get("token_ids") or []) or (1 if choice[0].get("text") else 0)
            if tokens:
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
                abandon(resp._response)  # the client goes away: the server must free the request's KV now
                resp.success()
                return
        out.status = "oom" if out.finish_reason == "oom" else "ok"
        resp.success()

    def _read_whole(self, plan: ReplayPlan, resp, out: Outcome) -> None:
        data = resp.json()
        choices = data.get("choices", [])
        out.output_tokens = sum(len(c.get("token_ids") or []) for c in choices) or data.get("usage", {}).get(
            "completion_tokens", 0)
        out.finish_reason = choices[0].get("finish_reason") if choices else None
        out.status = "oom" if out.finish_reason == "oom" else "ok"
        resp.success()
