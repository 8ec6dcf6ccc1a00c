"""What happened to one request, as the client saw it (kept free of Locust: importing it patches the process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from workloads.generate import TraceRequest

UNFINISHED = "still in flight at the end of the run"


@dataclass
class Outcome:
    request: TraceRequest
    sent_s: float
    late_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    status: str = "ok"
    finish_reason: str | None = None
    http_status: int | None = None
    error: str = ""
    tags: dict = field(default_factory=dict)  # what the rows carry beside the request: its point, rate, stream
