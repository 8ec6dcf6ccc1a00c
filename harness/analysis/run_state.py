"""A run's state in one line, the mark every format of `fragbench report` opens with (issue 88): a partial run (cut
off, or still going) says why it stopped, where run.json knows, and what it kept; a failed run, its cause."""

from __future__ import annotations

import pandas as pd

from harness.analysis.records import RunRecord


def kept(meta: RunRecord, requests: pd.DataFrame) -> str:
    """What the run kept: the engines it finished, and the request rows written per engine."""
    rows = requests.groupby("engine").size() if len(requests) else pd.Series(dtype=int)
    per_engine = ", ".join(f"{engine} {n}" for engine, n in rows.items()) or "none"
    return f"engines finished: {', '.join(meta.engines_done) or 'none'}; request rows kept: {per_engine}"


def run_mark(meta: RunRecord, requests: pd.DataFrame) -> str | None:
    """`PARTIAL RUN: ...` or `FAILED RUN: ...` naming what was kept; None for a complete run."""
    if meta.status == "complete":
        return None
    if meta.status == "failed":
        return f"FAILED RUN: {meta.failure or 'no cause recorded'} (kept: {kept(meta, requests)})"
    why = f"stopped by {meta.stopped}" if meta.stopped else "it did not finish (killed, or still running)"
    return (f"PARTIAL RUN: {why}; kept: {kept(meta, requests)}. Every figure comes from the rows it wrote "
            "before it stopped.")
