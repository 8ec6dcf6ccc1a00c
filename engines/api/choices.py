"""One sample's answer as the client sees it: its tokens, its text, and what ended it. The engines stop on
EOS and length; stop strings, stop token ids and min_tokens are the API's, applied here the same way for
every engine (the server then aborts the sample's request, freeing its KV that step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Choice:
    index: int
    decode: Callable[[list[int]], str]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str: bool = False
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # set when the server, not the engine, stops on EOS (min_tokens)
    prefix: str = ""  # echo: the prompt's text, sent before the first token
    score_only: bool = False  # max_tokens 0: the prompt scored; the one token the engine makes is dropped
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # each kept token's engines.token_sampling.Logprob (None: not asked)
    prompt_logprobs: list | None = None  # the prompt's, from the sample's first event
    text: str = ""
    sent: int = 0  # characters of prefix + text already sent
    finish_reason: str | None = None

    def add(self, token_id: int | None, engine_reason: str | None, logprob=None) -> str:
        """Take one event from the engine; the text to send now. A tail that may be the start of a stop
        string is held back until it is not (or the sample ends)."""
        if self.finish_reason is not None:
            return ""
        if self.score_only:  # the prompt alone: its text (echo) and logprobs, no token of the engine's
            self.finish_reason = "length"
            self.sent = len(self.prefix)
            return self.prefix
        if token_id is not None:
            self.tokens.append(token_id)
            self.logprobs.append(logprob)
            self._token_stop(token_id)
            self.text = self.decode(self.tokens if self.finish_reason is None or self.include_stop_str
                                    else self.tokens[:-1])
            self._string_stop()
        if self.finish_reason is None and engine_reason is not None:
            self.finish_reason = engine_reason
        full = self.prefix + self.text
        end = len(full) if self.finish_reason is not None else len(full) - self._held_back()
        delta, self.sent = full[self.sent:end], max(self.sent, end)
        return delta

    def _token_stop(self, token_id: int) -> None:
        if len(self.tokens) < self.min_tokens:
            return
        if token_id in self.stop_token_ids or token_id in self.eos_token_ids:
            self.finish_reason = "stop"

    def _string_stop(self) -> None:
        if not self.stop or len(self.tokens) < self.min_tokens or self.finish_reason is not None:
            return
        hits = [(at, s) for s in self.stop if (at := self.text.find(s)) >= 0]
        if hits:
            at, s = min(hits)
            self.text = self.text[:at + len(s)] if self.include_stop_str else self.text[:at]
            self.finish_reason = "stop"

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        return max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if self.text.endswith(s[:k])), default=0)

    @property
    def output(self) -> str:
        return self.prefix + self.text
