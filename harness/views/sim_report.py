"""Simulation results as text and as an HTML page beside the vLLM paper's Figure 2."""

from __future__ import annotations

import html
import textwrap
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from harness.analysis.headline import PAGED
from harness.analysis.summary import SHARE_COLUMNS
from harness.analysis.summary_records import SimulationOut, StepModelInfo, Summary
from harness.views.allocator_section import sim_allocator_lines
from harness.views.capacity_section import capacity_section, ratio_words, rival_in, where_words
from harness.views.html import (
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    PAPER_FIGURE2,
    STYLE,
    fig_html,
    fmt,
)

WIDTH = 120  # every line of the text: a terminal's, a log's


NBSP = "\xa0"  # textwrap does not break here: a figure stays beside its unit, a rate beside its attainment


def wrapped(text: str, indent: str = "  ", more: str = "    ") -> list[str]:
    text = text.replace(" %", NBSP + "%").replace(" req/s", NBSP + "req/s").replace(" GiB", NBSP + "GiB")
    return [line.replace(NBSP, " ") for line in textwrap.wrap(text, WIDTH, initial_indent=indent,
                                                              subsequent_indent=more, break_on_hyphens=False)]


def step_time_line(sm: StepModelInfo) -> str:
    """How a step's time was computed: the fitted model's terms, or the roofline's constants."""
    if sm.has("coefficients"):
        c = sm.coefficients
        r2 = "n/a" if sm.fit_r2 is None else f"{sm.fit_r2:.3f}"
        return (f"step time fitted on {sm.rows:,} measured steps of {sm.source} (R² {r2}): "
                f"{1e3 * c['fixed_s']:.3f} ms + {1e3 * c['per_decode_s']:.4f} ms/decode + "
                f"{1e3 * c['per_prefill_s']:.4f} ms/prefill + {1e6 * c['per_token_s']:.3f} µs/token + "
                f"{1e9 * c['per_context_token_s']:.3f} ns/key read")
    return ("step time = max((weights + KV read) / HBM, FLOPs / peak): weights "
            f"{sm.weights_bytes:,} B, KV {sm.kv_bytes_per_token:,} B/token, {sm.params:,} params, "
            f"{sm.attn_flops_per_query_key:,} attention FLOP per query-key pair, HBM {sm.hbm_bytes_per_s:.3g} "
            f"B/s, peak {sm.peak_flops:.3g} FLOP/s")


def verdict_line(out: SimulationOut) -> str:
    """The answer first: with a sweep, each policy's sustained rate at the SLO and the paged one against the best
    contiguous one; without, what each policy served and which ran out of memory."""
    if out.capacity:
        summary = Summary(capacity=out.capacity)
        cap = summary.capacity
        order = sorted(cap, key=lambda e: -cap[e].sustained_rps)
        rival = rival_in(summary)
        words = ", ".join(f"{e} {cap[e].sustained_rps:.2f} req/s{where_words(cap[e])}" for e in order)
        line = f"verdict: sustained within the SLO: {words}"
        for e in (e for e in order if e in PAGED and rival is not None and cap[rival].sustained_rps > 0):
            line += f"; {e} sustains {ratio_words(summary, e, rival)} the rate of the best contiguous ({rival})"
        return line + "."
    pol = out.policies
    order = sorted(pol, key=lambda e: -pol[e].output_tokens_per_s)
    served = ", ".join(f"{e} {pol[e].output_tokens_per_s:.0f}" for e in order)
    ooms = [f"{e} {pol[e].oom_total} ({pol[e].oom_fragmentation} fragmentation)" for e in order if pol[e].oom_total]
    return (f"verdict: output tokens/s {served}; OOMs: {', '.join(ooms) if ooms else 'none'}; the sustained rate "
            "at an SLO needs --sweep.")


# (header, unit, width): the policy table's columns, each figure's unit under its name
COLUMNS = (("policy", "", 14), ("placement", "", 9), ("token", "%", 6), ("resv", "%", 6), ("intrn", "%", 6),
           ("extrn", "%", 6), ("free", "%", 6), ("mean run", "seqs", 9), ("max run", "seqs", 8),
           ("OOMs", "(frag)", 10), ("preempt", "count", 8), ("output", "tok/s", 7), ("TTFT p50", "s", 9),
           ("TPOT p50", "ms", 9), ("wall", "s", 5))


def row_cells(name: str, r) -> list[str]:
    shares = [f"{100 * r.figure(c):.1f}" for c in SHARE_COLUMNS]
    ttft = "n/a" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f}"
    tpot = "n/a" if r.tpot_p50_s is None else f"{1000 * r.tpot_p50_s:.1f}"
    return [name, r.placement, *shares, f"{r.mean_running:.2f}", str(r.max_running),
            f"{r.oom_total} ({r.oom_fragmentation})", str(r.preemptions), f"{r.output_tokens_per_s:.0f}", ttft, tpot,
            f"{r.wall_s:.1f}"]


def table_lines(out: SimulationOut) -> list[str]:
    def line(cells: list[str]) -> str:
        return "  " + "".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}"
                              for i, (c, (_, _, w)) in enumerate(zip(cells, COLUMNS, strict=True))).rstrip()

    return [line([h for h, _, _ in COLUMNS]), line([u for _, u, _ in COLUMNS]),
            *(line(row_cells(name, r)) for name, r in out.policies.items())]


def render_text(out: SimulationOut) -> str:
    """The simulator's output (Simulation.record) as text: the verdict, the setting, the table, the sweep."""
    lines = wrapped(verdict_line(out), "", "  ")
    if out.capacity:
        slo = next(iter(out.capacity.values())).slo
        lines.append(f"  SLO: TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s for "
                     f"{100 * slo.attainment:.0f} % of requests, at steady state")
    lines += wrapped(f"simulate {out.model} on {out.gpu} ({out.dtype}), workload {out.workload}, "
                     f"{out.requests} requests, seed {out.seed}", "", "  ")
    lines += wrapped(f"KV budget {out.kv_budget_bytes / 2**30:.2f} GiB, max_seq_len {out.max_seq_len} tokens, "
                     f"blocks of {out.block_size} tokens, prefix caching {'on' if out.prefix_caching else 'off'}, "
                     "static " + ("admission waits for free bytes (Orca)" if out.static_preflight else
                                  "admission without a memory check (naive), OOM rejects"))
    lines += wrapped(step_time_line(out.step_model))
    lines += table_lines(out)
    lines += wrapped("token, resv (reservation), intrn / extrn (internal / external fragmentation), free: % of KV "
                     "capacity, time-weighted over the simulated run; wall: seconds this simulation took")
    for name, r in out.policies.items():
        if r.first_oom_running is not None:
            lines.append(f"  {name}: first OOM with {r.first_oom_running} sequences running")
    # --memory caching (harness/views/allocator_section.py)
    lines += [x for line in sim_allocator_lines(out) for x in wrapped(line.strip())]
    if out.capacity:
        lines.append("  SLO attainment per offered rate (req/s: % of requests within the SLO):")
        for name, c in out.capacity.items():
            lines += wrapped("  ".join(f"{p.offered_rps:g}:{NBSP}{fmt(p.slo_attainment, '%')}" for p in c.points),
                             f"  {name:<14}", " " * 16)
    return "\n".join(lines)


def render_simulation(sim, path: Path) -> Path:
    """sim: a harness.sim.simulator.Simulation."""
    out = sim.record
    names = list(out.policies)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, subplot_titles=names, vertical_spacing=0.05)
    for i, name in enumerate(names, start=1):
        tl = sim.timelines[name]
        t = [row[0] for row in tl]
        for k, (label, color) in enumerate(zip(CATEGORY_LABELS, CATEGORY_COLORS, strict=True)):
            fig.add_trace(go.Scatter(x=t, y=[100 * row[1 + k] for row in tl], name=label, stackgroup=f"p{i}",
                                     line=dict(width=0), fillcolor=color, legendgroup=label,
                                     showlegend=i == 1), row=i, col=1)
    fig.update_layout(height=220 * len(names), yaxis_title="% of KV")
    bars = go.Figure()
    values = [[100 * out.policies[n].figure(c) for c in SHARE_COLUMNS] for n in names]
    values += [[t, r, i, e, 0.0] for t, r, i, e in PAPER_FIGURE2.values()]
    for k, (label, color) in enumerate(zip(CATEGORY_LABELS, CATEGORY_COLORS, strict=True)):
        bars.add_trace(go.Bar(x=names + list(PAPER_FIGURE2), y=[v[k] for v in values], name=label,
                              marker_color=color))
    bars.update_layout(barmode="stack", height=420, yaxis_title="% of KV capacity")
    esc = html.escape
    title = f"fragbench simulate: {out.model} on {out.gpu}, {out.workload}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{STYLE}</style>"
        f"<script>{get_plotlyjs()}</script></head><body><h1>{esc(title)}</h1>"
        f"<pre>{esc(render_text(out))}</pre>"
        "<section id='figure2'><h2>Mean breakdown beside the vLLM paper's Figure 2</h2><p class='how'>The paper's "
        "last bar, 'external fragmentation &amp; others', includes free memory.</p>"
        f"{fig_html(bars)}</section><section id='memory-breakdown'><h2>Breakdown over simulated time</h2>"
        f"{fig_html(fig)}</section>{capacity_section(out)}</body></html>")
    return path
