"""Each family's rules: the seeds' five alerts in the names its server exports (harness/run/telemetry.py reads
the same names for `bench --target`), or the reason a family cannot carry one."""

from __future__ import annotations

from collections.abc import Callable

from harness.monitoring.rules import Alert, Omitted, RecordingRule, RuleSet, Thresholds

FRAGMENTATION = "KVFragmentationSuspected"
RESERVED = "ReservedMemoryGrowingAfterRequestsComplete"
FAILURES = "KVAllocationFailuresWithMemoryFree"
PREEMPTIONS = "PreemptionStorm"
CAPACITY = "KVFullWithWaitingQueue"
ALERTS = (FRAGMENTATION, RESERVED, FAILURES, PREEMPTIONS, CAPACITY)

WHERE = "{{ $labels.instance }}"
RUNBOOK = {
    FRAGMENTATION: "KV is unavailable but much of it holds no token: inspect block release and allocator reuse. "
                   "The KV is held by reservations and holes, not tokens (/stats?map=1 shows who holds it). A "
                   "block-based KV policy fixes it; more GPUs do not.",
    RESERVED: "Reserved is high while allocated is not: inspect the framework pool and process lifecycle. PyTorch's "
              "caching allocator keeps freed blocks (torch.cuda.memory_snapshot, PYTORCH_CUDA_ALLOC_CONF); a "
              "restart gives them back.",
    FAILURES: "Free memory exists but no free region fits the next request: the KV policy reserves contiguous "
              "regions and churn left them in pieces. Check live tokens and whether the next request needs one "
              "contiguous region; use a block-based policy or cap max_tokens. Not a capacity problem.",
    PREEMPTIONS: "Sequences are evicted and recomputed: the KV cannot hold the admitted concurrency. If live "
                 "tokens are high, tighten admission control (max_num_seqs, max_num_batched_tokens) or reduce "
                 "sequence limits.",
    CAPACITY: "The KV really holds tokens and requests queue for it: capacity, not fragmentation. Tighten "
              "admission or sequence limits, or add KV memory (quantized weights, more GPUs); if the model "
              "barely fits at startup, no allocator policy creates that headroom.",
}


FRAGMENTATION_KIND = (FRAGMENTATION, FAILURES)  # labelled cause="fragmentation"


def alert(name: str, expr: str, t: Thresholds, summary: str) -> Alert:
    return Alert(name, expr, t.hold, f"{WHERE}: {summary}", RUNBOOK[name],
                 cause="fragmentation" if name in FRAGMENTATION_KIND else None)


def pct(share: float) -> str:
    return f"{share:.0%}"


def fragbench(t: Thresholds) -> RuleSet:
    w = t.window
    envelope = str(t.envelope_tokens) if t.envelope_tokens is not None else "fragbench:kv_capacity_tokens"
    finished = f"fragbench:request_finished:rate{w}"
    records = [
        # memory held by no token and not free for the next allocation: a contiguous policy's reservations, its
        # rounding and the holes outside its largest free extent; a block pool's partly filled last blocks
        # alone (its largest free extent is all its free blocks), a few percent at any utilization
        RecordingRule("fragbench:kv_untokened_ratio",
                      "(fragbench:kv_capacity_bytes - fragbench:kv_largest_free_bytes\n"
                      " - fragbench:kv_token_states_bytes) / fragbench:kv_capacity_bytes"),
        RecordingRule("fragbench:kv_usable_free_ratio",
                      "fragbench:kv_largest_free_bytes / fragbench:kv_capacity_bytes"),
        RecordingRule("fragbench:kv_live_envelope_ratio", f"fragbench:kv_live_tokens / {envelope}"),
        RecordingRule(finished, f"sum without (finished_reason) (rate(fragbench:request_success_total[{w}]))"),
        RecordingRule(f"fragbench:kv_failed_allocation_bytes:rate{w}",
                      f"rate(fragbench:kv_failed_allocation_bytes_total[{w}])"),
    ]
    alerts = [
        alert(FRAGMENTATION, f"avg_over_time(fragbench:kv_untokened_ratio[{w}]) > {t.untokened_above}\n"
              f"and avg_over_time(fragbench:kv_usable_free_ratio[{w}]) < {t.free_below}", t,
              f"over {w}, more than {pct(t.untokened_above)} of the KV on average held by no token (reservations "
              f"and holes) while its largest free extent averaged under {pct(t.free_below)} of capacity: "
              "fragmentation suspected"),
        alert(RESERVED, f"delta(fragbench:memory_reserved_bytes[{w}]) > {t.reserved_growth_bytes}\n"
              f"and delta(fragbench:memory_allocated_bytes[{w}]) <= 0\nand on (instance, job) {finished} > 0", t,
              f"reserved memory grew by more than {t.reserved_growth_bytes} B over {w} while allocated memory did "
              "not, as requests completed: the allocator is retaining blocks"),
        alert(FAILURES, f"increase(fragbench:oom_total{{cause=\"fragmentation\"}}[{w}]) >= {t.fragmentation_ooms}\n"
              f"and on (instance, job) {finished} >= {t.churn_rps}", t,
              f"KV allocations failed with enough memory free (cause=fragmentation) over {w}, under churn of at "
              f"least {t.churn_rps} finished requests/s"),
        alert(PREEMPTIONS, f"rate(fragbench:num_preemptions_total[{w}]) > {t.preemptions_per_s}", t,
              f"more than {t.preemptions_per_s} preemptions/s over {w}: a preemption storm"),
        alert(CAPACITY, f"avg_over_time(fragbench:kv_cache_usage_perc[{w}]) >= {t.kv_full}\n"
              f"and avg_over_time(fragbench:num_requests_waiting[{w}]) > 0\n"
              f"and avg_over_time(fragbench:kv_live_envelope_ratio[{w}]) >= {t.envelope_share}", t,
              f"KV at least {pct(t.kv_full)} full over {w} with requests waiting and live tokens at "
              f"{pct(t.envelope_share)} of the envelope or more: capacity"),
    ]
    return RuleSet("fragbench", records, alerts, [], t, uses_envelope=True)


def vllm(t: Thresholds) -> RuleSet:
    w = t.window
    alerts = [
        alert(PREEMPTIONS, f"rate(vllm:num_preemptions_total[{w}]) > {t.preemptions_per_s}", t,
              f"more than {t.preemptions_per_s} preemptions/s over {w}: a preemption storm"),
        alert(CAPACITY, f"avg_over_time(vllm:kv_cache_usage_perc[{w}]) >= {t.kv_full}\n"
              f"and avg_over_time(vllm:num_requests_waiting[{w}]) > 0", t,
              f"KV at least {pct(t.kv_full)} full over {w} with requests waiting: capacity (vLLM's block pool "
              "holds only live tokens)"),
    ]
    omitted = [
        Omitted(FRAGMENTATION, "the rule needs the KV held by no token, and vLLM exports no live-token count or "
                               "token bytes to subtract, only the share of blocks in use (vllm:kv_cache_usage_perc); "
                               "its paged pool holds little beyond live tokens"),
        Omitted(RESERVED, "vLLM exports no allocator reserved or allocated bytes"),
        Omitted(FAILURES, "vLLM exports no failed allocations: it preempts instead (see the preemption storm)"),
    ]
    return RuleSet("vllm", [], alerts, omitted, t)


def sglang(t: Thresholds) -> RuleSet:
    w = t.window
    alerts = [
        alert(PREEMPTIONS, f"rate(sglang:num_retracted_requests_total[{w}]) > {t.preemptions_per_s}", t,
              f"more than {t.preemptions_per_s} retractions/s over {w}: a preemption storm (SGLang retracts "
              "running requests when its token pool runs out)"),
        alert(CAPACITY, f"avg_over_time(sglang:token_usage[{w}]) >= {t.kv_full}\n"
              f"and avg_over_time(sglang:num_queue_reqs[{w}]) > 0", t,
              f"KV at least {pct(t.kv_full)} full over {w} with requests queued: capacity"),
    ]
    omitted = [
        Omitted(FRAGMENTATION, "the rule needs the KV held by no token, and SGLang's one token count "
                               "(sglang:num_used_tokens) is the pool's used slots, which its token-granular pool "
                               "fills with live tokens alone: no gap to watch"),
        Omitted(RESERVED, "SGLang exports no allocator reserved or allocated bytes"),
        Omitted(FAILURES, "SGLang exports no failed allocations: it retracts instead (see the preemption storm)"),
    ]
    return RuleSet("sglang", [], alerts, omitted, t)


FAMILIES: dict[str, Callable[[Thresholds], RuleSet]] = {"fragbench": fragbench, "vllm": vllm, "sglang": sglang}


def rules_for(family: str, t: Thresholds) -> RuleSet:
    return FAMILIES[family](t)
