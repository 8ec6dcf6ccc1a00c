"""Request streams for steady-state measurement: every offered rate draws its own requests from the whole
workload, and every engine offered that rate draws the same ones (common random numbers).

- Rates live on a geometric grid (`STEPS_PER_OCTAVE` to a doubling): a rate's grid index is its stream's key.
  Two engines measured at one rate judge the same requests in the same order; two rates judge different
  requests.
- A generator workload (classes with length distributions) draws each key's stream from its own seed.
- A trace workload is cut into `TRACE_SLICES` equal slices; key k starts at the start of slice k mod
  `TRACE_SLICES` and reads on in the trace's order, wrapping at its end. Keys a multiple of `TRACE_SLICES`
  apart (a factor 2^(TRACE_SLICES / STEPS_PER_OCTAVE) in rate) start on the same rows, and a point that
  takes more than a slice reads into the next key's rows: the request ids (the trace row and its lap) say so.
- Replications: key `g<k>r<r>` is the r-th independent realization of grid rate k (a stream of its own seed,
  or a trace slice of its own), so that a point measured again as a replication judges requests no earlier
  realization judged: the variation between realizations (bursts, lengths) lands in the interval.
- Paired streams: key `p<n>` is a request sequence of no rate (its lengths, cancellations and arrival gaps in
  units of the mean), read by the n-th decision turn of each of the headline's two engines, each at its own
  offered rate (`Streams.arrivals` scales the gaps): turn n of paged and turn n of its rival judge the same
  requests (as far as their warm-ups allow), so that what a stream asks of an engine (more tokens, a burst)
  falls on both (the knee fit takes its offered token load out of both: harness/analysis/kneefit.py). A trace
  gives paired key n the middle of slice n x `PAIRED_STRIDE` mod `TRACE_SLICES`: the first `TRACE_SLICES` paired
  keys start in distinct slices, and a grid key, which starts at a slice's start, reads half a slice before it
  reaches a paired key's rows.
- A `Segment` is a stretch of one stream at one rate: requests `first`, `first + 1`, ... arriving from
  `start_s` on, the stream's own arrival gaps rescaled to the rate, until `end_s`. A point of a knee search
  is one or more segments; an extended point continues its stream where it stopped.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from itertools import islice

import numpy as np

from workloads.generate import TraceRequest, iter_requests, native_rate, trace_rows
from workloads.spec import WorkloadSpec

STEPS_PER_OCTAVE = 16  # grid rates 2^(k/16): 4.4 % apart, finer than any bracket a search stops at
TRACE_SLICES = 64
ENDLESS = 10**12  # a stream's length: it is read lazily, as far as its points go
CALIBRATION = "cal"  # the calibration's streams: never judged, never shared with a grid rate
PAIRED = "p"  # the decision's paired streams: `p<n>`, turn n of each headline engine
# a paired key's trace slice steps by this (odd, so the first TRACE_SLICES keys take distinct slices; about
# TRACE_SLICES over the golden ratio, so that each new key starts far from the keys before it)
PAIRED_STRIDE = 39


def grid_index(rate_rps: float) -> int:
    return round(STEPS_PER_OCTAVE * math.log2(rate_rps))


def grid_rate(index: int) -> float:
    return round(2 ** (index / STEPS_PER_OCTAVE), 6)


def snap(rate_rps: float) -> float:
    """The grid rate nearest `rate_rps` (what a point is offered)."""
    return grid_rate(grid_index(rate_rps))


def key_of(rate_rps: float, replication: int = 0) -> str:
    """The stream of a grid rate; replication r > 0 is an independent realization of it (its own seed, and for
    a trace its own slice): the same engines offered it judge the same requests, no other point does."""
    return f"g{grid_index(rate_rps)}" + (f"r{replication}" if replication else "")


def paired_key(turn: int) -> str:
    """The paired stream of the decision's `turn`-th turn of each headline engine (module docstring)."""
    return f"{PAIRED}{turn}"


def paired_turn(key: str | None) -> int | None:
    """The decision turn a paired key names; None for a key of another kind."""
    key = key or ""
    return int(key[len(PAIRED):]) if key.startswith(PAIRED) and key[len(PAIRED):].isdigit() else None


def replication_of(key: str | None) -> int:
    """The replication a stream key names (0: the rate's first stream, the search's, or a calibration key). A
    paired key `p<n>` is an independent realization, never the search's: n + 1."""
    turn = paired_turn(key)
    if turn is not None:
        return turn + 1
    head, _, rep = (key or "").partition("r")
    return int(rep) if head.startswith("g") and rep.isdigit() else 0


def stream_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"fragbench-stream:{seed}:{key}".encode()).digest()[:8], "little")


def _first_row(spec: WorkloadSpec, key: str) -> int:
    rows = len(trace_rows(spec))
    turn = paired_turn(key)
    if turn is not None:  # the middle of its own slice (module docstring)
        return ((turn * PAIRED_STRIDE) % TRACE_SLICES * 2 + 1) * rows // (2 * TRACE_SLICES)
    grid = key.startswith("g") and key[1:].lstrip("-").isdigit()
    index = int(key[1:]) if grid else stream_seed(0, key)  # a replication or calibration key: its own hash
    return (index % TRACE_SLICES) * rows // TRACE_SLICES


def stream(spec: WorkloadSpec, seed: int, key: str, max_seq_len: int = 2048, vocab_size: int = 4096,
           token_ids: bool = True) -> Iterator[TraceRequest]:
    """Stream `key` of the workload in its own arrival order and clock (arrival 0 at its first request).
    Request ids name the key and the index in it (a generator's) or the trace row and its lap (a trace's)."""
    if spec.trace is None:
        reqs = iter_requests(spec, stream_seed(seed, key), max_seq_len, vocab_size, ENDLESS, token_ids)
        for i, r in enumerate(reqs):
            yield replace(r, request_id=f"{key}.{i:06d}")
        return
    rows, first = len(trace_rows(spec)), _first_row(spec, key)
    reqs = iter_requests(spec, stream_seed(seed, key), max_seq_len, vocab_size, ENDLESS, token_ids, first)
    for i, r in enumerate(reqs):
        row = first + i
        yield replace(r, request_id=f"t{row % rows:06d}.{row // rows}")


def dispersion(spec: WorkloadSpec, seed: int, per_window: int, windows: int = 160, key: str = "g0") -> float:
    """The index of dispersion of the workload's arrivals: the variance over the mean of the arrival counts in
    consecutive windows that hold `per_window` arrivals on average (1 for a Poisson stream; a bursty one more).
    Rescaling a stream's clock to a rate leaves it as it is, so one stream's first arrivals tell every rate's."""
    arrivals = np.array([r.arrival_s for r in islice(stream(spec, seed, key, token_ids=False),
                                                     per_window * windows + 1)])
    if len(arrivals) < 3 * per_window or arrivals[-1] <= arrivals[0]:
        return 1.0
    width = per_window * (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    counts = np.bincount(((arrivals - arrivals[0]) // width).astype(int))[:-1]  # the last window is partial
    return float(counts.var(ddof=1) / counts.mean()) if len(counts) > 2 and counts.mean() > 0 else 1.0


@dataclass(frozen=True)
class Segment:
    """Requests `first`, `first + 1`, ... of stream `key`, the first arriving at `start_s` (the load
    generator's clock) and the rest at the stream's gaps times native / rate, while they arrive before `end_s`."""

    point: int  # the knee-search point it belongs to (an index into run.json's points of its engine)
    key: str
    rate_rps: float
    start_s: float
    first: int
    end_s: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, d: dict) -> Segment:  # the parse edge: a schedule line's `segment`, as json.loads gave it
        return cls(int(d["point"]), str(d["key"]), float(d["rate_rps"]), float(d["start_s"]), int(d["first"]),
                   float(d["end_s"]))


class Streams:
    """The streams of one workload, read once each: a segment's requests are the stream's items from its
    first, at the segment's clock. Holds what was read, so a stream read again (an extended point, another
    engine at the same rate) is not generated twice."""

    def __init__(self, spec: WorkloadSpec, seed: int, max_seq_len: int = 2048, vocab_size: int = 4096,
                 token_ids: bool = True):
        self.spec, self.seed, self.max_seq_len, self.vocab_size = spec, seed, max_seq_len, vocab_size
        self.token_ids = token_ids
        self.native_rps = native_rate(spec)
        self._iters: dict[str, Iterator[TraceRequest]] = {}
        self._read: dict[str, list[TraceRequest]] = {}

    def item(self, key: str, i: int) -> TraceRequest:
        read = self._read.setdefault(key, [])
        if key not in self._iters:
            self._iters[key] = stream(self.spec, self.seed, key, self.max_seq_len, self.vocab_size, self.token_ids)
        if i >= len(read):
            read.extend(islice(self._iters[key], i + 1 - len(read)))
        return read[i]

    def arrivals(self, seg: Segment, until_s: float | None = None) -> Iterator[TraceRequest]:
        """The segment's requests with their arrival times on the segment's clock, in order, while they arrive
        before its end (and before `until_s`, when given)."""
        stop = seg.end_s if until_s is None else min(seg.end_s, until_s)
        stretch = self.native_rps / seg.rate_rps
        origin = self.item(seg.key, seg.first).arrival_s
        i = seg.first
        while True:
            r = self.item(seg.key, i)
            t = seg.start_s + (r.arrival_s - origin) * stretch
            if t >= stop:
                return
            yield replace(r, arrival_s=round(t, 6))
            i += 1

    def sent(self, seg: Segment) -> list[TraceRequest]:
        return list(self.arrivals(seg))
