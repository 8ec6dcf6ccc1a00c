"""`/metrics` (engines/api/metrics.py): the request histograms count each request once, on vLLM's buckets; the
failed-allocation bytes add up by cause across scrapes; the allocator's bytes appear only where measured."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engines.api.metrics import E2E_BUCKETS_S, TTFT_BUCKETS_S, MetricsCollector, token_buckets
from engines.api.stats import StatsPayload
from engines.engine import TokenEvent
from engines.memory.arena import OOMEvent
from engines.sequence import SamplingParams, Sequence

STATS = {"kv_capacity_bytes": 4096 * 100, "allocated_bytes": 4096 * 60, "token_states_bytes": 4096 * 30,
         "free_bytes": 4096 * 40, "largest_free_bytes": 4096 * 10, "live_tokens": 30, "kv_bytes_per_token": 4096,
         "running": 2, "waiting": 1, "preempted_total": 0, "oom_total": 0, "oom_fragmentation": 0,
         "finished_total": {"length": 1}, "torch_reserved_bytes": None, "engine_config": {}}


def scrape(collector: MetricsCollector, stats: dict) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    collector.stats = StatsPayload.model_validate(stats)  # as the /metrics handler hands it over
    text = generate_latest(registry).decode()
    return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def sample(request_id: str, index: int, prompt: int) -> Sequence:
    return Sequence(f"{request_id}#{index}", [3] * prompt, SamplingParams(4), 512, request_id, sample_index=index,
                    arrival_s=time.monotonic() - 0.5)


def test_a_request_of_two_samples_is_one_ttft_one_e2e_and_its_tokens_summed():
    engine = SimpleNamespace(max_seq_len=512, oom_events=[])
    collector = MetricsCollector(Counter(), engine)
    a, b = sample("r", 0, 7), sample("r", 1, 7)
    for seq, token, done in ((a, 5, False), (b, 6, False), (a, 5, False), (b, None, False), (a, 5, True)):
        if token is not None:
            seq.token_ids.append(token)
        collector.requests.on_event(TokenEvent(seq, token, finished=token is None or done, request_done=done))
    collector.requests.on_step()
    m = scrape(collector, STATS)
    assert m["fragbench:time_to_first_token_seconds_count[]"] == 1
    assert m["fragbench:time_to_first_token_seconds_sum[]"] >= 0.5  # from the request's arrival
    assert m["fragbench:e2e_request_latency_seconds_count[]"] == 1
    assert m["fragbench:request_prompt_tokens_sum[]"] == 7  # the prompt once per request, as vLLM counts it
    assert m["fragbench:request_generation_tokens_sum[]"] == 4  # both samples' tokens
    assert m["fragbench:step_batch_size[]"] == 2
    assert m["fragbench:kv_live_tokens[]"] == 30 and m["fragbench:kv_capacity_tokens[]"] == 100
    assert not collector.requests.open  # nothing kept once the request is done
    assert m["fragbench:time_to_first_token_seconds_bucket[('le', '0.001')]"] == 0
    assert len([k for k in m if "time_to_first_token_seconds_bucket" in k]) == len(TTFT_BUCKETS_S) + 1  # +Inf
    assert len([k for k in m if "e2e_request_latency_seconds_bucket" in k]) == len(E2E_BUCKETS_S) + 1  # +Inf


def test_failed_allocation_bytes_add_up_by_cause_across_scrapes():
    engine = SimpleNamespace(max_seq_len=512, oom_events=[])
    collector = MetricsCollector(Counter(), engine)
    engine.oom_events.append((0.0, OOMEvent.classify(1000, 5000, 500), {}))  # free >= asked: fragmentation
    scrape(collector, STATS)
    engine.oom_events += [(1.0, OOMEvent.classify(3000, 100, 100), {}), (2.0, OOMEvent.classify(200, 900, 100), {})]
    m = scrape(collector, STATS)
    assert m["fragbench:kv_failed_allocation_bytes_total[('cause', 'fragmentation')]"] == 1200
    assert m["fragbench:kv_failed_allocation_bytes_total[('cause', 'capacity')]"] == 3000


def test_reserved_bytes_appear_only_where_an_allocator_measured_them():
    collector = MetricsCollector(Counter(), SimpleNamespace(max_seq_len=512, oom_events=[], device="cuda:0"))
    assert not any("memory_reserved" in k for k in scrape(collector, STATS))
    m = scrape(collector, {**STATS, "torch_reserved_bytes": 2**30, "torch_allocated_bytes": 2**29,
                           "allocator": {"reserved_bytes": 2**20, "allocated_bytes": 2**19},
                           "block_size": 16, "num_blocks": 6, "engine_config": {"max_num_batched_tokens": 2048}})
    assert m["fragbench:memory_reserved_bytes[('source', 'cuda')]"] == 2**30
    assert m["fragbench:memory_allocated_bytes[('source', 'allocator')]"] == 2**19
    assert m["fragbench:kv_free_blocks[]"] == 40 // 16 and m["fragbench:kv_blocks[]"] == 6
    assert m["fragbench:scheduler_token_budget[]"] == 2048


def test_token_buckets_are_vllms_1_2_5():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(2048)[-1] == 2000
