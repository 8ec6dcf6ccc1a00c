"""A sequence: one sample of one request, as the scheduler and the KV policies see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (as vLLM's _SAMPLING_EPS): dividing by it would overflow fp32.
GREEDY_BELOW = 1e-5


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens or max_seq_len
    ABORT = "abort"  # the client went away or cancelled
    OOM = "oom"  # a KV allocation failed and the engine rejects rather than crashes
    ERROR = "error"  # serving this sequence raised (sampling, stop rule): it alone fails


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, as vLLM takes it: penalties and the logit bias first, then temperature, min-p,
    top-k and top-p (engines/token_sampling.py). Logprobs are the raw model's (log-softmax of the fp32 logits, before
    any of these), as vLLM's default `raw_logprobs`."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's, on the tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's (and transformers'), on the prompt's and the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # each generated token's logprob and this many alternatives; None: none
    prompt_logprobs: int | None = None  # the same for every prompt position (the first has none)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Nothing to apply to the logits: greedy decoding reads their argmax as it is."""
        return self.greedy and not self.logit_bias and self.presence_penalty == 0 and self.frequency_penalty == 0 \
            and self.repetition_penalty == 1.0


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_seq_len: int
    request_id: str = ""
    sample_index: int = 0
    arrival_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose KV is written
    num_preemptions: int = 0
    error: str | None = None  # why it ended with FinishReason.ERROR
    prompt_logprobs: list | None = None  # params.prompt_logprobs: filled by the prefill that computed them

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if not self.request_id:
            self.request_id = self.seq_id
        self._num_prompt_tokens = len(self.prompt_ids)
        # where it ends unless it stops early: the KV accounting's "final length" (fixed at creation)
        self.final_len = min(self._num_prompt_tokens + self.params.max_tokens, self.max_seq_len)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
