"""The scheduler's beat (residue buckets served whole, engines/scheduled/beats.py) against its per-sequence heap, side
by side on random workloads under tight budgets: the same decisions and the same figures at every step.

Three worlds run the same workload in lockstep: paged as the engines run it (on the beat, named blocks), the same
policy with its beat hidden (every sequence on the heap, one by one: the scheduler before the beat), and, where
nothing is hashed or forked, the simulator's counted pool on the beat. Preemptions, OOM waits and rejections,
forks (copy-on-write of a shared tail) and shared prefixes (prefix-cache hits) all happen under these budgets.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.kv import PagedKV
from engines.memory.arena import Arena
from engines.scheduled.scheduler import Scheduler, SchedulerConfig
from engines.sequence import FinishReason, SamplingParams, SeqStatus, Sequence

BLOCK = 4
MAX_SEQ_LEN = 64
KVB = 128  # bytes per token: a block is the arena's 512-byte granule, so the budget is whole blocks


class OffBeat(PagedKV):
    """Paged with no beat: the scheduler keeps every sequence on its heap and asks for each one by one."""

    def period_tokens(self, seq) -> None:
        return None


def token(seq_id: str, position: int) -> int:
    """A generated token, the same in every world (decode blocks hash alike)."""
    return 3 + hash((seq_id, position)) % 50


class World:
    def __init__(self, kind: str, num_blocks: int, prefix_caching: bool, on_oom: str):
        cls = OffBeat if kind == "heap" else PagedKV
        self.kv = cls(Arena(num_blocks * BLOCK * KVB, backing_device=None), KVB, MAX_SEQ_LEN, BLOCK, prefix_caching)
        if kind == "counted":
            self.kv.count_blocks()
        self.sched = Scheduler(self.kv, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, on_oom=on_oom),
                               clock=lambda: 0.0)
        self.seqs: dict[str, Sequence] = {}
        self.named = kind != "counted"

    def add(self, seq_id: str, prompt: list[int], max_tokens: int) -> None:
        self.seqs[seq_id] = Sequence(seq_id, list(prompt), SamplingParams(max_tokens), MAX_SEQ_LEN)
        self.sched.add(self.seqs[seq_id])

    def step(self) -> tuple:
        """One schedule(), each running sequence's token, then the finished retired: what was decided."""
        plan = self.sched.schedule()
        for seq in self.sched.running:
            seq.token_ids.append(token(seq.seq_id, seq.num_tokens))
        self._retire()
        return (tuple(s.seq_id for s in plan.decodes), tuple((c.seq.seq_id, c.start, c.end) for c in plan.prefills),
                tuple(s.seq_id for s in plan.preempted), tuple(s.seq_id for s in plan.rejected))

    def stretch(self, steps: int) -> None:
        """The simulator's decode stretch: `steps` more tokens each, slots given on the way by advance()."""
        for _ in range(steps):
            for seq in self.sched.running:
                seq.token_ids.append(token(seq.seq_id, seq.num_tokens))
        self.sched.advance(steps)

    def fork(self, index: int, child_id: str) -> None:
        parent = self.sched.running[index % len(self.sched.running)]
        child = Sequence(child_id, parent.prompt_ids, parent.params, MAX_SEQ_LEN, token_ids=list(parent.token_ids))
        child.status = SeqStatus.RUNNING
        self.kv.fork(parent, child)
        self.sched.add_running(child, parent)
        self.seqs[child_id] = child

    def _retire(self) -> None:
        for seq in list(self.sched.running):
            if seq.num_tokens >= seq.final_len:
                self.sched.finish(seq, FinishReason.LENGTH)

    def figures(self) -> tuple:
        """What the simulator reads (the breakdown from the totals, the headroom) and what an engine reads (each
        table's blocks; their ids where the pool names them)."""
        live = sum(s.num_tokens for s in self.sched.running)
        tables = {i: len(self.kv.seqs[i].table) for i in sorted(self.kv.seqs)}
        return (self.kv.breakdown_of(live), self.kv.pool.num_free, tables, self.sched.decode_headroom(),
                self.sched.preempted_total, len(self.sched.oom_events), self.sched.memory_blocked,
                tuple(s.seq_id for s in self.sched.waiting))

    def block_ids(self) -> dict[str, list[int]]:
        return {i: [b.block_id for b in rec.table] for i, rec in sorted(self.kv.seqs.items())}


def headroom_stretch(world: World, want: int) -> int:
    """As the simulator: at most the headroom less one, and short of the first finish."""
    running = world.sched.running
    if not running:
        return 0
    to_finish = min(s.final_len - s.num_tokens for s in running)
    return max(0, min(want, world.sched.decode_headroom() - 1, to_finish - 1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 40), prefix_caching=st.booleans(),
       forks=st.booleans(), on_oom=st.sampled_from(["wait", "reject"]), steps=st.integers(20, 120))
def test_the_beat_decides_as_the_heap_does(seed, num_blocks, prefix_caching, forks, on_oom, steps):
    rng = random.Random(seed)
    kinds = ["beat", "heap"] + ([] if prefix_caching or forks else ["counted"])
    worlds = [World(k, num_blocks, prefix_caching, on_oom) for k in kinds]
    prefixes = [[rng.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    made = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals: some share a prefix of up to three blocks
            prompt = prefixes[rng.randrange(3)][: rng.randrange(13)] if rng.random() < 0.6 else []
            prompt = prompt + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))]
            # most fit the pool alone (a longer one waits for good, as it would on an engine that waits)
            max_tokens = rng.randrange(1, max(2, min(40, num_blocks * BLOCK - len(prompt))))
            for w in worlds:
                w.add(f"s{made}", prompt, max_tokens)
            made += 1
        decided = [w.step() for w in worlds]
        assert all(d == decided[0] for d in decided), f"decisions differ: {dict(zip(kinds, decided, strict=True))}"
        if forks and rng.random() < 0.15 and worlds[0].sched.running:
            index = rng.randrange(99)
            for w in worlds:
                w.fork(index, f"f{made}")
            made += 1
        if rng.random() < 0.3:  # a decode stretch, as the simulator takes them
            k = headroom_stretch(worlds[0], rng.randrange(1, 3 * BLOCK))
            for w in worlds if k else []:  # as the simulator, which stretches only when the headroom allows one
                assert headroom_stretch(w, k) == k
                w.stretch(k)
        figures = [w.figures() for w in worlds]
        assert all(f == figures[0] for f in figures), f"figures differ: {dict(zip(kinds, figures, strict=True))}"
        named = [w.block_ids() for w in worlds if w.named]
        assert all(b == named[0] for b in named), "the named pools gave different blocks"


def test_a_tight_budget_preempts_off_the_beat_and_the_beat_resumes():
    """The workload the random test draws can miss a case: a bucket that does not fit, served one by one (the
    newest preempted), then whole again once there is room."""
    worlds = [World(k, 9, False, "wait") for k in ("beat", "heap", "counted")]
    for w in worlds:
        for i in range(3):
            w.add(f"s{i}", [5] * 4, 20)  # three prompts of one block each, all due at the same step
    trace = []
    for _ in range(30):
        decided = [w.step() for w in worlds]
        assert decided[0] == decided[1] == decided[2]
        trace.append(decided[0])
        figures = [w.figures() for w in worlds]
        assert figures[0] == figures[1] == figures[2]
    assert any(preempted for _, _, preempted, _ in trace), "9 blocks for 3 x 24 tokens must preempt"
