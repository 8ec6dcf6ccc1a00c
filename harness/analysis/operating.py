"""The operating point: latency, throughput and memory where two runs judged the same requests.

Every default run measures each engine first at its fixed operating point: a rate from the table in
operating_points.json (per workload, KV budget and model, by the rule it states: half the lower end of the
engine's sustained-rate interval in recorded runs, so a load every run sustains), on a fixed stream
(`OPERATING_REPLICATION`: a realization no search reaches). The nightly gate compares each engine there, the same
requests at the same load in every pair of default runs; where a pair has no such point in common (a workload,
budget or model the table does not hold) it falls back to the rule below.

Two sweeps visit different rates, but every rate lies on one grid and each grid rate (and each replication of
it) has its own stream (workloads.streams.key_of): two points at one key and one rate judged the same requests
at the same load (a paired stream, the decision's, is read at whatever rate its turn placed it: the rate is
part of the pairing). The nightly gate compares each engine at the highest such point both runs judged below
the knee (steady, SLO met in both) at a rate no higher than either run's sustained-rate interval reaches down
to: the same offered load, the same requests, a load the engine sustains in both runs with confidence. Figures
pooled over a sweep's path are not comparable that way (views/compare.py keeps them ungated).

Each point's figures carry a 90 % interval from a circular block bootstrap: over its completed requests in
arrival order for latency and throughput (neighbours share the queue they met: blocks keep them together),
over its engine samples in time order for memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.knee import CONFIDENCE, central, named_rng
from harness.analysis.summary_records import CapacityBlock, CapacityPoint
from workloads.streams import grid_index, grid_rate, key_of

# figure -> whether higher is better, each gated at the operating point with its interval
OPERATING_FIGURES = {"ttft_p50_s": False, "tpot_p50_s": False, "output_tokens_per_s": True, "kv_usage": False}
REPLICATES = 1000
SEED = 20261203
TABLE = Path(__file__).with_name("operating_points.json")
OPERATING_REPLICATION = 1000  # the operating point's own stream of its rate: no search or decision reaches it
OPERATING_SHARE = 0.5  # of the median lower end of the sustained-rate interval in recorded runs
OPERATING_JUDGED = 30  # requests an operating point judges: enough for a median's block-bootstrap interval
MOST_ARRIVAL_S = 60.0  # an operating point whose judged requests would take longer to arrive is not measured


def table_key(workload: str, budget_bytes: int, model: str) -> str:
    return f"{Path(workload).stem}/{budget_bytes}/{Path(model).name}"


def operating_rate(workload: str, budget_bytes: int, model: str, engine: str, table: Path = TABLE) -> float | None:
    """The engine's operating rate for this workload, budget and model, or None where the table has none."""
    tables = json.loads(table.read_text()).get("tables", {}) if table.is_file() else {}
    return tables.get(table_key(workload, budget_bytes, model), {}).get(engine)


def operating_key(rate: float) -> str:
    return key_of(rate, OPERATING_REPLICATION)


def rule_rate(lower_ends: list[float], judged: int = OPERATING_JUDGED) -> float | None:
    """The table's rule: the grid rate at or under OPERATING_SHARE x the median lower end, where its judged
    requests arrive within MOST_ARRIVAL_S."""
    if not lower_ends:
        return None
    rate = grid_rate(math.floor(grid_index(OPERATING_SHARE * float(np.median(lower_ends))) + 1e-9))
    if rate > OPERATING_SHARE * float(np.median(lower_ends)):
        rate = grid_rate(grid_index(rate) - 1)
    return rate if judged / rate <= MOST_ARRIVAL_S else None


def block_indices(n: int, rng: np.random.Generator, replicates: int = REPLICATES) -> np.ndarray:
    """`replicates` rows of n indices into a series, drawn as circular blocks of about n^(1/3) neighbours."""
    size = max(1, round(n ** (1 / 3)))
    starts = rng.integers(0, n, size=(replicates, -(-n // size)))
    return ((starts[:, :, None] + np.arange(size)) % n).reshape(replicates, -1)[:, :n]


def interval(values: np.ndarray, statistic, rng: np.random.Generator) -> list[float] | None:
    """The statistic's central interval over block-bootstrap resamples of `values` (None under 2 values)."""
    values = values[np.isfinite(values)]
    if len(values) < 2:
        return None
    draws = values[block_indices(len(values), rng)]
    return central(statistic(draws), CONFIDENCE)


def point_intervals(rows: pd.DataFrame, samples: pd.DataFrame, judged_s: float, key: str) -> dict:
    """One point's operating figures and their intervals: {figure: value, figure + '_ci': [lo, hi]}.
    `rows` are the requests that arrived in its judged spans, `samples` the engine's samples there."""
    ok = rows[rows.status == "ok"].sort_values("arrival_s", kind="stable")
    ttft = pd.to_numeric(ok.ttft_s, errors="coerce").to_numpy(dtype=float)
    tpot = pd.to_numeric(ok.tpot_s, errors="coerce").to_numpy(dtype=float)
    tokens = pd.to_numeric(ok.output_tokens, errors="coerce").fillna(0).to_numpy(dtype=float)
    usage = kv_usage_series(samples)
    out = {"output_tokens_per_s": float(tokens.sum() / judged_s) if judged_s > 0 else None}
    rng = named_rng(SEED, key)
    out["ttft_p50_s_ci"] = interval(ttft, lambda d: np.median(d, axis=1), rng)
    out["tpot_p50_s_ci"] = interval(tpot, lambda d: np.median(d, axis=1), rng)
    out["output_tokens_per_s_ci"] = (interval(tokens, lambda d: d.sum(axis=1) / judged_s, rng)
                                     if judged_s > 0 else None)
    out["kv_usage_ci"] = interval(usage, lambda d: d.mean(axis=1), rng)
    return out


def kv_usage_series(samples: pd.DataFrame) -> np.ndarray:
    """The KV memory in use as a share of the budget, sample by sample in time order (as memory_figures'
    allocated_share averages it: the engine's bytes over its capacity, or a target's own usage gauge)."""
    smp = samples.sort_values("t_s", kind="stable") if "t_s" in samples else samples
    if {"allocated_bytes", "kv_capacity_bytes"} <= set(smp.columns):
        return (pd.to_numeric(smp.allocated_bytes, errors="coerce")
                / pd.to_numeric(smp.kv_capacity_bytes, errors="coerce")).to_numpy(dtype=float)
    if "kv_cache_usage_perc" in smp:
        return pd.to_numeric(smp.kv_cache_usage_perc, errors="coerce").to_numpy(dtype=float)
    return np.array([], dtype=float)


def below_knee(point: CapacityPoint, attainment: float) -> bool:
    """The point met the SLO at steady state: a load its engine sustains."""
    return bool(point.steady) and (point.slo_attainment or 0.0) >= attainment


def shared_point(base: CapacityBlock, new: CapacityBlock) -> tuple[CapacityPoint, CapacityPoint] | None:
    """Two capacity blocks' operating point, as (base point, new point); None where they share none.

    The fixed operating point where both runs measured it (`operating_point.keys`), else:

    The highest-rate stream both runs measured (one key at one rate) below the knee, at a rate no higher than
    the lower end of either run's sustained-rate interval: a load both runs sustain with confidence. A stream
    inside a knee's interval may queue in one run and not in the other (b1 and b3 of one commit at paged's
    3.83/s: TTFT p50 0.13 and 0.64 s, TPOT p50 +16 % with intervals apart); its latency is then a queueing
    figure, which the sustained rate already gates. Ties in rate go to the first realization (the lowest key)."""
    fixed = fixed_point(base, new)
    if fixed is not None:
        return fixed
    ceiling = min(lower_end(base), lower_end(new))

    def sustained(block: CapacityBlock) -> dict[tuple[str, float], CapacityPoint]:
        # by key and rate: a grid key has one rate, but a paired stream (workloads/streams.paired_key) is read at
        # whatever rate its turn placed it, and two points of one key at two rates did not judge one load
        target = block.slo.attainment
        return {(p.key, p.offered_rps): p for p in block.points
                if p.key and below_knee(p, target) and p.offered_rps <= ceiling}

    b, n = sustained(base), sustained(new)
    keys = sorted(set(b) & set(n), key=lambda k: (-k[1], k[0]))
    return (b[keys[0]], n[keys[0]]) if keys else None


def lower_end(block: CapacityBlock) -> float:
    """The lower end of a block's sustained-rate interval (its estimate where it has no interval)."""
    ci = block.sustained_rps_ci
    low = ci[0] if ci else block.sustained_rps
    return float("inf") if low is None else float(low)


def fixed_point(base: CapacityBlock, new: CapacityBlock) -> tuple[CapacityPoint, CapacityPoint] | None:
    """The fixed operating point both blocks measured: the same key, judged in both, and an operating point in
    both: steady, the SLO met, and its rate under both runs' sustained-rate intervals (a point inside a knee's
    interval is a queue in one run and not in the next: paged's table rate of 3.83/s against a knee of 3.76
    [3.00, 4.37] gave TTFT p50 of 1.1-2.6 s in five runs of one commit). None where it is not: the rule's point."""
    keys = [set(b.operating_point.keys if b.operating_point else []) for b in (base, new)]
    ceiling = min(lower_end(base), lower_end(new))
    for key in sorted(keys[0] & keys[1]):
        b, n = (next((p for p in blk.points if p.key == key), None) for blk in (base, new))
        if b is not None and n is not None and operating(b, base, ceiling) and operating(n, new, ceiling):
            return b, n
    return None


def operating(point: CapacityPoint, block: CapacityBlock, ceiling_rps: float) -> bool:
    """A point that is an operating point: sustained at steady state, under the knee intervals' lower ends."""
    return below_knee(point, block.slo.attainment) and point.offered_rps <= ceiling_rps
