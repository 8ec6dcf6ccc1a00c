"""Iteration-level continuous batching, shared by the static and paged engines (and the simulator):
FCFS admission under a token budget and a sequence cap, preemption by recompute of the newest sequence
when KV runs out, and abort at any step. What differs between engines is the KV policy alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engines.kv.base import KVPolicy
from engines.memory import OOMEvent, OutOfMemory
from engines.model import Chunk
from engines.sequence import FinishReason, SeqStatus, Sequence

# reject: the request fails; crash: the engine goes down; wait: the request waits (or is preempted) and
# retries once memory frees, as a scheduler that finds free bytes but no extent would do
OnOOM = Literal["reject", "crash", "wait"]
FRAGMENTATION_MAPS = 5  # memory maps kept at fragmentation OOMs (each is every extent of the arena)


def oom_context(running: list[Sequence], waiting: int, allocated_bytes: int, capacity_bytes: int) -> dict:
    """What an engine looked like when an allocation failed: every engine records the same fields."""
    return {"running": len(running), "waiting": waiting, "live_tokens": sum(s.num_tokens for s in running),
            "kv_usage": allocated_bytes / (capacity_bytes or 1)}


class EngineCrash(RuntimeError):
    """An allocation failed under `--on-oom crash`: the engine goes down as a naive server would."""

    def __init__(self, event: OOMEvent):
        super().__init__(f"engine crashed on a KV allocation: {event.cause}, requested {event.requested_bytes} B")
        self.event = event


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    on_oom: OnOOM = "reject"


@dataclass
class StepPlan:
    chunks: list[Chunk]
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # failed with FinishReason.OOM


class Scheduler:
    def __init__(self, kv: KVPolicy, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.config = config
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted_total = 0
        self.oom_events: list[tuple[float, OOMEvent, dict]] = []
        # the memory map at the first few failures with memory free: the holes no request fitted
        self.fragmentation_maps: list[tuple[float, OOMEvent, list[dict]]] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan(chunks=[])
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._make_room(seq, plan):
                continue
            if self._allocate(seq, seq.num_tokens, plan):
                plan.chunks.append(Chunk(seq, seq.num_tokens - 1, seq.num_tokens))
                budget -= 1
            elif self.config.on_oom == "wait":
                self.preempt(seq)
                plan.preempted.append(seq)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.kv.can_allocate(seq, seq.num_tokens):
                break  # FCFS: nobody overtakes the head of the queue
            cached = self.kv.num_cached_tokens(seq) if self.kv.holds(seq) else 0
            if seq.num_tokens - cached > budget and plan.chunks:
                break
            self.waiting.popleft()
            if not self._allocate(seq, seq.num_tokens, plan):
                if self.config.on_oom == "wait":
                    self.waiting.appendleft(seq)
                    break
                continue
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            start = min(self.kv.num_cached_tokens(seq), seq.num_tokens - 1)
            plan.chunks.append(Chunk(seq, start, seq.num_tokens))
            budget -= seq.num_tokens - start
        return plan

    def _make_room(self, seq: Sequence, plan: StepPlan) -> bool:
        """Preempt the newest running sequences until seq's next token fits; False if seq itself went."""
        while not self.kv.can_allocate(seq, seq.num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _allocate(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        try:
            self.kv.allocate(seq, num_tokens)
            return True
        except OutOfMemory as oom:
            self.oom_events.append((self.clock(), oom.event, self.context()))
            if oom.event.cause == "fragmentation" and len(self.fragmentation_maps) < FRAGMENTATION_MAPS:
                self.fragmentation_maps.append((self.oom_events[-1][0], oom.event, self.kv.memory_map()))
            if self.config.on_oom == "crash":
                raise EngineCrash(oom.event) from None
            if self.config.on_oom == "reject":
                self.finish(seq, FinishReason.OOM)
                plan.rejected.append(seq)
            return False

    def context(self) -> dict:
        kv = self.kv.stats()
        return oom_context(self.running, len(self.waiting), kv.allocated_bytes, kv.kv_capacity_bytes)

    def preempt(self, seq: Sequence) -> None:
        """Recompute: drop its KV and put it back at the head of the queue, tokens kept."""
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.preempted_total += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Free its KV in this step, wherever it is."""
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def add_running(self, seq: Sequence) -> None:
        """A forked sample that already holds its KV."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def live(self) -> list[Sequence]:
        return list(self.running)
