"""Static reservation at admission (Orca's three variants in the vLLM paper)."""

from __future__ import annotations

from typing import Literal

from engines.kv.base import KVOptions, SeqLike
from engines.kv.contiguous import ContiguousKV
from engines.memory.arena import DeviceMemory, next_pow2

Reserve = Literal["max", "pow2", "oracle"]


class StaticKV(ContiguousKV):
    """One buffer per sequence, sized at admission: max_seq_len, the next power of two of the true
    length, or the true length; it never grows afterwards."""

    def __init__(
        self,
        memory: DeviceMemory,
        kv_bytes_per_token: int,
        max_seq_len: int,
        reserve: Reserve = "max",
        preflight: bool = True,
    ):
        super().__init__(memory, kv_bytes_per_token, max_seq_len)
        # With preflight (Orca, as the vLLM paper runs it) a sequence waits until free bytes cover its
        # reservation; without it (a naive static server) it is admitted and the allocation finds out.
        self.preflight = preflight
        if reserve not in ("max", "pow2", "oracle"):
            raise ValueError(f"reserve must be max, pow2 or oracle, not {reserve!r}")
        self.reserve = reserve
        self.name = f"static-{reserve}"

    @classmethod
    def build(cls, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, options: KVOptions,
              **params) -> StaticKV:
        return cls(memory, kv_bytes_per_token, max_seq_len, preflight=options.preflight, **params)

    def reservation_tokens(self, seq: SeqLike) -> int:
        if self.reserve == "max":
            return self.max_seq_len
        if self.reserve == "pow2":
            return min(self.max_seq_len, next_pow2(seq.final_len))
        return seq.final_len

    def allocation_bytes(self, seq: SeqLike) -> int:
        return self.memory.rounded(max(seq.num_tokens, self.reservation_tokens(seq)) * self.kv_bytes_per_token
                                   + self.pad_bytes)

    def can_allocate(self, seq: SeqLike, num_tokens: int) -> bool:
        if self.holds(seq):
            return num_tokens <= self.capacity_tokens(seq)
        if not self.preflight:
            return True
        return self.memory.stats().free_bytes >= self.reservation_tokens(seq) * self.kv_bytes_per_token

    def allocate(self, seq: SeqLike, num_tokens: int) -> None:
        if self.holds(seq):
            if num_tokens > self.capacity_tokens(seq):
                raise ValueError(f"{seq.seq_id} outgrew its static reservation of {self.capacity_tokens(seq)} tokens")
            return
        self._replace(seq, max(num_tokens, self.reservation_tokens(seq)))
