"""Steady-state measurement: request streams per rate, the load generator's live schedule, the warm-up and
stationarity rules, the design's rules, the dependence-aware intervals and the headline."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from harness.analysis.design import Design, share_s
from harness.analysis.knee import Judged, KneeSearch, design_effect
from harness.analysis.steady import fewest_to_pass, halves, knee_use, warmup_s, wilson
from tests.conftest import run_cli
from workloads.schedule import ScheduleReader, ScheduleWriter
from workloads.spec import load_spec
from workloads.streams import TRACE_SLICES, Segment, Streams, grid_rate, key_of, snap


# -- streams
def test_one_rate_one_stream_shared_by_every_engine_and_other_rates_other_requests():
    a, b = Streams(load_spec("mixed-churn"), 0), Streams(load_spec("mixed-churn"), 0)
    seg = Segment(0, key_of(2.0), 2.0, 10.0, 0, 40.0)
    first, again = a.sent(seg), b.sent(seg)
    assert [r.prompt_ids for r in first] == [r.prompt_ids for r in again] and len(first) > 20
    other = a.sent(Segment(1, key_of(2.5), 2.5, 10.0, 0, 40.0))
    assert not {r.request_id for r in first} & {r.request_id for r in other}
    assert [len(r.prompt_ids) for r in first[:10]] != [len(r.prompt_ids) for r in other[:10]]


def test_a_segment_keeps_the_streams_gaps_rescaled_and_a_continuation_goes_on_from_its_cursor():
    s = Streams(load_spec("mixed-churn"), 0)
    slow, fast = s.sent(Segment(0, "g0", 1.0, 0.0, 0, 60.0)), s.sent(Segment(0, "g0", 2.0, 0.0, 0, 30.0))
    assert [r.request_id for r in fast] == [r.request_id for r in slow[: len(fast)]]
    assert fast[5].arrival_s == pytest.approx(slow[5].arrival_s / 2, abs=1e-5)
    assert 40 <= len(slow) <= 80  # about the rate times the window (a bursty gamma process)
    more = s.sent(Segment(0, "g0", 1.0, 60.0, len(slow), 90.0))
    assert more[0].request_id == s.item("g0", len(slow)).request_id and more[0].arrival_s == 60.0


def test_rates_live_on_a_grid_that_bisects_to_one_step():
    assert snap(1.0) == 1.0 and snap(2.03) == grid_rate(16) == 2.0
    search = KneeSearch(1.0, 0.9, tolerance=0.0, max_points=30)
    while (rate := search.next_rate()) is not None:
        search.record(rate, 1.0 if rate < 2.7 else 0.5)
    lo, hi = search.bracket()
    assert lo < 2.7 <= hi and round(16 * np.log2(hi / lo)) == 1


def test_a_trace_stream_reads_on_from_its_own_slice_and_ids_name_the_row():
    s = Streams(load_spec("azure-conv"), 0)
    rows = len(__import__("workloads.generate", fromlist=["x"]).trace_rows(load_spec("azure-conv")))
    a, b = s.item("g3", 0), s.item("g4", 0)
    assert a.request_id == f"t{3 * rows // TRACE_SLICES:06d}.0" and b.request_id == f"t{4 * rows // TRACE_SLICES:06d}.0"
    assert s.item("g3", 1).request_id == f"t{3 * rows // TRACE_SLICES + 1:06d}.0"


# -- the schedule
def test_the_load_generators_schedule_is_read_as_it_is_written(tmp_path):
    clock = {"t": 0.0}

    def sleep(dt):
        clock["t"] += max(dt, 0.01)

    streams = Streams(load_spec("mixed-churn"), 0)
    writer = ScheduleWriter(tmp_path / "s.jsonl")
    writer.start(Segment(0, "g0", 1.0, 1.0, 0, 11.0))
    reader = ScheduleReader(tmp_path / "s.jsonl", streams, sleep, poll_s=0.05)
    got = []
    for req, seg, index in reader.dispatch(lambda: clock["t"]):
        assert clock["t"] >= req.arrival_s - 1e-9  # never early
        got.append((req.request_id, seg.point, index, req.arrival_s))
        if len(got) == 3:
            writer.end_at(21.0)  # the point goes on: its end moves before it passes
            writer.start(Segment(1, "g8", 2.0, 22.0, 0, 27.0))  # and the next is written behind it
            writer.stop()
    points = [p for _, p, _, _ in got]
    assert points == sorted(points) and set(points) == {0, 1}
    first = [g for g in got if g[1] == 0]
    assert first[-1][3] < 21.0 and len(first) == len(streams.sent(Segment(0, "g0", 1.0, 1.0, 0, 21.0)))
    assert [i for _, p, i, _ in got if p == 0] == list(range(len(first)))


# -- warm-up, stationarity, binomial rules
def test_the_fewest_judged_requests_that_can_pass_a_90_percent_target():
    assert fewest_to_pass(0.9) == 25
    assert wilson(25, 25)[0] > 0.9 > wilson(24, 24)[0]


def test_the_warm_up_is_one_p90_latency_and_at_least_a_second():
    assert warmup_s([0.5] * 9 + [10.0]) == pytest.approx(np.percentile([0.5] * 9 + [10.0], 90))
    assert warmup_s([0.1, 0.2]) == 1.0 and warmup_s([]) == 1.0


def test_a_point_is_judged_on_its_attainment_against_the_target_not_on_its_queue():
    """Issue 48's cases, by the rule: halves on one side of the 90 % target count whatever the queue did; a
    collapse under the target while the queue grew is a miss; two sides with disjoint intervals and a flat queue
    are unsteady."""
    rng = np.random.default_rng(0)
    queue = rng.normal(5, 1, 400)
    calm = (rng.random(200) < 0.95).astype(float)
    assert knee_use(halves(calm, queue[:200], queue[200:]), 0.9) == "steady"
    # run A's paged at 3.67 req/s: 92.9 % then 100 % met (both pass), the running count moving with preemption
    both_pass = np.concatenate([(np.arange(85) % 14 != 0).astype(float), np.ones(86)])
    moved = halves(both_pass, queue[:200], queue[200:] + 6)
    assert knee_use(moved, 0.9) == "steady"
    # run B's paged at 4.36 req/s: 29 % then 26 % met (both miss): a miss, counted
    both_miss = np.concatenate([(np.arange(100) % 100 < 29).astype(float), (np.arange(100) % 100 < 26).astype(float)])
    assert knee_use(halves(both_miss, queue[:200], queue[200:] - 3), 0.9) == "steady"
    # run A's paged at 4.56 req/s: 77 % then 35 % met while the queue grew: over its knee (a miss)
    collapsing = np.concatenate([(np.arange(100) % 100 < 77).astype(float), (np.arange(100) % 100 < 35).astype(float)])
    assert knee_use(halves(collapsing, queue[:200], queue[200:] + 6), 0.9) == "over_knee"
    # the same collapse with a queue that did not grow, halves on two sides of the target: unsteady
    two_sides = np.concatenate([np.ones(100), (np.arange(100) % 100 < 40).astype(float)])
    flat = halves(two_sides, queue[:200], queue[200:] - 1)
    assert not flat.agree and knee_use(flat, 0.9) == "unsteady"


# -- the design
def test_the_design_derives_its_numbers_from_the_precision_and_the_time():
    d = Design.of(900, 1.5, 0.9)
    assert d.min_judged == 25 and d.max_judged == 25 and d.tolerance is None and d.screen_judged == 25
    assert len(d.rules()) == 6 and "25" in d.rules()[0] and "brackets its knee and stops" in d.rules()[2]
    assert "1 x the fewest" in d.rules()[0]
    asked = Design.of(900, 1.5, 0.9, point_requests=40)
    assert asked.min_judged == 40 and asked.screen_judged == 40 and "(--point-requests)" in asked.rules()[0]
    assert "1 x" not in asked.rules()[1]
    assert "1.150" in Design.of(900, 1.5, 0.9, tolerance=0.15).rules()[2]
    assert share_s(600, 2, 20) == pytest.approx((600 - 20) / (2 + 2))  # two engines and two decision shares
    assert share_s(600, 1, 20, decision=False) == 600


# -- intervals
def correlated(n: int, p: float, run: int, rng) -> np.ndarray:
    """Verdicts that come in runs of `run` alike: n / run independent draws."""
    return np.repeat((rng.random(n // run + 1) < p).astype(float), run)[:n]


def test_the_design_effect_sees_runs_of_shared_fate_and_not_independent_draws():
    rng = np.random.default_rng(1)
    iid = [Judged(1.0, "a", (rng.random(300) < 0.8).astype(float), np.arange(300))]
    runs = [Judged(1.0, "a", correlated(300, 0.8, 10, rng), np.arange(300))]
    assert design_effect(iid) < 1.5 and design_effect(runs) > 4


def judged(rate, att, n, key=None, run=1, rng=None):
    rng = rng or np.random.default_rng(int(rate * 1000))
    met = correlated(n, att, run, rng) if run > 1 else (np.arange(n) < round(att * n)).astype(float)
    rng.shuffle(met) if run == 1 else None
    return Judged(rate, key or key_of(rate), met, np.arange(n))


# -- the CLI's contract
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_bench_time_must_be_a_positive_number_of_seconds(value, tiny_model, tmp_path):
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--sweep", "--time", value,
                "--out", str(tmp_path))
    assert r.returncode == 2 and "--time" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_precision_must_be_above_one(tiny_model, tmp_path):
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--sweep", "--precision", "1",
                "--out", str(tmp_path))
    assert r.returncode == 2 and "--precision" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_dead_schedule_writer_leaves_the_reader_waiting_only_for_lines(tmp_path):
    """The reader polls a file: a schedule whose stop line comes later is read to its end once it does."""
    streams = Streams(load_spec("mixed-churn"), 0)
    path = tmp_path / "s.jsonl"
    writer = ScheduleWriter(path)
    writer.start(Segment(0, "g0", 5.0, 0.0, 0, 0.5))
    t0 = time.time()
    threading.Timer(0.3, writer.stop).start()
    reader = ScheduleReader(path, streams, time.sleep, poll_s=0.02)
    sent = list(reader.dispatch(lambda: time.time() - t0))
    assert reader.stopped and all(seg.point == 0 for _, seg, _ in sent)
    assert json.loads(path.read_text().splitlines()[-1]) == {"stop": True}


def test_the_warm_up_waits_for_the_load_a_point_inherits_even_while_it_is_still_running():
    """Nine in ten of what the earlier points left in the engine must end before a warm-up can; requests
    still running are infinities, and two of them at the quantile once made it NaN (and no wait at all)."""
    from harness.run.points import carried_until

    assert carried_until([], 10.0, 30.0) == 10.0
    assert carried_until([5.0, 8.0], 10.0, 30.0) == 10.0  # all ended before the point began
    assert carried_until([12.0] * 9 + [None], 10.0, 30.0) == 12.0
    assert carried_until([12.0] * 7 + [None] * 3, 10.0, 30.0) == 30.0  # still serving it: until now
    with np.errstate(all="raise"):
        assert carried_until([11.0, None, None], 10.0, 25.0) == 25.0
