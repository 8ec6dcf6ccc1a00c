"""An engine: requests in, tokens out, one `step()` at a time, and its memory state on demand.

Every engine implements `Engine`: the scheduled ones (`engines/scheduled/engine.py`) and the peers
(`engines/peers/`). The server and `generate` drive any engine through the same methods.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from engines.kv import Breakdown, KVStats
from engines.memory.arena import DeviceMemory, OOMEvent
from engines.sequence import FinishReason, SamplingParams, Sequence
from engines.token_sampling import Logprob


@dataclass
class TokenEvent:
    """One new token of one sample, or the end of that sample (token_id None when it ends without one)."""

    seq: Sequence
    token_id: int | None
    finished: bool
    request_done: bool = False  # every sample of the request has ended
    logprob: Logprob | None = None  # the token's, where the request asked (params.logprobs)
    prompt_logprobs: list[Logprob | None] | None = None  # on a sample's first event, where it asked


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
    waiting_for_memory: int | None = None  # requests waiting while memory alone holds the queue back (scheduled)
    free_outside_largest_bytes: int | None = None  # free bytes outside the largest extent (the older index)
    usable_free_bytes: int | None = None  # the free category: free bytes less external fragmentation

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


def eos_token_ids(hf_model) -> frozenset[int]:
    """Every id that ends a turn: the config's eos (an id or a list) and the generation config's, as vLLM
    stops on them (Llama-3.1-Instruct's config lists 128001 first; its chat turns end with 128009)."""
    ids: set[int] = set()
    for eos in (hf_model.config.eos_token_id, getattr(getattr(hf_model, "generation_config", None),
                                                          "eos_token_id", None)):
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return frozenset(ids)


class Engine(ABC):
    """What the server needs of every engine."""

    memory: DeviceMemory | None = None  # where its KV lives; None where another library owns it (hf-cb)

    def __init__(self, name: str, hf_model, max_seq_len: int) -> None:
        self.name = name
        self.max_seq_len = max_seq_len
        self.device = str(next(hf_model.parameters()).device)  # where the model runs: its samples read that GPU
        self.vocab_size: int = hf_model.config.vocab_size
        self.eos_token_ids = eos_token_ids(hf_model)
        self.sink: Sink = lambda event: None
        self.poll: Callable[[], None] = lambda: None  # the server's hook: called between steps and inside long ones
        self.oom_events: list[tuple[float, OOMEvent, dict]] = []  # when, what, the engine's state then
        self.fragmentation_maps: list[tuple[float, OOMEvent, list[dict]]] = []  # when, what, the memory map then
        self.finished_total: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.abort_release_s: list[float] = []
        self.abort_release_steps: list[int] = []  # engine steps between the abort's arrival and the free
        self.steps = 0  # scheduling iterations (for the naive engine: batches, the unit it frees memory in)
        self.by_request: dict[str, list[Sequence]] = {}

    def close(self) -> None:
        """The engine is done: its memory gives back what it changed of the process (the CUDA cap)."""
        if self.memory is not None:
            self.memory.close()

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
            free_outside_largest_bytes=kv.free_bytes - kv.largest_free_bytes, usable_free_bytes=bd.free_bytes,
            running=more.pop("running", len(live)), waiting=waiting, preempted_total=preempted_total,
            live_tokens=sum(s.num_tokens for s in live), kv_bytes_per_token=kv_bytes_per_token,
            oom_total=len(self.oom_events),
            oom_fragmentation=sum(1 for _, e, _ in self.oom_events if e.cause == "fragmentation"),
            steps=self.steps, **more)

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why seq ends after its newest token, if it does: EOS, max_tokens or the context."""
        if not seq.params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None = None) -> None:
        """A new token: the stop rule, then the event (finished when the rule says so)."""
        seq.token_ids.append(token)
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)
        self._emit(seq, token, reason is not None, logprob)

    @abstractmethod
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark seq finished and free what it holds (or, for a batch, what it no longer needs)."""

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq without a new token: finished, and its stream told so."""
        self._finish(seq, reason)
        self._emit(seq, None, True)

    def _emit(self, seq: Sequence, token_id: int | None, finished: bool, logprob: Logprob | None = None) -> None:
        done = False
        if finished:
            self.finished_total[seq.finish_reason.value] += 1
            self._forget(seq)
            done = all(s.is_finished for s in self.by_request.get(seq.request_id, []))
            if done:
                self.by_request.pop(seq.request_id, None)
        first = seq.num_output_tokens == 1 and token_id is not None  # the prompt's logprobs ride its first token
        self.sink(TokenEvent(seq, token_id, finished, done, logprob, seq.prompt_logprobs if first else None))

    def _forget(self, seq: Sequence) -> None:  # noqa: B027 - most engines keep no per-sample state
        """Drop per-sample state of a finished sample."""
