"""The interface every KV policy offers the scheduler, and the vLLM paper's Figure-2 accounting."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from engines.kv_categories import CATEGORIES, CATEGORY_COLUMNS  # noqa: F401 (the policies' accounting names them)
from engines.memory.arena import DeviceMemory

if TYPE_CHECKING:  # the simulator's policies name no tensor: it runs without importing torch (1.4 s a process)
    import torch


class SeqLike(Protocol):
    seq_id: str
    token_ids: list[int]  # prompt and output so far

    @property
    def num_tokens(self) -> int: ...

    @property
    def final_len(self) -> int:
        """The length it will end at: prompt + max_tokens unless it stops early."""
        ...


@dataclass(frozen=True)
class Breakdown:
    """Bytes of KV capacity in each Figure-2 category; they sum to the capacity."""

    token_states_bytes: int
    reservation_bytes: int
    internal_fragmentation_bytes: int
    external_fragmentation_bytes: int
    free_bytes: int

    @property
    def capacity_bytes(self) -> int:
        return sum(self.astuple())

    def astuple(self) -> tuple[int, ...]:
        """The bytes in CATEGORIES order (by hand: dataclasses.asdict deep-copies, per simulated event)."""
        return (self.token_states_bytes, self.reservation_bytes, self.internal_fragmentation_bytes,
                self.external_fragmentation_bytes, self.free_bytes)

    def shares(self) -> dict[str, float]:
        cap = self.capacity_bytes or 1
        return {f"{c}_share": v / cap for c, v in zip(CATEGORIES, asdict(self).values(), strict=True)}


@dataclass(frozen=True)
class KVStats:
    kv_capacity_bytes: int
    allocated_bytes: int  # owned by live sequences (free cached prefix blocks count as free)
    free_bytes: int
    largest_free_bytes: int
    num_seqs: int


@dataclass
class HeldTotals:
    """Sums over the held sequences, kept on every allocate, fork and free so that the breakdown costs O(1)
    where the caller keeps the sum of their num_tokens (the simulator does)."""

    allocated_tokens: int = 0  # token slots held
    eventual_tokens: int = 0  # of those, the ones the sequences will fill: min(slots, final_len) each
    remainder_bytes: int = 0  # allocator rounding below one token row (contiguous)

    def add(self, slots: int, final_len: int, remainder_bytes: int = 0, sign: int = 1) -> None:
        self.allocated_tokens += sign * slots
        self.eventual_tokens += sign * min(slots, final_len)
        self.remainder_bytes += sign * remainder_bytes


def seq_accounting(allocated_tokens: int, live_tokens: int, final_len: int) -> tuple[int, int, int]:
    """(token states, reservation, internal fragmentation) of one allocation, in tokens. A token whose
    slot is not allocated yet (sampled, KV not computed) holds no bytes."""
    live_tokens = min(live_tokens, allocated_tokens)
    used_eventually = min(allocated_tokens, max(final_len, live_tokens))
    return live_tokens, used_eventually - live_tokens, allocated_tokens - used_eventually


@dataclass(frozen=True)
class KVOptions:
    """What an engine's flags say of its policy; each policy reads those it has (`KVPolicy.build`)."""

    block_size: int = 16
    preflight: bool = True  # wait for free bytes before admitting (Orca); False: try, and OOM
    prefix_caching: bool = True


class KVPolicy(ABC):
    """Holds KV slots for sequences. `allocate` raises OutOfMemory; the scheduler decides what follows."""

    name: str
    memory: DeviceMemory
    kv_bytes_per_token: int
    # The store is laid out [planes, rows, kv_bytes_per_token / planes]: the runner uses one plane per layer
    # and K/V (as vLLM keeps one cache tensor per layer), so one layer's rows gather contiguously.
    planes: int = 1

    @classmethod
    def build(cls, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, options: KVOptions,
              **params) -> KVPolicy:
        """The policy as a registry entry names it (engines/registry.py): the entry's own `params`, and the
        options this policy reads (none here; a policy that reads some says which)."""
        return cls(memory, kv_bytes_per_token, max_seq_len, **params)

    @abstractmethod
    def can_allocate(self, seq: SeqLike, num_tokens: int) -> bool:
        """What the engine can know before trying: a GPU engine sees free bytes, not the largest extent."""

    @abstractmethod
    def allocate(self, seq: SeqLike, num_tokens: int) -> None:
        """Hold slots for positions [0, num_tokens) of seq."""

    @abstractmethod
    def free(self, seq: SeqLike) -> None: ...

    @abstractmethod
    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """Give child the parent's KV (shared where the policy can share)."""

    @abstractmethod
    def rows(self, seq: SeqLike, n: int) -> torch.Tensor:
        """Row indices in `store()` of positions [0, n) of seq, as a tensor on the store's device. It
        changes only when the policy allocates for seq: the runner may read it every step for free."""

    def allocation_bytes(self, seq: SeqLike) -> int | None:
        """What admitting seq would allocate now (contiguous policies: its buffer; None: nothing extent-shaped)."""
        return None

    next_need_bytes: int | None = None  # the scheduler's queue head's allocation_bytes, each step

    def discard(self, seq: SeqLike) -> None:
        """Free a sequence whose newest rows were never written (its forward failed): nothing of it may be
        found again (a prefix cache forgets the blocks it hashed past what was computed)."""
        self.free(seq)

    def row_of(self, seq: SeqLike, position: int) -> int:
        """The row of one position, as an int (a decode's write row: no tensor per sequence per step)."""
        return int(self.rows(seq, position + 1)[position])

    def slots(self, seq: SeqLike, start: int, end: int) -> list[int]:
        """Row indices of positions [start, end), as a list."""
        return self.rows(seq, end)[start:end].tolist()

    @abstractmethod
    def store(self) -> torch.Tensor:
        """The bytes the slots index, as a uint8 tensor of whole token rows."""

    @abstractmethod
    def breakdown(self, seqs: list[SeqLike]) -> Breakdown:
        """Figure-2 bytes, scanning seqs (the live sequences)."""

    @abstractmethod
    def breakdown_of(self, live_tokens: int) -> Breakdown:
        """The same from the running totals in O(1): live_tokens is the sum of the held sequences' num_tokens,
        each within its slots and its final length. Equal to breakdown() while no two sequences share a tail
        block (forks do, until they copy it)."""

    @abstractmethod
    def stats(self) -> KVStats: ...

    @abstractmethod
    def memory_map(self) -> list[dict]:
        """Extents or blocks with their owners, for the report's checkerboard."""

    def plane_view(self) -> torch.Tensor:
        store = self.store()
        rows = store.numel() // self.kv_bytes_per_token
        return store[: rows * self.kv_bytes_per_token].view(self.planes, rows, self.kv_bytes_per_token // self.planes)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy n token rows of every plane; a no-op for bookkeeping-only memory."""
        if n and self.memory.backed:
            view = self.plane_view()
            view[:, dst : dst + n] = view[:, src : src + n]

    @abstractmethod
    def longest_sequence_tokens(self) -> int:
        """The most tokens one sequence could hold if it came now: asked of a new policy, whether one
        sequence of max_seq_len fits the budget at all, the allocator's rounding included."""

    @abstractmethod
    def slack_tokens(self, seq: SeqLike) -> int:
        """Tokens seq (held) can still add before the policy must allocate for it: 0 when its next token
        needs the policy, negative when its slots already lag its tokens."""

    def period_tokens(self, seq: SeqLike) -> int | None:
        """Whether seq (held) needs memory on a fixed beat while it runs: every this many tokens, one allocation
        that takes the same for every periodic sequence (the scheduler then serves those due at a step together,
        allocate_periodic). None: no beat; the scheduler asks it alone when its slack runs out."""
        return None

    def can_allocate_periodic(self, num_seqs: int, crossings: int) -> bool:
        """Whether num_seqs periodic sequences can each cross `crossings` period boundaries now."""
        raise NotImplementedError(f"{self.name} has no periodic sequences")

    def allocate_periodic(self, seqs: list[SeqLike], crossings: int, lag: int) -> None:
        """Hold slots for positions [0, num_tokens - lag) of each of seqs (periodic ones, each `crossings` period
        boundaries past its slots), in order; the caller saw can_allocate_periodic. By default each one's own
        allocate, which is what a policy that names its memory needs."""
        for seq in seqs:
            self.allocate(seq, seq.num_tokens - lag)

    def decode_headroom(self, num_seqs: int, own_steps: int) -> int:
        """Decode steps num_seqs running sequences can take with each allocation certain to succeed,
        given that the one with the least slack can take own_steps without allocating at all."""
        return max(0, own_steps)

    def num_cached_tokens(self, seq: SeqLike) -> int:
        """Leading tokens whose KV the policy already holds (prefix cache hits)."""
        return 0

    def holds(self, seq: SeqLike) -> bool:
        return False
