"""The /v1/completions body, checked field by field: every failure names its field."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_N = 16
# seeds feed torch.Generator.manual_seed, which takes a signed or unsigned 64-bit integer
SEED_RANGE = (-(2**63), 2**63 - 1)


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict:
        return error_body(str(self), "invalid_request_error", self.status, self.param)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object: the one shape of every error the server answers or streams."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    temperature: float
    top_p: float
    seed: int | None
    model: str | None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise InvalidRequest(f"{key} must be a number", key)
    if not math.isfinite(v):  # Python's JSON reader accepts NaN and Infinity; no sampler does
        raise InvalidRequest(f"{key} must be a finite number, got {v}", key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise InvalidRequest(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"{key} must be a boolean", key)
    return v


def _int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    """An integer in [lo, hi]; NaN, Infinity and floats (even whole ones) are not integers."""
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_int(v):
        raise InvalidRequest(f"{key} must be an integer, got {v!r}"[:200], key)
    if not lo <= v <= hi:
        raise InvalidRequest(f"{key} must be in [{lo}, {hi}], got {v}"[:200], key)
    return v


def check_prompts(prompts: list[list[int]], vocab_size: int, max_seq_len: int) -> None:
    """Token ids an engine can embed, in prompts shorter than its context."""
    for ids in prompts:
        if not ids:
            raise InvalidRequest("prompt is empty", "prompt")
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequest(f"prompt has token ids outside the vocabulary [0, {vocab_size})", "prompt")
        if len(ids) >= max_seq_len:
            raise InvalidRequest(f"prompt of {len(ids)} tokens reaches max_seq_len {max_seq_len}", "prompt")


def check_lengths(prompts: list[list[int]], max_tokens: int, max_seq_len: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > max_seq_len:
        raise InvalidRequest(
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {max_seq_len}", "max_tokens"
        )


def check_engine(engine, temperature: float) -> None:
    """What one engine cannot do: hf-cb samples greedily only."""
    if getattr(engine, "greedy_only", False) and temperature > 0:
        raise InvalidRequest(f"engine {engine.name} decodes greedily: temperature must be 0", "temperature")


def parse_completion(body, tokenize, vocab_size: int, max_seq_len: int) -> CompletionRequest:
    """`tokenize(text) -> ids`. Raises InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", None)
    prompts = _prompts(body.get("prompt"), tokenize)
    check_prompts(prompts, vocab_size, max_seq_len)
    max_tokens = _int(body, "max_tokens", 16, 1, max_seq_len)
    check_lengths(prompts, max_tokens, max_seq_len)
    n = _int(body, "n", 1, 1, MAX_N)
    seed = _int(body, "seed", None, *SEED_RANGE)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    include_usage = _flag(options, "include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    return CompletionRequest(
        prompts=prompts,
        max_tokens=max_tokens,
        n=n,
        stream=_flag(body, "stream"),
        include_usage=include_usage,
        ignore_eos=_flag(body, "ignore_eos"),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        model=model,
    )


def _prompts(prompt, tokenize) -> list[list[int]]:
    """A text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [_tokenize(tokenize, prompt)]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [_tokenize(tokenize, p) for p in prompt]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")


def _tokenize(tokenize, text: str) -> list[int]:
    """Text that no tokenizer can encode (a lone surrogate, say) is the client's error, not the server's."""
    try:
        return tokenize(text)
    except (UnicodeError, ValueError, TypeError) as e:
        raise InvalidRequest(f"prompt cannot be tokenized: {type(e).__name__}", "prompt") from None
