"""What recording every step costs an engine: the same batch generated with and without `--step-log`'s
recorder, alternately, in one process.

Run by hand:  .venv/bin/python benchmarks/step_recording.py --model models/tiny-llama [--rounds 8]

Each round times one offline batch (16 prompts of the mixed-churn length mix, 64 output tokens each) on a
fresh paged engine twice, recorder on and off in alternating order. It prints the median time per step of
each, and the median of the rounds' paired differences with a 90 % bootstrap interval over the rounds: a
difference whose interval holds 0 is no measurable difference. A whole step is too noisy to resolve a few
microseconds, so it also times the recorder alone: 100,000 rows, the cost of one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.scheduled.steps import StepRecorder, StepRow
from engines.sequence import SamplingParams

OUTPUT_TOKENS = 64
MAX_SEQ_LEN = 2048


def prompts() -> list[list[int]]:
    from workloads.generate import trace
    from workloads.spec import load_spec

    reqs = trace(load_spec("mixed-churn"), seed=0, max_seq_len=MAX_SEQ_LEN).requests[:16]
    return [r.prompt_ids[: MAX_SEQ_LEN - OUTPUT_TOKENS] for r in reqs]


def per_step_s(model: str, record: Path | None) -> float:
    engine = make_engine(EngineSpec("paged", model, 256 * 2**20, max_seq_len=MAX_SEQ_LEN, max_num_seqs=16))
    if record is not None:
        engine.step_recorder = StepRecorder(record)
    started = time.perf_counter()
    generate(engine, prompts(), SamplingParams(OUTPUT_TOKENS))
    elapsed = time.perf_counter() - started
    engine.close()
    return elapsed / engine.steps


def recorder_row_s(path: Path, rows: int = 100_000) -> float:
    recorder = StepRecorder(path)
    row = StepRow(time.time(), 0.0123456, 12, 1, 300, 9000, 2, 13, 4)
    started = time.perf_counter()
    for _ in range(rows):
        recorder.record(row)
    recorder.close()
    return (time.perf_counter() - started) / rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    per_step_s(args.model, None)  # warm-up: the first forward allocates
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for recording in order:
                (on if recording else off).append(per_step_s(args.model, Path(tmp) / f"{i}.csv" if recording else None))
        alone = recorder_row_s(Path(tmp) / "alone.csv")
    on_a, off_a = np.array(on), np.array(off)
    diff = on_a - off_a
    rng = np.random.default_rng(0)
    boots = [np.median(rng.choice(diff, len(diff))) for _ in range(2000)]
    lo, hi = np.percentile(boots, [5, 95])
    print(f"per step, median of {args.rounds} rounds: recording {1e3 * np.median(on_a):.3f} ms, "
          f"not recording {1e3 * np.median(off_a):.3f} ms")
    print(f"recording - not recording: {1e6 * np.median(diff):+.1f} µs per step "
          f"[{1e6 * lo:+.1f}, {1e6 * hi:+.1f}] (90 % bootstrap over rounds), "
          f"{100 * np.median(diff) / np.median(off_a):+.2f} % of a step"
          + ("; the interval holds 0: no measurable difference" if lo <= 0 <= hi else ""))
    print(f"the recorder alone: {1e6 * alone:.2f} µs per row, {100 * alone / np.median(off_a):.3f} % of a step")


if __name__ == "__main__":
    main()
