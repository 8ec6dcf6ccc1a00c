"""The scheduler's rules on a fake KV policy: a pool of token slots and nothing else, so each test
sees one rule (FCFS head-of-line, newest-first preemption, the token budget, what an OOM does)."""

from __future__ import annotations

from collections import Counter

import torch

from engines.kv import PagedKV
from engines.kv.base import Breakdown, KVPolicy, KVStats, SeqLike
from engines.memory.arena import Arena, OOMEvent, OutOfMemory
from engines.scheduled.scheduler import Scheduler, SchedulerConfig
from engines.sequence import FinishReason, SeqStatus
from tests.helpers import seq


class TokenPool(KVPolicy):
    """`capacity` token slots; a sequence holds exactly as many as it asked for."""

    name = "fake"
    kv_bytes_per_token = 1

    def __init__(self, capacity: int, fail_with: str | None = None):
        self.capacity, self.held, self.fail_with = capacity, {}, fail_with

    def free_tokens(self) -> int:
        return self.capacity - sum(self.held.values())

    def can_allocate(self, s: SeqLike, n: int) -> bool:
        return n - self.held.get(s.seq_id, 0) <= self.free_tokens()

    def allocate(self, s: SeqLike, n: int) -> None:
        need = n - self.held.get(s.seq_id, 0)
        if need > self.free_tokens() or self.fail_with:
            free = self.free_tokens()
            raise OutOfMemory(OOMEvent.classify(need, free if not self.fail_with else need, 0, s.seq_id))
        self.held[s.seq_id] = max(n, self.held.get(s.seq_id, 0))

    def free(self, s: SeqLike) -> None:
        self.held.pop(s.seq_id, None)

    def holds(self, s: SeqLike) -> bool:
        return s.seq_id in self.held

    def fork(self, parent, child) -> None:
        self.allocate(child, parent.num_tokens)

    def rows(self, s: SeqLike, n: int) -> torch.Tensor:
        return torch.arange(n)

    def store(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def breakdown(self, seqs) -> Breakdown:
        return self.breakdown_of(0)

    def breakdown_of(self, live_tokens: int) -> Breakdown:
        used = sum(self.held.values())
        return Breakdown(used, 0, 0, 0, self.capacity - used)

    def stats(self) -> KVStats:
        used = sum(self.held.values())
        return KVStats(self.capacity, used, self.capacity - used, self.capacity - used, len(self.held))

    def memory_map(self) -> list[dict]:
        return []

    def longest_sequence_tokens(self) -> int:
        return self.capacity

    def slack_tokens(self, s: SeqLike) -> int:
        return self.held.get(s.seq_id, 0) - s.num_tokens


def step(sched: Scheduler):
    """Schedule, then let every scheduled sequence produce one token, as an engine would."""
    plan = sched.schedule()
    for chunk in plan.chunks:
        chunk.seq.num_computed_tokens = chunk.end
        chunk.seq.token_ids.append(1)
    return plan


def test_fcfs_nobody_overtakes_the_head_of_the_queue():
    sched = Scheduler(TokenPool(100), SchedulerConfig())
    sched.add(big := seq("big", 80, 4))
    step(sched)
    sched.add(head := seq("head", 60, 4))  # does not fit beside big
    sched.add(small := seq("small", 5, 4))  # would fit, but waits behind the head
    plan = step(sched)
    assert [c.seq for c in plan.chunks] == [big]
    assert list(sched.waiting) == [head, small]


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    sched = Scheduler(TokenPool(30), SchedulerConfig(on_oom="wait"))
    old, new = seq("old", 14, 10), seq("new", 14, 10)
    sched.add(old)
    sched.add(new)
    step(sched)  # both admitted: 28 of 30 slots
    step(sched)  # 30 of 30
    plan = step(sched)  # old needs a slot: the newest goes
    assert plan.preempted == [new] and new.status == SeqStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and new.num_preemptions == 1
    assert [c.seq for c in plan.chunks] == [old]


def test_the_token_budget_limits_what_one_step_prefills():
    sched = Scheduler(TokenPool(1000), SchedulerConfig(max_num_batched_tokens=50))
    first, second = seq("a", 40, 4), seq("b", 40, 4)
    sched.add(first)
    sched.add(second)
    plan = step(sched)
    assert [c.seq for c in plan.chunks] == [first]  # 40 + 40 is over the budget of 50
    plan = step(sched)
    assert [c.seq for c in plan.chunks] == [first, second]  # a decode (1) and the prefill (40)


def test_the_sequence_cap_holds():
    sched = Scheduler(TokenPool(1000), SchedulerConfig(max_num_seqs=2))
    for i in range(3):
        sched.add(seq(f"s{i}", 4, 4))
    step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_on_oom_reject_fails_the_request_and_records_the_event():
    sched = Scheduler(TokenPool(100, fail_with="fragmentation"), SchedulerConfig(on_oom="reject"))
    sched.add(s := seq("a", 10, 4))
    plan = step(sched)
    assert plan.rejected == [s] and s.finish_reason == FinishReason.OOM
    assert len(sched.oom_events) == 1 and sched.oom_events[0][1].cause == "fragmentation"
    assert not sched.has_work()


def test_on_oom_wait_keeps_the_request_at_the_head_until_memory_frees():
    pool = TokenPool(100, fail_with="fragmentation")
    sched = Scheduler(pool, SchedulerConfig(on_oom="wait"))
    sched.add(s := seq("a", 10, 4))
    assert not step(sched).chunks and sched.waiting[0] is s and s.finish_reason is None
    pool.fail_with = None  # memory frees (another sequence ended)
    assert [c.seq for c in step(sched).chunks] == [s]


def test_finish_frees_wherever_the_sequence_is():
    pool = TokenPool(100)
    sched = Scheduler(pool, SchedulerConfig())
    sched.add(running := seq("r", 10, 4))
    step(sched)
    sched.add(waiting := seq("w", 10, 4))
    sched.finish(running, FinishReason.ABORT)
    sched.finish(waiting, FinishReason.ABORT)
    assert pool.held == {} and not sched.has_work()


def test_a_running_sequence_asks_the_policy_only_when_its_block_fills():
    """Decoding costs the scheduler the sequences that cross a block boundary, not the whole batch."""
    kv = PagedKV(Arena(64 * 4 * 8, backing_device=None), 8, 256, block_size=4)
    calls = []
    allocate = kv.allocate
    kv.allocate = lambda s, n: (calls.append(s.seq_id), allocate(s, n))[1]
    sched = Scheduler(kv, SchedulerConfig())
    for i in range(3):
        sched.add(seq(f"s{i}", 4, 20))
    for _ in range(16):
        plan = sched.schedule()
        for chunk in plan.chunks:
            assert kv.slack_tokens(chunk.seq) >= 0, "a sequence computes a token it holds no slot for"
            chunk.seq.token_ids.append(1)
    # admission (1 each), then one allocation per new block: 4 + 16 tokens cross 4 boundaries each
    assert sorted(Counter(calls).values()) == [5, 5, 5]
