"""summary.json's `engines.<e>.allocator`: the caching allocator's figures (`--memory caching`, /stats'
`allocator`) as the sampler recorded them, so a run says what PyTorch's `torch.cuda.memory_stats()` would have:
allocated and reserved after the load (the last sample, once every request has completed: "if allocated falls but
reserved remains high, the caching allocator is retaining blocks"), their peaks, and the share of the KV budget
reserved by the allocator but allocated to nothing over the steady churn (the Figure-2 breakdown's extra line)."""

from __future__ import annotations

import pandas as pd

# the block's keys (/stats' `allocator` keys, torch.cuda.memory_stats()'s names) -> the samples columns
COLUMNS = {"allocated_bytes": "alloc_allocated_bytes", "reserved_bytes": "alloc_reserved_bytes",
           "active_bytes": "alloc_active_bytes", "inactive_split_bytes": "alloc_inactive_split_bytes",
           "segments": "alloc_segments", "alloc_retries": "alloc_retries"}
# requests by PyTorch's size class (engines/caching_memory.size_class) -> the samples columns counting them
CLASS_COLUMNS = {"small": "alloc_small_requests", "large": "alloc_large_requests", "huge": "alloc_huge_requests"}
STATS_COLUMNS = {**COLUMNS, **{f"{c}_requests": col for c, col in CLASS_COLUMNS.items()}}  # what the sampler reads
LAYERS = ("policy", "allocator")  # which layer an OOM under the caching allocator failed (memory/caching_memory.py)
PEAKS = ("allocated_bytes", "reserved_bytes", "segments")  # what a peak says more of than the last value


def allocator_block(smp: pd.DataFrame, churn: pd.DataFrame | None = None, ooms: pd.DataFrame | None = None) \
        -> dict | None:
    """An engine's allocator figures from its samples; None where no caching allocator held its KV (the arena, a
    target). Current values are the last sample's; `alloc_retries` counts over every server of the engine (a
    restarted server counts from zero, as torch's num_alloc_retries does); peaks are the highest sampled (10 Hz:
    a peak shorter than a sample interval can pass unseen); `reserved_unallocated_share` is the mean over the
    steady churn (`churn`, the samples summary.py's memory shares read) of reserved less allocated bytes over
    the KV budget. `oom_policy` and `oom_allocator` count the engine's OOM events (`ooms`) by layer."""
    rows = _figures(smp)
    if rows.empty:
        return None
    last = rows.iloc[-1]
    out: dict = {key: int(last[col]) for key, col in COLUMNS.items()}
    out["alloc_retries"] = counter_total(rows[COLUMNS["alloc_retries"]])
    for key in PEAKS:
        out[f"peak_{key}"] = int(rows[COLUMNS[key]].max())
    gap = rows[COLUMNS["reserved_bytes"]] - rows[COLUMNS["allocated_bytes"]]
    out["reserved_unallocated_bytes"] = int(gap.iloc[-1])
    out["peak_reserved_unallocated_bytes"] = int(gap.max())
    out["reserved_unallocated_share"] = reserved_unallocated_share(churn if churn is not None else smp)
    out["size_classes"] = size_classes(rows)
    for layer in LAYERS:
        out[f"oom_{layer}"] = layer_count(ooms, layer)
    return out


def layer_count(ooms: pd.DataFrame | None, layer: str) -> int:
    """OOM events whose layer is this one (an event without a layer, the arena's, counts in neither)."""
    if ooms is None or "layer" not in ooms:
        return 0
    return int((ooms.layer == layer).sum())


def size_classes(rows: pd.DataFrame) -> dict[str, int] | None:
    """The engine's allocation requests by PyTorch's size class, over every server of the engine: small (<= 1 MiB,
    2 MiB segments), large (under 10 MiB, a 20 MiB segment), huge (a segment of its own). None where the samples
    do not count them."""
    if any(col not in rows or rows[col].isna().any() for col in CLASS_COLUMNS.values()):
        return None
    return {c: counter_total(pd.to_numeric(rows[col])) for c, col in CLASS_COLUMNS.items()}


def reserved_unallocated_share(smp: pd.DataFrame) -> float | None:
    """Mean of (reserved - allocated) / KV budget over these samples: bytes the allocator holds from the device
    that no tensor uses (cached free blocks, inactive splits), as a share of the budget."""
    rows = _figures(smp)
    if rows.empty or "kv_capacity_bytes" not in rows:
        return None
    cap = pd.to_numeric(rows.kv_capacity_bytes, errors="coerce")
    share = (rows[COLUMNS["reserved_bytes"]] - rows[COLUMNS["allocated_bytes"]]) / cap
    share = share[cap > 0].dropna()
    return float(share.mean()) if len(share) else None


def counter_total(values: pd.Series) -> int:
    """A cumulative counter's total over restarts: each rise counts, and after a fall (a new process) the new
    value itself does."""
    v = values.astype(float).to_numpy()
    total = v[0]
    for before, now in zip(v, v[1:], strict=False):
        total += now - before if now >= before else now
    return int(total)


def _figures(smp: pd.DataFrame) -> pd.DataFrame:
    """The samples that carry every allocator figure, in time order, as numbers."""
    if smp is None or smp.empty or any(col not in smp for col in COLUMNS.values()):
        return pd.DataFrame()
    rows = smp.copy()
    for col in COLUMNS.values():
        rows[col] = pd.to_numeric(rows[col], errors="coerce")
    rows = rows.dropna(subset=list(COLUMNS.values()))
    return rows.sort_values("t_s") if "t_s" in rows else rows
