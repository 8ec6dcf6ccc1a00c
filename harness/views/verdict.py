"""The run report's verdict section: every sentence computed from this run, each linking to its evidence (the
capacity section, and the capacity sentences the verdict borrows, are harness/views/capacity_section.py's)."""

from __future__ import annotations

import pandas as pd

from harness.analysis.records import RunRecord
from harness.analysis.summary import SHARE_COLUMNS
from harness.analysis.summary_records import EngineFigures, Summary
from harness.views.capacity_section import bound_lines
from harness.views.glance import glance
from harness.views.html import details, fmt, link, mib, section, table
from harness.views.opening import lateness_parts, lead, warnings

RUNBOOK = {
    "capacity": "capacity: the live tokens did not fit; reduce max_num_seqs or max_seq_len, quantize the KV cache, "
                "or add memory",
    "reservation": "reservation and internal fragmentation: contiguous max-length reservations hold memory no token "
                   "uses; use blocks",
    "fragmentation": "external fragmentation: variable-size contiguous extents strand free memory; use blocks "
                     "(more memory only delays it)",
    "caching": "allocator caching: PyTorch reserved far more than it allocated; empty the cache or cap its fraction",
}
WASTE = {"reservation_share": "reservation", "internal_fragmentation_share": "internal fragmentation",
         "external_fragmentation_share": "external fragmentation", "free_share": "free"}


def diagnosis(s: EngineFigures, ooms: pd.DataFrame) -> str | None:
    """The OOM runbook's line for one engine, from its own failures and where its memory went."""
    if not len(ooms) and not s.crashes:
        return None
    if not len(ooms) and not (s.oom_total or s.oom_fragmentation or s.oom_capacity):
        return None  # a crash no OOM explains (a segfault, a kill, a target that died): the runbook is for OOMs
    if (s.oom_fragmentation or 0) > (s.oom_capacity or 0):
        return RUNBOOK["fragmentation"]
    if (s.reservation_share or 0) + (s.internal_fragmentation_share or 0) > (s.token_states_share or 0):
        return RUNBOOK["reservation"]
    return RUNBOOK["capacity"]


def verdict_sentences(summary: Summary, events: pd.DataFrame, meta: RunRecord) -> list[str]:
    """The answer in short sentences, each linking to its evidence; how each figure was measured is folded under
    the figure it explains (the verdict table's, the capacity section's)."""
    engines = summary.engines
    if not engines:
        return ["No engine produced a result in this run."]
    cfg = meta.config
    budget = cfg.kv_budget if cfg.has("kv_budget") else "the same budget"
    out = [link(anchor, text) for anchor, text in lead(summary)]
    if summary.capacity and any(c.has("bound") for c in summary.capacity.values()):  # a short line each, one lead
        head, parts = bound_lines(summary)
        out.append(link("capacity", head) + "<ul>" + "".join(f"<li>{link('capacity', x)}</li>" for x in parts)
                   + "</ul>")
    out += [link(anchor, text) for anchor, text in warnings(summary, meta)]  # a calm clock: under the table
    held = ", ".join(f"{e} {fmt(engines[e].mean_running)} (max {fmt(engines[e].max_running)})"
                     for e in sorted(engines, key=lambda e: -(engines[e].mean_running or 0)))
    out.append(link("scheduler", f"Requests held at once in {budget} of KV, mean over the churn: {held}."))
    where = []
    for e, s in engines.items():
        if s.token_states_share is None:
            where.append(f"{e} exports usage only ({fmt(s.allocated_share, '%')} allocated)")
            continue
        worst = max(WASTE, key=lambda k: s.figure(k) or 0)
        where.append(f"{e} {fmt(s.token_states_share, '%')} token states, largest other share {WASTE[worst]} "
                     f"{fmt(s.figure(worst), '%')}")
    out.append(link("figure2", "Where the memory went: " + "; ".join(where) + "."))
    oom = events[events.kind == "oom"] if len(events) else events
    failures = []
    for e, s in engines.items():
        mine = oom[oom.engine == e] if len(oom) else oom
        if not s.oom_total and not s.crashes:
            continue
        part = f"{e}: {s.oom_capacity} capacity and {s.oom_fragmentation} fragmentation OOMs"
        frag = mine[mine.cause == "fragmentation"] if len(mine) else mine
        if len(frag):
            part += (f" (the fragmentation ones failed with {mib(frag.free_bytes.median())} free, median, for "
                     f"{mib(frag.requested_bytes.median())} requested, the largest free extent "
                     f"{mib(frag.largest_free_bytes.median())})")
        part += f", {s.crashes} crashes"
        failures.append(part)
    out.append(link("oom-events", ("Failures: " + "; ".join(failures) + ".") if failures
                    else "No engine failed an allocation or crashed."))
    checked = {e: s.integrity for e, s in engines.items() if s.integrity}
    if checked:
        wrong = {e: r for e, r in checked.items() if r.diverged}
        line = ("KV integrity FAILED: " + "; ".join(f"{e} {r.diverged} of {r.probes} probes diverged"
                                                    for e, r in wrong.items()) + " (numbers wrong under churn)."
                if wrong else "KV integrity: no probe diverged from its idle answer (" + ", ".join(
                    f"{e} {r.probes} probes" + (f" ({r.ended_early} ended early by an OOM)"
                                                if r.ended_early else "")
                    for e, r in checked.items()) + ").")
        out.append(link("integrity", line))
    for e, s in engines.items():
        mine = oom[oom.engine == e] if len(oom) else oom
        line = diagnosis(s, mine)
        if line:
            out.append(link("memory-map", f"{e}, diagnosis: {line}."))
    return out


# -- sections
def verdict(summary: Summary, meta: RunRecord, events: pd.DataFrame | None = None) -> str:
    cfg = meta.config
    rows = []
    for engine, s in summary.engines.items():
        rows.append([
            engine, fmt(s.output_tokens_per_s), fmt(s.requests_per_s), fmt(s.goodput_requests_per_s),
            f"{fmt(s.ttft_p50_s, 'ms')} / {fmt(s.ttft_p99_s, 'ms')}",
            f"{fmt(s.tpot_p50_s, 'ms')} / {fmt(s.tpot_p99_s, 'ms')}",
            fmt(s.max_running), f"{s.oom_capacity} / {s.oom_fragmentation}", s.crashes,
            f"{s.cancelled} ({fmt(s.cancel_release_p99_s, 'ms')})", s.preemptions,
            " / ".join(fmt(s.figure(c), "%") for c in SHARE_COLUMNS),
            f"{s.requests_ok} ok, {s.requests_oom} oom, {s.requests_crashed} crashed, "
            f"{s.requests_error} failed, {s.requests_unfinished} unfinished at the end",
        ])
    header = ["engine", "output tok/s", "req/s", "goodput req/s", "TTFT p50 / p99", "TPOT p50 / p99",
              "max running", "OOMs capacity / fragm.", "crashes", "cancelled (release p99)", "preemptions",
              "token / reserv. / internal / external / free", "requests"]
    window = ("every sweep point's judged requests, the rates over the seconds its judged spans lasted (past each "
              "point's own warm-up; the time between an engine's visits is not its)"
              if meta.sweep else f"its churn window, after a warm-up of {cfg.warmup:.1f} s")
    how = (f"Per engine over {window}; crashes, cancellations, lateness and the requests column count every "
           f"request sent, calibration included; goodput counts requests with TTFT <= "
           f"{cfg.slo_ttft_s if cfg.has('slo_ttft_s') else 2.0} s and TPOT <= "
           f"{cfg.slo_tpot_s if cfg.has('slo_tpot_s') else 0.25} s. Memory shares are time "
           "averages of /stats samples at 10 Hz over the KV capacity while requests arrive. Cancel release: "
           "disconnect noticed to KV freed, timed inside the server. Unfinished: still queued or running when the "
           "run's grace period ended.")
    _, late = lateness_parts(summary, meta)
    sentences = verdict_sentences(summary, events if events is not None else pd.DataFrame(), meta)
    words = "<ul class='verdict'>" + "".join(f"<li>{x}</li>" for x in sentences) + "</ul>"
    return section("verdict", "Verdict", "The picture, the answer in a few sentences, then the figures per engine; "
                   "how each was measured is folded under it.", glance(summary) + words +
                   f"<div id='verdict-table'>{table(header, rows)}</div>"
                   + details("How these figures were measured", how, late))
