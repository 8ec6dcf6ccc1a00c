"""The request bodies of /v1/completions and /v1/chat/completions as typed models, one per endpoint, validated
once. Every field of the OpenAI and vLLM request schemas is declared: honoured (below, and in
docs/api.md), accepted as metadata that no generation reads, or rejected with a 400 naming it when set to
anything but its no-op value. A field in neither schema is ignored, as vLLM ignores it, and counted.

The checks that need the engine (prompt ids against the vocabulary, lengths against the context) come after,
in `engines/api/validation.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engines.api.validation import MAX_N, SEED_RANGE, InvalidRequest

Stop = str | list[str] | None


class Unsupported(ValueError):
    """A known field set to something fragbench's engines cannot do."""


def _no_op(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise Unsupported(f"{name}={value!r} is not supported by fragbench's engines (accepted: "
                          f"{', '.join(repr(a) for a in allowed)})")


class SamplingBody(BaseModel):
    """What both endpoints share. strict: no bool for an int, no string for a number; no NaN or Infinity."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool | None = False
    stream_options: dict | None = None
    skip_special_tokens: bool = True
    # metadata: accepted, read by no generation
    user: str | None = None
    request_id: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    priority: int = 0
    # rejected unless at their no-op value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None
    top_k: int | None = None
    min_p: float | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    response_format: dict | None = None
    spaces_between_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Stop) -> Stop:
        if isinstance(v, list) and (len(v) > 16 or not all(v)):
            raise ValueError("stop takes at most 16 non-empty strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _zero(cls, v, info):
        _no_op(info.field_name, v, (None, 0, 0.0))
        return v

    @field_validator("repetition_penalty", "length_penalty")
    @classmethod
    def _one(cls, v, info):
        _no_op(info.field_name, v, (None, 1, 1.0))
        return v

    @field_validator("logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "prompt_logprobs", "truncate_prompt_tokens")
    @classmethod
    def _unset(cls, v, info):
        _no_op(info.field_name, v if v != {} else None, (None,))
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        _no_op("top_k", v, (None, -1, 0))
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        _no_op("min_p", v, (None, 0, 0.0))
        return v

    @field_validator("use_beam_search")
    @classmethod
    def _beam(cls, v):
        _no_op("use_beam_search", v, (False,))
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        _no_op("response_format", v, (None, {"type": "text"}))
        return v

    @field_validator("stream_options")
    @classmethod
    def _options(cls, v):
        if v is not None:
            for key, value in v.items():
                if key not in ("include_usage", "continuous_usage_stats"):
                    raise ValueError(f"stream_options has no field {key!r}")
                if not isinstance(value, bool):
                    raise ValueError(f"stream_options.{key} must be a boolean")
        return v

    def output_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) over max_tokens (its deprecated one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage so far in every streamed event."""
        return bool((self.stream_options or {}).get("continuous_usage_stats"))

    def ignored(self) -> list[str]:
        """Fields in neither schema: ignored, as vLLM does, and counted by the server."""
        return sorted(self.model_extra or {})


class CompletionBody(SamplingBody):
    prompt: Any = None  # a text, token ids, or a list of either: checked with the tokenizer at hand
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unset(cls, v, info):
        _no_op(info.field_name, v, (None,))
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        _no_op("best_of", v, (None, 1))
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    modalities: list | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        _no_op("logprobs", v, (False,))
        return v

    @field_validator("top_logprobs", "functions", "function_call", "chat_template", "chat_template_kwargs",
                     "audio", "prediction", "reasoning_effort", "web_search_options")
    @classmethod
    def _unset(cls, v, info):
        _no_op(info.field_name, v if v not in ({}, []) else None, (None,))
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        _no_op("tools", v or None, (None,))
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        _no_op("tool_choice", v, (None, "none", "auto"))
        return v

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v):
        _no_op("modalities", v, (None, ["text"]))
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        _no_op("best_of", v, (None, 1))
        return v


def parse(model: type[SamplingBody], body) -> SamplingBody:
    """The body as `model`, or an InvalidRequest naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(x) for x in err["loc"]]
        cause = err.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, Unsupported) else err["msg"].removeprefix("Value error, ")
        return_param = loc[0] if loc else None
        raise InvalidRequest(f"{'.'.join(loc) or 'body'}: {message}"[:300], return_param) from None
