"""The engine-independent speed probe bench takes at its start, middle and end (run.json's `speed_probe`; the rule
that reads it is harness/analysis/speed_probe.py): taken between engines, when no server of the run is up, so it
times the machine and not the run's own load."""

from __future__ import annotations

import time

import numpy as np

MATRIX = 256  # a float32 product of this side, COMPUTE_REPS times: ~10 ms of BLAS on this 2-core machine
COMPUTE_REPS = 20
LOOP = 200_000  # a pure-Python accumulation loop: ~15 ms of one core's interpreter
REPEATS = 7  # each probe this many times a moment; the analysis takes their median
DESCRIBED = {"compute": f"{COMPUTE_REPS} float32 {MATRIX}x{MATRIX} matrix products (numpy)",
             "interpreter": f"a {LOOP:,}-step pure-Python loop"}


def compute_once(a: np.ndarray) -> float:
    began = time.perf_counter()
    for _ in range(COMPUTE_REPS):
        a = a @ a
        a /= np.abs(a).max() or 1.0  # keep the values finite: every product does the same work
    return time.perf_counter() - began


def interpreter_once() -> float:
    began = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i * i % 7
    return time.perf_counter() - began


def reading(at: str) -> dict:
    """One moment's probe (run.json's `speed_probe.readings[i]`)."""
    a = np.random.default_rng(0).standard_normal((MATRIX, MATRIX)).astype(np.float32)
    compute_once(a.copy())  # not kept: BLAS starts its threads on the first product (10-20x a warm one)
    return {"at": at, "compute_s": [round(compute_once(a.copy()), 6) for _ in range(REPEATS)],
            "interpreter_s": [round(interpreter_once(), 6) for _ in range(REPEATS)]}
