"""`GET /metrics`: every signal the seeds ask a production dashboard for, named as vLLM names its own.

Where vLLM has a metric, ours has its name under `fragbench:` and, for histograms, its buckets
(vllm/v1/metrics/loggers.py): time to first token, end-to-end latency, prompt and generation tokens per
request. Where vLLM has none (live tokens, reserved and allocated bytes, free blocks, the bytes of the
allocations that failed and why, the step's batch and token budget), the name is ours.

Two sources: the engine's snapshot, read at scrape time (`MetricsCollector.stats`, set by the handler), and
the engine's token events, observed as they happen on the engine thread (`RequestObserver`): a histogram
needs every request, not a sample of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engines.api.stats import StatsPayload
from engines.engine import Engine, TokenEvent

# vLLM's own boundaries (vllm/v1/metrics/loggers.py), so that one dashboard reads both servers
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
OOM_CAUSES = ("capacity", "fragmentation")


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, ... up to the context."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return out
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class InFlight:
    """A request between its arrival and its last sample's end, as the histograms need it."""

    arrival_s: float  # monotonic: when the HTTP handler handed it to the engine
    prompt_tokens: int
    first_token_seen: bool = False
    generation_tokens: int = 0


class RequestObserver:
    """Per-request histograms from the engine's token events, observed on the engine thread: TTFT at a
    request's first token (any of its samples), E2E and its token counts when its last sample ends. Aborted
    and failed requests count too, as vLLM counts every finished request. Also the last step's batch: the
    sequences that got a token in it."""

    def __init__(self, max_model_len: int) -> None:
        self.ttft_s = Histogram("fragbench:time_to_first_token_seconds", "Histogram of time to first token in "
                                "seconds.", buckets=TTFT_BUCKETS_S, registry=None)
        self.e2e_s = Histogram("fragbench:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                               "seconds.", buckets=E2E_BUCKETS_S, registry=None)
        buckets = token_buckets(max_model_len)
        self.prompt_tokens = Histogram("fragbench:request_prompt_tokens", "Number of prefill tokens processed.",
                                       buckets=buckets, registry=None)
        self.generation_tokens = Histogram("fragbench:request_generation_tokens", "Number of generation tokens "
                                           "processed.", buckets=buckets, registry=None)
        self.open: dict[str, InFlight] = {}
        self.step_seqs: set[str] = set()  # sequences that got a token in the step under way
        self.last_step_batch = 0

    def on_event(self, event: TokenEvent) -> None:
        seq = event.seq
        req = self.open.get(seq.request_id)
        if req is None:
            req = self.open[seq.request_id] = InFlight(seq.arrival_s, seq.num_prompt_tokens)
        if event.token_id is not None:
            req.generation_tokens += 1
            self.step_seqs.add(seq.seq_id)
            if not req.first_token_seen:
                req.first_token_seen = True
                self.ttft_s.observe(time.monotonic() - req.arrival_s)
        if event.request_done:
            del self.open[seq.request_id]
            self.e2e_s.observe(time.monotonic() - req.arrival_s)
            self.prompt_tokens.observe(req.prompt_tokens)
            self.generation_tokens.observe(req.generation_tokens)

    def on_step(self) -> None:
        """After each `engine.step()`: the batch it served becomes the gauge's value."""
        self.last_step_batch = len(self.step_seqs)
        self.step_seqs.clear()

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.ttft_s, self.e2e_s, self.prompt_tokens, self.generation_tokens):
            yield from histogram.collect()


class FailedAllocations:
    """The bytes every failed KV allocation asked for, summed by cause. Read from the engine's OOM list at
    scrape time, from where the last scrape stopped (the snapshot carries only the last 100 events)."""

    def __init__(self) -> None:
        self.seen = 0
        self.requested_bytes = dict.fromkeys(OOM_CAUSES, 0)

    def update(self, engine: Engine) -> None:
        events = engine.oom_events  # appended on the engine thread; a slice is one atomic read
        new = events[self.seen:]
        self.seen += len(new)
        for _, event, _ in new:
            self.requested_bytes[event.cause] = self.requested_bytes.get(event.cause, 0) + event.requested_bytes


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"fragbench:{name}", doc, value=value)


class MetricsCollector:
    """Prometheus metrics named after vLLM's: the engine's state from the last snapshot at scrape time, the
    request histograms from the observer."""

    def __init__(self, ignored: dict[str, int], engine: Engine | None = None) -> None:
        self.stats: StatsPayload | None = None  # the last snapshot, set by the handler before each scrape
        self.ignored = ignored  # request fields in neither the OpenAI nor the vLLM schema, by name
        self.engine = engine
        self.requests = RequestObserver(engine.max_seq_len if engine is not None else 2048)
        self.failed = FailedAllocations()

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        if self.engine is not None:
            self.failed.update(self.engine)
        yield from self.kv(s)
        yield from self.memory(s)
        yield from self.scheduler(s)
        yield from self.counters(s)
        yield from self.requests.collect()

    def kv(self, s: StatsPayload) -> Iterator[Metric]:
        cap = s.kv_capacity_bytes or 1
        yield gauge("kv_cache_usage_perc", "KV capacity in use, 0-1 (as vllm:kv_cache_usage_perc)",
                    s.allocated_bytes / cap)
        yield gauge("kv_capacity_bytes", "KV capacity", s.kv_capacity_bytes)
        yield gauge("kv_token_states_bytes", "KV of tokens that exist now", s.token_states_bytes)
        yield gauge("kv_allocated_bytes", "KV held by live sequences", s.allocated_bytes)
        yield gauge("kv_free_bytes", "KV free", s.free_bytes)
        yield gauge("kv_largest_free_bytes", "largest free extent", s.largest_free_bytes)
        yield gauge("kv_live_tokens", "tokens of the live sequences (prompt and output so far)", s.live_tokens)
        if s.kv_bytes_per_token:
            yield gauge("kv_capacity_tokens", "KV capacity in tokens (capacity bytes over bytes per token)",
                        s.kv_capacity_bytes // s.kv_bytes_per_token)
        if s.block_size and s.kv_bytes_per_token:  # a block pool: the seeds' "blocks available"
            block_bytes = s.block_size * s.kv_bytes_per_token
            yield gauge("kv_blocks", "KV blocks in the pool", s.num_blocks)
            yield gauge("kv_free_blocks", "KV blocks free (cached prefix blocks count as free)",
                        s.free_bytes // block_bytes)

    def memory(self, s: StatsPayload) -> Iterator[Metric]:
        """The allocator's two numbers, where something measured them: PyTorch's caching allocator on a GPU
        (source "cuda"), or /stats' `allocator` block, the caching allocator's emulator (source "allocator").
        Absent on a plain CPU arena, whose reserved bytes are its capacity and say nothing."""
        reserved = GaugeMetricFamily("fragbench:memory_reserved_bytes", "bytes the allocator holds from the "
                                     "device (PyTorch's reserved)", labels=["source"])
        allocated = GaugeMetricFamily("fragbench:memory_allocated_bytes", "bytes the allocator has handed to "
                                      "live tensors (PyTorch's allocated)", labels=["source"])
        found = False
        on_gpu = str(getattr(self.engine, "device", "cpu")).startswith("cuda")  # off a GPU torch_* echo the block
        if on_gpu and s.torch_reserved_bytes is not None:
            reserved.add_metric(["cuda"], s.torch_reserved_bytes)
            allocated.add_metric(["cuda"], s.torch_allocated_bytes or 0)
            found = True
        block = s.allocator
        if block is not None and block.reserved_bytes is not None:
            reserved.add_metric(["allocator"], block.reserved_bytes)
            allocated.add_metric(["allocator"], block.allocated_bytes or 0)
            found = True
        if found:
            yield reserved
            yield allocated

    def scheduler(self, s: StatsPayload) -> Iterator[Metric]:
        if s.running is not None:  # an engine that cannot tell (hf-cb on an old transformers) says nothing
            yield gauge("num_requests_running", "sequences running", s.running)
            yield gauge("num_requests_waiting", "sequences waiting", s.waiting)
        yield gauge("step_batch_size", "sequences that got a token in the engine's last step",
                    self.requests.last_step_batch)
        budget = s.engine_config.max_num_batched_tokens if s.engine_config is not None else None
        if budget:  # scheduled engines; it comes down after a forward OOM
            yield gauge("scheduler_token_budget", "tokens the scheduler may batch in one step", budget)

    def counters(self, s: StatsPayload) -> Iterator[Metric]:
        yield CounterMetricFamily("fragbench:num_preemptions", "preemptions", value=s.preempted_total)
        # absent for a contiguous engine (no block pool)
        yield CounterMetricFamily("fragbench:prefix_cache_hits", "prefix-cache hit tokens",
                                  value=s.prefix_cache_hit_tokens or 0)
        yield CounterMetricFamily("fragbench:prefix_cache_queries", "prefix-cache queried tokens",
                                  value=s.prefix_cache_query_tokens or 0)
        oom = CounterMetricFamily("fragbench:oom", "failed KV allocations by cause", labels=["cause"])
        oom.add_metric(["capacity"], s.oom_total - s.oom_fragmentation)
        oom.add_metric(["fragmentation"], s.oom_fragmentation)
        yield oom
        failed = CounterMetricFamily("fragbench:kv_failed_allocation_bytes", "bytes the failed KV allocations "
                                     "asked for, by cause", labels=["cause"])
        for cause, requested in self.failed.requested_bytes.items():
            failed.add_metric([cause], requested)
        yield failed
        yield CounterMetricFamily("fragbench:engine_errors", "errors that stopped the engine (it then exits)",
                                  value=s.engine_errors or 0)
        done = CounterMetricFamily("fragbench:request_success", "finished samples by reason",
                                   labels=["finished_reason"])
        for reason, count in s.finished_total.items():
            done.add_metric([reason], count)
        yield done
        ignored = CounterMetricFamily("fragbench:ignored_request_fields", "request fields in neither the OpenAI "
                                      "nor the vLLM schema, ignored", labels=["field"])
        for name, count in self.ignored.items():
            ignored.add_metric([name[:64]], count)
        yield ignored
