"""An engine: requests in, tokens out, one `step()` at a time, and its memory state on demand.

`ScheduledEngine` is the static and paged engines: the shared scheduler, the model runner and a KV
policy. The server and `generate` drive any engine through the same methods.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from engines.kv import Breakdown, KVPolicy, KVStats, PagedKV
from engines.memory import DeviceMemory, OOMEvent, OutOfMemory
from engines.model import ModelRunner
from engines.sampler import make_generator, sample
from engines.scheduler import Scheduler, SchedulerConfig
from engines.sequence import FinishReason, SamplingParams, Sequence


@dataclass
class TokenEvent:
    """One new token of one sample, or the end of that sample (token_id None when it ends without one)."""

    seq: Sequence
    token_id: int | None
    finished: bool
    request_done: bool = False  # every sample of the request has ended


Sink = Callable[[TokenEvent], None]


@dataclass
class BlockPoolStats:
    """What a block pool adds: its geometry, sharing and prefix cache."""

    block_size: int
    num_blocks: int
    shared_blocks: int
    max_block_ref_count: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


@dataclass
class EngineStats:
    """The one record every engine reports, named once: the samples columns (docs/architecture.md), the
    Figure-2 categories and the counters. `/stats` is its JSON, flat."""

    engine: str
    policy: str
    kv_capacity_bytes: int
    token_states_bytes: int
    reservation_bytes: int
    internal_fragmentation_bytes: int
    external_fragmentation_bytes: int
    allocated_bytes: int
    free_bytes: int
    largest_free_bytes: int
    running: int | None  # None: the engine cannot tell (hf-cb without transformers' scheduler)
    waiting: int | None
    preempted_total: int
    live_tokens: int
    kv_bytes_per_token: int
    oom_total: int
    oom_fragmentation: int
    steps: int
    blocks: BlockPoolStats | None = None
    decode_steps: int | None = None  # the naive engine: tokens generated, batch by batch

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(out.pop("blocks") or {})
        if out["decode_steps"] is None:
            del out["decode_steps"]
        return out


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    arrival_s: float = field(default_factory=time.monotonic)

    def sample(self, index: int, max_seq_len: int, token_ids: list[int] | None = None) -> Sequence:
        """The sequence of sample `index`; ids are the request's own unless it asked for several."""
        return Sequence(
            seq_id=f"{self.request_id}#{index}" if self.n > 1 else self.request_id,
            prompt_ids=list(self.prompt_ids),
            params=self.params,
            max_seq_len=max_seq_len,
            request_id=self.request_id,
            sample_index=index,
            arrival_s=self.arrival_s,
            token_ids=list(token_ids or []),
        )


class Engine(ABC):
    """What the server needs of every engine."""

    memory: DeviceMemory | None = None  # where its KV lives; None where another library owns it (hf-cb)

    def __init__(self, name: str, hf_model, max_seq_len: int) -> None:
        self.name = name
        self.max_seq_len = max_seq_len
        self.vocab_size: int = hf_model.config.vocab_size
        eos = hf_model.config.eos_token_id
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        self.sink: Sink = lambda event: None
        self.poll: Callable[[], None] = lambda: None  # the server's hook: called between steps and inside long ones
        self.oom_events: list[tuple[float, OOMEvent, dict]] = []  # when, what, the engine's state then
        self.fragmentation_maps: list[tuple[float, OOMEvent, list[dict]]] = []  # when, what, the memory map then
        self.finished_total: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.abort_release_s: list[float] = []
        self.abort_release_steps: list[int] = []  # engine steps between the abort's arrival and the free
        self.steps = 0  # scheduling iterations (for the naive engine: batches, the unit it frees memory in)
        self.by_request: dict[str, list[Sequence]] = {}

    @abstractmethod
    def add_request(self, request: Request) -> list[Sequence]: ...

    @abstractmethod
    def abort(self, request_id: str, requested_at: float | None = None, steps_at: int | None = None) -> None:
        """Free the request's KV in the current step; `requested_at` (monotonic) and `steps_at` (self.steps
        when the abort was asked for) time the release."""

    def _released(self, requested_at: float | None, steps_at: int | None) -> None:
        self.abort_release_s.append(time.monotonic() - (requested_at or time.monotonic()))
        self.abort_release_steps.append(self.steps - (self.steps if steps_at is None else steps_at))

    @abstractmethod
    def step(self) -> None:
        """Advance: emit TokenEvents through `self.sink`."""

    @abstractmethod
    def has_work(self) -> bool: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def memory_map(self) -> list[dict]:
        return []

    def _stats(self, policy: str, kv: KVStats, bd: Breakdown, live: list[Sequence], waiting: int | None,
               preempted_total: int, kv_bytes_per_token: int, **more) -> EngineStats:
        return EngineStats(
            engine=self.name, policy=policy, kv_capacity_bytes=kv.kv_capacity_bytes,
            token_states_bytes=bd.token_states_bytes, reservation_bytes=bd.reservation_bytes,
            internal_fragmentation_bytes=bd.internal_fragmentation_bytes,
            external_fragmentation_bytes=bd.external_fragmentation_bytes, allocated_bytes=kv.allocated_bytes,
            free_bytes=kv.free_bytes, largest_free_bytes=kv.largest_free_bytes,
            running=more.pop("running", len(live)), waiting=waiting, preempted_total=preempted_total,
            live_tokens=sum(s.num_tokens for s in live), kv_bytes_per_token=kv_bytes_per_token,
            oom_total=len(self.oom_events),
            oom_fragmentation=sum(1 for _, e, _ in self.oom_events if e.cause == "fragmentation"),
            steps=self.steps, **more)

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why seq ends after its newest token, if it does: EOS, max_tokens or the context."""
        if not seq.params.ignore_eos and seq.token_ids[-1] == self.eos_token_id:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _append(self, seq: Sequence, token: int) -> None:
        """A new token: the stop rule, then the event (finished when the rule says so)."""
        seq.token_ids.append(token)
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)
        self._emit(seq, token, reason is not None)

    @abstractmethod
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark seq finished and free what it holds (or, for a batch, what it no longer needs)."""

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq without a new token: finished, and its stream told so."""
        self._finish(seq, reason)
        self._emit(seq, None, True)

    def _emit(self, seq: Sequence, token_id: int | None, finished: bool) -> None:
        done = False
        if finished:
            self.finished_total[seq.finish_reason.value] += 1
            self._forget(seq)
            done = all(s.is_finished for s in self.by_request.get(seq.request_id, []))
            if done:
                self.by_request.pop(seq.request_id, None)
        self.sink(TokenEvent(seq, token_id, finished, done))

    def _forget(self, seq: Sequence) -> None:  # noqa: B027 - most engines keep no per-sample state
        """Drop per-sample state of a finished sample."""


class ScheduledEngine(Engine):
    def __init__(self, name: str, hf_model, kv: KVPolicy, config: SchedulerConfig, max_seq_len: int):
        super().__init__(name, hf_model, max_seq_len)
        self.kv = kv
        self.scheduler = Scheduler(kv, config)
        self.oom_events = self.scheduler.oom_events
        self.fragmentation_maps = self.scheduler.fragmentation_maps
        self.runner = ModelRunner(hf_model, kv)
        self.generators: dict[str, torch.Generator | None] = {}
        self.pending_forks: dict[str, Request] = {}  # parent seq id -> request still to fork

    # -- requests
    def _new_seq(self, request: Request, index: int, token_ids: list[int] | None = None) -> Sequence:
        seq = request.sample(index, self.max_seq_len, token_ids)
        self.generators[seq.seq_id] = make_generator(request.params, index)
        self.by_request.setdefault(request.request_id, []).append(seq)
        return seq

    def add_request(self, request: Request) -> list[Sequence]:
        seq = self._new_seq(request, 0)
        if request.n > 1:
            self.pending_forks[seq.seq_id] = request
        self.scheduler.add(seq)
        return [seq]

    def abort(self, request_id: str, requested_at: float | None = None, steps_at: int | None = None) -> None:
        self._end_request(request_id, FinishReason.ABORT)
        self._released(requested_at, steps_at)

    def fail_request(self, request_id: str, err: Exception) -> None:
        """Serving the request raised: every sample of it ends with an error, its KV freed in this step."""
        for seq in self.by_request.get(request_id, []):
            seq.error = f"{type(err).__name__}: {err}"[:300]
        self._end_request(request_id, FinishReason.ERROR)

    def _end_request(self, request_id: str, reason: FinishReason) -> None:
        for seq in list(self.by_request.get(request_id, [])):
            if not seq.is_finished:
                self._end(seq, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step
    def step(self) -> None:
        plan = self.scheduler.schedule()
        for seq in plan.rejected:
            self._emit(seq, None, True)
        if not plan.chunks:
            return
        logits = self.runner.forward(plan.chunks)
        self.steps += 1
        for chunk, row in zip(plan.chunks, logits, strict=True):
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if seq.is_finished:  # a sibling's failure earlier in this loop ended it
                continue
            try:
                if seq.seq_id in self.pending_forks:
                    self._fork(seq, row)
                self._append(seq, sample(row, seq.params, self.generators[seq.seq_id]))
            except Exception as err:  # one sequence's failure is its request's alone
                self.fail_request(seq.request_id, err)

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> None:
        """Parallel samples: after the prompt's prefill, children share its KV and sample on their own."""
        request = self.pending_forks.pop(parent.seq_id)
        for i in range(1, request.n):
            child = self._new_seq(request, i, parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            oom = None
            try:
                self.kv.fork(parent, child)
            except OutOfMemory as e:  # contiguous policies copy, and the copy may not fit
                oom = e
            token = sample(logits, child.params, self.generators[child.seq_id])
            if oom is None:
                self.scheduler.add_running(child, parent)
                self._append(child, token)
            else:
                child.token_ids.append(token)
                self._emit(child, token, False)
                self.scheduler.add(child)  # recomputes its prompt when there is room

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)

    def _forget(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        # a parent that ends before its prefill takes its unborn samples with it
        self.pending_forks.pop(seq.seq_id, None)

    # -- what it reports
    def stats(self) -> EngineStats:
        live = self.scheduler.live()
        blocks = None
        if isinstance(self.kv, PagedKV):
            refs = [b.ref_count for b in self.kv.pool.blocks]
            blocks = BlockPoolStats(self.kv.block_size, len(refs), sum(1 for r in refs if r > 1), max(refs),
                                    self.kv.prefix_hits_tokens, self.kv.prefix_queries_tokens)
        return self._stats(self.kv.name, self.kv.stats(), self.kv.breakdown(live), live, len(self.scheduler.waiting),
                           self.scheduler.preempted_total, self.kv.kv_bytes_per_token, blocks=blocks)

    def memory_map(self) -> list[dict]:
        return self.kv.memory_map()

    @property
    def memory(self) -> DeviceMemory:
        return self.kv.memory
