"""A Llama-family forward whose attention reads and writes K/V through a KV policy's slots.

Tokens of all sequences in a step are flattened (prefill chunks and decodes alike). Each layer scatters
the new K/V rows into the policy's store at their slots, then gathers every sequence's context rows
(a block-table or contiguous gather) into a padded batch for `scaled_dot_product_attention`.
The same code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.kv.base import KVPolicy
from engines.sequence import Sequence

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class Chunk:
    """Positions [start, end) of one sequence computed in this step; logits come from position end-1."""

    seq: Sequence
    start: int
    end: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    context_slots: torch.Tensor  # [B, C] rows of each sequence's context, padded with 0
    attn_mask: torch.Tensor  # [B, 1, Q, C] True where a query may attend
    query_index: torch.Tensor  # [B, Q] flat token index of each query (padded with 0)
    query_valid: torch.Tensor  # [B, Q]
    last_index: torch.Tensor  # [B] flat index of each chunk's last token
    decode_only: bool  # one query per sequence: the matmul path beats SDPA's padding


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

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        ids, pos, slots, q_idx = [], [], [], []
        flat = 0
        for c in chunks:
            n = c.end - c.start
            ids.extend(c.seq.token_ids[c.start : c.end])
            pos.extend(range(c.start, c.end))
            slots.extend(self.kv.slots(c.seq, c.start, c.end))
            q_idx.append(list(range(flat, flat + n)))
            flat += n
        dev = self.device
        lengths = [c.end for c in chunks]
        context = self.kv.context_slots([c.seq for c in chunks], lengths).to(dev)
        max_c = context.shape[1]
        max_q = max(len(x) for x in q_idx)
        query_index = torch.tensor([x + [0] * (max_q - len(x)) for x in q_idx], device=dev)
        q_len = torch.tensor([len(x) for x in q_idx], device=dev)
        c_len = torch.tensor(lengths, device=dev)
        q_valid = torch.arange(max_q, device=dev)[None, :] < q_len[:, None]
        # query i of a chunk sits at absolute position c_len - q_len + i and sees keys up to it
        q_pos = (c_len - q_len)[:, None] + torch.arange(max_q, device=dev)[None, :]
        k_pos = torch.arange(max_c, device=dev)[None, None, :]
        mask = (k_pos <= q_pos[:, :, None]) & (k_pos < c_len[:, None, None])
        return StepInputs(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            write_slots=torch.tensor(slots, device=dev),
            context_slots=context,
            attn_mask=mask[:, None],
            decode_only=max_q == 1,
            query_index=query_index,
            query_valid=q_valid,
            last_index=torch.tensor([x[-1] for x in q_idx], device=dev),
        )

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [B, vocab] at the last position of each chunk, in fp32."""
        inp = self.prepare(chunks)
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
        k_rows.index_copy_(0, inp.write_slots, k[0].transpose(0, 1))
        v_rows.index_copy_(0, inp.write_slots, v[0].transpose(0, 1))
        B, C = inp.context_slots.shape
        # index_select copies whole rows: several times faster than advanced indexing here
        flat = inp.context_slots.flatten()
        keys = k_rows.index_select(0, flat).view(B, C, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = v_rows.index_select(0, flat).view(B, C, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if inp.decode_only:
            out = self._decode_attention(q[0].transpose(0, 1), keys, values, inp.attn_mask)
            return attn.o_proj(out.reshape(1, T, self.num_heads * self.head_dim))
        queries = q[0].transpose(0, 1)[inp.query_index].transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=inp.attn_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, H, Q, D]
        out = out.transpose(1, 2)[inp.query_valid]  # [T, H, D], in flat order
        return attn.o_proj(out.reshape(1, T, self.num_heads * self.head_dim))

    def _decode_attention(self, q, keys, values, mask) -> torch.Tensor:
        """One query per sequence: grouped heads against their KV head by plain matmuls. q: [B, H, D]."""
        B, groups = q.shape[0], self.num_heads // self.num_kv_heads
        qg = q.reshape(B, self.num_kv_heads, groups, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.head_dim**-0.5  # [B, KVH, G, C]
        scores = scores.masked_fill(~mask[:, :, 0, None, :], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, KVH, G, D]
