"""The verdict at a glance: the one picture the report opens with. Each engine's sustained rate with its 90 %
interval (a forest plot), the headline ratio's interval against 1.0 (no difference) and against the width asked
(`--precision`), and where each engine's memory went at its knee (the Figure-2 shares of the point that bound it).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from harness.analysis.summary import SHARE_COLUMNS
from harness.analysis.summary_records import CapacityBlock, HeadlineBlock, Summary
from harness.views.html import CATEGORY_COLORS, CATEGORY_LABELS, fig_html


def knee_shares(c: CapacityBlock) -> list[float | None]:
    """The Figure-2 shares (in %) at the engine's knee point: where its memory went when it stopped keeping up."""
    rate = c.knee_point.offered_rps if c.knee_point else None
    point = next((p for p in c.points if p.offered_rps == rate), None)
    return [None if point is None or point.figure(k) is None else 100 * point.figure(k) for k in SHARE_COLUMNS]


def forest(fig: go.Figure, summary: Summary, order: list[str]) -> None:
    cap = summary.capacity
    for e in order:
        c, ci = cap[e], cap[e].sustained_rps_ci or [cap[e].sustained_rps] * 2
        fig.add_trace(go.Scatter(
            x=[c.sustained_rps], y=[e], mode="markers", marker=dict(size=11, color="#1f3b73"), showlegend=False,
            error_x=dict(type="data", symmetric=False, array=[ci[1] - c.sustained_rps],
                         arrayminus=[c.sustained_rps - ci[0]], thickness=2, width=8),
            hovertemplate=f"{e}: %{{x:.2f}} req/s [{ci[0]:.2f}, {ci[1]:.2f}]<extra></extra>"), row=1, col=1)


def ratio(fig: go.Figure, h: HeadlineBlock) -> None:
    lo, hi = h.ratio_ci
    name = f"{h.engine} / {h.against}"
    color = "#2a9d8f" if h.decided else "#e76f51"
    fig.add_trace(go.Scatter(
        x=[h.ratio], y=[name], mode="markers", marker=dict(size=12, color=color), showlegend=False,
        error_x=dict(type="data", symmetric=False, array=[hi - h.ratio], arrayminus=[h.ratio - lo],
                     thickness=3, width=10),
        hovertemplate=f"{name}: %{{x:.2f}}x [{lo:.2f}, {hi:.2f}]<extra></extra>"), row=1, col=2)
    # the width asked: an interval of hi / lo = precision, centred (in log) on the estimate
    half = math.sqrt(h.precision or 1.5)
    asked = h.precision if h.has("precision") else 1.5
    fig.add_trace(go.Scatter(x=[h.ratio / half, h.ratio * half], y=[name, name], mode="lines",
                             line=dict(color="#999", width=14), opacity=0.35, showlegend=False,
                             hovertemplate=f"the width asked: hi / lo = {asked:g}<extra></extra>"),
                  row=1, col=2)
    fig.add_vline(x=1.0, line_dash="dash", line_color="#c0392b", row=1, col=2)


def shares(fig: go.Figure, summary: Summary, order: list[str]) -> None:
    cap = summary.capacity
    for k, (label, color) in enumerate(zip(CATEGORY_LABELS, CATEGORY_COLORS, strict=True)):
        fig.add_trace(go.Bar(y=order, x=[knee_shares(cap[e])[k] or 0 for e in order], orientation="h", name=label,
                             marker_color=color, legendgroup=label), row=1, col=3)


def glance(summary: Summary) -> str:
    """The figure, or nothing when the run measured no capacity (one offered rate)."""
    cap, h = summary.capacity, summary.headline
    if not cap:
        return ""
    order = sorted(cap, key=lambda e: cap[e].sustained_rps)
    # the ratio and its verdict in words are the sentence under the figure: a title this narrow holds the numbers
    verdict = "no headline" if not h else f"{h.ratio:.2f}x [{h.ratio_ci[0]:.2f}, {h.ratio_ci[1]:.2f}]"
    fig = make_subplots(rows=1, cols=3, column_widths=[0.38, 0.3, 0.32], horizontal_spacing=0.1,
                        subplot_titles=("sustained req/s at the SLO, 90 % interval", f"headline ratio {verdict}",
                                        "memory at the knee, % of KV"))
    forest(fig, summary, order)
    if h:
        ratio(fig, h)
    shares(fig, summary, order)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_xaxes(type="log", row=1, col=2, title_text="dashed: 1.0 (no difference); grey: the width asked")
    fig.update_xaxes(range=[0, 100], row=1, col=3)
    fig.update_layout(barmode="stack", height=140 + 40 * len(order), legend=dict(orientation="h", y=-0.35),
                      margin=dict(t=50, b=40))
    return "<div id='glance'>" + fig_html(fig) + "</div>"
