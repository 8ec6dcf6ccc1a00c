"""Contiguous per-sequence KV re-allocated and copied as it fills, as a dynamic cache's torch.cat does."""

from __future__ import annotations

from engines.kv.base import KVOptions, SeqLike
from engines.kv.contiguous import ContiguousKV
from engines.memory.arena import DeviceMemory


class GrowthKV(ContiguousKV):
    """`grow_tokens` = 1 is torch.cat's exact growth; larger steps amortise the copies."""

    name = "growth"

    def __init__(self, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, grow_tokens: int = 1,
                 preflight: bool = True):
        super().__init__(memory, kv_bytes_per_token, max_seq_len)
        self.grow_tokens = grow_tokens
        self.preflight = preflight  # False: grow without looking at free bytes, as torch.cat does

    @classmethod
    def build(cls, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, options: KVOptions,
              **params) -> GrowthKV:
        return cls(memory, kv_bytes_per_token, max_seq_len, preflight=options.preflight, **params)

    def _target(self, num_tokens: int) -> int:
        return -(-num_tokens // self.grow_tokens) * self.grow_tokens

    def allocation_bytes(self, seq: SeqLike) -> int:
        return self.memory.rounded(self._target(seq.num_tokens) * self.kv_bytes_per_token + self.pad_bytes)

    def can_allocate(self, seq: SeqLike, num_tokens: int) -> bool:
        if num_tokens <= self.capacity_tokens(seq) or not self.preflight:
            return True
        return self.memory.stats().free_bytes >= self._target(num_tokens) * self.kv_bytes_per_token

    def allocate(self, seq: SeqLike, num_tokens: int) -> None:
        if num_tokens > self.capacity_tokens(seq):
            self._replace(seq, self._target(num_tokens))
