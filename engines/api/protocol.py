"""The request bodies of /v1/completions and /v1/chat/completions as typed models, one per endpoint, validated
once. Every field of the OpenAI and vLLM request schemas is declared: honoured (below, and in
docs/api.md), accepted as metadata that no generation reads, or rejected with a 400 naming it when set to
anything but its no-op value. A field in neither schema is ignored, as vLLM ignores it, and counted.

The checks that need the engine (prompt ids against the vocabulary, lengths against the context) come after,
in `engines/api/validation.py`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.api.validation import MAX_N, SEED_RANGE, InvalidRequest
from engines.token_sampling import MAX_LOGPROBS

Stop = str | list[str] | None


class Unsupported(ValueError):
    """A known field set to something fragbench's engines cannot do (or cannot do alone: `why`)."""

    def __init__(self, field: str, value: Any, allowed: tuple, why: str | None = None):
        super().__init__(f"{field}={value!r}: {why}" if why else
                         f"{field}={value!r} is not supported by fragbench's engines (accepted: "
                         f"{', '.join(repr(a) for a in allowed)})")
        self.field = field


UNSET = (None,)

# why each refused field stays refused (docs/api.md lists the same): said in its 400
WHY: dict[str, str] = {
    "best_of": "best-of ranks several hidden samples by cumulative logprob; ask for n samples with logprobs and "
               "rank them (vLLM removed best_of with its V0 engine)",
    "use_beam_search": "beam search forks and prunes hypotheses inside one request, a scheduler of its own "
                       "that the KV policies under test do not have (vLLM serves it apart from its engine)",
    "length_penalty": "a beam-search parameter, and beam search is not served",
    "truncate_prompt_tokens": "a prompt cut on the server would change the lengths the workload asks for; "
                              "cut it in the client",
    "guided_json": "structured outputs need a grammar engine (xgrammar, outlines) masking every step's logits: "
                   "not a dependency of fragbench, and indifferent to the KV policy it measures",
    "guided_regex": "structured outputs (guided decoding) are not served: see guided_json",
    "guided_choice": "structured outputs (guided decoding) are not served: see guided_json",
    "guided_grammar": "structured outputs (guided decoding) are not served: see guided_json",
    "structured_outputs": "structured outputs (guided decoding) are not served: see guided_json",
    "response_format": "only {'type': 'text'}: JSON modes are guided decoding, which is not served",
    "suffix": "insertion needs a fill-in-the-middle model and prompt format (vLLM refuses it too)",
    "tools": "tool calls need a model trained to make them and a parser of its output; the served models have "
             "neither",
    "tool_choice": "tool calls are not served: see tools",
    "functions": "tool calls are not served: see tools",
    "function_call": "tool calls are not served: see tools",
    "chat_template": "a template from the request is code the server would run; the model's own is used",
    "chat_template_kwargs": "a template from the request is code the server would run; the model's own is used",
    "modalities": "the served models read and write text alone",
    "audio": "the served models read and write text alone",
    "prediction": "predicted outputs are a speculative-decoding path the engines do not have",
    "reasoning_effort": "the served models are not reasoning models",
    "web_search_options": "no search tool is served",
}


class SamplingBody(BaseModel):
    """What both endpoints share. strict: no bool for an int, no string for a number; no NaN or Infinity."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 scores the prompt alone (completions, with echo)
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
    # sampling, as vLLM applies it (engines/token_sampling.py)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias in [-100, 100]
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: every prompt position's
    # rejected unless at their no-op value
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    truncate_prompt_tokens: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    response_format: dict | None = None
    spaces_between_special_tokens: bool = True

    # each refused field with the values that ask for nothing (an empty {} or [] counts as unset)
    NO_OP: ClassVar[dict[str, tuple]] = {
        "length_penalty": (None, 1), "best_of": (None, 1), "use_beam_search": (False,), "truncate_prompt_tokens": UNSET,
        "guided_json": UNSET, "guided_regex": UNSET, "guided_choice": UNSET, "guided_grammar": UNSET,
        "structured_outputs": UNSET, "response_format": (None, {"type": "text"}),
    }

    @model_validator(mode="after")
    def _refused(self):
        for name, allowed in self.NO_OP.items():
            value = getattr(self, name)
            if value not in allowed and value not in ({}, []):
                raise Unsupported(name, value, allowed, f"{WHY[name]} (accepted: "
                                  f"{', '.join(repr(a) for a in allowed)})")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, not {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], not {value}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Stop) -> Stop:
        if isinstance(v, list) and (len(v) > 16 or not all(v)):
            raise ValueError("stop takes at most 16 non-empty strings")
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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True

    NO_OP: ClassVar[dict[str, tuple]] = {**SamplingBody.NO_OP, "suffix": UNSET}

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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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

    NO_OP: ClassVar[dict[str, tuple]] = {
        **SamplingBody.NO_OP, "tools": UNSET,
        "tool_choice": (None, "none", "auto"), "functions": UNSET, "function_call": UNSET, "chat_template": UNSET,
        "chat_template_kwargs": UNSET, "modalities": (None, ["text"]), "audio": UNSET, "prediction": UNSET,
        "reasoning_effort": UNSET, "web_search_options": UNSET,
    }

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", self.top_logprobs, (None,), "it needs logprobs: true")
        return self


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
        if isinstance(cause, Unsupported):  # from the model's own check: no location, the field is on it
            loc, message = [cause.field], str(cause)
        else:
            message = err["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{'.'.join(loc) or 'body'}: {message}"[:300], loc[0] if loc else None) from None
