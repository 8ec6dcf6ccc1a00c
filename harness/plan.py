"""Capacity plan: what one token of KV costs, what fits beside the weights, and how many requests run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engines.shapes import ModelShape

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

    def to_json(self) -> dict:
        return asdict(self)


def make_plan(
    shape: ModelShape,
    gpu_mem_bytes: int,
    dtype: str = "float16",
    gpu_util: float = DEFAULT_GPU_UTIL,
    max_seq_len: int | None = None,
    block_size: int = 16,
    mix: LengthMix = SHAREGPT_MIX,
) -> Plan:
    from engines.shapes import DTYPE_BYTES

    max_seq_len = max_seq_len or shape.max_seq_len
    kvb = shape.kv_bytes_per_token(dtype)
    weights = shape.weights_bytes(dtype)
    headroom = shape.activation_bytes(DTYPE_BYTES[dtype], max(2048, max_seq_len), DEFAULT_MAX_NUM_SEQS)
    usable = int(gpu_mem_bytes * gpu_util)
    budget = max(0, usable - weights - headroom)
    # a request holds its prompt and, on average over its life, half its output, plus half a block
    prompt = min(mix.mean_prompt_tokens, max_seq_len)
    output = min(mix.mean_output_tokens, max_seq_len - prompt)
    live_per_request = prompt + output / 2 + block_size / 2
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
        paged_expected_concurrency=int(budget // kvb / live_per_request),
        mean_live_tokens_per_request=live_per_request,
        workload=mix.source,
        fits=fits,
        reason=reason,
    )


def render_plan(p: Plan) -> str:
    from harness.units import format_bytes as fb

    lines = [
        f"Capacity plan: {p.model} ({p.num_params / 1e9:.2f} B parameters, {p.dtype})",
        f"  GPU memory                {fb(p.gpu_mem_bytes)} x utilisation {p.gpu_util:.2f}",
        f"  weights                   {fb(p.weights_bytes)}",
        f"  activation headroom       {fb(p.activation_headroom_bytes)} "
        f"(one forward of max(2048, max_seq_len) tokens + fp32 logits of {DEFAULT_MAX_NUM_SEQS} sequences)",
        f"  KV budget                 {fb(p.kv_budget_bytes)}",
        f"  KV bytes per token        {p.kv_bytes_per_token:,} (2 x layers x kv_heads x head_dim x dtype bytes)",
        f"  max live tokens           {p.max_live_tokens:,}",
        f"  static concurrency        {p.static_max_concurrency} requests reserving max_seq_len = {p.max_seq_len}",
        f"  paged concurrency         ~{p.paged_expected_concurrency} requests of "
        f"{p.mean_live_tokens_per_request:.0f} live tokens on average (blocks of {p.block_size}; {p.workload})",
        f"  fits                      {'yes' if p.fits else 'NO'}: {p.reason}",
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
