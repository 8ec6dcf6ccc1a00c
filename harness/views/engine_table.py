"""The per-engine table on the console: what `fragbench bench` ends with under its `decision:` line and
`fragbench report RUN_DIR --format text` prints (vllm bench serve's closing block, guidellm's table): the rows of
harness/analysis/engine_rows.py, every column with its unit, latencies in milliseconds."""

from __future__ import annotations

import textwrap

from rich import box
from rich.console import Console
from rich.table import Table

from harness.analysis.engine_rows import EngineRow, engine_rows
from harness.analysis.summary_records import Summary

WIDTH = 120  # a log or a pipe has no terminal width: the table is laid out for this many columns


def rate_cell(r: EngineRow) -> str:
    """The sustained rate with its 90 % interval, or the bound it is: '>= x' where every rate met the SLO."""
    if r.sustained_rps is None:
        return "n/a"
    if r.sustained_where == "beyond":
        return f">= {r.sustained_rps:.2f}"
    if r.sustained_where == "below":
        return f"< {r.sustained_rps:.2f}" if not r.sustained_hi_rps else \
            f"{r.sustained_rps:.2f} [{r.sustained_lo_rps:.2f}, {r.sustained_hi_rps:.2f}]"
    if r.sustained_lo_rps is None or r.sustained_hi_rps is None:
        return f"{r.sustained_rps:.2f}"
    return f"{r.sustained_rps:.2f} [{r.sustained_lo_rps:.2f}, {r.sustained_hi_rps:.2f}]"


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1000 * v:.0f}"


def pair_ms(p50: float | None, p90: float | None) -> str:
    return f"{ms(p50)} / {ms(p90)}"


def num(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def oom_cell(r: EngineRow) -> str:
    if r.ooms is None:
        return "n/a"
    return f"{r.oom_capacity or 0} / {r.oom_fragmentation or 0}"


HEADER = ("engine", "sustained req/s\n[90 % interval]", "bound\nby", "served\nreq/s", "OOMs\ncap. / frag.",
          "failed /\nunfinished req", "TTFT ms\np50 / p90", "TPOT ms\np50 / p90", "output\ntok/s")


ONE_RATE = ("engine", "goodput req/s\n(within SLO)", *HEADER[3:])  # no knee search: goodput, as the report opens


def cells(r: EngineRow, swept: bool = True) -> list[str]:
    failed = f"{r.failed_requests} / {r.unfinished_requests}"
    rate = [rate_cell(r), r.bound or "n/a"] if swept else [num(r.goodput_rps)]
    return [r.engine, *rate, num(r.served_rps), oom_cell(r), failed,
            pair_ms(r.ttft_p50_s, r.ttft_p90_s), pair_ms(r.tpot_p50_s, r.tpot_p90_s), num(r.output_tokens_per_s, 1)]


def engine_table(summary: Summary) -> str:
    """The table as text (no colour, no markup): one header, a row per engine, a line on what the figures are."""
    rows = engine_rows(summary)
    if not rows:
        return "no engine produced a result: no per-engine figures"
    swept = bool(summary.capacity)  # a run at one rate has no sustained rate or bound: no column of n/a for them
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, h in enumerate(HEADER if swept else ONE_RATE):
        table.add_column(h, justify="left" if i < 1 else "right", no_wrap=True)
    for r in rows:
        table.add_row(*cells(r, swept))
    console = Console(width=WIDTH, record=True, no_color=True, force_terminal=False, file=_Null())
    console.print(table)
    slo = next(iter(summary.capacity.values())).slo if summary.capacity else None
    note = (f"sustained: the highest offered rate at which the long-run share of all requests (every stream at that "
            f"rate pooled) within TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s reaches "
            f"{100 * slo.attainment:.0f} % (the vLLM paper's sustained rate, DistServe's goodput); " if slo else
            "goodput: requests per second within the SLO at the workload's own rate (one offered rate, no knee "
            "search: bench --sweep measures the sustained rate); ")
    note += ("latency, served and tokens over every point's judged requests; " if slo else
             "latency, served and tokens over the churn window; ")
    note += "failed: OOM'd, rejected, errors or crashed; unfinished: still in flight when the run's grace period ended."
    lines = [line.rstrip() for line in console.export_text().rstrip().splitlines()]
    return "\n".join([*lines, *textwrap.wrap(note, WIDTH)])


class _Null:
    """Where the recording console writes as it records: nowhere (export_text gives the text)."""

    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass
