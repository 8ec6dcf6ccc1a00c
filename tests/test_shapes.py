import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engines.shapes import load_shape, preset_config, preset_names

KNOWN_KV_BYTES_FP16 = {
    "llama-2-7b": 524_288,
    "llama-2-13b": 819_200,
    "llama-3-8b": 131_072,
    "llama-3-70b": 327_680,
    "mistral-7b": 131_072,
    "qwen2.5-7b": 57_344,
    "opt-13b": 819_200,
    "tiny-llama": 2_048,
    "tiny-qwen2": 28_672,
    "tiny-llama-8b-kv": 65_536,  # Llama-3-8B's bytes a token in fp32 (its MEMORY=caching CPU model)
}


def test_every_preset_has_its_true_kv_bytes_per_token():
    assert set(preset_names()) == set(KNOWN_KV_BYTES_FP16)
    for name, kvb in KNOWN_KV_BYTES_FP16.items():
        assert load_shape(name).kv_bytes_per_token("float16") == kvb


@pytest.mark.parametrize("name", sorted(KNOWN_KV_BYTES_FP16))
def test_parameter_formula_matches_transformers(name):
    cfg = dict(preset_config(name))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert load_shape(name).num_params == sum(p.numel() for p in model.parameters())


def test_tiny_llama_is_the_documented_shape():
    s = load_shape("tiny-llama")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.vocab_size) == (4, 256, 4, 2, 4096)
    assert 3e6 < s.num_params < 5e6
