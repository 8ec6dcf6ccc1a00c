"""A Llama-family forward whose attention reads and writes K/V through a KV policy's rows.

Tokens of all sequences in a step are flattened (prefill chunks and decodes alike). Each layer computes its
projections fused (q, k and v as one matmul, gate and up as another: the weights concatenated once, when the
runner is built), scatters the new K/V rows into the policy's store in one copy (K and V of a row lie side by
side: the store is [layer, row, k|v, kv_head, head_dim]), then attends over each sequence's own context and
nothing more:
- decodes (one query each) in length buckets: sorted by context length, a bucket holds sequences within
  BUCKET_RATIO of its longest. On the CPU in fp32 a compiled kernel reads each context row where it lies
  (engines/scheduled/kernels.py); elsewhere the rows are gathered in one copy per layer (K and V together),
  expanded to every query head and attended by `scaled_dot_product_attention` with a padding mask: a path a GPU
  runs fused (the memory-efficient kernel; grouped heads beside a mask fell to the math kernel, fp32 scores).
  Padding is bounded by the ratio (not by the batch's longest), so a step costs about the tokens it holds;
- a prefill chunk that is its sequence's whole context attends over its own fresh K/V (causal, nothing to
  gather); one that continues a context (a prefix-cache hit, a recomputed preemption) gathers its rows.
Step inputs are built from Python ints (the policy's `row_of`), one tensor each; row tensors come from the
policy, which changes them only when it allocates. The same code runs on CPU and CUDA tensors, and its greedy
tokens are transformers' (tests/test_engines.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.host_copy import to_device
from engines.kv.base import KVPolicy
from engines.scheduled.kernels import decode_attention_kernel, usable
from engines.sequence import Sequence
from engines.shapes import BUCKET_RATIO  # with what its gathers allocate (attention_temporaries_bytes), sized there

if TYPE_CHECKING:
    from engines.scheduled.scheduler import Chunk

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class Bucket:
    """One-query sequences of similar context length, padded to the longest of them."""

    token_index: torch.Tensor  # [B] flat index of each one's query
    rows: torch.Tensor  # [B, L] context rows, padded with row 0
    lengths: torch.Tensor  # [B] each one's context
    mask: torch.Tensor  # [B, 1, 1, L] True at a real key


@dataclass
class Prefill:
    """One chunk of several queries: tokens [first, first + n) of the flat step, over `rows` of context."""

    first: int
    n: int
    rows: torch.Tensor | None  # [C] its context rows, the chunk's own included; None: the chunk is the context
    mask: torch.Tensor | None  # [n, C] causal from its start; None when the chunk is the whole context


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor  # [T] where each token's K/V goes
    last_index: torch.Tensor  # [chunks] flat index of each chunk's last token
    last: list[int]  # the same on the host, where the step reads them
    buckets: list[Bucket]
    prefills: list[Prefill]


@dataclass
class FusedLayer:
    """One decoder layer's weights as the runner multiplies them: q|k|v and gate|up concatenated, every matrix
    stored [in, out] (x @ W: a few rows against a weight laid out for them, not a transposed view of it)."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    qkv: torch.Tensor  # [hidden, q + 2 kv]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [q, hidden]
    gate_up: torch.Tensor  # [hidden, 2 intermediate]
    down: torch.Tensor  # [intermediate, hidden]
    act: torch.nn.Module

    @classmethod
    def of(cls, layer) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = torch.cat([p.bias for p in projections]) if attn.q_proj.bias is not None else None
        for linear in (attn.o_proj, mlp.down_proj):
            assert linear.bias is None, "the runner's o and down projections carry no bias (Llama, Mistral, Qwen2)"
        return cls(layer.input_layernorm, layer.post_attention_layernorm, laid_out(projections), bias,
                   laid_out([attn.o_proj]), laid_out([mlp.gate_proj, mlp.up_proj]), laid_out([mlp.down_proj]),
                   mlp.act_fn)


def laid_out(linears) -> torch.Tensor:
    """The linears' weights side by side as one [in, sum of out] matrix; each linear's own weight becomes a view
    of it, so the model keeps working and its weights are held once (a real model's are gigabytes). Each weight is
    copied into its slice and its own tensor let go at once: the peak is the group's weights and one fused copy
    (a cat and a contiguous copy held two beside the original: 1.96 GiB more for Llama-3-8B's lm_head)."""
    first = linears[0].weight
    fused = torch.empty(first.shape[1], sum(lin.weight.shape[0] for lin in linears), dtype=first.dtype,
                        device=first.device)
    at = 0
    for lin in linears:
        n = lin.weight.shape[0]
        fused[:, at: at + n].copy_(lin.weight.t())
        lin.weight.data = fused[:, at: at + n].t()
        at += n
    return fused


@dataclass
class FusedWeights:
    """Every weight as the runner multiplies it: each layer's FusedLayer and the [hidden, vocab] head."""

    layers: list[FusedLayer]
    lm_head: torch.Tensor


def fused_weights(hf_model) -> FusedWeights:
    """The model's weights re-laid for the runner, once per model (kept on it): the factory lays them out before a
    cuda memory sets its cap (the copies are the weights', not the KV's or a forward's), and the runner reads them."""
    done = getattr(hf_model, "fragbench_fused", None)
    if done is not None:
        return done
    with torch.no_grad():
        layers = [FusedLayer.of(layer) for layer in hf_model.model.layers]
        # a head tied to the embeddings stays theirs (a transposed view: no second copy)
        tied = hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
        lm_head = hf_model.lm_head.weight.t() if tied else laid_out([hf_model.lm_head])
    hf_model.fragbench_fused = FusedWeights(layers, lm_head)
    return hf_model.fragbench_fused


def load_hf_model(model_dir: str | Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if model.config.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"the runner supports {', '.join(SUPPORTED_TYPES)} models, not {model.config.model_type}")
    return model.to(device).eval()


def expanded(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, KVH, L, D] K or V with each head repeated for the `group` query heads that read it: SDPA's fused
    kernels on a GPU take no grouped heads (enable_gqa) beside a mask, and the math kernel it falls to then
    upcasts to fp32 and builds every score."""
    return x.repeat_interleave(group, dim=-3) if group > 1 else x


class ModelRunner:
    def __init__(self, hf_model, kv: KVPolicy, gather_rows: int | None = None):
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
        kv.planes = self.num_layers
        planes = kv.plane_view()
        # [layer, row, k|v, kv_head, head_dim]: one layer's K and V of a row lie side by side, so a row is
        # written in one copy and a bucket's context gathered in one
        self.kv_planes = planes.view(self.dtype).view(self.num_layers, planes.shape[1], 2, self.num_kv_heads,
                                                      self.head_dim)
        weights = fused_weights(hf_model)
        self.layers, self.lm_head = weights.layers, weights.lm_head  # lm_head: [hidden, vocab]
        self.q_dim, self.kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.kernel = decode_attention_kernel() if usable(self.kv_planes) else None
        self.group = self.num_heads // self.num_kv_heads  # query heads per K/V head
        self.attention_path = "compiled kernel (no gathered copy)" if self.kernel is not None else \
            "torch: gather, K/V expanded to every head, scaled_dot_product_attention (fused on a GPU)"
        # the most context rows a decode bucket gathers at once (engines/shapes.decode_gather_rows: the headroom's
        # count); None: no bound (a runner built alone, on the CPU)
        self.gather_rows = gather_rows
        self.last_buckets = 0  # decode buckets of the last forward (a step's row records them)
        self.position_states: dict[int, torch.Tensor] = {}  # the last forward's, for the chunks that asked

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        dev, kv = self.device, self.kv
        ids: list[int] = []
        pos: list[int] = []
        write: list[torch.Tensor] = []  # the rows each token's K/V goes to, in pieces already on the device
        decode_rows: list[int] = []  # the decodes' rows since the last piece: one copy down for all of them
        last: list[int] = []
        decodes, prefills = [], []
        flat = 0
        for c in chunks:
            n = c.end - c.start
            ids.extend(c.seq.token_ids[c.start: c.end])
            pos.extend(range(c.start, c.end))
            if n == 1:
                decode_rows.append(kv.row_of(c.seq, c.start))
                decodes.append((c.end, flat, c.seq))
            else:
                rows = kv.rows(c.seq, c.end)  # on the device already: never read back to the host
                write += [to_device(decode_rows, dev)] if decode_rows else []
                write.append(rows[c.start:])
                decode_rows = []
                if c.start:  # query i sits at position start + i and sees keys up to it
                    mask = torch.arange(c.end, device=dev)[None, :] <= torch.arange(c.start, c.end, device=dev)[:, None]
                    prefills.append(Prefill(flat, n, rows, mask))
                else:
                    prefills.append(Prefill(flat, n, None, None))
            flat += n
            last.append(flat - 1)
        write += [to_device(decode_rows, dev)] if decode_rows else []
        return StepInputs(
            input_ids=to_device(ids, dev),
            positions=to_device(pos, dev),
            write_rows=write[0] if len(write) == 1 else torch.cat(write),
            last_index=to_device(last, dev),
            last=last,
            buckets=self._buckets(decodes),
            prefills=prefills,
        )

    def _buckets(self, decodes: list[tuple[int, int, Sequence]]) -> list[Bucket]:
        """(context length, flat index, seq) of each decode, grouped longest first, a group closed where its
        padding would pass BUCKET_RATIO or its gathered rows `gather_rows` (shared context is gathered once per
        reader: a bucket attends in turn, its copies freed before the next): the kernel reads no padding and
        gathers nothing, so it takes every decode in one bucket."""
        if self.kernel is not None:
            return [self._bucket(decodes)] if decodes else []
        out, group = [], []
        cap = self.gather_rows
        for item in sorted(decodes, key=lambda d: -d[0]):  # a group's first is its longest: padded to it
            if group and (item[0] * BUCKET_RATIO < group[0][0] or (cap and (len(group) + 1) * group[0][0] > cap)):
                out.append(self._bucket(group))
                group = []
            group.append(item)
        return [*out, self._bucket(group)] if group else out

    def _bucket(self, group: list[tuple[int, int, Sequence]]) -> Bucket:
        dev = self.device
        rows = torch.nn.utils.rnn.pad_sequence([self.kv.rows(s, n) for n, _, s in group], batch_first=True)
        lengths = to_device([n for n, _, _ in group], dev)
        mask = torch.arange(rows.shape[1], device=dev)[None, :] < lengths[:, None]
        return Bucket(to_device([i for _, i, _ in group], dev), rows, lengths, mask[:, None, None, :])

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], every_position: set[int] = frozenset()) -> torch.Tensor:
        """Logits [chunks, vocab] at the last position of each chunk, in fp32; for the chunks indexed in
        `every_position`, the final hidden states of each of their positions too, in `position_states` (prompt
        logprobs: `position_logits` makes their logits a slice at a time)."""
        inp = self.prepare(chunks)
        self.last_buckets = len(inp.buckets)
        model = self.hf.model
        h = model.embed_tokens(inp.input_ids)  # [T, H]
        cos, sin = model.rotary_emb(h[None], inp.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D]: one angle per position, every head
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer, layer.input_norm(h), cos, sin, i, inp)
            x = layer.post_norm(h) @ layer.gate_up
            gate, up = x.split(x.shape[-1] // 2, dim=-1)
            h = h + (layer.act(gate) * up) @ layer.down
        h = model.norm(h)
        # [n, hidden] each, not [n, vocab] fp32 logits: 2,000 positions of a 128k vocabulary were 1 GiB of logits
        # and as much again of log-softmax, beyond the cap's headroom
        self.position_states = {}
        for i in every_position:
            first = inp.last[i] - (chunks[i].end - chunks[i].start) + 1
            self.position_states[i] = h[first: inp.last[i] + 1]
        return (h[inp.last_index] @ self.lm_head).float()

    @torch.inference_mode()
    def position_logits(self, states: torch.Tensor) -> torch.Tensor:
        """fp32 logits of some of `position_states`' rows."""
        return (states @ self.lm_head).float()

    def _attention(self, layer: FusedLayer, x, cos, sin, index: int, inp: StepInputs) -> torch.Tensor:
        T = x.shape[0]
        qkv = x @ layer.qkv if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, x, layer.qkv)
        q, k, v = qkv.split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = rope(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        store = self.kv_planes[index]  # [rows, 2, KVH, D]
        store.index_copy_(0, inp.write_rows, torch.stack((k, v), dim=1))
        out = torch.empty_like(q)
        for b in inp.buckets:
            out[b.token_index] = self._decode_attention(q[b.token_index], store, b)
        for p in inp.prefills:
            out[p.first: p.first + p.n] = self._prefill_attention(q[p.first: p.first + p.n], k, v, store, p)
        return out.view(T, self.q_dim) @ layer.o

    def _decode_attention(self, q: torch.Tensor, store: torch.Tensor, b: Bucket) -> torch.Tensor:
        """One query per sequence over its context, grouped heads. q: [B, H, D]. The compiled kernel reads the
        rows where they lie (engines/scheduled/kernels.py); the torch path gathers them, then attends."""
        if self.kernel is not None:
            return self.kernel.decode_attention(q.contiguous(), store, b.rows, b.lengths, self.head_dim**-0.5)
        B, L = b.rows.shape
        context = store.index_select(0, b.rows.flatten()).view(B, L, 2, self.num_kv_heads, self.head_dim)
        keys, values = (expanded(x.transpose(1, 2), self.group) for x in context.unbind(2))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=b.mask)
        return out[:, :, 0]  # [B, H, D]

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: torch.Tensor,
                           p: Prefill) -> torch.Tensor:
        """Several queries of one sequence over its context: its own fresh K/V when the chunk is the whole
        context, else its rows gathered. q: [n, H, D]."""
        if p.rows is None:
            keys, values = k[p.first: p.first + p.n], v[p.first: p.first + p.n]
        else:
            keys, values = store.index_select(0, p.rows).unbind(1)  # [C, KVH, D] each
        keys, values = (expanded(x.transpose(0, 1)[None], self.group) for x in (keys, values))  # [1, H, C, D]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=p.mask,
                                             is_causal=p.mask is None)  # [1, H, n, D]
        return out[0].transpose(0, 1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it (x * cos + rotate_half(x) * sin). x: [T, heads, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
