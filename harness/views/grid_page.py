"""`simulate --grid`'s page (grid.html) and its text: the Pareto front of capacity against memory and against
price per GPU-hour, and per model the configuration that serves the grid's traffic cheapest."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from harness.sim.gridrun import best_per_model, pareto_front
from harness.views.html import PALETTE, STYLE, fig_html, fmt, section, table

AXIS_COLUMNS = ("model", "gpu", "dtype", "kv_budget", "gpu_util", "policy", "block_size", "alloc_conf", "workload")
# how the step model the grid stands on was checked: the twin (docs/simulate.md, "How far to trust a grid")
STEP_MODEL_NOTE = ("Step times are the roofline's on each GPU preset (harness/sim/roofline.py), not measured on "
                   "it; the twin measures how far a fitted step model's sustained rate lies from a bench run's "
                   "(fragbench report: 'twin'), see docs/simulate.md for its measured error.")


def config_words(row: pd.Series) -> str:
    budget = f"KV {row.kv_budget}" if isinstance(row.kv_budget, str) else f"gpu_util {row.gpu_util:g}"
    return (f"{row.model} ({row.dtype}) on {row.gpu}, {budget}, {row.policy}, blocks of {row.block_size}, "
            f"{row.alloc_conf}, {row.workload}")


def best_rows(table_: pd.DataFrame) -> list[list]:
    return [[r.model, config_words(r), fmt(float(r.sustained_rps)), f"{r.requests_per_gpu_hour:,.0f}",
             fmt(r.usd_per_gpu_hour), "n/a" if pd.isna(r.requests_per_usd) else f"{r.requests_per_usd:,.0f}"]
            for r in best_per_model(table_).itertuples()]


def render_grid_text(table_: pd.DataFrame, resumed: int, out_dir: Path) -> str:
    fitting = int(table_.fits.sum())
    lines = [f"grid: {len(table_)} configurations ({resumed} resumed from {out_dir}), {fitting} fit their GPU; "
             f"{out_dir / 'grid.parquet'}, {out_dir / 'grid.html'}"]
    best = best_rows(table_)
    if not best:
        lines.append("  no configuration sustains any rate within the SLO")
    for model, words, rps, per_hour, _, per_usd in best:
        lines.append(f"  best for {model}: {words}: {rps} req/s sustained, {per_hour} requests/GPU-hour, "
                     f"{per_usd} requests/USD")
    return "\n".join(lines)


def front_figure(table_: pd.DataFrame, cost: str, cost_title: str, scale: float = 1.0) -> go.Figure:
    fig = go.Figure()
    for i, (model, rows) in enumerate(table_[table_.sustained_rps > 0].groupby("model", sort=False)):
        color = PALETTE[i % len(PALETTE)]
        words = [config_words(r) for r in rows.itertuples()]
        fig.add_trace(go.Scatter(x=rows[cost] / scale, y=rows.sustained_rps, mode="markers", name=model,
                                 marker=dict(color=color, opacity=0.45), text=words, legendgroup=model,
                                 hovertemplate="%{text}<br>%{y:.3g} req/s<extra></extra>"))
        front = pareto_front(rows, cost)
        fig.add_trace(go.Scatter(x=front[cost] / scale, y=front.sustained_rps, mode="lines+markers",
                                 name=f"{model}: front", line=dict(color=color, shape="hv"), legendgroup=model,
                                 text=[config_words(r) for r in front.itertuples()],
                                 hovertemplate="%{text}<br>%{y:.3g} req/s<extra></extra>"))
    fig.update_layout(height=440, xaxis_title=cost_title, yaxis_title="sustained requests/s at the SLO")
    return fig


def render_grid(table_: pd.DataFrame, resumed: int, out_dir: Path) -> Path:
    esc = html.escape
    slo = table_.iloc[0]
    title = f"fragbench simulate --grid: {len(table_)} configurations"
    how = (f"Each configuration is a knee search at the SLO (TTFT <= {slo.slo_ttft:g} s, TPOT <= {slo.slo_tpot:g} s) "
           f"over {slo.requests:,} requests of its workload (seed {slo.seed}); a point on a front is a configuration "
           "no other of its model beats with less memory (or a cheaper GPU-hour) and more capacity. " + STEP_MODEL_NOTE)
    columns = [c for c in (*AXIS_COLUMNS, "sustained_rps", "sustained_lo_rps", "sustained_hi_rps",
                           "requests_per_gpu_hour", "usd_per_gpu_hour", "token_states_share", "oom_policy",
                           "oom_allocator", "reason") if c in table_]
    ranked = table_.sort_values("sustained_rps", ascending=False, kind="stable")
    rows = [[fmt(v) if isinstance(v, float) else v for v in r] for r in ranked[columns].itertuples(index=False)]
    body = (section("best", "Best configuration per model", "Most requests per dollar at the sustained rate "
                    "(one GPU per configuration, the price per GPU-hour from the presets or the grid file).",
                    table(["model", "configuration", "req/s", "requests/GPU-hour", "USD/GPU-hour", "requests/USD"],
                          best_rows(table_)))
            + section("memory-front", "Capacity against KV memory", how,
                      fig_html(front_figure(table_, "kv_budget_bytes", "KV budget (GiB)", 2**30)))
            + section("price-front", "Capacity against price per GPU-hour", "The GPU's price per hour, the "
                      "presets' (harness/gpus.py) unless the grid file's price_per_gpu_hour overrides them.",
                      fig_html(front_figure(table_, "usd_per_gpu_hour", "USD per GPU-hour")))
            + section("all", "Every configuration", "grid.parquet beside this page holds every column "
                      "(docs/simulate.md says what each means).", table(list(columns), rows)))
    path = out_dir / "grid.html"
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
                    f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{esc(title)}</h1>"
                    f"<pre>{esc(render_grid_text(table_, resumed, out_dir))}</pre>{body}</body></html>")
    return path
