"""Random allocate / append / fork / free / preempt sequences against every policy and both placements."""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engines.kv import PagedKV, make_policy
from engines.memory.arena import Arena, OutOfMemory
from engines.registry import entry, policies
from engines.sequence import SamplingParams, Sequence

KVB = 512
MAX_SEQ_LEN = 48


class PolicyMachine(RuleBasedStateMachine):
    def make_policy(self):
        raise NotImplementedError

    def __init__(self):
        super().__init__()
        self.kv = self.make_policy()
        self.seqs: dict[str, Sequence] = {}
        self.counter = 0
        self.forked = False

    def _new_seq(self, prompt: list[int], max_tokens: int) -> Sequence:
        self.counter += 1
        return Sequence(f"s{self.counter}", prompt, SamplingParams(max_tokens), MAX_SEQ_LEN)

    @rule(
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=24),  # a small alphabet shares prefixes
        max_tokens=st.integers(1, 20),
    )
    def admit(self, prompt, max_tokens):
        s = self._new_seq(prompt, max_tokens)
        if self.kv.can_allocate(s, s.num_tokens):
            try:
                self.kv.allocate(s, s.num_tokens)
                self.seqs[s.seq_id] = s
                self.check_write_target(s)
                return
            except OutOfMemory:
                pass
        assert not self.kv.holds(s)  # a failed admission leaves nothing behind

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        s = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[s]
        if s.num_tokens >= s.final_len:
            return
        s.token_ids.append(token)
        try:
            self.kv.allocate(s, s.num_tokens)
        except OutOfMemory:
            self._drop(s)  # preempt: give everything back
            return
        self.check_write_target(s)

    def check_write_target(self, s: Sequence) -> None:
        """After allocate, the row the runner writes next (position num_tokens - 1) is s's alone."""
        row = self.kv.slots(s, s.num_tokens - 1, s.num_tokens)[0]
        for other in self.seqs.values():
            if other is not s and other.num_tokens:
                assert row not in self.kv.slots(other, 0, other.num_tokens), f"{s.seq_id} writes {other.seq_id}'s row"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        child = self._new_seq(parent.prompt_ids, parent.params.max_tokens)
        child.token_ids = list(parent.token_ids)
        try:
            self.kv.fork(parent, child)
        except OutOfMemory:
            self.kv.free(child)
            return
        self.seqs[child.seq_id] = child
        self.forked = True

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self._drop(self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))])

    def _drop(self, s):
        self.kv.free(s)
        del self.seqs[s.seq_id]

    @invariant()
    def categories_sum_to_capacity(self):
        bd = self.kv.breakdown(list(self.seqs.values()))
        assert bd.capacity_bytes == self.kv.stats().kv_capacity_bytes
        assert min(bd.__dict__.values()) >= 0

    @invariant()
    def running_totals_give_the_scans_breakdown(self):
        if not self.forked:  # a fork shares its tail block until it copies it: only the scan tells
            live = sum(s.num_tokens for s in self.seqs.values())
            assert self.kv.breakdown_of(live) == self.kv.breakdown(list(self.seqs.values()))

    @invariant()
    def every_live_sequence_has_its_slots(self):
        for s in self.seqs.values():
            slots = self.kv.slots(s, 0, s.num_tokens)
            assert len(slots) == s.num_tokens

    def teardown(self):
        for s in list(self.seqs.values()):
            self._drop(s)
        assert self.kv.stats().allocated_bytes == 0


class PagedMachine(PolicyMachine):
    def make_policy(self):
        return PagedKV(Arena(64 * KVB, backing_device=None), KVB, MAX_SEQ_LEN, block_size=4)

    @invariant()
    def ref_counts_equal_owners_and_free_queue_is_exact(self):
        owners = Counter(b.block_id for rec in self.kv.seqs.values() for b in rec.table)
        for b in self.kv.pool.blocks:
            assert b.ref_count == owners.get(b.block_id, 0)
            assert (b.ref_count == 0) == (b.block_id in self.kv.pool.free_queue)
        for h, block_id in self.kv.pool.cached.items():
            assert self.kv.pool.blocks[block_id].block_hash == h

    def check_write_target(self, s: Sequence) -> None:
        super().check_write_target(s)
        # copy-on-write has happened: the block holding the write is owned by one table
        assert self.kv.table(s)[(s.num_tokens - 1) // self.kv.block_size].ref_count == 1


class ArenaPolicyMachine(PolicyMachine):
    @invariant()
    def no_byte_owned_twice(self):
        extents = self.kv.memory.extents()
        end = 0
        for offset, size, _ in extents:
            assert offset == end, "extents overlap or leave a gap"
            end = offset + size
        assert end == self.kv.memory.capacity_bytes


def machine(name: str, placement: str) -> type[PolicyMachine]:
    """The machine for one registered policy on one arena placement: a block pool's invariants for the paged
    policy, an arena's (no byte owned twice) for the contiguous ones."""
    known = entry(name)
    base = PagedMachine if issubclass(known.policy_class(), PagedKV) else \
        ArenaPolicyMachine if known.kv == "contiguous" else PolicyMachine
    tokens = 64 if known.kv == "blocks" else 256 if placement == "buddy" else 150  # buddy: a power of two

    class Machine(base):
        def make_policy(self):
            return make_policy(name, Arena(tokens * KVB, placement, backing_device=None), KVB, MAX_SEQ_LEN,
                               block_size=4)

    Machine.__name__ = f"{name}-{placement}"
    return Machine


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
# every policy the registry lists (engines/registry.py), on its own placement and, for contiguous reservations,
# on the other too (a block pool is one allocation: its placement does not matter)
for _name in policies():
    for _placement in dict.fromkeys([entry(_name).placement, *(("best-fit", "buddy") if entry(_name).kv ==
                                                                 "contiguous" else ())]):
        _case = machine(_name, _placement).TestCase
        _case.settings = SETTINGS
        globals()[f"Test_{_name.replace('-', '_')}_{_placement.replace('-', '_')}"] = _case
del _name, _placement, _case
