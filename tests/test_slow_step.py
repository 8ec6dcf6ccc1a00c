"""`serve --slow-step F` (issue 48): fault injection for testing a regression gate. Every engine step takes F
times its wall time: an engine whose step is not fragbench's (hf, hf-cb) sleeps (F - 1) x the step's own time
after it, on the server's engine thread (here); a scheduled engine sleeps inside its step (tests/test_step_faults.py).
"""

from __future__ import annotations

import time

import pytest

from engines.api.server import EngineThread
from harness.cli.bench import engine_args
from tests.conftest import run_cli

STEP_S = 0.02


class Stepping:
    """An engine with work for `left` steps, each taking STEP_S (a sleep: its time is known from below)."""

    def __init__(self, left: int):
        self.left, self.steps, self.sink, self.poll, self.memory = left, 0, None, None, None

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        time.sleep(STEP_S)
        self.left -= 1
        self.steps += 1

    def stats(self):
        return {}


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_every_step_takes_f_times_its_own_time(factor):
    """Ten steps of at least 20 ms each: once the tenth has run, nine steps of at least 20 ms x F and the tenth's
    own 20 ms have passed (its slow-down follows it), since a sleep never wakes early (a lower bound, not a speed:
    the step's own time is the fake's sleep). Without the slow-down the bound at F = 3 (0.56 s) is out of reach
    of ten 20 ms steps."""
    engine, failed = Stepping(10), []
    thread = EngineThread(engine, lambda crash: None, failed.append, slow_step=factor)
    began = time.perf_counter()
    thread.start()
    while engine.left and not failed and time.perf_counter() - began < 30:
        time.sleep(0.005)
    elapsed = time.perf_counter() - began
    thread.stop()
    assert not failed and engine.steps == 10 and elapsed >= (9 * factor + 1) * STEP_S, failed


@pytest.mark.parametrize("flag", ["--slow-step", "--burn-step"])
@pytest.mark.parametrize("value", ["0.5", "nan", "inf", "x"])
def test_a_slow_step_under_one_or_not_finite_exits_2_in_one_line(flag, value, tiny_model):
    r = run_cli("serve", "--engine", "paged", "--model", str(tiny_model), "--kv-budget", "16MiB", flag, value)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr, r.stderr


def test_bench_passes_it_to_one_engine_through_engine_args():
    assert engine_args(["paged=--slow-step 1.5"], ["paged", "static-oracle"]) == {"paged": ["--slow-step", "1.5"]}
    assert engine_args(["paged=--burn-step 1.2"], ["paged", "static-oracle"]) == {"paged": ["--burn-step", "1.2"]}
