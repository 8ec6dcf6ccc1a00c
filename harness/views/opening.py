"""What a run's answer opens with, in words: the verdict (the headline and the sustained rates of a sweep, or goodput
at the workload's own rate) and the warnings beside it (the load generator fell behind; an engine's median TTFT over
the SLO). The report's verdict links each sentence to its evidence (harness/views/verdict.py); `fragbench bench`
prints the same sentences, from the same Summary, above its table, so the console and the page say one answer."""

from __future__ import annotations

import textwrap
from pathlib import Path

from harness.analysis.headline import PAGED
from harness.analysis.records import RunRecord
from harness.analysis.summary_records import Summary
from harness.views.capacity_section import capacity_sentence, headline_sentence

LATE_SHARE = 0.05  # the load generator's lateness worth a warning, as a share of the TTFT limit


def ttft_limit(meta: RunRecord) -> float:
    cfg = meta.config
    return float(cfg.slo_ttft_s if cfg.has("slo_ttft_s") else 2.0)


def goodput_sentence(summary: Summary) -> str:
    engines = summary.engines
    ranked = sorted(engines, key=lambda e: -(engines[e].goodput_requests_per_s or 0))
    best = ranked[0]
    contiguous = [e for e in engines if e not in PAGED]
    rates = ", ".join(f"{e} {engines[e].goodput_requests_per_s or 0:.2f}" for e in ranked)
    line = f"Goodput at the workload's own rate (requests per second within the SLO): {rates}; {best} served the most"
    if best in PAGED and contiguous:
        rival = max(contiguous, key=lambda e: engines[e].goodput_requests_per_s or 0)
        theirs = engines[rival].goodput_requests_per_s or 0
        line += (f", {(engines[best].goodput_requests_per_s or 0) / theirs:.1f}x the best contiguous engine ({rival})"
                 if theirs else ", and no contiguous engine served any request within the SLO")
    return line + "."


def lateness_sentence(summary: Summary, ttft_limit_s: float) -> str | None:
    """Latency counts from each request's due time, so a late send is charged to the engine it waited for; the
    load generator's own lateness still says whether the client kept the schedule it was given."""
    late = {e: s.late_p99_s for e, s in summary.engines.items() if s.late_p99_s is not None}
    if not late:
        return None
    worst = max(late, key=late.get)
    words = ", ".join(f"{e} {1000 * v:.0f} ms" for e, v in late.items())
    line = (f"Latency is timed from each request's due time (its arrival in the schedule), not from its send: the "
            f"load generator's lateness p99 {words}")
    if late[worst] > LATE_SHARE * ttft_limit_s:
        return (f"WARNING: the load generator fell behind its schedule: lateness p99 {1000 * late[worst]:.0f} ms "
                f"for {worst}, over {100 * LATE_SHARE:.0f} % of the {ttft_limit_s:g} s TTFT limit: the rate was not "
                "offered on time (the wait still counts against the engine). " + line + ".")
    return line + f", under {100 * LATE_SHARE:.0f} % of the {ttft_limit_s:g} s TTFT limit."


def lateness_parts(summary: Summary, meta: RunRecord) -> tuple[str | None, str | None]:
    """The lateness sentence cut in two: its warning (the verdict's, where the load generator fell behind) and
    how latency is timed (the table's method)."""
    late = lateness_sentence(summary, ttft_limit(meta))
    if late is None or not late.startswith("WARNING"):
        return None, late
    warning, how = late.split(" Latency is timed", 1)
    return warning, "Latency is timed" + how


def ttft_warnings(summary: Summary, meta: RunRecord) -> list[str]:
    """At the workload's own rate, an engine whose median request missed the TTFT limit: its goodput is the few
    that did not. (A sweep's figures pool every point, past the knee too: its sustained rate says it instead.)"""
    if summary.capacity:
        return []
    limit = ttft_limit(meta)
    return [f"WARNING: {e}'s median TTFT {s.ttft_p50_s:.2f} s is over the SLO's {limit:g} s TTFT limit: most of its "
            "requests missed the SLO." for e, s in summary.engines.items()
            if s.ttft_p50_s is not None and s.ttft_p50_s > limit]


def lead(summary: Summary) -> list[tuple[str, str]]:
    """The answer's sentences, each with the report section that holds its evidence."""
    if not summary.engines and not summary.capacity:
        return [("verdict-table", "No engine produced a result in this run.")]
    if not summary.capacity:  # one offered rate: goodput at it is the measure of what memory bought
        return [("verdict-table", goodput_sentence(summary))]
    head = headline_sentence(summary)
    return [("capacity", x) for x in (head, capacity_sentence(summary)) if x]


def warnings(summary: Summary, meta: RunRecord) -> list[tuple[str, str]]:
    late, _ = lateness_parts(summary, meta)
    return ([("latency", late)] if late else []) + [("verdict-table", w) for w in ttft_warnings(summary, meta)]


def opening_lines(summary: Summary, meta: RunRecord) -> list[str]:
    """The verdict and its warnings as plain sentences, in the report's order."""
    return [text for _, text in lead(summary) + warnings(summary, meta)]


def console_opening(run_dir: Path, summary: Summary, width: int = 120) -> str:
    """What bench prints above its table: `verdict:` and each warning, wrapped, from the Summary the report reads."""
    out = []
    for i, line in enumerate(opening_lines(summary, RunRecord.read(run_dir))):
        tag = "" if line.startswith("WARNING") else ("verdict: " if i == 0 else "         ")
        out.append(textwrap.fill(line, width, initial_indent=tag, subsequent_indent="         "))
    return "\n".join(out)
