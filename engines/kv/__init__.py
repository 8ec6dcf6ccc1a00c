"""KV-cache allocation policies: pure bookkeeping over `engines.memory.arena`, shared by engines and simulator."""

from engines.kv.base import Breakdown, KVOptions, KVPolicy, KVStats, SeqLike
from engines.kv.growth import GrowthKV
from engines.kv.paged import PagedKV
from engines.kv.static import StaticKV
from engines.memory.arena import DeviceMemory
from engines.registry import REGISTRY, policies


def make_policy(name: str, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, block_size: int = 16,
                preflight: bool = True, prefix_caching: bool = True) -> KVPolicy:
    """A policy by the name engines, bench and simulate share (`static` is `static-max`), as its registry entry
    builds it."""
    found = REGISTRY.get(name)
    if found is None or found.policy is None:
        raise ValueError(f"unknown KV policy {name!r}; policies: {', '.join(policies())}")
    return found.policy_class().build(memory, kv_bytes_per_token, max_seq_len,
                                      KVOptions(block_size, preflight, prefix_caching), **dict(found.params))


__all__ = ["Breakdown", "GrowthKV", "KVOptions", "KVPolicy", "KVStats", "PagedKV", "SeqLike",
           "StaticKV", "make_policy"]
