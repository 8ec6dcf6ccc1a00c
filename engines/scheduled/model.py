"""A Llama-family forward whose attention reads and writes K/V through a KV policy's rows.

Tokens of all sequences in a step are flattened (prefill chunks and decodes alike). Each layer scatters
the new K/V rows into the policy's store, then attends over each sequence's own context and nothing more:
- decodes (one query each) in length buckets: sorted by context length, a bucket holds sequences within
  BUCKET_RATIO of its longest, padded to that one and attended with plain batched matmuls. Padding is
  bounded by the ratio (not by the batch's longest), so a step costs about the tokens it holds: one long
  retrieval prompt no longer makes fifteen chats pay for its length;
- prefill chunks (several queries each) one by one through `scaled_dot_product_attention`.
Row tensors come from the policy, which changes them only when it allocates: the per-step Python work is
per sequence, not per token of context. The same code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.kv.base import KVPolicy
from engines.sequence import Sequence

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# A decode bucket's shortest context is at least 1/BUCKET_RATIO of its longest: at most a third of what a
# bucket reads is padding, and a batch of any length mix needs few buckets (each costs a few kernel calls).
BUCKET_RATIO = 1.5


@dataclass
class Chunk:
    """Positions [start, end) of one sequence computed in this step; logits come from position end-1."""

    seq: Sequence
    start: int
    end: int


@dataclass
class Bucket:
    """One-query sequences of similar context length, padded to the longest of them."""

    token_index: torch.Tensor  # [B] flat index of each one's query
    rows: torch.Tensor  # [B, L] context rows, padded with row 0
    mask: torch.Tensor  # [B, 1, 1, L] True at a real key


@dataclass
class Prefill:
    """One chunk of several queries: tokens [first, first + n) of the flat step, over `rows` of context."""

    first: int
    n: int
    rows: torch.Tensor  # [C] its context rows, the chunk's own included
    mask: torch.Tensor | None  # [n, C] causal from its start; None when the chunk is the whole context


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor  # [T] where each token's K/V goes
    last_index: torch.Tensor  # [chunks] flat index of each chunk's last token
    buckets: list[Bucket]
    prefills: list[Prefill]


def load_hf_model(model_dir: str | Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if model.config.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"the runner supports {', '.join(SUPPORTED_TYPES)} models, not {model.config.model_type}")
    return model.to(device).eval()


class ModelRunner:
    def __init__(self, hf_model, kv: KVPolicy):
        cfg = hf_model.config
        self.hf = hf_model
        self.kv = kv
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        row_bytes = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        assert row_bytes == kv.kv_bytes_per_token, "KV policy sized for another model or dtype"
        kv.planes = 2 * self.num_layers
        planes = kv.plane_view()
        # [layer, k|v, row, kv_head, head_dim]: one layer's keys gather as whole contiguous rows
        self.kv_planes = planes.view(self.dtype).view(
            self.num_layers, 2, planes.shape[1], self.num_kv_heads, self.head_dim
        )
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.last_buckets = 0  # decode buckets of the last forward (a step's row records them)

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        dev = self.device
        ids, pos, write, last = [], [], [], []
        decodes, prefills = [], []
        flat = 0
        for c in chunks:
            n = c.end - c.start
            rows = self.kv.rows(c.seq, c.end)
            ids.extend(c.seq.token_ids[c.start : c.end])
            pos.append((c.start, c.end))
            write.append(rows[c.start :])
            if n == 1:
                decodes.append((c.end, flat, rows))
            else:
                mask = None
                if c.start:  # query i sits at position start + i and sees keys up to it
                    mask = torch.arange(c.end, device=dev)[None, :] <= torch.arange(c.start, c.end, device=dev)[:, None]
                prefills.append(Prefill(flat, n, rows, mask))
            flat += n
            last.append(flat - 1)
        return StepInputs(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.cat([torch.arange(a, b, device=dev) for a, b in pos]),
            write_rows=torch.cat(write),
            last_index=torch.tensor(last, device=dev),
            buckets=self._buckets(decodes),
            prefills=prefills,
        )

    def _buckets(self, decodes: list[tuple[int, int, torch.Tensor]]) -> list[Bucket]:
        """(context length, flat index, rows) of each decode, grouped longest first."""
        out, group = [], []
        for item in sorted(decodes, key=lambda d: -d[0]):
            if group and item[0] * BUCKET_RATIO < group[0][0]:
                out.append(self._bucket(group))
                group = []
            group.append(item)
        return [*out, self._bucket(group)] if group else out

    def _bucket(self, group: list[tuple[int, int, torch.Tensor]]) -> Bucket:
        dev = self.device
        rows = torch.nn.utils.rnn.pad_sequence([r for _, _, r in group], batch_first=True)
        lengths = torch.tensor([n for n, _, _ in group], device=dev)
        mask = torch.arange(rows.shape[1], device=dev)[None, :] < lengths[:, None]
        return Bucket(torch.tensor([i for _, i, _ in group], device=dev), rows, mask[:, None, None, :])

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [chunks, vocab] at the last position of each chunk, in fp32."""
        inp = self.prepare(chunks)
        self.last_buckets = len(inp.buckets)
        model = self.hf.model
        h = model.embed_tokens(inp.input_ids)[None]  # [1, T, H]
        cos, sin = model.rotary_emb(h, inp.positions[None])
        for i, layer in enumerate(model.layers):
            residual = h
            h = residual + self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, i, inp)
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
        h = model.norm(h)[0, inp.last_index]
        return self.hf.lm_head(h).float()

    def _attention(self, attn, x, cos, sin, layer: int, inp: StepInputs) -> torch.Tensor:
        T = x.shape[1]
        q = attn.q_proj(x).view(1, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        k_rows, v_rows = self.kv_planes[layer]  # [rows, KVH, D]
        k_rows.index_copy_(0, inp.write_rows, k[0].transpose(0, 1))
        v_rows.index_copy_(0, inp.write_rows, v[0].transpose(0, 1))
        q = q[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q)
        for b in inp.buckets:
            out[b.token_index] = self._decode_attention(q[b.token_index], k_rows, v_rows, b)
        for p in inp.prefills:
            out[p.first : p.first + p.n] = self._prefill_attention(q[p.first : p.first + p.n], k_rows, v_rows, p)
        return attn.o_proj(out.reshape(1, T, self.num_heads * self.head_dim))

    def _decode_attention(self, q: torch.Tensor, k_rows, v_rows, b: Bucket) -> torch.Tensor:
        """One query per sequence, grouped heads against their KV head by plain matmuls. q: [B, H, D]."""
        B, L = b.rows.shape
        groups = self.num_heads // self.num_kv_heads
        flat = b.rows.flatten()
        keys = k_rows.index_select(0, flat).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = v_rows.index_select(0, flat).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        qg = q.view(B, self.num_kv_heads, groups, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.head_dim**-0.5  # [B, KVH, G, L]
        scores = scores.masked_fill(~b.mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values).view(B, self.num_heads, self.head_dim)

    def _prefill_attention(self, q: torch.Tensor, k_rows, v_rows, p: Prefill) -> torch.Tensor:
        """Several queries of one sequence over its context. q: [n, H, D]."""
        keys = k_rows.index_select(0, p.rows).transpose(0, 1)[None]  # [1, KVH, C, D]
        values = v_rows.index_select(0, p.rows).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=p.mask,
                                             is_causal=p.mask is None,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # [1, H, n, D]
        return out[0].transpose(0, 1)
