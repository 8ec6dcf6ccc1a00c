"""The roofline step-time model: what `simulate` charges a step on a GPU it has no measurements of."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.shapes import ModelShape
from harness.gpus import GPU


@dataclass(frozen=True)
class StepModel:
    """Roofline: a step takes the longer of moving its bytes (weights + KV read) over HBM and doing its
    FLOPs (2 x params per token + attention) at peak."""

    weights_bytes: int
    kv_bytes_per_token: int
    params: int
    attn_flops_per_ctx_token: int  # 4 x layers x heads x head_dim per (query, key) pair
    hbm_bytes_per_s: float
    peak_flops: float

    @classmethod
    def of(cls, shape: ModelShape, dtype: str, gpu: GPU) -> StepModel:
        return cls(shape.weights_bytes(dtype), shape.kv_bytes_per_token(dtype), shape.num_params,
                   4 * shape.num_layers * shape.num_heads * shape.head_dim, gpu.hbm_bytes_per_s, gpu.peak_bf16_flops)

    def step_s(self, decodes, prefills, tokens: np.ndarray | float, context_read: np.ndarray | float,
               attn_pairs: np.ndarray | float) -> np.ndarray | float:
        """A step of `decodes` one-token sequences and `prefills` chunks computing `tokens` positions, reading
        `context_read` keys (attention over `attn_pairs` query-key pairs). The roofline counts bytes and
        FLOPs alone; a fitted model (harness/sim/stepfit.py) also the cost per sequence and per chunk."""
        memory = (self.weights_bytes + self.kv_bytes_per_token * context_read) / self.hbm_bytes_per_s
        compute = (2 * self.params * tokens + self.attn_flops_per_ctx_token * attn_pairs) / self.peak_flops
        if isinstance(memory, np.ndarray):
            return np.maximum(memory, compute)
        return max(memory, compute)  # one step (the event's first): a float, no array to set up

    def constants(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "params": self.params, "attn_flops_per_query_key": self.attn_flops_per_ctx_token,
                "hbm_bytes_per_s": self.hbm_bytes_per_s, "peak_flops": self.peak_flops}


__all__ = ["StepModel"]
