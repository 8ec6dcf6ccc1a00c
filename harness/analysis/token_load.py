"""A stream's offered token load over a point's judged window: what the knee fit takes out of the stream's own
effect (harness/analysis/kneefit.py). The tokens the window's requests asked (prompt + output: cancelled ones too,
they arrived and were served until they left) per second of the window, over what the point's rate offers at the
workload's mean, as a log: a stream whose requests came in a burst, or asked for longer answers, offers more. It is
known from the requests alone, before any engine runs, so two engines offered one stream see the same load (as far
as their judged windows coincide). The workload's mean is read from MEAN_SAMPLE requests of a stream of their own.

Why the load and not the tokens asked alone: in the bench's twin (benchmarks/pairing_study.py, 200 streams of
mixed-churn at paged's and static-oracle's knees) the tokens asked explained under 8 % of a stream's effect, the
offered token load 34 % and 42 %."""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import islice

import pandas as pd

from workloads.spec import load_spec
from workloads.streams import stream

MEAN_SAMPLE = 4000  # the workload's mean tokens a request asks, read from this many requests (sd of the mean ~1.5 %)
MEAN_KEY = "token-load"  # the stream it is read from: never one a point judges


@lru_cache(maxsize=8)
def mean_tokens_asked(workload: str, seed: int, max_seq_len: int) -> float | None:
    """The workload's mean prompt + output tokens a request asks; None where the workload cannot be read."""
    try:
        spec = load_spec(workload)
    except (OSError, ValueError):
        return None
    reqs = list(islice(stream(spec, seed, MEAN_KEY, max_seq_len, token_ids=False), MEAN_SAMPLE))
    return sum(len(r.prompt_ids) + r.max_tokens * r.n for r in reqs) / len(reqs) if reqs else None


def log_token_load(rows: pd.DataFrame, window_s: float, rate_rps: float, mean_tokens: float | None) -> float:
    """log(tokens the window's requests asked per second of it / (rate x the workload's mean tokens)); 0 where
    any of them is unknown."""
    if not mean_tokens or window_s <= 0 or rate_rps <= 0 or not len(rows) \
            or not {"prompt_tokens", "output_tokens_target"} <= set(rows.columns):
        return 0.0
    asked = float((pd.to_numeric(rows.prompt_tokens, errors="coerce")
                   + pd.to_numeric(rows.output_tokens_target, errors="coerce")).sum())
    return math.log(asked / window_s / (rate_rps * mean_tokens)) if asked > 0 else 0.0
