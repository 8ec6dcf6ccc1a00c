"""A cancel storm: many streaming requests at once, a share of them cut by the client at a random token.
Used by the reliability tests (short form) and `make stress` (long form)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import aiohttp


@dataclass
class StormResult:
    sent: int = 0
    cancelled: int = 0
    completed: int = 0
    status_5xx: int = 0
    oom: int = 0  # ended by the engine for want of memory
    errors: list[str] = field(default_factory=list)


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, cut_at: int | None,
               result: StormResult) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    result.sent += 1
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status >= 500:
                result.status_5xx += 1
                return
            tokens, reason = 0, None
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += len(choice["token_ids"])
                    reason = choice["finish_reason"] or reason
                if cut_at is not None and tokens >= cut_at:
                    resp.close()
                    result.cancelled += 1
                    return
            if reason == "oom":
                result.oom += 1
            else:
                result.completed += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.errors.append(f"{type(e).__name__}: {e}")


async def cancel_storm(url: str, requests: int, concurrency: int = 64, cancel_share: float = 0.5,
                       seed: int = 0, max_tokens: int = 24) -> StormResult:
    rng = random.Random(seed)
    result = StormResult()
    gate = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randrange(4, 64))]
        cut = rng.randrange(1, max_tokens) if rng.random() < cancel_share else None
        async with gate:
            await _one(session, url, prompt, max_tokens, cut, result)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(guarded(i) for i in range(requests)))
    return result
