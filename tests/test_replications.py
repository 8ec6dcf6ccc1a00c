"""Replications (issue 48): independent realizations of a rate's stream, pooled per rate where a bracket is read
(the knee's interval, from every stream: tests/test_kneefit.py)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.analysis.knee import Judged, pooled
from workloads.spec import load_spec
from workloads.streams import Streams, key_of, replication_of


def point(rate: float, met: list[int] | np.ndarray, replication: int = 0) -> Judged:
    met = np.asarray(met, dtype=float)
    return Judged(rate, key_of(rate, replication), met, np.arange(len(met)))


def test_a_replication_is_a_stream_of_its_own_that_names_its_replication():
    streams = Streams(load_spec("mixed-churn"), 0)
    first, again = key_of(2.0), key_of(2.0, 1)
    assert first == "g16" and again == "g16r1" and replication_of(again) == 1 and replication_of(first) == 0
    ids = {streams.item(first, i).request_id for i in range(20)}
    assert not ids & {streams.item(again, i).request_id for i in range(20)}  # no request judged twice
    prompts = [[streams.item(key, i).prompt_ids for i in range(5)] for key in (first, again)]
    assert prompts[0] != prompts[1]


def test_a_rates_replications_are_pooled_into_one_verdict_and_counted():
    pts = [point(2.0, [1, 1, 0, 0]), point(2.0, [1, 1, 1, 1], 1), point(1.5, [1, 1, 1, 1]),
           point(1.5, [1, 1, 1, 1], 1), point(1.5, [1, 1, 1, 1], 2)]
    rows = pooled(pts)
    assert [p.offered_rps for p in rows] == [1.5, 2.0]
    assert rows[1].attainment == pytest.approx(6 / 8) and len(rows[0].met) == 12
