"""Model shapes: the numbers that decide KV and weight bytes, from a preset or a model directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}  # float8: planning only
BUILD_DTYPES = ("float32", "bfloat16", "float16")


class ModelNotFound(ValueError):
    """Neither a preset name nor a model directory with a config.json."""


MIN_BATCHED_TOKENS = 2048  # a step's batched tokens by default: at least this many, and at least the context


def batched_tokens(max_seq_len: int, asked: int | None = None) -> int:
    """The tokens one step batches: `asked` (an engine's max_num_batched_tokens) where given, else vLLM's default,
    the larger of MIN_BATCHED_TOKENS and the context (a whole prompt fits one step). The one place of the rule: the
    in-house engines' scheduler and forward headroom, hf-cb's batches, the simulator's memory gate and the plan."""
    return asked or max(MIN_BATCHED_TOKENS, max_seq_len)


# A decode bucket's shortest context is at least 1/BUCKET_RATIO of its longest: at most a third of what a
# bucket reads is padding, and a batch of any length mix needs few buckets (each costs a few kernel calls).
BUCKET_RATIO = 1.5
LOGITS_BYTES = 4  # logits are computed in fp32
MLP_PEAK_WIDTHS = 4  # x @ gate|up (2), act(gate) (1) and act(gate) * up (1) live at once, in MLP widths

@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool
    qkv_bias: bool
    config: dict

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelShape:  # the parse edge: a Hugging Face config.json
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            name=name,
            model_type=cfg["model_type"],
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg.get("intermediate_size") or cfg.get("ffn_dim"),
            vocab_size=cfg["vocab_size"],
            max_seq_len=cfg["max_position_embeddings"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False)),
            config=cfg,
        )

    @property
    def dtype(self) -> str | None:
        """The dtype its config names (transformers writes `dtype`, older versions `torch_dtype`), if any."""
        return self.config.get("dtype") or self.config.get("torch_dtype")

    def kv_bytes_per_token(self, dtype: str = "float16") -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def activation_bytes(self, dtype_bytes: int, batched_tokens: int, max_num_seqs: int) -> int:
        """Peak temporaries of one forward over `batched_tokens`: residual and normed hidden states, q/k/v,
        the MLP at its peak (gate|up, 2x its width, then act(gate) and act(gate) * up beside it: 4x), and fp32
        logits for every running sequence. What a KV budget must leave beside it (the plan; a cuda memory's cap,
        with the attention's own temporaries: attention_temporaries_bytes, forward_headroom_bytes)."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_token = 2 * self.hidden_size + q_dim + 2 * kv_dim + MLP_PEAK_WIDTHS * self.intermediate_size
        return batched_tokens * per_token * dtype_bytes + max_num_seqs * self.vocab_size * LOGITS_BYTES

    @property
    def num_params(self) -> int:
        h, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.model_type == "opt":
            # learned positions carry an offset of 2; every linear and layer norm has a bias
            per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
            return v * h + (self.max_seq_len + 2) * h + self.num_layers * per_layer + 2 * h
        attn = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.qkv_bias:
            attn += q_dim + 2 * kv_dim
        per_layer = attn + 3 * h * f + 2 * h
        lm_head = 0 if self.tied_embeddings else v * h
        return v * h + lm_head + self.num_layers * per_layer + h

    def weights_bytes(self, dtype: str = "float16") -> int:
        return self.num_params * DTYPE_BYTES[dtype]


def attention_temporaries_bytes(num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                                pool_tokens: int, max_seq_len: int, batched_tokens: int) -> int:
    """What one layer's attention allocates beside the activations, at its peak, on the path the runner
    (engines/scheduled/model.py) takes off the CPU kernel (`expanded`: SDPA over K/V expanded to every query head,
    which a GPU runs fused, memory-efficient with a mask, flash without; no score matrix is made): the decode
    bucket's gathered K and V (`pool_tokens` padded by up to BUCKET_RATIO: decode_gather_rows, where the runner
    splits a bucket whose readers share blocks; buckets attend in turn), their copies expanded to every head and
    their padding mask (bool, and SDPA's additive copy of it in the model's dtype); a continuing prefill chunk's
    gathered and expanded context and its [chunk, context] mask; a whole chunk's own K/V expanded. What a cuda
    memory's cap must leave beside the KV budget."""
    kv_row = 2 * num_kv_heads * head_dim * dtype_bytes  # one token's K and V as the store holds them
    expanded_row = 2 * num_heads * head_dim * dtype_bytes if num_heads != num_kv_heads else 0
    mask_entry = 1 + dtype_bytes  # the bool mask and SDPA's additive copy of it
    decode = decode_gather_rows(pool_tokens) * (kv_row + expanded_row + mask_entry)
    prefill = max_seq_len * (kv_row + expanded_row) + batched_tokens * max_seq_len * mask_entry
    whole_chunk = batched_tokens * expanded_row
    return decode + max(prefill, whole_chunk)  # buckets and a chunk may be live in one step's layer


def live_decode_tokens(pool_tokens: int, max_num_seqs: int, max_seq_len: int) -> int:
    """The context tokens the decodes of one step are sized for: the KV pool's, never more than max_num_seqs
    max-length sequences."""
    return min(pool_tokens, max_num_seqs * max_seq_len)


def decode_gather_rows(live_tokens: int) -> int:
    """The most context rows one decode bucket gathers (padded) at once: `live_tokens` (live_decode_tokens) with
    BUCKET_RATIO's padding. Blocks shared by forks or the prefix cache are gathered once per sequence that reads
    them, so a step's contexts can add up to more than the pool holds: the runner splits a bucket at this many rows
    (engines/scheduled/model.py), and the headroom counts this many (attention_temporaries_bytes), so no sharing
    takes a forward past what the cap left (docs/method.md)."""
    return int(BUCKET_RATIO * live_tokens)


def forward_headroom_bytes(shape: ModelShape, dtype_bytes: int, batched_tokens: int, max_num_seqs: int,
                           pool_tokens: int, max_seq_len: int) -> int:
    """What one forward of a scheduled engine allocates beside the KV: the activations, and the attention's
    temporaries (engines/scheduled/model.py) for the decodes that can be live at once, the KV pool's tokens but
    never more than max_num_seqs max-length sequences. Under --memory cuda the cap leaves room for both; the plan
    (harness/plan.py) leaves the same beside its budget: the one rule of both."""
    return shape.activation_bytes(dtype_bytes, batched_tokens, max_num_seqs) + \
        attention_temporaries_bytes(shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype_bytes,
                                    live_decode_tokens(pool_tokens, max_num_seqs, max_seq_len), max_seq_len,
                                    batched_tokens)


def preset_names() -> list[str]:
    files = resources.files("engines").joinpath("presets").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def preset_config(name: str) -> dict:
    if name not in preset_names():
        raise ModelNotFound(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    return json.loads(resources.files("engines").joinpath("presets", f"{name}.json").read_text())


def load_shape(model: str) -> ModelShape:
    """A preset name, or a model directory holding an HF config.json."""
    if model in preset_names():
        return ModelShape.from_config(model, preset_config(model))
    cfg_path = Path(model) / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFound(f"{model!r} is neither a model preset nor a directory with a config.json")
    return ModelShape.from_config(Path(model).name, json.loads(cfg_path.read_text()))
