"""The one percentile function: every p50/p99 fragbench reports (server, summary, simulate, load) is this."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (q in [0, 1]) of the values, linearly interpolated as numpy and pandas do by default;
    missing values (None, NaN) are left out; None when nothing is left."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    arr = arr[~np.isnan(arr)]
    return float(np.quantile(arr, q)) if arr.size else None
