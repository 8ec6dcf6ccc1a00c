"""What the simulator keeps while it runs: every request's row (`Tracks`), the time integrals of the
breakdown (`Accumulator`), and the sequences that count their tokens on one shared decode clock
(`DecodeClock`, `SimSequence`), so that a decode stretch costs O(1) however many sequences run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from engines.kv.base import Breakdown
from engines.sequence import FinishReason, SeqStatus
from workloads.generate import TraceRequest


class Tracks:
    """What the figures need of every request, by column: arrival, first token and end (NaN until they
    happen), output tokens and outcome. A day of traffic is millions of requests: 30 bytes each."""

    OUTCOMES = ("unfinished", "ok", "oom")

    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.arrival_s = np.empty(capacity)
        self.first_s = np.full(capacity, np.nan)
        self.end_s = np.full(capacity, np.nan)
        self.target = np.empty(capacity, dtype=np.int64)
        self.outcome = np.zeros(capacity, dtype=np.int8)  # an index into OUTCOMES

    def add(self, arrival_s: float, target: int) -> int:
        if self.n == len(self.arrival_s):
            self._grow()
        i, self.n = self.n, self.n + 1
        self.arrival_s[i], self.target[i] = arrival_s, target
        return i

    def end(self, i: int, t: float, outcome: str) -> None:
        self.end_s[i], self.outcome[i] = t, self.OUTCOMES.index(outcome)

    def _grow(self) -> None:
        for name in ("arrival_s", "first_s", "end_s", "target", "outcome"):
            old = getattr(self, name)
            new = np.full(2 * len(old), np.nan) if name in ("first_s", "end_s") else np.zeros(2 * len(old), old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def frame(self) -> pd.DataFrame:
        """Request rows with the columns capacity.request_metrics reads."""
        n, first, end, target = self.n, self.first_s[: self.n], self.end_s[: self.n], self.target[: self.n]
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(target > 1, (end - first) / np.maximum(target - 1, 1), np.nan)
        status = pd.Categorical.from_codes(self.outcome[:n], self.OUTCOMES)
        return pd.DataFrame({"status": status, "arrival_s": self.arrival_s[:n], "output_tokens": target,
                             "ttft_s": first - self.arrival_s[:n], "tpot_s": tpot, "e2e_s": end - self.arrival_s[:n]})


@dataclass
class Accumulator:
    """Time integrals of the breakdown and of the running count."""

    capacity: int
    # None: the integrals cover the time the engine is serving (the paper's figures); a (start, end) window of
    # simulated seconds: the wall-clock time inside it, idle included, as a sampler sees it (a twin's point)
    window: tuple[float, float] | None = None
    seconds: float = 0.0
    bytes_s: list[float] = field(default_factory=lambda: [0.0] * 5)  # CATEGORIES order
    running_s: float = 0.0
    max_running: int = 0
    timeline: list[tuple] = field(default_factory=list)
    next_sample_s: float = 0.0
    # the same integrals over each of these spans of simulated time (a twin's points' judged spans)
    spans: list[tuple[float, float]] = field(default_factory=list)
    span_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    span_bytes_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 5)))
    span_running_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        n = len(self.spans)
        self._lo = np.array([a for a, _ in self.spans], dtype=float)
        self._hi = np.array([b for _, b in self.spans], dtype=float)
        self.span_seconds, self.span_bytes_s, self.span_running_s = np.zeros(n), np.zeros((n, 5)), np.zeros(n)

    def idle(self, now: Breakdown, t: float, until: float, every_s: float) -> float:
        """Nothing runs from t until `until` (the next arrival): memory as it is, no sequence running."""
        if self.window is not None:
            self.add(now, now, 0, until - t, until, every_s)
        return until

    def add(self, before: Breakdown, after: Breakdown, running: int, dt: float, t: float, every_s: float) -> None:
        # five categories, once per event: plain floats (numpy costs more to set up than to add five numbers)
        end = after.astuple()
        lo, hi = self.window or (-math.inf, math.inf)
        inside = max(0.0, min(t, hi) - max(t - dt, lo))  # of the interval [t - dt, t]
        mean = [(b + e) / 2 for b, e in zip(before.astuple(), end, strict=True)]
        self.bytes_s = [s + m * inside for s, m in zip(self.bytes_s, mean, strict=True)]
        self.seconds += inside
        self.running_s += running * inside
        if len(self.spans):
            part = np.clip(np.minimum(t, self._hi) - np.maximum(t - dt, self._lo), 0.0, None)
            self.span_seconds += part
            self.span_bytes_s += part[:, None] * np.array(mean)[None, :]
            self.span_running_s += running * part
        self.max_running = max(self.max_running, running)
        if t >= self.next_sample_s:
            self.timeline.append((t, *(e / self.capacity for e in end), running))
            self.next_sample_s = t + every_s


class DecodeClock:
    """Decode steps taken by the running set, and the sum of the running sequences' tokens in O(1): each
    running sequence holds (tokens when it started running - steps then), and gains one token per step."""

    def __init__(self):
        self.steps = 0
        self.running = 0
        self._base = 0  # sum over running sequences of (tokens at start - steps at start)

    def live_tokens(self) -> int:
        return self._base + self.running * self.steps

    def join(self, tokens: int) -> None:
        self.running += 1
        self._base += tokens - self.steps

    def leave(self, tokens: int) -> None:
        self.running -= 1
        self._base -= tokens - self.steps


class SimSequence:
    """A simulated sequence, as the scheduler and the KV policies see a Sequence: its prompt ids (what prefix
    caching hashes) and a token count that runs on the decode clock while the scheduler keeps it RUNNING.
    Output token values never matter to a memory policy, so none is stored and no step touches it."""

    __slots__ = ("seq_id", "token_ids", "prompt_len", "max_tokens", "final_len", "num_computed_tokens",
                 "num_preemptions", "finish_reason", "track", "_clock", "_tokens", "_since", "_status")

    def __init__(self, req: TraceRequest, max_seq_len: int, clock: DecodeClock, track: int, keep_ids: bool):
        self.seq_id = req.request_id
        # only prefix caching reads the ids: without it a queue of millions keeps none
        self.token_ids = req.prompt_ids if keep_ids else ()
        self.prompt_len = len(req.prompt_ids)
        self.max_tokens = req.max_tokens
        self.final_len = min(self.prompt_len + req.max_tokens, max_seq_len)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.track = track  # its row in Tracks
        self._clock = clock
        self._tokens = self.prompt_len  # while not running; while running, at `_since` steps
        self._since = 0
        self._status = SeqStatus.WAITING

    @property
    def num_tokens(self) -> int:
        if self._status is SeqStatus.RUNNING:
            return self._tokens + self._clock.steps - self._since
        return self._tokens

    @property
    def status(self) -> SeqStatus:
        return self._status

    @status.setter
    def status(self, value: SeqStatus) -> None:
        tokens = self.num_tokens
        if self._status is SeqStatus.RUNNING:
            self._clock.leave(tokens)
        if value is SeqStatus.RUNNING:
            self._clock.join(tokens)
        self._tokens, self._since, self._status = tokens, self._clock.steps, value

    @property
    def finish_step(self) -> int:
        """The decode clock's value when it holds all its tokens, if it keeps running."""
        return self._since + self.prompt_len + self.max_tokens - self._tokens


def stale(entry: tuple[int, int, SimSequence]) -> bool:
    """A finish entry of a sequence that was preempted (and may run again, later) since it was pushed."""
    return entry[2].status is not SeqStatus.RUNNING or entry[2].finish_step != entry[0]


__all__ = ["Accumulator", "DecodeClock", "SimSequence", "Tracks", "stale"]
