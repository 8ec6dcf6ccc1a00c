"""Paired streams (issue 71): the decision's n-th turn of each headline engine reads one request sequence of no
rate, `p<n>`, each engine at its own offered rate, so that the two engines judge the same requests."""

from __future__ import annotations

import pytest

from workloads.generate import trace_rows
from workloads.spec import load_spec
from workloads.streams import (
    PAIRED_STRIDE,
    TRACE_SLICES,
    Segment,
    Streams,
    _first_row,
    key_of,
    paired_key,
    paired_turn,
    replication_of,
)


def test_a_paired_stream_is_one_request_sequence_at_whatever_rate_each_engine_is_offered():
    s = Streams(load_spec("mixed-churn"), 0)
    paged = s.sent(Segment(0, paired_key(3), 3.6, 0.0, 0, 20.0))
    rival = s.sent(Segment(0, paired_key(3), 2.4, 0.0, 0, 30.0))
    n = min(len(paged), len(rival))
    assert n > 20
    assert [(r.request_id, r.prompt_ids, r.max_tokens) for r in paged[:n]] == \
        [(r.request_id, r.prompt_ids, r.max_tokens) for r in rival[:n]]
    assert paged[10].arrival_s == pytest.approx(rival[10].arrival_s * 2.4 / 3.6, abs=1e-5)  # its gaps, rescaled
    other = s.sent(Segment(0, paired_key(4), 3.6, 0.0, 0, 20.0))
    assert not {r.request_id for r in paged} & {r.request_id for r in other}
    grid = s.sent(Segment(0, key_of(3.6), 3.6, 0.0, 0, 20.0))
    assert not {r.request_id for r in paged} & {r.request_id for r in grid}


def test_a_paired_key_names_its_turn_and_is_never_the_searchs_realization():
    assert paired_key(0) == "p0" and paired_turn("p12") == 12
    assert paired_turn("g16r1") is None and paired_turn("cal") is None and paired_turn(None) is None
    assert replication_of("p0") == 1 and replication_of("p7") == 8  # independent, never replication 0
    assert replication_of("g16r2") == 2 and replication_of("g16") == 0


def test_a_trace_gives_each_paired_key_its_own_slice_and_starts_it_where_no_grid_key_does():
    """Paired keys were hashed onto slices like any key of no grid rate: two of ten turns would share rows
    about half the time. Each now starts in the middle of a slice of its own."""
    spec = load_spec("azure-conv")
    rows = len(trace_rows(spec))
    firsts = [_first_row(spec, paired_key(n)) for n in range(TRACE_SLICES)]
    slices = [f * TRACE_SLICES // rows for f in firsts]
    assert sorted(slices) == list(range(TRACE_SLICES))  # the first 64 turns: 64 distinct slices
    grid_starts = {_first_row(spec, key_of(2 ** (k / 16))) for k in range(-64, 64)}
    assert not set(firsts) & grid_starts
    assert all(f - s * rows // TRACE_SLICES >= rows // (2 * TRACE_SLICES) - 1 for f, s in zip(firsts, slices,
                                                                                               strict=True))
    assert abs(slices[1] - slices[0]) == PAIRED_STRIDE  # successive turns far apart
    s = Streams(spec, 0)
    assert s.item(paired_key(1), 0).request_id == f"t{firsts[1]:06d}.0"
