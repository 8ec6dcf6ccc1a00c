"""One point of a sweep, measured at steady state on a running engine: a segment of its rate's stream sent
by the engine's load generator (workloads/schedule.py), judged after its warm-up, stopped by the design's
rules (harness/analysis/design.py), then a tail guard at the same rate before the next point begins.

A point's life, on the engine's clock:
    start ... start + warm-up ........ judged end ...... end (judged end + guard) -> the next point's start
              (sent, not judged)  (judged)          (sent, not judged: the judged requests finish under
                                                     the load they arrived in)
The warm-up is read off the point's finished requests while it runs (harness/analysis/steady.warmup_s); the
point is decided `DECIDE_S` before its segment's planned end, which then moves: later (more requests), or
to the judged end plus the guard. What is known of a judged request before it ends counts: a stream with
no first token past the TTFT limit, a first token that came too late, an answer past what the SLO allows
its whole length are misses already.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from harness.analysis.capacity import SLO, meets_slo
from harness.analysis.design import guard_s
from harness.analysis.knee import Judged, design_effect
from harness.analysis.steady import warmup_s, wilson
from harness.results import JournalTail
from workloads.generate import TraceRequest
from workloads.outcome import UNFINISHED
from workloads.schedule import ScheduleWriter
from workloads.streams import Segment, Streams

LEAD_S = 0.5  # a segment starts this long after it is written (the load generator polls every 0.05 s)
DECIDE_S = 2.0  # a point is decided this long before its segment's planned end, while that end can still move
TICK_S = 0.25
LATE_S = 0.3  # an end closer than this may have passed for the load generator: a new segment continues instead


@dataclass(frozen=True)
class PointJob:
    """What one point (or one more stretch of an existing point) is to judge."""

    point: int  # its index among the engine's points at this budget
    rate_rps: float
    key: str
    first: int  # where in the stream it starts (the engine's cursor on that stream)
    min_judged: int = 1
    max_judged: int = 1
    min_judged_s: float = 0.0
    early_judged: int = 10
    target: float = 0.9
    fixed: bool = False  # judge min_judged (and min_judged_s) and stop: no sequential rule
    stop_by_s: float = float("inf")  # engine clock: judging ends by then, whatever the rules say
    warmup_guess_s: float = 3.0  # what the plan allows for the warm-up before the first decision
    warm: bool = True  # False: the engine already runs at this rate (the point goes on): nothing to warm up
    earlier: tuple[Judged, ...] = ()  # the engine's points so far: with this one's, its design effect


@dataclass
class State:
    """A point at one moment: where its warm-up ends, what it has judged, and what is known of that."""

    warmup_s: float
    judged: list[TraceRequest]  # arrivals past the warm-up, cancellations left out (the SLO leaves them out)
    met: np.ndarray  # verdicts known: 1 met, 0 missed
    index: np.ndarray  # their stream indices
    e2e_median_s: float | None

    @property
    def known(self) -> int:
        return len(self.met)

    def wilson(self, earlier: tuple[Judged, ...] = ()) -> tuple[float, float]:
        """At the effective size: the verdicts known over the engine's design effect (harness/analysis/knee.py)."""
        d = design_effect([*earlier, Judged(0.0, "", self.met, self.index)])
        return wilson(float(self.met.sum()) / d, self.known / d)


@dataclass
class PointResult:
    segments: list[dict]  # run.json: start_s, first, end_s, warmup_s, judged_end_s, judged
    attainment: float | None  # of the verdicts known once the guard ended (the summary re-reads every row)
    judged: int
    met: np.ndarray
    index: np.ndarray
    next_index: int  # the stream's cursor after the point
    warmup_s: float
    e2e_median_s: float | None


def carried_until(ends: list[float | None], start: float, now: float, share: float = 0.9) -> float:
    """When `share` of the requests still in the engine at `start` have ended (None: not yet), at most `now`.
    The order statistic itself, not an interpolation: two requests still running are two infinities."""
    carried = [np.inf if e is None else e for e in ends if e is None or e > start]
    if not carried:
        return start
    return min(float(np.quantile(np.array(carried, dtype=float), share, method="inverted_cdf")), now)


def cancelled(r: TraceRequest) -> bool:
    return r.cancel_after_tokens is not None or r.cancel_after_s is not None


@dataclass
class PointRunner:
    """Points on one engine's running server, through its load generator's schedule."""

    writer: ScheduleWriter
    tail: JournalTail
    progress: JournalTail  # first tokens, as they arrive
    streams: Streams
    slo: SLO
    clock: Callable[[], float]  # the engine's clock, seconds
    supervise: Callable[[], None]  # restarts a crashed server, collects OOMs; called every tick
    rows: dict[str, dict] = field(default_factory=dict)  # completed rows of this load generator, by id
    before: list[TraceRequest] = field(default_factory=list)  # what the points before sent on this visit
    first_token: dict[str, float] = field(default_factory=dict)  # request id -> TTFT, as streamed
    segments: list[Segment] = field(default_factory=list)  # every segment this load generator was given

    def run(self, job: PointJob, show: Callable[[str], None] = lambda text: None) -> PointResult:
        start = round(max(self.clock(), self.writer.current.end_s if self.writer.current else 0.0) + LEAD_S, 3)
        judged_share = 1 - self.cancel_share(job.key)
        judging_s = max(job.min_judged / job.rate_rps / judged_share, job.min_judged_s)
        # a point never plans past its engine's share (stop_by_s): a slow engine's point judges fewer requests, and
        # its interval says so, rather than taking the next engine's time
        plan = min((job.warmup_guess_s if job.warm else 0.0) + judging_s, max(job.stop_by_s - start, DECIDE_S + 1.0))
        segs = [self.writer.start(Segment(job.point, job.key, job.rate_rps, start, job.first,
                                          round(start + plan, 3)))]
        self.segments.append(segs[0])
        while True:
            now = self.wait_until(min(segs[-1].end_s - DECIDE_S, job.stop_by_s))
            state = self.state(segs, start, now, warm=job.warm)
            show(f"{job.rate_rps:g} req/s, {len(state.judged)} judged")
            if self.enough(job, state, now, start):
                break
            if now >= segs[-1].end_s - LATE_S:  # too late to move this end: continue the stream after it
                nxt = Segment(job.point, job.key, job.rate_rps, round(now + LEAD_S, 3), self.next_index(segs),
                              round(now + LEAD_S + DECIDE_S + 2.0, 3))
                segs.append(self.writer.start(nxt))
                self.segments.append(segs[-1])
                continue
            short = max(job.min_judged - len(state.judged), 1) / job.rate_rps / judged_share
            end = min(segs[-1].end_s + max(2.0, short), max(job.stop_by_s + DECIDE_S, segs[-1].end_s))
            segs[-1] = self.segments[-1] = self.writer.end_at(end)
        judged_end = round(max(now, segs[-1].start_s), 3)
        if now < segs[-1].end_s - LATE_S:  # the tail guard: the judged requests finish under their own load
            segs[-1] = self.segments[-1] = self.writer.end_at(max(judged_end + guard_s(state.e2e_median_s),
                                                                  now + LATE_S))
        self.wait_until(segs[-1].end_s)
        final = self.state(segs, start, self.clock(), judged_end, warm=job.warm)
        self.before += [r for r, _ in self.sent(segs, float("inf"))]
        records = [{**s.to_json(), "warmup_s": final.warmup_s if i == 0 else 0.0,
                    "judged_end_s": min(judged_end, s.end_s)} for i, s in enumerate(segs)]
        records[0]["judged"] = len(final.judged)
        return PointResult(records, float(final.met.mean()) if final.known else None, len(final.judged), final.met,
                           final.index, self.next_index(segs), final.warmup_s, final.e2e_median_s)

    def in_flight(self, engine: str) -> list[dict]:
        """A requests row for each request sent and not yet ended, as the load generator writes one it cuts off at
        the run's end (status error, `UNFINISHED`, judged on what it showed: harness/analysis/capacity.py), so
        that what the run says now judges it by the rule the summary will."""
        self.refresh()
        now, rows = self.clock(), []
        for seg in self.segments:
            for i, r in enumerate(self.streams.arrivals(seg, now)):
                if r.request_id in self.rows:
                    continue
                ttft = self.first_token.get(r.request_id)
                rows.append({"engine": engine, "request_id": r.request_id, "class": r.cls, "arrival_s": r.arrival_s,
                             "sent_s": r.arrival_s, "end_s": now, "prompt_tokens": len(r.prompt_ids),
                             "output_tokens_target": r.max_tokens * r.n, "output_tokens": 0, "n": r.n,
                             "stream": r.stream, "status": "cancelled" if cancelled(r) else "error",
                             "error": UNFINISHED, "ttft_s": ttft, "tpot_s": None, "e2e_s": now - r.arrival_s,
                             "late_s": 0.0, "point": seg.point, "offered_rps": seg.rate_rps, "stream_key": seg.key,
                             "stream_index": seg.first + i})
        return rows

    def refresh(self) -> None:
        for row in self.tail.read():
            self.rows[row["request_id"]] = row
        for row in self.progress.read():
            self.first_token[row["request_id"]] = row["first_token_s"] - row.get("due_s", row["sent_s"])

    # -- waiting, supervised
    def wait_until(self, t_s: float) -> float:
        while (now := self.clock()) < t_s:
            self.supervise()
            time.sleep(min(TICK_S, max(0.0, t_s - now)))
        return now

    # -- what a point knows
    def cancel_share(self, key: str, sample: int = 200) -> float:
        return float(np.mean([cancelled(self.streams.item(key, i)) for i in range(sample)]))

    def next_index(self, segs: list[Segment]) -> int:
        return segs[-1].first + sum(1 for _ in self.streams.arrivals(segs[-1]))

    def sent(self, segs: list[Segment], until_s: float) -> list[tuple[TraceRequest, int]]:
        return [(r, s.first + i) for s in segs for i, r in enumerate(self.streams.arrivals(s, until_s))]

    def state(self, segs: list[Segment], start: float, now: float, judged_end: float | None = None,
              warm: bool = True) -> State:
        self.refresh()
        sent = self.sent(segs, now)
        e2e = [self.rows[r.request_id]["e2e_s"] for r, _ in sent if r.request_id in self.rows
               and self.rows[r.request_id].get("e2e_s") is not None]
        e2e_median = float(np.median(e2e)) if e2e else None
        skip = max(warmup_s(e2e), self.carried_s(start, now)) if warm else 0.0
        end = judged_end if judged_end is not None else now
        judged = [(r, i) for r, i in sent if start + skip <= r.arrival_s < end and not cancelled(r)]
        met, index = self.verdicts(judged, now)
        return State(skip, [r for r, _ in judged], met, index, e2e_median)

    def carried_s(self, start: float, now: float) -> float:
        """Until nine in ten of the requests the points before left in the engine at `start` have ended: the
        warm-up cannot end while the previous load is still being served (seconds from `start`)."""
        ends = [self.rows[r.request_id]["end_s"] if r.request_id in self.rows else None for r in self.before]
        return carried_until(ends, start, now) - start

    def verdicts(self, judged: list[tuple[TraceRequest, int]], now: float) -> tuple[np.ndarray, np.ndarray]:
        """The verdicts known now: a finished request's (the SLO's rule), and a miss for one still running
        past what the SLO allows its whole answer (a late one cannot meet it any more)."""
        done = [(self.rows[r.request_id], i) for r, i in judged if r.request_id in self.rows]
        met, index = [], []
        if done:
            frame = pd.DataFrame([row for row, _ in done])
            ok = frame.status == "ok"
            verdict = pd.Series(False, index=frame.index)
            verdict[ok] = meets_slo(frame[ok], self.slo)
            keep = frame.status != "cancelled"
            met += verdict[keep].astype(int).tolist()
            index += [i for (_, i), k in zip(done, keep, strict=True) if k]
        for r, i in judged:
            if r.request_id not in self.rows and self.missed_already(r, now):
                met.append(0)
                index.append(i)
        order = np.argsort(index, kind="stable")
        return np.asarray(met, dtype=float)[order], np.asarray(index, dtype=int)[order]

    def missed_already(self, r: TraceRequest, now: float) -> bool:
        """A request still in flight that can no longer meet the SLO."""
        waited = now - r.arrival_s
        if r.stream:
            ttft = self.first_token.get(r.request_id)
            # a first token's line may be a tick behind it: the limit and half a second
            if (ttft is None and waited > self.slo.ttft_s + 0.5) or (ttft is not None and ttft > self.slo.ttft_s):
                return True
        return waited > self.slo.ttft_s + self.slo.tpot_s * max(r.max_tokens * r.n - 1, 0)

    @staticmethod
    def enough(job: PointJob, state: State, now: float, start: float) -> bool:
        n, judged_s = len(state.judged), now - start - state.warmup_s
        if now >= job.stop_by_s:
            return True
        if n < job.min_judged or judged_s < job.min_judged_s:
            lo, hi = state.wilson(job.earlier)
            return not job.fixed and state.known >= job.early_judged and hi < job.target  # a clear miss
        if job.fixed or n >= job.max_judged:
            return True
        lo, hi = state.wilson(job.earlier)
        return state.known >= job.min_judged and not lo <= job.target <= hi
