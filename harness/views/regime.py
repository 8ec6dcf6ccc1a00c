"""The KV budget's regime in words: how many max-length sequences it holds, make bench's rule for this device
kind (harness/plan.py's BENCH_REGIMES), and on a GPU the roofline's evidence that memory, not compute, binds."""

from __future__ import annotations

from engines.shapes import load_shape
from harness.analysis.records import RunRecord
from harness.analysis.summary_records import Summary
from harness.gpus import GPU, gpu_of_device_name
from harness.plan import BENCH_REGIMES, GPU_TARGET_CONCURRENCY, live_tokens_per_request, workload_mix
from harness.sim.roofline import StepModel
from workloads.generate import trace
from workloads.spec import load_spec

MiB = 2**20


def gpu_of_name(name: str | None) -> GPU | None:
    """The GPU preset whose figures are the named device's ("NVIDIA H200" -> h200-141gb; an H100 PCIe, an
    A100 80GB PCIe or a GH200 has none: no roofline is better than another board's), if any."""
    return gpu_of_device_name(name)


def cpu_rule() -> str:
    return (f"make bench's default on a CPU is {BENCH_REGIMES['cpu'].sequences}, the rule that puts contiguous "
            "reservations in the regime of a GPU: a static-max engine then holds 2 requests at once, fewer than the "
            "CPU can batch before a step misses the TPOT limit, so memory, not compute, is what binds it.")


def mean_live_tokens(workload: str, seed: int, max_seq_len: int, vocab_size: int) -> float:
    mix = workload_mix(trace(load_spec(workload), seed, max_seq_len, vocab_size).requests, workload, max_seq_len)
    return live_tokens_per_request(mix, max_seq_len, 16)


def kv_dtype(shape, kvb: int) -> str:
    """The dtype whose KV bytes a token the run measured (2 bytes: the roofline's figures are the same for both)."""
    return "float32" if kvb == shape.kv_bytes_per_token("float32") else "bfloat16"


def roofline_words(shape, kvb: int, live: float, gpu: GPU, tpot_s: float) -> str:
    """The decode step of GPU_TARGET_CONCURRENCY requests of `live` tokens on `gpu`, by the roofline."""
    steps = StepModel.of(shape, kv_dtype(shape, kvb), gpu)
    batch = GPU_TARGET_CONCURRENCY
    step_s = steps.step_s(batch, 0, batch, batch * live, batch * live)
    weights_s = steps.weights_bytes / steps.hbm_bytes_per_s
    compute_s = 2 * steps.params * batch / steps.peak_flops
    return (f" At {batch} requests the roofline's decode step of this model on an {gpu.name} is {1e3 * step_s:.1f} ms "
            f"({1e3 * weights_s:.1f} ms of it reading the weights, {1e3 * compute_s:.2f} ms of compute), "
            f"{tpot_s / step_s:.0f}x under the TPOT limit: compute leaves room, and KV memory is what bounds how "
            "many requests run (each engine's bound at its knee is in the table, measured).")


def gpu_rule(meta: RunRecord, budget_bytes: int, kvb: int, max_seq_len: int, tpot_s: float) -> str:
    """The cuda rule in words, with its figures for this run's model and workload."""
    config = meta.config
    regime = BENCH_REGIMES["cuda"]
    model, workload = config.model, config.workload
    words = (f"make bench's default on a GPU is {regime.sequences} ({regime.preset}'s shape in {regime.dtype}, "
             f"random weights built locally): the fewest max-length sequences at which the paged engine's expected "
             f"concurrency on mixed-churn reaches {GPU_TARGET_CONCURRENCY} requests (each holding its prompt, half "
             "its output and half a block).")
    if not (model and workload):
        return words
    shape = load_shape(model)
    live = mean_live_tokens(workload, int(config.seed), max_seq_len, shape.vocab_size)
    words += (f" Here, on {workload}, requests hold {live:.0f} live tokens on average: the budget's "
              f"{budget_bytes // kvb:,} tokens hold about {budget_bytes / kvb / live:.0f} of them.")
    gpu = gpu_of_name(meta.hardware.device_name if meta.hardware else None)
    return words + (roofline_words(shape, kvb, live, gpu, tpot_s) if gpu else "")


def regime_words(summary: Summary, meta: RunRecord, budget_bytes: int | None) -> str:
    """The budget in max-length sequences and the rule for the device the run measured."""
    kvb = next((s.kv_bytes_per_token for s in summary.engines.values() if s.kv_bytes_per_token), None)
    max_seq_len = summary.max_seq_len
    if not (kvb and budget_bytes and max_seq_len):
        return ""
    sequences = budget_bytes / (kvb * max_seq_len)
    words = (f" The KV budget, {budget_bytes / MiB:g} MiB, is {sequences:.1f} max-length sequences "
             f"({max_seq_len} tokens x {kvb} B); ")
    on_gpu = str((meta.hardware.device_device if meta.hardware else None) or "cpu").startswith("cuda")
    if not on_gpu:
        return words + cpu_rule()
    slo = next(iter(summary.capacity.values())).slo
    return words + gpu_rule(meta, budget_bytes, kvb, max_seq_len, slo.tpot_s)
