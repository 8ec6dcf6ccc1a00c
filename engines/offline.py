"""Offline generation through any engine: add every request, step until done, collect per sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.engine import Engine, Request, TokenEvent
from engines.sequence import SamplingParams


@dataclass
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    sample: int
    finish_reason: str


def generate(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int = 1,
    after_step: Callable[[], None] = lambda: None,
) -> list[list[Output]]:
    """One list of n outputs per prompt, in prompt order."""
    tokens: dict[tuple[int, int], list[int]] = {}
    reasons: dict[tuple[int, int], str] = {}

    def collect(ev: TokenEvent) -> None:
        key = (int(ev.seq.request_id), ev.seq.sample_index)
        if ev.token_id is not None:
            tokens.setdefault(key, []).append(ev.token_id)
        if ev.finished:
            reasons[key] = ev.seq.finish_reason.value

    engine.sink = collect
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(str(i), prompt, params, n))
    while engine.has_work():
        engine.step()
        after_step()
    return [
        [Output(prompt, tokens.get((i, s), []), s, reasons.get((i, s), "")) for s in range(n)]
        for i, prompt in enumerate(prompts)
    ]
