from __future__ import annotations

from engines.sequence import SamplingParams, Sequence


def seq(seq_id: str, prompt_len: int, max_tokens: int, max_seq_len: int = 2048, first_token: int = 10) -> Sequence:
    return Sequence(seq_id, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens), max_seq_len)
