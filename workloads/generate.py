"""spec + seed -> a deterministic list of requests. Equal prefixes are equal token ids."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import numpy as np

from workloads.spec import LengthDist, RequestClass, WorkloadSpec
from workloads.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, read_trace

FIRST_ID = 3  # ids 0-2 are the tokenizer's special tokens


@dataclass
class TraceRequest:
    request_id: str
    arrival_s: float
    cls: str
    prompt_ids: list[int]
    max_tokens: int
    n: int = 1
    stream: bool = True
    temperature: float = 0.0
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    read_delay_s: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["class"] = d.pop("cls")
        return json.dumps(d, separators=(",", ":"))


@dataclass
class WorkloadTrace:
    """A workload's requests for one seed (engines/memory/snapshot_replay.Trace is a CUDA snapshot's)."""

    spec: WorkloadSpec
    seed: int
    max_seq_len: int
    length_scale: float  # applied to every prompt and output length
    requests: list[TraceRequest] = field(default_factory=list)
    closed_concurrency: int | None = None  # closed loop: this many in flight, arrival times unused


@lru_cache(maxsize=8)
def _rows(path: str, fmt: str | None) -> tuple[TraceRow, ...]:
    return tuple(read_trace(path, fmt))


def draw_length(d: LengthDist, rng: np.random.Generator) -> int:
    if d.dist == "fixed":
        x = d.value
    elif d.dist == "uniform":
        x = rng.integers(d.low, d.high + 1)
    elif d.dist == "normal":
        x = rng.normal(d.mean, d.std)
    elif d.dist == "lognormal":
        x = rng.lognormal(np.log(d.mean) - d.sigma**2 / 2, d.sigma)
    else:
        rows = _rows(d.trace, None)
        row = rows[rng.integers(len(rows))]
        x = row.input_tokens if d.column == "input" else row.output_tokens
    x = max(d.min, int(round(x)))
    return min(x, d.max) if d.max else x


@lru_cache(maxsize=1 << 16)
def _ids(key: tuple, length: int, vocab_size: int) -> np.ndarray:
    """Kept as an array, read-only since callers share it (4 KiB for a 512-token block, where a tuple of ints
    took 18): a Mooncake prompt joins its blocks' arrays and makes one list of the whole."""
    seed = int.from_bytes(hashlib.sha256(repr(("fragbench-prefix", *key)).encode()).digest()[:8], "little")
    ids = np.random.default_rng(seed).integers(FIRST_ID, vocab_size, length)
    ids.flags.writeable = False
    return ids


def ids_for(key: tuple, length: int, vocab_size: int) -> list[int]:
    """The same key always gives the same ids, in every process: that makes shared prefixes shareable."""
    return _ids(key, length, vocab_size).tolist()


def fit(prompt: int, output: int, scale: float, max_seq_len: int) -> tuple[int, int]:
    """Scale both lengths, then keep prompt + output within max_seq_len (the prompt gives way first)."""
    prompt, output = max(1, round(prompt * scale)), max(1, round(output * scale))
    output = min(output, max_seq_len // 2) if prompt + output > max_seq_len else output
    return max(1, min(prompt, max_seq_len - output)), output


class Arrivals:
    def __init__(self, spec: WorkloadSpec, rng: np.random.Generator):
        self.spec, self.rng, self.t = spec, rng, 0.0
        self.rate = (spec.arrival.rate or 0) * (spec.scale.rate if spec.scale else 1)

    def next(self) -> float:
        a = self.spec.arrival
        if a.process == "poisson":
            self.t += self.rng.exponential(1 / self.rate)
        elif a.process == "gamma":
            shape = 1 / a.cv**2
            self.t += self.rng.gamma(shape, 1 / (self.rate * shape))
        return self.t


def length_scale(spec: WorkloadSpec, max_seq_len: int) -> float:
    return min(1.0, max_seq_len / spec.scale.reference_max_seq_len) if spec.scale else 1.0


def has_shared_prefixes(spec: WorkloadSpec) -> bool:
    return any(c.shared_prefix for c in spec.classes) or (spec.trace is not None and spec.trace.format == "mooncake")


def iter_requests(spec: WorkloadSpec, seed: int, max_seq_len: int = 2048, vocab_size: int = 4096,
                  num_requests: int | None = None, token_ids: bool = True, first_row: int = 0
                  ) -> Iterator[TraceRequest]:
    """The requests one by one, in arrival order. token_ids=False gives placeholder ids of the right lengths
    (for simulating millions of requests whose content the memory policy never compares). `first_row`: a
    trace replay starts at that row (and wraps past the trace's end); a generator ignores it."""
    rng = np.random.default_rng(seed)
    scale = length_scale(spec, max_seq_len)
    n = num_requests or spec.num_requests
    if spec.trace is not None:
        return _replay(spec, rng, scale, max_seq_len, vocab_size, n, token_ids, first_row)
    return _synthesize(spec, rng, scale, max_seq_len, vocab_size, n, token_ids)


def trace_rows(spec: WorkloadSpec) -> list[TraceRow]:
    """A trace workload's rows, from its start time on."""
    return [r for r in _rows(spec.trace.path, spec.trace.format) if r.t_s >= spec.trace.start_s]


def native_rate(spec: WorkloadSpec) -> float:
    """The workload's own long-run arrival rate (requests/s): its process's rate, or a trace's mean rate."""
    if spec.arrival.process == "trace":
        rows = trace_rows(spec)
        span = (rows[-1].t_s - rows[0].t_s) * spec.arrival.time_scale / (spec.scale.rate if spec.scale else 1.0)
        return (len(rows) - 1) / span if span > 0 else 1.0
    return Arrivals(spec, np.random.default_rng(0)).rate


def at_rate(requests: list[TraceRequest], rate_rps: float, start_s: float = 0.0) -> list[TraceRequest]:
    """The same requests offered at rate_rps: the arrival process's shape kept, its clock rescaled, and
    every arrival shifted by start_s."""
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    native = (len(requests) - 1) / span if span > 0 else rate_rps
    stretch = native / rate_rps
    return [replace(r, arrival_s=round(start_s + r.arrival_s * stretch, 6)) for r in requests]


def closed_concurrency(spec: WorkloadSpec) -> int | None:
    """How many requests a closed loop keeps in flight; None for open-loop arrivals."""
    return spec.arrival.concurrency if spec.arrival.process == "closed" else None


def trace(spec: WorkloadSpec, seed: int, max_seq_len: int = 2048, vocab_size: int = 4096) -> WorkloadTrace:
    return WorkloadTrace(spec, seed, max_seq_len, length_scale(spec, max_seq_len),
                         requests=list(iter_requests(spec, seed, max_seq_len, vocab_size)),
                         closed_concurrency=closed_concurrency(spec))


def _draw(rng, length: int, vocab_size: int) -> np.ndarray:
    """`length` token ids drawn from the stream's generator (the special ids below FIRST_ID left out)."""
    return rng.integers(FIRST_ID, vocab_size, length)


def _body(rng, length: int, vocab_size: int, token_ids: bool) -> list[int]:
    return _draw(rng, length, vocab_size).tolist() if token_ids else [FIRST_ID] * length


def _synthesize(spec, rng, scale, max_seq_len, vocab_size, n, token_ids) -> Iterator[TraceRequest]:
    weights = np.array([c.weight for c in spec.classes])
    arrivals = Arrivals(spec, rng)
    for i in range(n):
        cls: RequestClass = spec.classes[rng.choice(len(weights), p=weights / weights.sum())]
        prompt_len, output_len = fit(draw_length(cls.prompt, rng), draw_length(cls.output, rng), scale, max_seq_len)
        prefix: list[int] = []
        sp = cls.shared_prefix
        if sp and rng.random() < sp.share:
            group = int(rng.integers(sp.groups))
            prefix = ids_for((spec.name, cls.name, group), min(max(1, round(sp.tokens * scale)), prompt_len),
                             vocab_size)
        body = _body(rng, prompt_len - len(prefix), vocab_size, token_ids)
        req = TraceRequest(
            request_id=f"r{i:06d}",
            arrival_s=round(arrivals.next(), 6) if spec.arrival.process != "closed" else 0.0,
            cls=cls.name,
            prompt_ids=prefix + body,
            max_tokens=output_len,
            n=cls.n,
            stream=bool(rng.random() < cls.stream),
            temperature=cls.temperature,
        )
        _churn(req, cls.cancel, cls.slow_readers, rng)
        yield req


def _churn(req: TraceRequest, cancel, slow, rng) -> None:
    if cancel and rng.random() < cancel.probability:
        req.stream = True  # a cancellation is a client closing its stream
        if cancel.after_tokens is not None:
            req.cancel_after_tokens = min(draw_length(cancel.after_tokens, rng), req.max_tokens)
        else:
            req.cancel_after_s = cancel.after_s
    if slow and rng.random() < slow.share:
        req.stream = True
        req.read_delay_s = slow.read_delay_s


def _hashed_prompt(rng, hash_ids: list[int], block: int, prompt_len: int, vocab_size: int) -> list[int]:
    """A trace row's prompt: its blocks' ids as far as the prompt (cut to fit) reaches, then drawn ids. The draw
    is of the whole prompt's length, used or not, so that every later draw of the stream stays where it was;
    only what the prompt keeps of it becomes a list."""
    reach = -(-prompt_len // block)
    blocks = [_ids(("mooncake", h), block, vocab_size) for h in hash_ids[:reach]]
    return np.concatenate([*blocks, _draw(rng, prompt_len, vocab_size)])[:prompt_len].tolist()


def _replay(spec, rng, scale, max_seq_len, vocab_size, n, token_ids, first_row=0) -> Iterator[TraceRequest]:
    """The trace's rows in order from `first_row`; past its end it starts over, one trace-length later (and one
    mean gap)."""
    rows = trace_rows(spec)
    rate_scale = spec.scale.rate if spec.scale else 1.0
    arrivals = Arrivals(spec, rng)
    t0 = rows[(first_row % len(rows))].t_s if first_row else rows[0].t_s
    period = rows[-1].t_s - rows[0].t_s + (rows[-1].t_s - rows[0].t_s) / max(1, len(rows) - 1)
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    for j in range(n):
        i = j + first_row
        row = rows[i % len(rows)]
        prompt_len, output_len = fit(row.input_tokens, row.output_tokens, scale, max_seq_len)
        if row.hash_ids and token_ids:  # each 512-token block becomes `block` ids fixed by its hash id
            prompt = _hashed_prompt(rng, row.hash_ids, block, prompt_len, vocab_size)
        else:
            prompt = _body(rng, prompt_len, vocab_size, token_ids)
        if spec.arrival.process == "trace":
            arrival = (row.t_s - t0 + (i // len(rows)) * period) * spec.arrival.time_scale / rate_scale
        else:
            arrival = arrivals.next() if spec.arrival.process != "closed" else 0.0
        req = TraceRequest(f"r{j:06d}", round(arrival, 6), spec.name, prompt, output_len,
                           stream=bool(rng.random() < spec.stream))
        _churn(req, spec.cancel, None, rng)
        yield req


def describe(t: WorkloadTrace) -> str:
    reqs = t.requests
    prompts = np.array([len(r.prompt_ids) for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    lines = [f"workload {t.spec.name}: {len(reqs)} requests, seed {t.seed}, max_seq_len {t.max_seq_len}"]
    if t.spec.description:
        lines.append(f"  {t.spec.description}")
    lines.append(f"  lengths scaled x{t.length_scale:.4f}" + (
        f" (from a {t.spec.scale.reference_max_seq_len}-token context)" if t.spec.scale else ""))
    if t.closed_concurrency:
        lines.append(f"  arrivals: closed loop, {t.closed_concurrency} in flight")
    else:
        lines.append(f"  arrivals: {t.spec.arrival.process}, {len(reqs) / span if span else float('inf'):.2f} req/s "
                     f"over {span:.1f} s")
    lines.append("  class mix:")
    for name in sorted({r.cls for r in reqs}):
        share = sum(r.cls == name for r in reqs) / len(reqs)
        lines.append(f"    {name:<16} {share:6.1%}")
    lines.append(f"  {'tokens':<8}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for label, xs in (("prompt", prompts), ("output", outputs), ("total", prompts + outputs)):
        p50, p90, p99 = np.percentile(xs, [50, 90, 99])
        lines.append(f"  {label:<8}{xs.mean():>8.0f}{p50:>8.0f}{p90:>8.0f}{p99:>8.0f}{xs.max():>8}")
    streaming = np.mean([r.stream for r in reqs])
    cancels = np.mean([r.cancel_after_tokens is not None or r.cancel_after_s is not None for r in reqs])
    slow = np.mean([r.read_delay_s > 0 for r in reqs])
    lines.append(f"  streaming {streaming:.0%}, cancelled {cancels:.0%}, slow readers {slow:.0%}, "
                 f"parallel samples {np.mean([r.n > 1 for r in reqs]):.0%}")
    if t.spec.attribution:
        lines.append(f"  source: {t.spec.attribution}")
    return "\n".join(lines)
