"""The A/B gate's instruction-count figure (issue 78): callgrind's dumps read, BASE's reading against NEW's, and the
probe run whole on the tiny model under valgrind (marked `valgrind`: minutes of CPU; skipped without valgrind)."""

from __future__ import annotations

import math
import os
import shutil
import sys

import pytest

from harness.analysis.ab_instr import (
    InstrReading,
    ShapeInstructions,
    callgrind_instructions,
    instr_ratio,
    shape_ratios,
)
from harness.run.ab_instr_probes import InstrProbeError, dumped_counts, instructions, last_words
from tests.conftest import ROOT

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  python -c import runpy
part: 3

desc: I1 cache:
positions: line
events: Ir
summary: 123456789


totals: 123456789
"""


def reading(*counts: int, engine_args: tuple[str, ...] = ()) -> InstrReading:
    shapes = tuple(ShapeInstructions(f"s{i}", 1, 32, 0, 5, n) for i, n in enumerate(counts))
    return InstrReading("paged", engine_args, shapes, "2.x")


def test_a_dump_s_instructions_are_its_summary_or_totals_line():
    assert callgrind_instructions(DUMP) == 123456789
    assert callgrind_instructions("events: Ir\ntotals: 77\n") == 77
    with pytest.raises(ValueError, match="not a callgrind dump"):
        callgrind_instructions("events: Ir\n")


def test_the_ratio_is_the_geometric_mean_of_the_shapes_ratios():
    base, new = reading(100, 1000), reading(120, 1200)
    assert shape_ratios(base, new) == {"s0": 1.2, "s1": 1.2} and instr_ratio(base, new) == pytest.approx(1.2)
    assert instr_ratio(reading(100, 100), reading(200, 50)) == pytest.approx(1.0)
    assert reading(100, 1000).instructions == 1100
    assert reading(100).json()["shapes"][0]["instructions_per_step"] == 20
    with pytest.raises(ValueError, match="different shapes"):
        instr_ratio(reading(1, 2), reading(1))


def test_each_shape_is_read_from_its_own_dump_in_order(tmp_path):
    out = tmp_path / "callgrind.out"
    for i, n in enumerate((5, 7, 11), start=1):
        out.with_name(f"callgrind.out.{i}").write_text(f"events: Ir\nsummary: {n}\n")
    assert dumped_counts(out, 3) == [5, 7, 11]
    with pytest.raises(InstrProbeError, match="dumped 3 of 4 shapes"):
        dumped_counts(out, 4)


def test_a_child_s_last_words_are_its_own_and_valgrind_s_signal_not_a_progress_bar():
    stderr = ("==7== Callgrind\nLoading weights:   0%|  | 0/39\rLoading weights: 100%| 39/39\n"
              "==7== Process terminating with default action of signal 11 (SIGSEGV)\n==7==    at 0x1: f\n")
    assert last_words(stderr, -11) == "Process terminating with default action of signal 11 (SIGSEGV)"
    assert last_words("Traceback...\nAssertionError: boom\n", 1) == "AssertionError: boom"
    assert last_words("", 3) == "exit 3"


def test_a_flag_the_probe_does_not_know_is_could_not_run_not_a_crash(tiny_model):
    """A bad engine arg stops the child at its set-up (exit 2): no valgrind needed to see it refused."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    with pytest.raises(InstrProbeError) as err:
        instructions(ROOT, sys.executable, "paged", ["--no-such-flag"], str(tiny_model), 1200)
    assert not err.value.crashed and "--no-such-flag" in str(err.value)


@pytest.mark.valgrind
@pytest.mark.timeout(3600)
def test_a_burn_of_1_2_reads_plus_20_percent_and_a_repeat_reads_the_same(tiny_model):
    """The tiny model's paged engine twice plain and once with --burn-step 1.2: the two plain readings agree within
    0.5 % at every shape, and the burn reads 1.2x (+- 1 %) against them. Counted instructions, not time."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    if os.environ.get("FRAGBENCH_VALGRIND_TESTS") != "1":  # three probes: about 27 CPU minutes, past the suite's 10
        pytest.skip("three callgrind probes take about 27 CPU minutes: FRAGBENCH_VALGRIND_TESTS=1 runs them")
    plain = instructions(ROOT, sys.executable, "paged", [], str(tiny_model), 1800)
    again = instructions(ROOT, sys.executable, "paged", [], str(tiny_model), 1800)
    burn = instructions(ROOT, sys.executable, "paged", ["--burn-step", "1.2"], str(tiny_model), 1800)
    assert all(math.isclose(r, 1, abs_tol=0.005) for r in shape_ratios(plain, again).values()), \
        (plain.json(), again.json())
    assert 1.19 <= instr_ratio(plain, burn) <= 1.21, (plain.json(), burn.json())
