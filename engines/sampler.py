"""Greedy, or temperature / top-p with one seeded generator per sample (reproducible under batching)."""

from __future__ import annotations

import torch

from engines.sequence import SamplingParams

# Below this temperature sampling is greedy (as vLLM's _SAMPLING_EPS): dividing by it would overflow fp32.
GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    if params.temperature < GREEDY_BELOW:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:  # any 64-bit seed and sample index give a seed manual_seed takes
        g.manual_seed((params.seed * 1_000_003 + sample_index) % 2**63)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           greedy: int | None = None) -> int:
    """One token from one row of fp32 logits. `greedy`: the row's argmax, already read with the whole batch's
    (one device sync a step rather than one a row)."""
    if params.temperature < GREEDY_BELOW:
        return greedy if greedy is not None else int(logits.argmax())
    probs = torch.softmax(logits.cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
