"""A stream's offered token load over a point's window (harness/analysis/token_load.py): what the knee fit takes
out of a stream's own effect."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.analysis.token_load import log_token_load, mean_tokens_asked


def rows(n: int, tokens: int = 100) -> pd.DataFrame:
    return pd.DataFrame({"prompt_tokens": [tokens // 2] * n, "output_tokens_target": [tokens - tokens // 2] * n})


def test_a_window_at_its_rate_and_mean_offers_no_shift_and_a_burst_or_longer_requests_offer_more():
    assert log_token_load(rows(10), 5.0, 2.0, 100.0) == pytest.approx(0.0)
    assert log_token_load(rows(20), 5.0, 2.0, 100.0) == pytest.approx(math.log(2))  # twice the arrivals: a burst
    assert log_token_load(rows(10, 150), 5.0, 2.0, 100.0) == pytest.approx(math.log(1.5))  # longer requests
    assert log_token_load(rows(5), 5.0, 2.0, 100.0) == pytest.approx(math.log(0.5))


def test_an_unknown_load_is_no_shift():
    assert log_token_load(rows(10), 5.0, 2.0, None) == 0.0
    assert log_token_load(rows(0), 5.0, 2.0, 100.0) == 0.0
    assert log_token_load(pd.DataFrame({"prompt_tokens": [3]}), 5.0, 2.0, 100.0) == 0.0  # a journal without targets
    assert mean_tokens_asked("no-such-workload", 0, 2048) is None


def test_the_workloads_mean_is_read_from_its_own_stream_once():
    mean = mean_tokens_asked("mixed-churn", 0, 2048)
    assert mean is not None and 50 < mean < 2048 * 2
    assert mean_tokens_asked("mixed-churn", 0, 2048) == mean
