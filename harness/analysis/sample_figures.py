"""An engine's state over its /stats samples (samples.parquet), as summary.json reports it: the Figure-2 shares of
the KV capacity, the share allocated, the requests running, how often memory held the queue's head back, the time a
step takes and a counter's rise (harness/analysis/summary.py reads them per engine and per sweep point)."""

from __future__ import annotations

import pandas as pd

from engines.kv_categories import CATEGORY_COLUMNS

SHARE_COLUMNS = {f"{c}_share": column for c, column in CATEGORY_COLUMNS.items()}  # summary key -> samples column


def known(churn: pd.DataFrame, column: str) -> bool:
    """Every sample has it: a server that does not export a figure (a target) leaves it unknown, not 0."""
    return bool(len(churn)) and column in churn and bool(pd.to_numeric(churn[column], errors="coerce").notna().all())


def memory_figures(churn: pd.DataFrame) -> dict:
    cap = pd.to_numeric(churn.get("kv_capacity_bytes", pd.Series(dtype=float)), errors="coerce")
    sized = known(churn, "kv_capacity_bytes")
    out = {}
    for share, col in SHARE_COLUMNS.items():
        out[share] = float((churn[col].astype(float) / cap).mean()) if sized and known(churn, col) else None
    if sized and known(churn, "allocated_bytes"):
        out["allocated_share"] = float((churn.allocated_bytes.astype(float) / cap).mean())
    elif known(churn, "kv_cache_usage_perc"):  # a target's own usage gauge (vllm:kv_cache_usage_perc, ...)
        out["allocated_share"] = float(pd.to_numeric(churn.kv_cache_usage_perc).mean())
    else:
        out["allocated_share"] = None
    out["mean_running"] = float(churn.running.astype(float).mean()) if len(churn) and churn.running.notna().any() \
        else None
    out["max_running"] = int(churn.running.max()) if len(churn) and churn.running.notna().any() else None
    return out


def waiting_for_memory(smp: pd.DataFrame) -> float | None:
    """Share of samples in which requests waited and memory alone held the queue's head back."""
    col = pd.to_numeric(smp.get("waiting_for_memory", pd.Series(dtype=float)), errors="coerce").dropna()
    return float((col > 0).mean()) if len(col) else None


def step_seconds(smp: pd.DataFrame) -> float | None:
    """Mean time per engine step over the samples: elapsed time over the steps counter's rise."""
    steps = pd.to_numeric(smp.get("steps", pd.Series(dtype=float)), errors="coerce")
    ok = steps.notna()
    if ok.sum() < 2:
        return None
    rise = float(steps[ok].iloc[-1] - steps[ok].iloc[0])
    return float(smp.t_s[ok].iloc[-1] - smp.t_s[ok].iloc[0]) / rise if rise > 0 else None


def counter_rise(smp: pd.DataFrame, column: str) -> int:
    values = pd.to_numeric(smp.get(column, pd.Series(dtype=float)), errors="coerce").dropna()
    return int(values.diff().clip(lower=0).sum()) if len(values) else 0
