"""Does batching pay off? Output and decode tokens/s of each engine, uniform and mixed-length batches,
each beside a roofline measured on this machine.

Run by hand:  .venv/bin/python benchmarks/engine_throughput.py --model models/tiny-llama [--threads 1]

Rows:
- `batch B` (128 prompt / 128 output tokens): output tokens/s, prefill included.
- decode-only (time for 48 output tokens minus time for 1, so prefill cancels out): `16x128`,
  `1x1500+15x128` (one long retrieval prompt among chats), `32x128`, and `mixed-churn` (16 prompts drawn
  from that workload's length mix); `mixed/uniform` is the second over the first.
- `logprobs`: 32x128 decode tokens/s with `logprobs: N` (each token's logprob and N alternatives, the
  batched log-softmax of the step's fp32 logits) beside the same run without, in the same process.
- `roofline`: the share of the bound a decode step cannot beat: every step reads the weights and the live
  KV once, at the copy bandwidth torch reaches on this machine (measured here, printed).

Every in-house engine runs in this process with the same torch thread count, and the engines take turns:
each row's engines are built together, then timed in `--rounds` rounds, the order reversed each round, and
each keeps its best (a slow spell of a shared machine hits every engine of a row, not one engine's whole
series, as timing each engine's rows in a block did: paged / static-oracle read 0.74 to 2.01 that way).
`NAME/FIRST` rows give each engine over the first. `--clock cpu` times the in-house engines in this
process's CPU time instead of the wall clock's: with 1 thread, their compute, which a machine shared with
other work inflates far less (on the project's 2 busy cores one engine's wall-clock rows moved 2x between
rounds). vLLM (when .venv-vllm exists) runs its own server process, pinned to the same number of cores,
timed over HTTP on the wall clock.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.sequence import SamplingParams
from harness.cli.args import positive_int

PROMPT_TOKENS = OUTPUT_TOKENS = 128
DECODE_TOKENS = 48
MAX_SEQ_LEN = 2048


def prompt(length: int, salt: int) -> list[int]:
    return [(17 * salt + 31 * i) % 4000 + 3 for i in range(length)]


def shapes() -> dict[str, list[int]]:
    from workloads.generate import trace
    from workloads.spec import load_spec

    churn = [len(r.prompt_ids) for r in trace(load_spec("mixed-churn"), seed=0, max_seq_len=MAX_SEQ_LEN).requests]
    return {"16x128": [128] * 16, "1x1500+15x128": [1500] + [128] * 15, "32x128": [128] * 32,
            "mixed-churn": [min(n, MAX_SEQ_LEN - DECODE_TOKENS) for n in churn[:16]]}


def make(engine_name: str, model: str, batch: int):
    return make_engine(EngineSpec(engine_name, model, 512 * 2**20, max_seq_len=MAX_SEQ_LEN, max_batch=batch,
                                  max_num_seqs=batch, max_num_batched_tokens=32768, prefix_caching=False))


# what a run's seconds are: the wall clock's, or this process's CPU time (--clock cpu)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def timed(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> tuple[float, int]:
    start = clock()
    outs = generate(engine, prompts, SamplingParams(max_tokens, ignore_eos=True, logprobs=logprobs))
    return clock() - start, sum(len(o[0].token_ids) for o in outs)


def in_turn(names: list[str], rounds: int, run) -> dict[str, list]:
    """run(name) for each engine, `rounds` times, the order reversed each round: each engine's results."""
    out: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(run(name))
    return out


def output_tokens_per_s(names: list[str], model: str, batch: int, rounds: int) -> dict[str, float]:
    """Each engine's best output tokens/s of `batch` prompts, the engines timed in turn."""
    engines = {name: make(name, model, batch) for name in names}
    for engine in engines.values():
        timed(engine, [prompt(PROMPT_TOKENS, 0)], 4)  # warm-up
    prompts = [prompt(PROMPT_TOKENS, b) for b in range(batch)]
    runs = in_turn(names, rounds, lambda name: timed(engines[name], prompts, OUTPUT_TOKENS))
    for engine in engines.values():
        getattr(engine, "close", lambda: None)()
    return {name: max(tokens / elapsed for elapsed, tokens in r) for name, r in runs.items()}


def decode_rate(batch: int, one_s: float, many_s: float) -> float:
    """Decode tokens/s from a 1-token and a DECODE_TOKENS-token run of the same batch: the prefill cancels out
    only if both runs paid for it. A prefix cache that served the second run's prompts from the first makes
    the difference non-positive: that is a broken measurement, not an infinitely fast engine."""
    if many_s <= one_s:
        raise RuntimeError(f"{DECODE_TOKENS} tokens took {many_s:.3f} s, 1 token {one_s:.3f} s: the runs did not pay "
                           "for the same prefill (a prefix cache hit?)")
    return batch * (DECODE_TOKENS - 1) / (many_s - one_s)


def decode_tokens_per_s(names: list[str], model: str, lengths: list[int], rounds: int,
                        logprobs: int | None = None) -> dict[str, float]:
    """Each engine's decode tokens/s from its fastest 1-token and DECODE_TOKENS-token runs, the engines timed
    in turn (a round: each engine's two runs, back to back)."""
    engines = {name: make(name, model, len(lengths)) for name in names}  # prefix caching off: every run prefills
    prompts = [prompt(n, b) for b, n in enumerate(lengths)]
    for engine in engines.values():
        timed(engine, prompts[:1], 2, logprobs)  # warm-up
    runs = in_turn(names, rounds, lambda name: (timed(engines[name], prompts, 1, logprobs)[0],
                                                timed(engines[name], prompts, DECODE_TOKENS, logprobs)[0]))
    for engine in engines.values():
        getattr(engine, "close", lambda: None)()
    return {name: decode_rate(len(lengths), min(one for one, _ in r), min(many for _, many in r))
            for name, r in runs.items()}


def logprobs_rows(engines: list[str], model: str, n: int) -> None:
    """Decode tokens/s of 32x128 with and without logprobs, alternated so a slow spell of the VM hits both."""
    print(f"\ndecode tokens/s of 32x128 with logprobs: {n} beside without (best of 3 alternated runs):")
    print(f"{'engine':<8}{'without':>12}{'with':>12}{'with/without':>15}")
    for name in engines:
        without, with_ = [], []
        for _ in range(3):
            without.append(decode_tokens_per_s([name], model, [128] * 32, 2)[name])
            with_.append(decode_tokens_per_s([name], model, [128] * 32, 2, logprobs=n)[name])
        print(f"{name:<8}{max(without):>12.0f}{max(with_):>12.0f}{max(with_) / max(without):>15.2f}", flush=True)


def copy_bandwidth() -> float:
    """Bytes per second torch moves in a large copy (read + write), best of five."""
    src = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = min(_time(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def roofline_tokens_per_s(model: str, lengths: list[int], bandwidth: float) -> float:
    """A decode step reads the weights and every live token's KV once: B tokens per that many bytes."""
    import json
    from pathlib import Path

    from engines.shapes import ModelShape

    cfg = json.loads((Path(model) / "config.json").read_text())
    shape = ModelShape.from_config(Path(model).name, cfg)
    dtype = cfg.get("dtype", "float32")
    live = sum(lengths) + len(lengths) * DECODE_TOKENS / 2  # the mean over the decode steps
    step_bytes = shape.weights_bytes(dtype) + shape.kv_bytes_per_token(dtype) * live
    return len(lengths) * bandwidth / step_bytes


def vllm_rows(model: str, batches: list[int], decode: dict[str, list[int]], threads: int) -> tuple[list, list]:
    """vLLM through its own server, on `threads` cores (the same as ours): B concurrent requests."""
    import asyncio
    import tempfile
    from pathlib import Path

    import aiohttp

    from harness.run.servers import start_server

    async def run(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        async with aiohttp.ClientSession() as s:
            async def req(p: list[int]) -> int:
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    return (await r.json())["usage"]["completion_tokens"]
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(req(p) for p in prompts)))
            return time.perf_counter() - start, tokens

    log = Path(tempfile.mkdtemp()) / "vllm.log"
    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cores)  # the server inherits the same cores
    with start_server("vllm", model, "512MiB", log, extra=["--max-seq-len", str(MAX_SEQ_LEN)], timeout_s=900) as srv:
        asyncio.run(run(srv.url, [prompt(8, 0)], 2))  # warm-up
        out = []
        for b in batches:
            elapsed, tokens = asyncio.run(run(srv.url, [prompt(PROMPT_TOKENS, i) for i in range(b)], OUTPUT_TOKENS))
            out.append(tokens / elapsed)
        dec = []
        salts = iter(range(1000, 10**6, len(max(decode.values(), key=len))))
        for lengths in decode.values():
            # vLLM keeps its prefix cache on: prompts it has seen would be served from it, so every timed run
            # gets prompts no earlier run sent, and pays for its prefill as our engines (caching off) do
            def fresh(max_tokens: int, lengths: list[int] = lengths) -> float:
                salt = next(salts)
                prompts = [prompt(n, salt + b) for b, n in enumerate(lengths)]
                return asyncio.run(run(srv.url, prompts, max_tokens))[0]

            one = min(fresh(1) for _ in range(2))
            many = min(fresh(DECODE_TOKENS) for _ in range(2))
            dec.append(decode_rate(len(lengths), one, many))
        return out, dec


def print_ratios(rows: dict[str, list[float]], first: str | None, width: int) -> None:
    """Each engine's row over the first engine's, cell by cell, on a line of its own named NAME/FIRST."""
    for name, values in rows.items():
        if name != first and len(values) == len(rows[first]):
            print(f"{name}/{first}:")
            print(f"{'':<14}" + "".join(f"{v / f:>{width}.2f}" for v, f in zip(values, rows[first], strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny-llama", help="model directory (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads and vLLM's cores (default: %(default)s)")
    ap.add_argument("--engines", default="hf,static,paged,vllm", help="engines to time (default: %(default)s)")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of the output rows (default: %(default)s)")
    ap.add_argument("--logprobs", type=int, default=5,
                    help="alternatives per token of the logprobs rows; 0 skips them (default: %(default)s)")
    ap.add_argument("--only-logprobs", action="store_true", help="print the logprobs rows alone (default: off)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds in which the in-house engines of a row take turns; each keeps its best "
                         "(default: %(default)s)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="the in-house engines' seconds: wall, or cpu (this process's CPU time: with 1 thread the "
                         "engine's compute, which other work on a shared machine inflates far less; vLLM's are "
                         "always wall) (default: %(default)s)")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    names = args.engines.split(",")
    in_house = [e for e in names if e != "vllm"]
    if args.only_logprobs:
        logprobs_rows(in_house, args.model, args.logprobs)
        return
    batches = [int(b) for b in args.batches.split(",")]
    decode = shapes()
    bandwidth = copy_bandwidth()
    roof = {name: roofline_tokens_per_s(args.model, lengths, bandwidth) for name, lengths in decode.items()}
    print(f"{args.threads} torch thread(s); copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write, measured); "
          f"in-house engines in turn, best of {args.rounds} rounds, {args.clock} clock")
    out_rows: dict[str, list[float]] = {name: [] for name in in_house}
    decode_rows: dict[str, list[float]] = {name: [] for name in in_house}
    if in_house:
        for b in batches:
            for name, v in output_tokens_per_s(in_house, args.model, b, args.rounds).items():
                out_rows[name].append(v)
        for lengths in decode.values():
            for name, v in decode_tokens_per_s(in_house, args.model, lengths, args.rounds).items():
                decode_rows[name].append(v)
    if "vllm" in names:
        from engines.peers.vllm import vllm_python

        if vllm_python() is None:
            print("vllm    not installed (make vllm)")
        else:
            out_rows["vllm"], decode_rows["vllm"] = vllm_rows(args.model, batches, decode, args.threads)
    first = names[0] if names[0] in out_rows else next(iter(out_rows), None)
    print(f"output tokens/s, {PROMPT_TOKENS} prompt / {OUTPUT_TOKENS} output tokens, prefill included:")
    print(f"{'engine':<14}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
    for name, row in out_rows.items():
        print(f"{name:<14}" + "".join(f"{v:>12.0f}" for v in row))
    print_ratios(out_rows, first, 12)
    print(f"\ndecode tokens/s ({DECODE_TOKENS} output tokens minus 1), and its share of the roofline:")
    print(f"{'engine':<14}" + "".join(f"{k:>22}" for k in decode) + f"{'mixed/uniform':>15}")
    print(f"{'roofline':<14}" + "".join(f"{v:>22.0f}" for v in roof.values()))
    for name, values in decode_rows.items():
        cells = "".join(f"{v:>14.0f} ({v / roof[k]:>4.0%})" for k, v in zip(decode, values, strict=True))
        print(f"{name:<14}{cells}{values[1] / values[0]:>15.2f}", flush=True)
    print_ratios(decode_rows, first, 22)
    if args.logprobs:
        logprobs_rows(in_house, args.model, args.logprobs)


if __name__ == "__main__":
    main()
