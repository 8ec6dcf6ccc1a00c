"""Capacity plan: what one token of KV costs, what fits beside the weights, and how many requests run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from engines.shapes import DTYPE_BYTES, MIN_BATCHED_TOKENS, ModelShape, batched_tokens, forward_headroom_bytes
from harness.units import format_bytes as fb

DEFAULT_GPU_UTIL = 0.9  # vLLM's gpu_memory_utilization default
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default cap on running sequences


@dataclass(frozen=True)
class LengthMix:
    mean_prompt_tokens: float
    mean_output_tokens: float
    source: str


def workload_mix(requests: list, name: str, max_seq_len: int) -> LengthMix:
    """The mean prompt and output of a workload's requests (TraceRequest-like: prompt_ids, max_tokens)."""
    return LengthMix(sum(len(r.prompt_ids) for r in requests) / len(requests),
                     sum(r.max_tokens for r in requests) / len(requests),
                     f"workload {name}, {len(requests)} requests at max_seq_len {max_seq_len}")


# The vLLM paper's ShareGPT setting (section 6.2), used when no workload is named.
SHAREGPT_MIX = LengthMix(161.0, 338.0, "ShareGPT-like means from the vLLM paper (161 in, 338 out)")


def live_tokens_per_request(mix: LengthMix, max_seq_len: int, block_size: int) -> float:
    """A request holds its prompt and, on average over its life, half its output, plus half a block."""
    prompt = min(mix.mean_prompt_tokens, max_seq_len)
    return prompt + min(mix.mean_output_tokens, max_seq_len - prompt) / 2 + block_size / 2


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    num_params: int
    gpu_mem_bytes: int
    gpu_util: float
    max_seq_len: int
    block_size: int
    kv_bytes_per_token: int
    weights_bytes: int
    activation_headroom_bytes: int
    kv_budget_bytes: int
    max_live_tokens: int
    static_max_concurrency: int
    paged_expected_concurrency: int
    mean_live_tokens_per_request: float
    workload: str
    fits: bool
    reason: str
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the server's cap on running sequences: the headroom's and concurrency's

    def to_json(self) -> dict:
        return asdict(self)


def headroom_at(shape: ModelShape, dtype: str, max_seq_len: int, kv_budget_bytes: int,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> int:
    """The headroom the in-house engine's forward asks beside a KV budget (engines/shapes.forward_headroom_bytes,
    as the factory calls it: the default batched tokens, the budget's tokens as its pool)."""
    return forward_headroom_bytes(shape, DTYPE_BYTES[dtype], batched_tokens(max_seq_len), max_num_seqs,
                                  kv_budget_bytes // shape.kv_bytes_per_token(dtype), max_seq_len)


def kv_budget_and_headroom(shape: ModelShape, dtype: str, avail_bytes: int, max_seq_len: int,
                           max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> tuple[int, int]:
    """The largest KV budget (whole tokens of KV) that fits `avail_bytes` beside the headroom a forward of the
    in-house engine asks at that budget, and that headroom: the engine's own rule (engines/shapes.
    forward_headroom_bytes, which the factory sets a cuda memory's cap by), so that an engine built at the plan's
    budget asks no more than the plan left. The headroom grows with the budget (its decodes' gathers count every
    live token), so the budget is the largest whose sum with its own headroom fits."""
    kvb = shape.kv_bytes_per_token(dtype)

    def headroom(tokens: int) -> int:
        return headroom_at(shape, dtype, max_seq_len, tokens * kvb, max_num_seqs)

    lo, hi = 0, max(0, avail_bytes) // kvb  # lo always fits (or nothing does), hi + 1 never does
    if kvb * lo + headroom(lo) > avail_bytes:
        return 0, headroom(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid * kvb + headroom(mid) <= avail_bytes else (lo, mid - 1)
    return lo * kvb, headroom(lo)


def make_plan(
    shape: ModelShape,
    gpu_mem_bytes: int,
    dtype: str = "float16",
    gpu_util: float = DEFAULT_GPU_UTIL,
    max_seq_len: int | None = None,
    block_size: int = 16,
    mix: LengthMix = SHAREGPT_MIX,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> Plan:
    max_seq_len = max_seq_len or shape.max_seq_len
    kvb = shape.kv_bytes_per_token(dtype)
    weights = shape.weights_bytes(dtype)
    usable = int(gpu_mem_bytes * gpu_util)
    budget, headroom = kv_budget_and_headroom(shape, dtype, usable - weights, max_seq_len, max_num_seqs)
    live_per_request = live_tokens_per_request(mix, max_seq_len, block_size)
    fits = budget >= max_seq_len * kvb
    if weights > usable:
        reason = "the weights alone exceed the usable GPU memory"
    elif not fits:
        reason = "the KV budget left after weights and headroom cannot hold one max_seq_len sequence"
    else:
        reason = "fits"
    return Plan(
        model=shape.name,
        dtype=dtype,
        num_params=shape.num_params,
        gpu_mem_bytes=gpu_mem_bytes,
        gpu_util=gpu_util,
        max_seq_len=max_seq_len,
        block_size=block_size,
        kv_bytes_per_token=kvb,
        weights_bytes=weights,
        activation_headroom_bytes=headroom,
        kv_budget_bytes=budget,
        max_live_tokens=budget // kvb,
        static_max_concurrency=budget // (max_seq_len * kvb),
        # the tokens' estimate, but never past the running sequences the server schedules
        paged_expected_concurrency=min(max_num_seqs, int(budget // kvb / live_per_request)),
        mean_live_tokens_per_request=live_per_request,
        workload=mix.source,
        fits=fits,
        reason=reason,
        max_num_seqs=max_num_seqs,
    )


def render_plan(p: Plan) -> str:
    lines = [
        f"Capacity plan: {p.model} ({p.num_params / 1e9:.2f} B parameters, {p.dtype})",
        f"  GPU memory                {fb(p.gpu_mem_bytes)} x utilisation {p.gpu_util:.2f}",
        f"  weights                   {fb(p.weights_bytes)}",
        f"  activation headroom       {fb(p.activation_headroom_bytes)} "
        f"(one forward of max({MIN_BATCHED_TOKENS}, max_seq_len) tokens + fp32 logits of {p.max_num_seqs} "
        "sequences + one decode bucket's gathers, the live tokens at most, the runner splitting a bucket there: "
        "the in-house engine's rule)",
        f"  KV budget                 {fb(p.kv_budget_bytes)}",
        f"  KV bytes per token        {p.kv_bytes_per_token:,} (2 x layers x kv_heads x head_dim x dtype bytes)",
        f"  max live tokens           {p.max_live_tokens:,}",
        f"  static concurrency        {p.static_max_concurrency} requests reserving max_seq_len = {p.max_seq_len}",
        f"  paged concurrency         ~{p.paged_expected_concurrency} requests of "
        f"{p.mean_live_tokens_per_request:.0f} live tokens on average (blocks of {p.block_size}; {p.workload}; "
        f"at most max_num_seqs {p.max_num_seqs})",
        "  fits                      " + (f"yes: the KV budget holds {p.static_max_concurrency} max-length "
                                           "sequence(s) beside the weights" if p.fits else f"NO: {p.reason}"),
    ]
    return "\n".join(lines)


class PlanRefused(ValueError):
    """A model that cannot serve one max-length sequence on the GPU given."""


def fitting_plan(shape: ModelShape, gpu_name: str, gpu_mem_bytes: int, dtype: str, gpu_util: float,
                 max_seq_len: int, block_size: int) -> Plan:
    plan = make_plan(shape, gpu_mem_bytes, dtype, gpu_util, max_seq_len, block_size)
    if not plan.fits:
        raise PlanRefused(f"{shape.name} on {gpu_name}: {plan.reason} (see fragbench plan)")
    return plan


# make bench's defaults by device kind, each by a rule the report prints (harness/views/regime.py).
# The KV budget is a whole number of max-length sequences of the model:
# - cpu: 2. static-max then holds 2 requests at once, fewer than 2 cores batch within the TPOT limit, so the
#   contiguous engines are memory-bound at their knees as on a GPU.
# - cuda: the fewest max-length sequences at which the paged engine's expected concurrency (make_plan's rule: a
#   request holds its prompt, half its output and half a block) reaches GPU_TARGET_CONCURRENCY on the default
#   workload. At that batch a decode step of a real-shape model still reads its weights for most of its time
#   (the roofline), so adding requests costs little compute and what stops more from running is KV memory.
GPU_TARGET_CONCURRENCY = 32


@dataclass(frozen=True)
class BenchRegime:
    """What `make bench` runs on one device kind: the model (a preset built locally with random weights) and the
    KV budget in max-length sequences of it."""

    device_kind: str
    preset: str
    dtype: str
    model_dir: str
    sequences: int
    max_seq_len: int = 2048

    def kv_budget_bytes(self, shape: ModelShape) -> int:
        return self.sequences * self.max_seq_len * shape.kv_bytes_per_token(self.dtype)


def gpu_sequences(shape: ModelShape, dtype: str, mix: LengthMix, max_seq_len: int = 2048, block_size: int = 16) -> int:
    """The cuda rule: the fewest max-length sequences whose tokens hold GPU_TARGET_CONCURRENCY requests of the
    mix's mean live tokens (make_plan's estimate)."""
    live = live_tokens_per_request(mix, max_seq_len, block_size)
    return math.ceil(GPU_TARGET_CONCURRENCY * live / max_seq_len)


BENCH_REGIMES: dict[str, BenchRegime] = {
    "cpu": BenchRegime("cpu", "tiny-llama", "float32", "models/tiny-llama", 2),
    # Llama-3-8B's shape whole (32 layers, bf16: 16 GB of weights); gpu_sequences on mixed-churn gives 8
    "cuda": BenchRegime("cuda", "llama-3-8b", "bfloat16", "models/llama-3-8b-bf16", 8),
}
