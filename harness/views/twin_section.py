"""The report's "Twin" section: each scheduled engine simulated on its own measured steps, beside what bench
measured, with the error of each figure and the curves the bench cannot afford (harness/sim/twin.py)."""

from __future__ import annotations

import itertools

import plotly.graph_objects as go

from harness.analysis.summary_records import CapacityPoint, Summary, TwinErrors
from harness.sim.twin import CURVE_JUDGED
from harness.views.capacity_section import MiB, measured_budgets
from harness.views.html import PALETTE, fig_html, fmt, section, table

WORDS = {"sustained_rps": "sustained rate", "mean_running": "mean running", "ttft_p50_s": "TTFT p50",
         "tpot_p50_s": "TPOT p50", "token_states_share": "token-state share"}


def signed(v, points: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:+.1f} pts" if points else f"{100 * v:+.0f} %"


def pair(m, t, unit: str = "") -> str:
    return f"{fmt(m, unit)} / {fmt(t, unit)}"


def disagreement(engine: str, err: TwinErrors, twin_rps: float, ci: list[float] | None) -> str:
    """Where the twin is furthest from the measurement, and whether the measurement can tell, in a sentence."""
    inside = ""
    if ci and ci[0] <= twin_rps <= ci[1]:
        inside = (f" Its sustained rate, {twin_rps:.2f} req/s, lies inside the measured 90 % interval "
                  f"[{ci[0]:.2f}, {ci[1]:.2f}]: no measurable difference from the measurement.")
    return first_disagreement(engine, err) + inside


def first_disagreement(engine: str, err: TwinErrors) -> str:
    scored = [(abs(v) if k != "token_states_share" else abs(v) * 3, k, v) for k in WORDS
              if (v := err.figure(k)) is not None]
    if not scored:
        return f"{engine}: nothing to compare."
    _, key, value = max(scored)
    within = abs(err.sustained_rps or 0) <= 0.15 and abs(err.token_states_share or 0) <= 0.05
    side = "over" if value > 0 else "under"
    how = f"{100 * abs(value):.1f} points" if key == "token_states_share" else f"{100 * abs(value):.0f} %"
    lead = "agrees within 15 % on the sustained rate and 5 points on the token share; " if within else ""
    return f"{engine}: {lead}it disagrees most on {WORDS[key]}, which the twin {side}states by {how}."


def directions(summary: Summary) -> list[str]:
    """Every ratio between two engines' sustained rates, measured and twin: the same way up or not. Where
    the measured ratio's (joint) interval holds 1.0 the measurement has no direction for the twin to share."""
    twin, measured, ratios = summary.twin, summary.capacity, summary.capacity_ratios
    out = []
    for a, b in itertools.combinations([e for e in twin if e in measured], 2):
        m = measured[a].sustained_rps / measured[b].sustained_rps if measured[b].sustained_rps else None
        t = twin[a].sustained_rps / twin[b].sustained_rps if twin[b].sustained_rps else None
        if m is None or t is None:
            continue
        bounds = ratios[f"{a}/{b}"].ratio_ci if f"{a}/{b}" in ratios else None
        if bounds and bounds[0] <= 1 <= bounds[1]:
            word = f"measured interval [{bounds[0]:.2f}, {bounds[1]:.2f}] holds 1.0: no measurable difference"
        else:
            word = "same direction" if (m - 1) * (t - 1) > 0 else "OPPOSITE direction"
        out.append(f"{a}/{b}: measured {m:.2f}x, twin {t:.2f}x ({word})")
    return out


def curves(summary: Summary, budget: int) -> str:
    twin, measured, by_budget = summary.twin, summary.capacity, summary.capacity_by_budget
    fig = go.Figure()
    for i, (engine, t) in enumerate(twin.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = [p for p in t.budget_curve if p.sustained_where != "cannot start"]
        fig.add_trace(go.Scatter(x=[p.kv_budget_bytes / MiB for p in pts], y=[p.sustained_rps for p in pts],
                                 mode="lines", line=dict(color=color, dash="dash"), name=f"{engine} (simulated)"))
        others = [(int(b), blocks.get(engine)) for b, blocks in (by_budget or {}).items() if int(b) != budget]
        seen = [(budget, measured.get(engine)), *others]
        fig.add_trace(measured_budgets([(b, c) for b, c in seen if c], mode="markers",
                                       marker=dict(color=color, size=10), name=f"{engine} (measured)"))
    fig.update_layout(height=400, xaxis_title="KV budget (MiB, log)", xaxis_type="log",
                      yaxis_title="sustained req/s at the SLO")
    return "<h3>Sustained rate against KV budget: simulated (dashed), measured (markers, 90 % interval)</h3>" \
        + fig_html(fig)


def needed(summary: Summary, budget: int) -> str:
    rows = []
    for engine, t in summary.twin.items():
        need = t.budget_for_best_rps
        b = need.kv_budget_bytes
        rows.append([engine, fmt(need.rate_rps), "more than 4x the run's (beyond the curve)" if b is None
                     else f"{b / MiB:.1f} MiB ({b / budget:.2f}x the run's)"])
    return ("<h3>The KV budget each engine needs to sustain the best engine's measured rate (simulated)</h3>"
            + table(["engine", "best measured rate (req/s)", "KV budget the twin needs"], rows))


def point_rows(engine: str, twin_points: list[CapacityPoint], measured_points: list[CapacityPoint]) -> list[list]:
    rows = []
    for t, m in zip(twin_points, sorted(measured_points, key=lambda p: p.offered_rps), strict=False):
        rows.append([engine, fmt(m.offered_rps), pair(m.slo_attainment, t.slo_attainment, "%"),
                     pair(m.mean_running, t.mean_running), pair(m.ttft_p50_s, t.ttft_p50_s, "ms"),
                     pair(m.tpot_p50_s, t.tpot_p50_s, "ms"),
                     f"{m.oom_total} ({m.oom_fragmentation}) / {t.oom_total} "
                     f"({t.oom_fragmentation})", f"{m.preemptions} / {t.preemptions}",
                     pair(m.token_states_share, t.token_states_share, "%"),
                     pair(m.reservation_share, t.reservation_share, "%"),
                     pair(m.internal_fragmentation_share, t.internal_fragmentation_share, "%")])
    return rows


def twin_section(summary: Summary, budget: int | None) -> str:
    twin, measured = summary.twin, summary.capacity
    if not twin:
        return section("twin", "Twin: the simulator beside the measurement",
                       "No twin: it needs a sweep (bench --sweep) of a scheduled engine (static-*, growth, paged) "
                       "with enough recorded steps to fit a step model.", "")
    how = ("Each scheduled engine simulated by fragbench's own simulator: the same KV policy and scheduler "
           "code, configured as the engine reported itself, its step time from a model fitted on that engine's "
           "own steps in this run's measured windows (fixed + per decode + per prefill chunk + per token + per "
           "key read, least squares, no negative coefficient). Each visit of the bench to an engine replayed as "
           "its load generator sent it: every point's stream at its rate, one after another, warm-ups and tail "
           "guards included, cancels, slow readers, whole answers, the grace cut-off; each point judged on the "
           "requests the measurement judged (its judged spans, past its recorded warm-up). Errors: twin / "
           "measured - 1 (per-point figures: the median over the points); the token-state share as the median "
           f"difference in points. The curves are simulated, a knee search each bisected to one grid step, each "
           f"rate judged as a measured point is (its stream's requests past the warm-up rule) on {CURVE_JUDGED} "
           "requests: at the run's own budget the curve reads the twin's knee more precisely than its replay of "
           "the measured points, which judges as many requests as they did.")
    rows = []
    for engine, t in twin.items():
        m, e, sm = measured.get(engine), t.error, t.step_model
        ci = m.sustained_rps_ci if m else None
        rows.append([engine, f"{sm.rows:,} steps, R² {fmt(sm.fit_r2)}",
                     fmt(m.sustained_rps if m else None) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""),
                     fmt(t.sustained_rps), signed(e.sustained_rps), signed(e.mean_running),
                     signed(e.ttft_p50_s), signed(e.tpot_p50_s), signed(e.token_states_share, True)])
    head = table(["engine", "step model", "measured sustained req/s [90 %]", "twin", "error", "mean running",
                  "TTFT p50", "TPOT p50", "token share"], rows)
    words = "".join(
        f"<li>{disagreement(e, t.error, t.sustained_rps, measured[e].sustained_rps_ci if e in measured else None)}</li>"
        for e, t in twin.items())
    ratio = "".join(f"<li>{line}</li>" for line in directions(summary))
    points = table(["engine", "offered req/s", "SLO attainment", "mean running", "TTFT p50", "TPOT p50",
                    "OOMs (fragmentation)", "preemptions", "token share", "reservation", "internal frag."],
                   [r for engine, t in twin.items() for r in point_rows(
                       engine, t.points, measured[engine].points if engine in measured else [])])
    body = (head + f"<ul class='verdict'>{words}{ratio}</ul><h3>Point by point: measured / twin</h3>" + points
            + (curves(summary, budget) + needed(summary, budget)
               if budget else ""))
    return section("twin", "Twin: the simulator beside the measurement", how, body)
