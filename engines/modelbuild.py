"""Build a model directory offline: seeded random weights and a byte-level BPE tokenizer trained locally."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from engines.shapes import BUILD_DTYPES, ModelShape, preset_config

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the Llama convention
# Building holds the weights once in memory and once more while serializing.
BUILD_MEMORY_FACTOR = 2


class BuildRefused(RuntimeError):
    """The machine cannot hold what the build needs."""


def training_text() -> list[str]:
    """Python's own documentation topics: English and code, shipped with every CPython."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int, max_seq_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_seq_len,
    )


def check_fits_in_ram(shape: ModelShape, dtype: str) -> None:
    need = shape.weights_bytes(dtype) * BUILD_MEMORY_FACTOR
    have = psutil.virtual_memory().total
    if need > have:
        raise BuildRefused(
            f"preset {shape.name} needs about {need / 2**30:.1f} GiB of RAM to build "
            f"({dtype} weights {shape.weights_bytes(dtype) / 2**30:.1f} GiB x {BUILD_MEMORY_FACTOR}); "
            f"this machine has {have / 2**30:.1f} GiB"
        )


# `overrides`: Hugging Face config.json keys, free-form as transformers takes them (the config is the edge)
def build_model(preset: str, out: Path, dtype: str = "float32", seed: int = 0, overrides: dict | None = None) -> Path:
    """`overrides` changes the preset's config (gpu-check's real-shape model: Llama-3-8B's layer, fewer layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**preset_config(preset), **(overrides or {})}
    shape = ModelShape.from_config(preset, cfg)
    if dtype not in BUILD_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(BUILD_DTYPES)}, not {dtype!r}")
    check_fits_in_ram(shape, dtype)
    # The built tokenizer defines the special ids, whatever the original model used.
    cfg.update(bos_token_id=1, eos_token_id=2, torch_dtype=dtype, dtype=dtype)
    cfg.pop("pad_token_id", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    train_tokenizer(min(shape.vocab_size, 32000), shape.max_seq_len).save_pretrained(out)
    (out / "fragbench.json").write_text(json.dumps({"preset": preset, "dtype": dtype, "seed": seed}) + "\n")
    return out
