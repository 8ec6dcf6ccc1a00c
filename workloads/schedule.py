"""A load generator's schedule, decided while it runs: the bench appends segments (workloads/streams.py) to a
JSONL file as its knee search chooses rates, and the load generator, started once per engine, reads them as
they come and sends their requests at their arrival times: no gap between points, one process for the
whole search.

Lines, in order:
- `{"segment": {...}}`: a new segment; it starts no earlier than the previous one ended.
- `{"end_s": T}`: the current (last) segment now ends at T (later: the point is extended; earlier: cut).
- `{"stop": true}`: no segment follows; requests in flight finish within the grace period.

The writer only moves an end that has not passed (`ScheduleWriter.extend` starts a new segment on the same
stream instead), so the reader never misses an extension it has already passed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from workloads.generate import TraceRequest
from workloads.streams import Segment, Streams


class ScheduleWriter:
    """The bench's side: what it appends, and where each segment stands."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)
        self.current: Segment | None = None

    def _line(self, obj: dict) -> None:  # the write edge: a line's JSON object (a segment, or a new end)
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def start(self, seg: Segment) -> Segment:
        assert self.current is None or seg.start_s >= self.current.end_s - 1e-6, \
            f"segments do not overlap: {seg.start_s} starts before {self.current.end_s}"
        self.current = seg
        self._line({"segment": seg.to_json()})
        return seg

    def end_at(self, end_s: float) -> Segment:
        """Move the current segment's end (it must not have passed: the reader may have moved on)."""
        assert self.current is not None, "no segment to end"
        self.current = Segment(**{**self.current.to_json(), "end_s": round(end_s, 6)})
        self._line({"end_s": self.current.end_s})
        return self.current

    def stop(self) -> None:
        self._line({"stop": True})
        self._f.close()


class ScheduleReader:
    """The load generator's side: the requests of every segment as the file gives them, each with its
    segment, waiting (via `sleep`) for lines not yet written."""

    def __init__(self, path: Path, streams: Streams, sleep, poll_s: float = 0.05):
        self.path, self.streams, self.sleep, self.poll_s = Path(path), streams, sleep, poll_s
        self._offset = 0
        self._pending: list[Segment] = []
        self.current: Segment | None = None
        self.stopped = False

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self._offset)
            while (line := f.readline()).endswith("\n"):
                self._offset = f.tell()
                msg = json.loads(line)
                if "segment" in msg:
                    self._pending.append(Segment.of(msg["segment"]))
                elif "end_s" in msg:
                    last = self._pending[-1] if self._pending else self.current
                    moved = Segment(**{**last.to_json(), "end_s": float(msg["end_s"])})
                    if self._pending:
                        self._pending[-1] = moved
                    else:
                        self.current = moved
                elif msg.get("stop"):
                    self.stopped = True

    def next_segment(self) -> Segment | None:
        """The next segment, once written; None once the schedule stopped with none left."""
        while True:
            self.poll()
            if self._pending:
                self.current = self._pending.pop(0)
                return self.current
            if self.stopped:
                return None
            self.sleep(self.poll_s)

    def dispatch(self, now) -> Iterator[tuple[TraceRequest, Segment, int]]:
        """Each request when it is due (`now()` reached its arrival), with its segment and its index in the
        segment's stream; ends with the schedule.
        A request due after its segment's end waits for that end to pass (the end may still move)."""
        while (seg := self.next_segment()) is not None:
            i = seg.first
            origin = self.streams.item(seg.key, seg.first).arrival_s
            stretch = self.streams.native_rps / seg.rate_rps
            while True:
                r = self.streams.item(seg.key, i)
                t = round(seg.start_s + (r.arrival_s - origin) * stretch, 6)
                if not self._due(t, now):
                    break
                yield replace(r, arrival_s=t), self.current, i
                i += 1

    def _due(self, t: float, now) -> bool:
        """Wait until `t` (True: send it) or until the current segment's end passes before it (False)."""
        while True:
            self.poll()
            end = self.current.end_s
            if t < end and now() >= t:
                return True
            if t >= end and now() >= end:
                return False
            self.sleep(max(0.0, min(self.poll_s, min(t, end) - now())))
