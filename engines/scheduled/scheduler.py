"""Iteration-level continuous batching, shared by the static and paged engines (and the simulator):
FCFS admission under a token budget and a sequence cap, preemption by recompute of the newest sequence
when KV runs out, and abort at any step. What differs between engines is the KV policy alone.

Every running sequence gains one token per step, so the scheduler asks the policy about a running sequence
only when its slack (the tokens its slots still cover) runs out: a heap keyed by the step at which that
happens. A sequence the policy says needs memory on a beat (paged, its tail block its own: one block every
block_size steps) sits in its residue's bucket instead (beats.py): a step serves its bucket whole when the policy
says all of it fits, and otherwise one by one as the heap's are, preemption order unchanged. A step's cost is then
its admissions, its finishes and the sequences that cross a boundary off the beat, not the size of the running
batch: what lets the simulator replay millions of requests.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.kv.base import KVPolicy
from engines.memory.arena import OOMEvent, OutOfMemory
from engines.oom import FRAGMENTATION_MAPS, EngineCrash, OnOOM, oom_context
from engines.scheduled.beats import Beats
from engines.sequence import FinishReason, SeqStatus, Sequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    on_oom: OnOOM = "reject"


@dataclass
class Chunk:
    """Positions [start, end) of one sequence computed in this step; logits come from position end-1. The
    scheduler's record to the runner (engines/scheduled/model.py), here so that the simulator, which runs the
    scheduler alone, never imports the runner (and torch with it)."""

    seq: Sequence
    start: int
    end: int


@dataclass
class StepPlan:
    decodes: list[Sequence]  # running sequences computing their newest token, in admission order
    prefills: list[Chunk]  # sequences admitted in this step, in queue order
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # failed with FinishReason.OOM

    @property
    def chunks(self) -> list[Chunk]:
        """What the runner computes: one position per decode, then each admission's uncached prompt."""
        return [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in self.decodes] + self.prefills


class Scheduler:
    def __init__(self, kv: KVPolicy, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.config = config
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: preemption takes the newest
        # The last schedule() left requests waiting because memory held the queue's head back (not the sequence
        # cap or the token budget): what tells a memory-bound engine from a compute-bound one at its knee.
        self.memory_blocked = False
        # Steps taken: a running sequence's num_tokens - steps is constant while it runs (one token each).
        self.steps = 0
        # (step at which its slots run out, admission rank, entry number, seq). An entry is current while
        # _due[seq_id] is its step and the sequence runs; those of preempted, finished or re-allocated sequences
        # are skipped when they surface. Asking early is harmless (allocate is idempotent), late never happens.
        self._due_heap: list[tuple[int, int, int, Sequence]] = []
        self._due: dict[str, int] = {}
        self._beats = Beats()  # running sequences on the policy's beat: never on the heap at the same time
        self._rank: dict[str, int] = {}  # running sequence -> admission number, the running list's order
        self._counter = itertools.count()
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
        """One step: room for every running sequence's next token, then FCFS admissions. Each call is a step
        that every sequence running after it takes (its caller appends one token to each)."""
        self.steps += 1
        plan = StepPlan(decodes=[], prefills=[])
        for seq in self._due_one_by_one(self.steps):
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._make_room(seq, plan):
                if self._allocate(seq, seq.num_tokens, plan):
                    self._push_due(seq, seq.num_tokens)
                elif self.config.on_oom == "wait":
                    self.preempt(seq)
                    plan.preempted.append(seq)
        plan.decodes = list(self.running)
        budget = self.config.max_num_batched_tokens - len(plan.decodes)
        self.memory_blocked = False
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.kv.can_allocate(seq, seq.num_tokens):
                self.memory_blocked = True
                break  # FCFS: nobody overtakes the head of the queue
            cached = self.kv.num_cached_tokens(seq) if self.kv.holds(seq) else 0
            if seq.num_tokens - cached > budget and (plan.decodes or plan.prefills):
                break
            self.waiting.popleft()
            if not self._allocate(seq, seq.num_tokens, plan):
                if self.config.on_oom == "wait":
                    self.waiting.appendleft(seq)
                    self.memory_blocked = True
                    break
                continue
            self._run(seq)
            start = min(self.kv.num_cached_tokens(seq), seq.num_tokens - 1)
            plan.prefills.append(Chunk(seq, start, seq.num_tokens))
            budget -= seq.num_tokens - start
        # what the policy's breakdown judges its holes against: the allocation the queue's head waits for
        self.kv.next_need_bytes = self.kv.allocation_bytes(self.waiting[0]) if self.waiting else None
        return plan

    def unstep(self) -> None:
        """The step just planned never ran (its forward raised): no sequence gained a token, so the next schedule()
        takes the same step again. Every allocation made in it stands (allocate is idempotent) and every due it
        pushed is still right; without this, a beat's bucket would be asked one step before its sequences cross
        into their next block, and never at the step they do (row_of past the table's end)."""
        self.steps -= 1

    def _due_one_by_one(self, step: int) -> list[Sequence]:
        """Serve the beat's bucket due at `step` whole if nothing else is due and the policy has room for all of
        it; what is left to serve one by one (the heap's and, when the bucket was not served, the bucket's), in
        (due step, admission) order."""
        entries = self._pop_due(step)
        bucket = self._beats.due_at(step)
        if not bucket:
            return [seq for _, _, seq in entries]
        if not entries and self.kv.can_allocate_periodic(len(bucket), 1):
            self.kv.allocate_periodic(list(bucket.values()), 1, lag=0)
            return []
        entries += [(step, rank, seq) for rank, seq in bucket.items()]
        return [seq for _, _, seq in sorted(entries, key=lambda e: e[:2])]

    def advance(self, steps: int) -> None:
        """The running sequences took `steps` more steps after this one without asking (the simulator's decode
        stretch, within `decode_headroom`): give each the slots of the tokens it computed on the way (its newest
        token is sampled, not computed yet: lag 1), in the order the steps would have asked."""
        start = self.steps
        self.steps += steps
        entries = self._pop_due(self.steps)
        stretch = self._beats.stretch(start, self.steps)
        if not entries:  # the beat's buckets alone: each in one call, however many crossings
            for _, crossings, seqs in stretch:
                self.kv.allocate_periodic(seqs, crossings, lag=1)
            return
        entries += [(first, self._rank[seq.seq_id], seq) for first, _, seqs in stretch for seq in seqs]
        for _, _, seq in sorted(entries, key=lambda e: e[:2]):
            self.kv.allocate(seq, seq.num_tokens - 1)
            self._push_due(seq, seq.num_tokens - 1)

    def decode_headroom(self) -> int:
        """Steps the running sequences can take after this one with every allocation certain to succeed."""
        while self._due_heap and self._stale(self._due_heap[0]):
            heapq.heappop(self._due_heap)
        dues = [self._due_heap[0][0]] if self._due_heap else []
        beat = self._beats.next_due(self.steps)
        dues += [beat] if beat is not None else []
        own = min(dues) - self.steps - 1 if dues else 1
        return self.kv.decode_headroom(len(self.running), own)

    def _run(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._rank[seq.seq_id] = next(self._counter)
        self._push_due(seq, seq.num_tokens)

    def _push_due(self, seq: Sequence, tokens_now: int) -> None:
        """seq held slots for its tokens_now tokens at this step, and slack_tokens more: it gains one a step,
        so it must ask again at the step where it outgrows them."""
        due = self.steps + self.kv.slack_tokens(seq) + seq.num_tokens - tokens_now + 1
        period = self.kv.period_tokens(seq)
        if period is not None:
            self._beats.put(seq, self._rank[seq.seq_id], due, period)
            return
        self._due[seq.seq_id] = due
        heapq.heappush(self._due_heap, (due, self._rank[seq.seq_id], next(self._counter), seq))

    def _stale(self, entry: tuple[int, int, int, Sequence]) -> bool:
        seq = entry[3]
        return self._due.get(seq.seq_id) != entry[0] or self._rank.get(seq.seq_id) != entry[1]

    def _pop_due(self, step: int) -> list[tuple[int, int, Sequence]]:
        """(due step, admission rank, seq) of the heap's running sequences whose slots run out by `step`, in that
        order."""
        out = []
        while self._due_heap and self._due_heap[0][0] <= step:
            entry = heapq.heappop(self._due_heap)
            if not self._stale(entry):
                del self._due[entry[3].seq_id]
                out.append((entry[0], entry[1], entry[3]))
        return out

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

    def preempt(self, seq: Sequence, discard: bool = False) -> None:
        """Recompute: drop its KV and put it back at the head of the queue, tokens kept. `discard`: its newest
        rows were never written (a failed forward): the policy forgets what it promised of them."""
        self._stop(seq, discard)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.preempted_total += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Free its KV in this step, wherever it is."""
        running = seq.status == SeqStatus.RUNNING
        self._stop(seq)
        if not running and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _stop(self, seq: Sequence, discard: bool = False) -> None:
        """Free its KV; out of the running set if it was there."""
        (self.kv.discard if discard else self.kv.free)(seq)
        if self._rank.pop(seq.seq_id, None) is not None:
            self.running.remove(seq)
        self._due.pop(seq.seq_id, None)
        self._beats.remove(seq.seq_id)

    def add_running(self, seq: Sequence, parent: Sequence) -> None:
        """A forked sample that already holds its KV, shared with parent's: both ask at the next step, where
        a shared tail block is copied before either writes to it."""
        self._run(seq)
        if parent.seq_id in self._rank:
            self._beats.remove(parent.seq_id)  # its tail is shared now: off the beat until it copies it
            self._due[parent.seq_id] = self.steps + 1
            heapq.heappush(self._due_heap, (self.steps + 1, self._rank[parent.seq_id], next(self._counter), parent))

    def live(self) -> list[Sequence]:
        return list(self.running)
