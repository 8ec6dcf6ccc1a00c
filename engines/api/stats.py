"""`GET /stats` as one typed record: what the server answers (built once per snapshot on the engine thread) and
what the harness reads (the stats poller, the supervisor, the probes parse the JSON they GET into it once and pass
the record down). A vLLM peer's proxy and a target's metrics answer a subset of the same fields, so every field
may be absent; what no reader names rides along (`extra="allow"`).

The JSON keeps its fields and values: a record dumps only the keys it was given (`written()`), in the order the
server has always emitted them (the fields below are declared in that order), an int stays an int and a float a
float (`Num`: a target's metric page gives floats, and the samples journal writes what it read)."""

from __future__ import annotations

from typing import Any

from engines.json_record import Num, Record


class AllocatorBlock(Record):
    """`allocator`: the caching allocator emulator's figures (engines/memory/allocstats.py), by its names."""

    allocated_bytes: Num | None = None
    reserved_bytes: Num | None = None


class EngineConfigBlock(Record):
    """`engine_config`: what a simulated twin of the engine needs (engines/scheduled/engine.py `config()`, in its
    order: run.json records it as it came); empty for an engine without one."""

    policy: str | None = None
    placement: str | None = None
    block_size: Num | None = None
    preflight: bool | None = None
    prefix_caching: bool | None = None
    max_num_seqs: Num | None = None
    max_num_batched_tokens: Num | None = None  # comes down after a forward OOM
    on_oom: str | None = None
    kv_budget_bytes: Num | None = None
    kv_bytes_per_token: Num | None = None
    max_seq_len: Num | None = None
    row_pad_bytes: Num | None = None


class OomEventRow(Record):
    """One of `oom_events` (the engine keeps its latest 100): when on the server's clock, then the OOMEvent's
    fields in their order and the engine's state then (engines/oom.py oom_context) riding along."""

    t_s: Num | None = None  # absent from a crash line (the server's last words, which supervisor.py reads as a row)
    requested_bytes: Num | None = None
    free_bytes: Num | None = None
    largest_free_bytes: Num | None = None
    cause: str | None = None


class FragmentationOomMap(Record):
    """One of `fragmentation_oom_maps` (`?map=1`): the memory map the engine took at a fragmentation OOM."""

    t_s: Num


class StatsPayload(Record):
    """GET /stats, flat as it is sent. Declared in the server's emission order: the engine's EngineStats, its block
    pool's, the device's, the allocator's, then the server's own; `?releases=1` and `?map=1` add theirs."""

    # engines/engine.py EngineStats, flat
    engine: str | None = None
    policy: str | None = None
    kv_capacity_bytes: Num | None = None
    token_states_bytes: Num | None = None
    reservation_bytes: Num | None = None
    internal_fragmentation_bytes: Num | None = None
    external_fragmentation_bytes: Num | None = None
    allocated_bytes: Num | None = None
    free_bytes: Num | None = None
    largest_free_bytes: Num | None = None
    running: Num | None = None  # None: the engine cannot tell (hf-cb on an old transformers)
    waiting: Num | None = None
    preempted_total: Num | None = None
    live_tokens: Num | None = None
    kv_bytes_per_token: Num | None = None
    oom_total: Num | None = None
    oom_fragmentation: Num | None = None
    steps: Num | None = None
    decode_steps: Num | None = None  # the naive engine alone; absent elsewhere
    waiting_for_memory: Num | None = None
    free_outside_largest_bytes: Num | None = None
    usable_free_bytes: Num | None = None
    # a block pool's (BlockPoolStats); absent for a contiguous engine
    block_size: Num | None = None
    num_blocks: Num | None = None
    shared_blocks: Num | None = None
    max_block_ref_count: Num | None = None
    prefix_cache_hit_tokens: Num | None = None
    prefix_cache_query_tokens: Num | None = None
    # the device's (engines/memory/cuda.py device_snapshot), then the caching emulator's
    torch_allocated_bytes: Num | None = None
    torch_reserved_bytes: Num | None = None
    device_used_bytes: Num | None = None
    torch_active_bytes: Num | None = None
    torch_inactive_split_bytes: Num | None = None
    torch_segments: Num | None = None
    torch_alloc_retries: Num | None = None
    torch_ooms: Num | None = None
    allocator: AllocatorBlock | None = None
    # the server's (engines/api/server.py EngineThread._stats)
    t_s: Num | None = None  # the server's uptime
    finished_total: dict[str, Num] | None = None
    oom_events: list[OomEventRow] | None = None
    abort_release_count: Num | None = None
    abort_release_p50_s: Num | None = None
    abort_release_p99_s: Num | None = None
    abort_release_max_s: Num | None = None
    abort_release_p99_steps: Num | None = None
    threads: Num | None = None
    engine_errors: Num | None = None
    engine_config: EngineConfigBlock | None = None
    fragmentation_oom_maps_count: Num | None = None
    abort_release_s: list[Num] | None = None  # ?releases=1
    memory_map: list[Any] | None = None  # ?map=1: runs of blocks or extents, drawn as they come
    fragmentation_oom_maps: list[FragmentationOomMap] | None = None  # ?map=1
    engine_error: str | None = None  # the engine thread is down: the last snapshot, marked
    asyncio_tasks: Num | None = None
    oom_snapshot: bool | None = None
    # a peer's proxy or a target's metrics: what the figures were read from, and the usage gauge
    source: str | None = None
    kv_cache_usage_perc: Num | None = None
