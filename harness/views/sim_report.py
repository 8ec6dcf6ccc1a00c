"""Simulation results as text and as an HTML page beside the vLLM paper's Figure 2."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from harness.analysis.summary import SHARE_COLUMNS
from harness.analysis.summary_records import SimulationOut, StepModelInfo, Summary
from harness.views.allocator_section import sim_allocator_lines
from harness.views.capacity_section import capacity_section, capacity_sentence
from harness.views.html import (
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    PAPER_FIGURE2,
    STYLE,
    fig_html,
    fmt,
)


def step_time_line(sm: StepModelInfo) -> str:
    """How a step's time was computed: the fitted model's terms, or the roofline's constants."""
    if sm.has("coefficients"):
        c = sm.coefficients
        r2 = "n/a" if sm.fit_r2 is None else f"{sm.fit_r2:.3f}"
        return (f"  step time fitted on {sm.rows:,} measured steps of {sm.source} (R² {r2}): "
                f"{1e3 * c['fixed_s']:.3f} ms + {1e3 * c['per_decode_s']:.4f} ms/decode + "
                f"{1e3 * c['per_prefill_s']:.4f} ms/prefill + {1e6 * c['per_token_s']:.3f} µs/token + "
                f"{1e9 * c['per_context_token_s']:.3f} ns/key read")
    return ("  step time = max((weights + KV read) / HBM, FLOPs / peak): weights "
            f"{sm.weights_bytes:,} B, KV {sm.kv_bytes_per_token:,} B/token, {sm.params:,} params, "
            f"{sm.attn_flops_per_query_key:,} attention FLOP per query-key pair, HBM {sm.hbm_bytes_per_s:.3g} "
            f"B/s, peak {sm.peak_flops:.3g} FLOP/s")


def render_text(out: SimulationOut) -> str:
    """The simulator's output (Simulation.record) as text."""
    lines = [
        f"simulate {out.model} on {out.gpu} ({out.dtype}), workload {out.workload}, "
        f"{out.requests} requests, seed {out.seed}",
        f"  KV budget {out.kv_budget_bytes / 2**30:.2f} GiB, max_seq_len {out.max_seq_len}, "
        f"blocks of {out.block_size}, prefix caching {'on' if out.prefix_caching else 'off'}, static "
        + ("admission waits for free bytes (Orca)" if out.static_preflight else
           "admission without a memory check (naive), OOM rejects"),
        step_time_line(out.step_model),
        f"  {'policy':<14}{'placement':<10}{'token':>7}{'reserv':>8}{'intern':>8}{'extern':>8}{'free':>7}"
        f"{'mean run':>10}{'max run':>9}{'OOM (frag)':>12}{'preempt':>9}{'out tok/s':>11}{'TTFT p50':>10}"
        f"{'TPOT p50':>10}{'wall s':>8}",
    ]
    for name, r in out.policies.items():
        shares = "".join(f"{100 * r.figure(c):>{w}.1f}" for c, w in zip(SHARE_COLUMNS, (7, 8, 8, 8, 7), strict=True))
        ttft = "n/a" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f}"
        tpot = "n/a" if r.tpot_p50_s is None else f"{1000 * r.tpot_p50_s:.1f}ms"
        lines.append(
            f"  {name:<14}{r.placement:<10}{shares}{r.mean_running:>10.2f}{r.max_running:>9}"
            f"{r.oom_total:>7} ({r.oom_fragmentation}){r.preemptions:>9}{r.output_tokens_per_s:>11.0f}"
            f"{ttft:>10}{tpot:>10}{r.wall_s:>8.1f}")
    lines.append("  shares are % of KV capacity, time-weighted over the simulated run")
    for name, r in out.policies.items():
        if r.first_oom_running is not None:
            lines.append(f"  {name}: first OOM with {r.first_oom_running} sequences running")
    # --memory caching (harness/views/allocator_section.py)
    lines += sim_allocator_lines(out)
    if out.capacity:
        lines.append("  " + capacity_sentence(Summary(capacity=out.capacity)))
        for name, c in out.capacity.items():
            lines.append(f"  {name:<14}" + "  ".join(f"{p.offered_rps:g} req/s: {fmt(p.slo_attainment, '%')}"
                                                     for p in c.points))
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
