"""What a step costs each scheduled engine, on the bench's kind of steps but without the bench's machine: the
step model (fixed + per decode + per prefill + per token + per key read, `harness/sim/stepfit.py`, the fit
`make bench` makes) fitted on the CPU time of each engine's steps, in one process, one torch thread.

Run by hand:  .venv/bin/python benchmarks/step_cost.py --model models/tiny-llama [--engines static-oracle,paged]

Each engine replays the first `--requests` of mixed-churn under the same KV budget, arriving at `--rate` on a
clock that each step advances by the CPU time it took (what an engine at that rate would see, less its HTTP
serving). A step's duration is the CPU time of `engine.step()` on this thread, so a busy machine (a bench's
load generator and servers, other users) slows the steps less than it does a wall clock: a `make bench` fit
on 2 shared cores moves by tens of percent between runs. The rows differ between engines (paged holds more
sequences, and preempts), which is what the fit is for; `step_ms` prints each model's cost of the same three
steps.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import pandas as pd
import torch

from engines.engine import Request
from engines.factory import EngineSpec, make_engine
from engines.registry import Kind, names
from engines.scheduled.steps import StepRow
from engines.sequence import SamplingParams
from harness.cli.args import positive_int
from harness.sim.stepfit import fit
from workloads.generate import trace
from workloads.spec import load_spec

MAX_SEQ_LEN = 2048
# (decodes, context tokens) of the steps `step_ms` prices: a 16 MiB pool's few long sequences, a full batch of
# chats, and one retrieval prompt among chats
PRICED = ((6, 3600), (32, 32 * 176), (16, 1548 + 15 * 176))


class Rows:
    """A step recorder that keeps the rows (the engine calls record; close is its end of run)."""

    def __init__(self):
        self.rows: list[StepRow] = []

    def record(self, row: StepRow) -> None:
        self.rows.append(row)

    def close(self) -> None:
        pass


def replay(name: str, model: str, budget_bytes: int, rate: float, requests: int) -> tuple[pd.DataFrame, int]:
    """The steps of `name` over the trace, each with its CPU time; and the preemptions it made."""
    engine = make_engine(EngineSpec(name, model, budget_bytes, max_seq_len=MAX_SEQ_LEN))
    engine.step_recorder = rows = Rows()
    engine.sink = lambda event: None
    todo = trace(load_spec("mixed-churn"), seed=0, max_seq_len=MAX_SEQ_LEN).requests[:requests]
    t0, spacing = todo[0].arrival_s, load_spec("mixed-churn").arrival.rate / rate
    clock, i = 0.0, 0
    while i < len(todo) or engine.has_work():
        while i < len(todo) and (todo[i].arrival_s - t0) * spacing <= clock:
            r = todo[i]
            engine.add_request(Request(r.request_id, r.prompt_ids, SamplingParams(r.max_tokens, ignore_eos=True)))
            i += 1
        if not engine.has_work():
            clock = (todo[i].arrival_s - t0) * spacing  # idle until the next arrival
            continue
        recorded = len(rows.rows)
        start = time.thread_time()
        engine.step()
        took = time.thread_time() - start
        clock += took
        if len(rows.rows) > recorded:  # a step that computed something
            rows.rows[-1] = replace(rows.rows[-1], duration_s=took)
    engine.close()
    return pd.DataFrame([r.__dict__ for r in rows.rows]), engine.scheduler.preempted_total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny-llama", help="model directory (default: %(default)s)")
    ap.add_argument("--engines", default="static-oracle,paged", help="scheduled engines (default: %(default)s)")
    ap.add_argument("--kv-budget-mib", type=positive_int, default=16, help="KV budget, MiB (default: %(default)s)")
    ap.add_argument("--rate", type=float, default=3.0, help="offered requests/s (default: %(default)s)")
    ap.add_argument("--requests", type=positive_int, default=150,
                    help="mixed-churn requests replayed (default: %(default)s)")
    args = ap.parse_args()
    if not args.rate > 0:
        ap.error(f"--rate must be above 0, not {args.rate}")
    scheduled = names(Kind.SCHEDULED)
    if unknown := [e for e in args.engines.split(",") if e not in scheduled]:
        ap.error(f"--engines: {', '.join(unknown)} not a scheduled engine ({', '.join(scheduled)})")
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print(f"mixed-churn, {args.requests} requests at {args.rate:g} req/s, {args.kv_budget_mib} MiB of KV, "
          "1 torch thread; step = CPU time of engine.step()")
    print(f"{'engine':<14}{'steps':>7}{'preempt':>8}{'fixed':>9}{'/decode':>9}{'/prefill':>9}{'/token':>9}"
          f"{'/key read':>11}{'R2':>6}  step_ms at (decodes, keys) " + " ".join(map(str, PRICED)))
    for name in args.engines.split(","):
        steps, preempted = replay(name, args.model, args.kv_budget_mib * 2**20, args.rate, args.requests)
        m = fit(steps, name)
        c = m.coefficients
        priced = " ".join(f"{1e3 * m.step_s(d, 0, d, k, 0):.2f}" for d, k in PRICED)
        print(f"{name:<14}{len(steps):>7}{preempted:>8}{1e3 * c['fixed_s']:>7.2f}ms{1e3 * c['per_decode_s']:>7.3f}ms"
              f"{1e3 * c['per_prefill_s']:>7.3f}ms{1e3 * c['per_token_s']:>7.3f}ms"
              f"{1e6 * c['per_context_token_s']:>9.2f}µs{m.fit_r2:>6.2f}  {priced}", flush=True)


if __name__ == "__main__":
    main()
