"""KV-cache allocation policies: pure bookkeeping over `engines.memory`, shared by engines and simulator."""

from engines.kv.base import Breakdown, KVPolicy, KVStats, SeqLike
from engines.kv.growth import GrowthKV
from engines.kv.paged import PagedKV
from engines.kv.static import StaticKV
from engines.memory import DeviceMemory

POLICIES = ("static-max", "static-pow2", "static-oracle", "growth", "paged")


def make_policy(name: str, memory: DeviceMemory, kv_bytes_per_token: int, max_seq_len: int, block_size: int = 16,
                preflight: bool = True, prefix_caching: bool = True) -> KVPolicy:
    """A policy by the name engines, bench and simulate share (`static` is `static-max`)."""
    name = "static-max" if name == "static" else name
    if name == "paged":
        return PagedKV(memory, kv_bytes_per_token, max_seq_len, block_size, prefix_caching)
    if name == "growth":
        return GrowthKV(memory, kv_bytes_per_token, max_seq_len, preflight=preflight)
    if name in POLICIES:
        return StaticKV(memory, kv_bytes_per_token, max_seq_len, name.removeprefix("static-"), preflight)
    raise ValueError(f"unknown KV policy {name!r}; policies: {', '.join(POLICIES)}")


__all__ = ["POLICIES", "Breakdown", "GrowthKV", "KVPolicy", "KVStats", "PagedKV", "SeqLike", "StaticKV",
           "make_policy"]
