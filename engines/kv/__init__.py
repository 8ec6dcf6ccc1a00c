"""KV-cache allocation policies: pure bookkeeping over `engines.memory`, shared by engines and simulator."""

from engines.kv.base import Breakdown, KVPolicy, KVStats, SeqLike
from engines.kv.growth import GrowthKV
from engines.kv.paged import PagedKV
from engines.kv.static import StaticKV

POLICIES = ("static-max", "static-pow2", "static-oracle", "growth", "paged")

__all__ = ["POLICIES", "Breakdown", "GrowthKV", "KVPolicy", "KVStats", "PagedKV", "SeqLike", "StaticKV"]
