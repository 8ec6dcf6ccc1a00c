"""What the API checks against the engine once a body has its type (`engines/api/protocol.py`): prompts
against the vocabulary and context, lengths, what one engine cannot do; the one error shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.sequence import SamplingParams

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
    """A request both endpoints hand the engine, checked against it: prompts as ids, and what ends a sample."""

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
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first one
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no EOS, stop string or stop token ends a sample before this many tokens
    echo: bool = False  # completions: the prompt's text leads the answer's
    skip_special_tokens: bool = True
    chat: bool = False
    continuous_usage: bool = False  # usage so far in every streamed event (vLLM's continuous_usage_stats)
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # alternatives per generated token (completions' logprobs, chat's top_logprobs)
    prompt_logprobs: int | None = None  # vLLM's, per prompt position
    score_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated

    def sampling(self) -> SamplingParams:
        """The engine's parameters: the server stops on EOS itself when min_tokens must hold it off, and scores a
        prompt alone with one token it then drops; an echo with logprobs needs the prompt's."""
        prompt = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt = max(prompt or 0, self.logprobs)
        return SamplingParams(
            self.max_tokens, self.temperature, self.top_p, self.seed, self.ignore_eos or self.min_tokens > 0,
            top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias, logprobs=self.logprobs, prompt_logprobs=prompt)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def check_engine(engine, req: CompletionRequest | SamplingParams) -> None:
    """What one engine cannot do: hf-cb decodes greedily from transformers' own logits (no sampling, no
    penalty, no bias: its per-request processors are fixed when it starts)."""
    if not getattr(engine, "greedy_only", False):
        return
    if req.temperature > 0:
        raise InvalidRequest(f"engine {engine.name} decodes greedily: temperature must be 0", "temperature")
    for name, plain in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                        ("logit_bias", ())):
        if getattr(req, name) != plain:
            raise InvalidRequest(f"engine {engine.name} decodes greedily from transformers' own logits: {name} is "
                                 "not applied there", name)


def checked(body, prompts: list[list[int]], vocab_size: int, max_seq_len: int, chat: bool = False,
            echo: bool = False, default_temperature: float = 1.0) -> CompletionRequest:
    """A parsed body (`engines/api/protocol.SamplingBody`) and its prompts, checked against the engine.
    `default_temperature`: OpenAI's 1.0, or 0 for an engine that decodes greedily only (hf-cb)."""
    check_prompts(prompts, vocab_size, max_seq_len)
    limit = body.output_limit()
    score_only = limit == 0
    if score_only and not echo:
        raise InvalidRequest("max_tokens 0 scores the prompt alone: it needs echo (completions)", "max_tokens")
    max_tokens = 1 if score_only else limit or 16
    if max_tokens > max_seq_len:
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequest(f"{name} must be in [1, {max_seq_len}], got {max_tokens}", name)
    check_lengths(prompts, max_tokens, max_seq_len)
    if body.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({body.min_tokens}) exceeds the output limit ({max_tokens})", "min_tokens")
    if any(not 0 <= t < vocab_size for t in body.stop_token_ids or []):
        raise InvalidRequest(f"stop_token_ids has ids outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return CompletionRequest(
        prompts=prompts, max_tokens=max_tokens, n=body.n, stream=bool(body.stream), include_usage=body.include_usage,
        ignore_eos=body.ignore_eos,
        temperature=default_temperature if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, model=body.model,
        stop=body.stop_strings(), stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output, min_tokens=body.min_tokens, echo=echo,
        skip_special_tokens=body.skip_special_tokens, chat=chat,
        continuous_usage=body.continuous_usage, top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias(body.logit_bias, vocab_size), logprobs=logprobs_asked(body, chat),
        prompt_logprobs=body.prompt_logprobs, score_only=score_only)


def logprobs_asked(body, chat: bool) -> int | None:
    """Alternatives per generated token: completions' `logprobs`, chat's `top_logprobs` (0 when only `logprobs`)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def bias(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias has token id {token} outside the vocabulary [0, {vocab_size})",
                                 "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def prompt_ids(prompt, tokenize) -> list[list[int]]:
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
