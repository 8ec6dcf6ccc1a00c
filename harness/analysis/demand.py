"""A stream's token demand over a point's window: what the knee fit takes out of the stream's own effect
(harness/analysis/kneefit.py). A point's demand is the mean of prompt + output tokens its window's requests asked
(cancelled ones too: they arrived and were served until they left), as the log of its ratio to the workload's
own mean, read from DEMAND_SAMPLE requests of a stream of their own. It is known from the requests alone, before
any engine runs, so two engines offered one stream see the same demand."""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import islice

import pandas as pd

from workloads.spec import load_spec
from workloads.streams import stream

DEMAND_SAMPLE = 4000  # the workload's mean demand is read from this many requests (its sd of the mean about 1.5 %)
DEMAND_KEY = "demand"  # the stream it is read from: never one a point judges


@lru_cache(maxsize=8)
def mean_tokens_asked(workload: str, seed: int, max_seq_len: int) -> float | None:
    """The workload's mean prompt + output tokens a request asks; None where the workload cannot be read."""
    try:
        spec = load_spec(workload)
    except (OSError, ValueError):
        return None
    reqs = list(islice(stream(spec, seed, DEMAND_KEY, max_seq_len, token_ids=False), DEMAND_SAMPLE))
    return sum(len(r.prompt_ids) + r.max_tokens * r.n for r in reqs) / len(reqs) if reqs else None


def log_demand(rows: pd.DataFrame, reference_tokens: float | None) -> float:
    """log(mean tokens asked by the window's requests / the workload's mean); 0 where either is unknown."""
    if not reference_tokens or not len(rows) or not {"prompt_tokens", "output_tokens_target"} <= set(rows.columns):
        return 0.0
    asked = pd.to_numeric(rows.prompt_tokens, errors="coerce") + pd.to_numeric(rows.output_tokens_target,
                                                                               errors="coerce")
    mean = float(asked.mean())
    return math.log(mean / reference_tokens) if mean > 0 else 0.0
