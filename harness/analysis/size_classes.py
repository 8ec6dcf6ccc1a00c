"""The rule that picks the CPU's model for `--memory caching`: PyTorch's allocator sorts a request by absolute
size (small <= 1 MiB, packed in 2 MiB segments; large under 10 MiB, a 20 MiB segment; huge, a segment of its
own), so the emulator behaves as on a GPU only where each engine's KV allocations fall in the classes a real
model's would. The tiny model's do not (4 KiB a token: its per-request buffers are small and large where
Llama-3-8B's are huge). The rule: on the CPU, `--memory caching` runs the CPU preset with the fewest KV bytes
a token (the cheapest to run) whose allocations on the run's workload fall in Llama-3-8B's classes, within
`TOLERANCE` of each class's share, for each way an engine allocates (`PATTERNS`). The Makefile's default for
MEMORY=caching is that preset (a test holds the two together) and the report prints the comparison."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engines.memory.allocconf import parse_alloc_conf
from engines.memory.blocks import SIZE_CLASSES, round_size, size_class
from engines.shapes import ModelNotFound, ModelShape, load_shape, preset_names
from harness.analysis.records import RunConfig

REFERENCE = ("llama-3-8b", "bfloat16")  # the real model whose classes the CPU's should fall in
TOLERANCE = 0.05  # each class's share of an engine's allocations, at most this far from the reference's
# how an engine allocates its KV, as bytes for one request of `tokens` (prompt + max_tokens) tokens
PATTERNS = {
    "a buffer of the request's tokens (static-oracle)": lambda shape, dtype, tokens, max_len: tokens * shape
    .kv_bytes_per_token(dtype),
    "a max-length buffer (static-max)": lambda shape, dtype, tokens, max_len: max_len * shape.kv_bytes_per_token(dtype),
    "one layer's K (or V), grown by torch.cat (hf, one sequence)": lambda shape, dtype, tokens, max_len: tokens
    * shape.kv_bytes_per_token(dtype) // (2 * shape.num_layers),
}


def shares(shape: ModelShape, dtype: str, lengths: Sequence[int], max_len: int) -> dict[str, dict[str, float]]:
    """Per pattern, the share of the requests whose allocation falls in each of PyTorch's classes."""
    conf = parse_alloc_conf(None)
    out = {}
    for name, size in PATTERNS.items():
        counts = Counter(size_class(round_size(size(shape, dtype, t, max_len), conf)) for t in lengths)
        out[name] = {c: round(counts[c] / max(1, len(lengths)), 3) for c in SIZE_CLASSES}
    return out


def distance(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> float:
    """The largest gap between two models' shares, over every pattern and class."""
    return max(abs(a[p][c] - b[p][c]) for p in a for c in SIZE_CLASSES)


def cpu_presets() -> list[str]:
    """The presets the CPU runs (the tiny ones), cheapest KV first."""
    tiny = [n for n in preset_names() if n.startswith("tiny-")]
    return sorted(tiny, key=lambda n: load_shape(n).kv_bytes_per_token(load_shape(n).dtype or "float32"))


def comparison(model: str, lengths: Sequence[int], max_len: int) -> dict:
    """summary.json's `size_classes_rule`: the run's model against the reference on the run's requests, and
    the preset the rule picks."""
    shape = load_shape(model)
    mine = shares(shape, shape.dtype or "float32", lengths, max_len)
    ref = shares(load_shape(REFERENCE[0]), REFERENCE[1], lengths, max_len)
    return {"reference": f"{REFERENCE[0]} ({REFERENCE[1]})", "tolerance": TOLERANCE, "model": shape.name,
            "kv_bytes_per_token": shape.kv_bytes_per_token(shape.dtype or "float32"), "shares": mine,
            "reference_shares": ref, "distance": round(distance(mine, ref), 3),
            "matches": distance(mine, ref) <= TOLERANCE, "rule_picks": rule_pick(lengths, max_len, ref)}


def rule_pick(lengths: Sequence[int], max_len: int, ref: dict[str, dict[str, float]] | None = None) -> str | None:
    """The cheapest CPU preset whose classes match the reference's (`ref`, its shares on these requests, computed
    here when not given) within the tolerance; None if none does."""
    ref = ref or shares(load_shape(REFERENCE[0]), REFERENCE[1], lengths, max_len)
    for name in cpu_presets():
        shape = load_shape(name)
        if distance(shares(shape, shape.dtype or "float32", lengths, max_len), ref) <= TOLERANCE:
            return name
    return None


def run_rule(requests, cfg: RunConfig) -> dict | None:
    """The comparison for a `--memory caching` run, on the requests it sent (prompt + target output tokens, each
    once); None for another memory, or where the model can no longer be read."""
    if cfg.memory != "caching" or requests is None or not len(requests):
        return None
    max_len = int(cfg.max_seq_len or 2048)
    first = requests.drop_duplicates("request_id")
    lengths = (first.prompt_tokens.fillna(0) + first.output_tokens_target.fillna(0)).clip(upper=max_len)
    try:
        return comparison(str(cfg.model), [int(t) for t in lengths], max_len)
    except ModelNotFound:
        return None
