"""The per-engine table, one typed row per engine, read from the typed Summary (the object the console's `decision:`
line reads): the bench console's table (harness/views/engine_table.py), `report --format csv|json` and the
engines.csv every finalize writes beside summary.json are each a rendering of these rows, so none can disagree.
Column names carry their units (`ttft_p50_s`, `sustained_rps`); the console shows milliseconds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd

from engines.kv_categories import CATEGORIES
from harness.analysis.summary_records import Summary
from harness.results import whole_file

ENGINES_CSV = "engines.csv"  # beside summary.json in every run's folder


@dataclass(frozen=True)
class EngineRow:
    """One engine's answer: its sustained rate at the SLO (a sweep's; None in a run at one rate), what bound it, and
    what it served, failed and how fast."""

    engine: str
    sustained_rps: float | None  # the highest offered rate within the SLO
    sustained_lo_rps: float | None  # its 90 % interval (grid.py's names)
    sustained_hi_rps: float | None
    sustained_where: str | None  # within the rates measured; beyond (a lower bound); below (under the lowest)
    bound: str | None  # what bound it at its knee: memory, compute or failures
    served_rps: float | None  # requests completed per second of judged arrivals
    goodput_rps: float | None  # of those, the ones within the SLO
    oom_capacity: int | None  # failed KV allocations: free < requested (None: a target's metrics do not say)
    oom_fragmentation: int | None  # free >= requested, no extent fits
    failed_requests: int  # sent and not served: OOM'd, rejected, errors, crashed (unfinished at the end apart)
    unfinished_requests: int  # still queued or running when the run's grace period ended
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    output_tokens_per_s: float | None
    # where its KV memory went over the run, shares of its budget (0 to 1; the vLLM paper's Figure 2,
    # engines/kv_categories.py): None where its rows do not say (a target's metrics)
    kv_token_states_share: float | None = None
    kv_reservation_share: float | None = None
    kv_internal_fragmentation_share: float | None = None
    kv_external_fragmentation_share: float | None = None
    kv_free_share: float | None = None

    @property
    def ooms(self) -> int | None:
        known = [n for n in (self.oom_capacity, self.oom_fragmentation) if n is not None]
        return sum(known) if known else None


COLUMNS = tuple(f.name for f in fields(EngineRow))


def number(v) -> float | None:
    return None if v is None else float(v)


def count(v) -> int | None:
    return None if v is None else int(v)


def engine_rows(summary: Summary) -> list[EngineRow]:
    """Every engine the summary has figures or a capacity block for, highest sustained rate first (engines
    without one after, in the run's order)."""
    names = list(dict.fromkeys([*summary.engines, *summary.capacity]))
    cap = summary.capacity
    names.sort(key=lambda e: -(cap[e].sustained_rps if e in cap else -1.0))
    rows = []
    for e in names:
        s, c = summary.engines.get(e), cap.get(e)
        ci = c.sustained_rps_ci if c is not None and c.sustained_rps_ci else None
        # a knee not bracketed is the bound the rates measured give (knee.bound_of), not the fit's extrapolation
        bound = c.sustained_bound if c is not None and c.sustained_where in ("beyond", "below") else None
        ci = None if bound else ci
        failed = 0 if s is None else int(s.requests_oom + s.requests_rejected + s.requests_error
                                         + s.requests_crashed)
        rows.append(EngineRow(
            engine=e, sustained_rps=number(bound["rps"] if bound else c.sustained_rps) if c else None,
            sustained_lo_rps=number(ci[0]) if ci else None, sustained_hi_rps=number(ci[1]) if ci else None,
            sustained_where=c.sustained_where if c else None, bound=c.bound if c else None,
            served_rps=number(s.requests_per_s) if s else None,
            goodput_rps=number(s.goodput_requests_per_s) if s else None,
            oom_capacity=count(s.oom_capacity) if s else None,
            oom_fragmentation=count(s.oom_fragmentation) if s else None,
            failed_requests=failed, unfinished_requests=int(s.requests_unfinished) if s else 0,
            ttft_p50_s=number(s.ttft_p50_s) if s else None, ttft_p90_s=number(s.ttft_p90_s) if s else None,
            tpot_p50_s=number(s.tpot_p50_s) if s else None, tpot_p90_s=number(s.tpot_p90_s) if s else None,
            output_tokens_per_s=number(s.output_tokens_per_s) if s else None, **kv_shares(s)))
    return rows


def kv_shares(figures) -> dict[str, float | None]:
    """An engine's Figure-2 shares as EngineRow's fields (kv_token_states_share...), None where none was measured."""
    return {f"kv_{c}_share": number(figures.figure(f"{c}_share")) if figures else None for c in CATEGORIES}


DTYPES = {"float | None": "Float64", "int | None": "Int64", "int": "Int64", "str | None": "string", "str": "string"}
# engines.csv's schema (pandas' nullable dtypes): the run's state first, then EngineRow's fields
SCHEMA = {"run_status": "string", **{f.name: DTYPES[f.type] for f in fields(EngineRow)}}


def engines_frame(summary: Summary) -> pd.DataFrame:
    """The rows as a frame, the run's status (complete, partial or failed) then one column per field (its unit in
    its name), in the order the fields are declared, each of SCHEMA's dtype whatever the run held."""
    frame = pd.DataFrame([asdict(r) for r in engine_rows(summary)], columns=list(COLUMNS))
    frame.insert(0, "run_status", summary.status)
    return frame.astype(SCHEMA)


def write_engines_csv(folder: Path, summary: Summary) -> Path:
    path = folder / ENGINES_CSV
    with whole_file(path) as tmp:  # whole or not at all, as summary.json is
        engines_frame(summary).to_csv(tmp, index=False)
    return path
