"""What happened to one request, as the client saw it (kept free of Locust: importing it patches the process)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from workloads.generate import TraceRequest

UNFINISHED = "still in flight at the end of the run"


@dataclass(frozen=True)
class PointTags:
    """What a request's row carries beside the request (a scheduled run's): the knee-search point it was sent for,
    the point's rate, and its place in its stream."""

    point: int
    offered_rps: float
    stream_key: str
    stream_index: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Outcome:
    request: TraceRequest
    sent_s: float
    late_s: float  # how long after its due time the load generator sent it (0 in a closed loop)
    # when the schedule meant it to leave (its arrival; a closed loop's send): latency counts from here, so that
    # a late send cannot hide its wait from the SLO (coordinated omission)
    due_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    status: str = "ok"
    finish_reason: str | None = None
    http_status: int | None = None
    error: str = ""
    tags: PointTags | None = None  # a scheduled request's point, rate and stream place (None: no schedule)

    def __post_init__(self) -> None:
        if self.due_s is None:
            self.due_s = self.sent_s - self.late_s
