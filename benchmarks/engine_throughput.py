"""Output tokens/s of each engine at batch 1, 8 and 32 (128 prompt / 128 output tokens, tiny model).

Run by hand:  .venv/bin/python benchmarks/engine_throughput.py --model models/tiny-llama [--threads 1]
Every engine runs in this process with the same torch thread count; vLLM (when .venv-vllm exists)
runs its own server process through `fragbench serve --engine vllm`, timed over HTTP.
"""

from __future__ import annotations

import argparse
import time

import torch

from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.sequence import SamplingParams

PROMPT_TOKENS = OUTPUT_TOKENS = 128


def tokens_per_s(engine_name: str, model: str, batch: int) -> float:
    engine = make_engine(EngineSpec(engine_name, model, 512 * 2**20, max_seq_len=512, max_batch=batch,
                                    max_num_seqs=batch, prefix_caching=False))
    prompts = [[(17 * b + 31 * i) % 4000 + 3 for i in range(PROMPT_TOKENS)] for b in range(batch)]
    params = SamplingParams(OUTPUT_TOKENS, ignore_eos=True)
    generate(engine, prompts[:1], SamplingParams(4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = generate(engine, prompts, params)
    elapsed = time.perf_counter() - start
    getattr(engine, "close", lambda: None)()
    return sum(len(o[0].token_ids) for o in outs) / elapsed


def vllm_tokens_per_s(model: str, batches: list[int]) -> list[float]:
    """vLLM through its own server (one process, its own thread settings): B concurrent requests."""
    import asyncio
    import tempfile
    from pathlib import Path

    import aiohttp

    from harness.servers import start_server

    async def one_batch(url: str, batch: int) -> float:
        async with aiohttp.ClientSession() as s:
            async def req(b: int) -> int:
                body = {"prompt": [(17 * b + 31 * i) % 4000 + 3 for i in range(PROMPT_TOKENS)],
                        "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    return (await r.json())["usage"]["completion_tokens"]
            await req(0)  # warm-up
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(req(b) for b in range(batch))))
            return tokens / (time.perf_counter() - start)

    log = Path(tempfile.mkdtemp()) / "vllm.log"
    with start_server("vllm", model, "512MiB", log, extra=["--max-seq-len", "512"], timeout_s=900) as srv:
        return [asyncio.run(one_batch(srv.url, b)) for b in batches]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", default="hf,hf-cb,static,paged,vllm")
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"output tokens/s, {PROMPT_TOKENS} prompt / {OUTPUT_TOKENS} output tokens, {args.threads} thread(s)")
    print(f"{'engine':<8}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
    for name in args.engines.split(","):
        if name == "vllm":
            from engines.vllm_peer import vllm_python

            if vllm_python() is None:
                print("vllm    not installed (make vllm)")
                continue
            row = vllm_tokens_per_s(args.model, batches)
        else:
            row = [tokens_per_s(name, args.model, b) for b in batches]
        print(f"{name:<8}" + "".join(f"{v:>12.0f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
