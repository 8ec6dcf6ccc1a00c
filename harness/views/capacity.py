"""The capacity section: each engine's sustained rate at the SLO with its interval, the ratio of the paged
engines to the best contiguous one, what bound each at its knee, and (with --kv-budgets) rate against budget."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from harness.analysis.knee import KV_USAGE_NEAR_FULL, WAITING_FOR_MEMORY, ratio_interval
from harness.views.html import PALETTE, fig_html, fmt, section, table

PAGED = ("paged", "hf-cb", "vllm")
MiB = 2**20


def where_words(c: dict) -> str:
    return {"beyond": " or more (every rate met the SLO)", "below": " (under the lowest rate swept)"}.get(
        c["sustained_where"], "")


def rate_words(c: dict) -> str:
    ci = c.get("sustained_rps_ci")
    return f"{c['sustained_rps']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") + where_words(c)


def best_contiguous(capacity: dict) -> str | None:
    """The contiguous engine that sustains the highest rate: what the paged ones are measured against."""
    return max((e for e in capacity if e not in PAGED), key=lambda e: capacity[e]["sustained_rps"], default=None)


def ratio_of(mine: dict, theirs: dict) -> tuple[str, bool]:
    """The ratio of two sustained rates with its interval, and whether that interval holds 1.0 (no
    measurable difference)."""
    ratio = mine["sustained_rps"] / theirs["sustained_rps"]
    ci = ratio_interval(mine["sustained_rps_ci"], theirs["sustained_rps_ci"]) \
        if "sustained_rps_ci" in mine and "sustained_rps_ci" in theirs else None
    if ci is None:
        return f"{ratio:.2f}x", False
    return f"{ratio:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]", ci[0] <= 1.0 <= ci[1]


def ratio_words(mine: dict, theirs: dict) -> str:
    words, same = ratio_of(mine, theirs)
    return words + (": no measurable difference" if same else "")


def capacity_sentence(capacity: dict) -> str:
    slo = next(iter(capacity.values()))["slo"]
    order = sorted(capacity, key=lambda e: -capacity[e]["sustained_rps"])
    has_ci = any("sustained_rps_ci" in c for c in capacity.values())
    rates = ", ".join(f"{e} {rate_words(capacity[e])} req/s" for e in order)
    line = (f"Sustained request rate within the SLO (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s for "
            f"{100 * slo['attainment']:.0f} % of requests{', 90 % interval in brackets' if has_ci else ''}): {rates}")
    rival = best_contiguous(capacity)
    if rival is not None:
        for e in (e for e in capacity if e in PAGED):
            mine, theirs = capacity[e], capacity[rival]
            if theirs["sustained_rps"] <= 0:
                line += f"; no contiguous engine sustained any rate, {e} {mine['sustained_rps']:.2f} req/s"
                continue
            words, same = ratio_of(mine, theirs)
            line += f"; {e} sustains {words} the rate of the best contiguous engine ({rival})" + (
                ", an interval that holds 1.0: no measurable difference" if same else "")
    return line + "."


def bound_sentence(capacity: dict) -> str:
    parts = [f"{e} by {c['bound']} ({c['bound_evidence']}, at {c['knee']['offered_rps']:.2f} req/s)"
             for e, c in sorted(capacity.items(), key=lambda kv: -kv[1]["sustained_rps"]) if "bound" in c]
    return "What bound each engine at its knee, the lowest rate that missed the SLO: " + "; ".join(parts) + "."


def knee_cells(c: dict) -> list[str]:
    k = c.get("knee")
    if not k:
        return ["n/a"] * 7
    return [f"{c['bound']}", fmt(k["kv_usage"], "%"), fmt(k["waiting_for_memory_share"], "%"), fmt(k["running"]),
            fmt(k["step_s"], "ms"), str(k["oom_total"]), str(k["preemptions"])]


def capacity_table(cap: dict) -> str:
    rival = best_contiguous(cap)
    rows = []
    for e, c in sorted(cap.items(), key=lambda kv: -kv[1]["sustained_rps"]):
        vs = "the best contiguous" if e == rival else ratio_words(c, cap[rival]) \
            if rival is not None and cap[rival]["sustained_rps"] > 0 else "n/a"
        per_rate = " / ".join(f"{p['offered_rps']:g}: {fmt(p['slo_attainment'], '%')} of {p.get('requests', '?')}"
                              for p in c["points"])
        rows.append([e, rate_words(c), vs, *knee_cells(c), per_rate])
    return table(["engine", "sustained req/s [90 % interval]", "vs best contiguous", "bound at the knee",
                  "KV usage", "waiting for memory", "running", "step", "OOMs", "preemptions",
                  "SLO attainment per rate (of requests judged)"], rows)


def curves(cap: dict) -> go.Figure:
    fig = make_subplots(rows=1, cols=3, subplot_titles=("SLO attainment", "normalized latency (s/token)",
                                                         "mean running requests"), horizontal_spacing=0.07)
    for i, (engine, c) in enumerate(cap.items()):
        pts = sorted(c["points"], key=lambda p: p["offered_rps"])
        x = [p["offered_rps"] for p in pts]
        color = PALETTE[i % len(PALETTE)]
        for col, key in enumerate(("slo_attainment", "normalized_latency_s_per_token", "mean_running"), start=1):
            fig.add_trace(go.Scatter(x=x, y=[p[key] for p in pts], mode="lines+markers", name=engine,
                                     legendgroup=engine, showlegend=col == 1, line_color=color), row=1, col=col)
    target = next(iter(cap.values()))["slo"]["attainment"]
    fig.add_hline(y=target, line_dash="dot", line_color="#888", row=1, col=1)
    fig.update_xaxes(title_text="offered req/s", type="log")
    fig.update_layout(height=380)
    return fig


def measured_budgets(pts: list[tuple[int, dict]], **style) -> go.Scatter:
    """(KV budget, capacity block) pairs as one trace: each sustained rate with its 90 % interval as error bars."""
    y = [c["sustained_rps"] for _, c in pts]
    lo = [y_ - (c.get("sustained_rps_ci") or [y_])[0] for y_, (_, c) in zip(y, pts, strict=True)]
    hi = [(c.get("sustained_rps_ci") or [y_, y_])[1] - y_ for y_, (_, c) in zip(y, pts, strict=True)]
    return go.Scatter(x=[b / MiB for b, _ in pts], y=y, error_y=dict(type="data", symmetric=False, array=hi,
                                                                     arrayminus=lo), **style)


def budget_curve(by_budget: dict) -> str:
    """Sustained rate against KV budget per engine: what memory each needs for a given rate."""
    fig = go.Figure()
    engines = list(dict.fromkeys(e for blocks in by_budget.values() for e in blocks))
    for i, engine in enumerate(engines):
        pts = sorted((int(b), blocks[engine]) for b, blocks in by_budget.items() if engine in blocks)
        fig.add_trace(measured_budgets(pts, mode="lines+markers", name=engine, line_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(height=380, xaxis_title="KV budget (MiB)", yaxis_title="sustained req/s at the SLO")
    return "<h3>Sustained rate against KV budget</h3>" + fig_html(fig)


def regime_words(summary: dict, budget_bytes: int | None) -> str:
    kvb = next((s.get("kv_bytes_per_token") for s in summary["engines"].values() if s.get("kv_bytes_per_token")),
               None)
    max_seq_len = summary.get("max_seq_len")
    if not (kvb and budget_bytes and max_seq_len):
        return ""
    one = kvb * max_seq_len
    return (f" The KV budget, {budget_bytes / MiB:g} MiB, is {budget_bytes / one:.1f} max-length sequences "
            f"({max_seq_len} tokens x {kvb} B); make bench's default is 2, the rule that puts contiguous "
            "reservations in the regime of a GPU: a static-max engine then holds 2 requests at once, fewer than "
            "the CPU can batch before a step misses the TPOT limit, so memory, not compute, is what binds it.")


def capacity_section(summary: dict, budget_bytes: int | None = None) -> str:
    cap = summary.get("capacity")
    if not cap:
        return section("capacity", "Capacity at the SLO", "This run did not sweep request rates "
                       "(fragbench bench --sweep does): see the verdict's goodput instead.", "")
    slo = next(iter(cap.values()))["slo"]
    searched = any("sustained_rps_ci" in c for c in cap.values())
    how = (f"The workload's request mix offered at each rate (its arrival shape kept, its clock rescaled), one "
           f"server per engine for all of them. A request meets the SLO with TTFT <= {slo['ttft_s']:g} s and "
           f"TPOT <= {slo['tpot_s']:g} s; rejected, OOM'd, crashed or failed requests miss it; client cancellations "
           "are left out; a request still in flight when a rate's window closed is judged on what it showed "
           "(within both limits so far: met; already past one: missed; too young to tell: left out). Sustained: "
           f"the highest rate at which {100 * slo['attainment']:.0f} % meet it, interpolated between the rates "
           "measured.")
    if searched:
        how += (" Each engine's rates come from its own knee search: from 0.75x its calibrated saturation rate, steps"
                " of x1.6, x1.6^2, ... until one rate meets the SLO and a higher one misses it, then geometric "
                "bisection until the two are within the run's tolerance or its search time is spent. The 90 % "
                "interval: the bootstrap (2,000 replicates, each point's requests resampled with replacement, the "
                "crossing re-interpolated) widened to the measured bracket; a ratio's interval bounds it by the two "
                "engines' intervals, and one that contains 1.0 is no measurable difference. Requests in one point are"
                " not independent (they share a queue), so the bootstrap alone would be too narrow: the bracket is "
                "the floor; and a bracket end whose attainment cannot be told from the target (its Wilson 90 % "
                "interval holds it) bounds nothing: the interval reaches the next measured rate, or one search "
                "step, past it. "
                "Bound at the knee, from the lowest rate that missed the SLO: failures (crashes, or failed"
                " requests half of the misses), else memory (OOMs, preemptions, KV usage >= "
                f"{100 * KV_USAGE_NEAR_FULL:.0f} %, or requests waiting for memory alone in >= "
                f"{100 * WAITING_FOR_MEMORY:.0f} % of samples), else compute (KV room left while steps slow).")
    how += regime_words(summary, budget_bytes)
    body = fig_html(curves(cap)) + capacity_table(cap)
    if summary.get("capacity_by_budget"):
        body += budget_curve(summary["capacity_by_budget"])
    return section("capacity", "Capacity at the SLO: what the memory buys", how, body)
